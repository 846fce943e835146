"""`python -m analysis.study`: the debias study's report (analysis.study.cli)."""
import sys

from analysis.study.cli import main

sys.exit(main())
