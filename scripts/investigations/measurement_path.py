"""Which of the project's modules one per-step measurement passes through, in order (issue 67's closing numbers).

    python -m scripts.investigations.measurement_path            # +exp=in2 at a tiny size, step 1 measured

Builds a tiny `+exp=in2` run (`train.setup`), then records every call into the project's own code while
`train.measure` runs once: the modules in the order first entered, and the distinct caller -> callee pairs of modules
(each pair of modules that call one another counts once, however many calls cross it).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_of(filename: str) -> str | None:
    """`analysis.measure.step` for a file of this project, None for any other."""
    path = Path(filename)
    if not path.is_absolute() or ROOT not in path.parents or ".venv" in path.parts:
        return None
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def main() -> int:
    import train

    cfg = train.as_train_config(train.compose_config(
        ["+exp=in2", "trainer.max_steps=2", "data.num_train=64", "logger.mode=disabled", "eval.every=0"]))
    with tempfile.TemporaryDirectory() as tmp:
        run = train.setup(cfg, Path(tmp) / "run")
        order: list[str] = []
        edges: set[tuple[str, str]] = set()

        def trace(frame, event, arg):
            if event != "call" or (module := module_of(frame.f_code.co_filename)) is None:
                return
            caller = frame.f_back and module_of(frame.f_back.f_code.co_filename)
            if caller and caller not in (module, module_of(__file__)):
                edges.add((caller, module))
            if module not in order:
                order.append(module)

        sys.setprofile(trace)
        try:
            train.measure(run, 1)
        finally:
            sys.setprofile(None)
            train.cleanup(run)
    print(f"{len(order)} modules, in the order first entered:")
    print("\n".join(f"  {i + 1:>2}. {m}" for i, m in enumerate(order)))
    print(f"{len(edges)} caller -> callee pairs of modules:")
    print("\n".join(f"  {a} -> {b}" for a, b in sorted(edges, key=lambda e: (order.index(e[0]), order.index(e[1])))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
