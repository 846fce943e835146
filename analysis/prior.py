"""Look at the prior before training: the closed-form Cesàro prior as CSV and a log-scale PNG.

    python -m analysis.prior --L 2048 --H 24 --alpha 0.3 --out prior/

Writes `<out>/prior_L<L>_H<H>_a<alpha>.csv` (columns j, x, p) and the `.png` of the same name; the prior is
`analysis.measure.prior.prior_profile`, the figure `analysis.report.figures.plot_prior`.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from analysis.command_line import CommandParser
from analysis.measure.prior import prior_profile
from analysis.report.figures import plot_prior


def main(argv: Sequence[str] | None = None) -> None:
    parser = CommandParser(
        prog="python -m analysis.prior",
        description="Write the closed-form Cesàro prior p(j) = (N^H)[L, j] as CSV and a log-scale PNG.",
    )
    parser.add_argument("--L", type=int, default=2048, help="sequence length (default 2048)")
    parser.add_argument("--H", type=int, default=24, help="number of layers (default 24)")
    parser.add_argument("--alpha", type=float, default=0.3, help="residual weight a in [0, 1] (default 0.3)")
    parser.add_argument("--out", type=Path, required=True, help="output directory (created if missing)")
    args = parser.parse_args(argv)
    try:
        p = prior_profile(args.L, args.H, args.alpha)
    except ValueError as err:
        parser.error(str(err))

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"prior_L{args.L}_H{args.H}_a{args.alpha:g}"
    csv_path, png_path = args.out / f"{stem}.csv", args.out / f"{stem}.png"
    j = np.arange(1, args.L + 1)
    x = np.linspace(0.0, 1.0, args.L)
    np.savetxt(
        csv_path, np.column_stack([j, x, p]), fmt=["%d", "%.17g", "%.17g"],
        delimiter=",", header="j,x,p", comments="",
    )
    plot_prior(x, p, png_path, f"Cesàro prior, L={args.L}, H={args.H}, a={args.alpha:g}")
    print(f"wrote {csv_path} and {png_path}")


if __name__ == "__main__":
    main()
