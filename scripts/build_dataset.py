"""Build an IN2 dataset folder once, train on it many times.

    python -m scripts.build_dataset data=in2_nq out=built/in2_nq       # train.py's data/model overrides
    python -m scripts.build_dataset data=in2_film model=qwen2_0.5b out=built/film   # with its tokenizer
    python train.py data.prebuilt=built/in2_nq                         # train on the folder

(`python scripts/build_dataset.py ...` works the same once the project is installed: pip install -e .)

It takes the overrides `train.py` takes (the data group, and `model=` for a model's own tokenizer)
and writes to `out`: the splits (`save_to_disk`), `tokenizer/`, `heldout_docs.json`, `build.json`
and a dataset card `README.md` (sources and licences, counts per task, skipped questions, length
and depth histograms under `plots/`, config, seed, fingerprint).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional, Sequence

import matplotlib
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from analysis.command_line import CommandParser
from data_builders.build import BUILD_FILE, DataBundle, build_datasets, save_built
from data_builders.in2 import TASKS
from models.training.renamed_keys import UnknownKeyError
from train import as_train_config, compose_config, model_tokenizer

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)


def _histograms(bundle: DataBundle, plots: Path) -> None:
    plots.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, (name, ds) in zip(axes, (("train", bundle.train), ("eval", bundle.eval))):
        lengths = ds.data.column("input_ids").combine_chunks().value_lengths().to_numpy()
        ax.hist(lengths, bins=50)
        ax.set(title=f"{name}: sample length", xlabel="tokens", ylabel="samples")
    fig.tight_layout()
    fig.savefig(plots / "lengths.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, (name, ds) in zip(axes, (("train", bundle.train), ("eval", bundle.eval))):
        tasks = ds.data.column("task").to_pylist()
        depths = ds.data.column("depths").to_pylist()
        for task in TASKS[:2]:
            values = [d for t, golds in zip(tasks, depths) if t == task for d in golds]
            if values:
                ax.hist(values, bins=20, range=(0, 1), histtype="step", label=f"{task} ({len(values)} golds)")
        ax.set(title=f"{name}: gold depth", xlabel="depth", ylabel="gold segments")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plots / "depths.png", dpi=100)
    plt.close(fig)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _split_section(split: Optional[dict[str, Any]]) -> str:
    """The card's account of the question split (nq sources), or nothing."""
    if split is None:
        return ""
    n_eval, n_train = split["questions"]["evaluation"], split["questions"]["training"]
    return f"""

## Evaluation questions

Split by question (`data_builders/question_split.py`): a question is an evaluation question when
`{split['rule']}`, with share {split['share']} and salt `{split['salt']}` (`data.nq_split`). Of the source's
{n_eval + n_train} questions, {n_eval} are evaluation questions and {n_train} are on the training side. The
held-out split asks evaluation questions only; no evaluation question, nor its gold passage (as gold or as
distractor), is in a training sample. The mdqa probe asks the same questions with
`eval.mdqa.questions=heldout` and `eval.mdqa.split` equal to `data.nq_split`.

Fingerprint (sha256 of the evaluation questions' distinct normalized texts, sorted, one a line):
`{split['fingerprint']}`."""


def write_card(bundle: DataBundle, out: Path, command: str) -> None:
    """README.md dataset card and plots/*.png for a built folder."""
    stats = bundle.stats
    _histograms(bundle, out / "plots")
    counts = [
        [split, len(ds), *(stats["tasks"][split].get(t, 0) for t in TASKS),
         int(ds.data.column("input_ids").combine_chunks().value_lengths().to_numpy().sum())]
        for split, ds in (("train", bundle.train), ("eval", bundle.eval))
    ]
    skipped = [[where, why, n] for where, reasons in stats["skipped"].items() for why, n in reasons.items()]
    example = bundle.eval[0]
    prompt_tail = bundle.tokenizer.decode(example["input_ids"][max(0, example["prompt_len"] - 60):])
    cfg = stats["config"]
    card = f"""# IN2 dataset `{cfg['name']}`

Built with `{command}`. Train on it with `python train.py data.prebuilt={out}`.

## Sources and licences

{chr(10).join('- ' + line for line in stats['attribution'])}

## Contents

{_table(['split', 'samples', *TASKS, 'tokens'], counts)}

Questions available (after skips): {json.dumps(stats['questions'])}.
Segment pools: {json.dumps(stats['pool'])}.

## Skipped questions

{_table(['where', 'reason', 'questions'], skipped) if skipped else 'None.'}{_split_section(stats.get('split'))}

## Lengths and depths

![sample lengths](plots/lengths.png)
![gold depths](plots/depths.png)

Depth of a gold segment = non-gold context tokens before it / all non-gold context tokens, drawn
uniformly and independently per gold (see `data_builders/in2.py`).

## Records

`input_ids` (prompt + answer + eos), `labels` (-100 except answer and eos), `prompt_len`,
`gold_spans` ([start, end) token spans of the gold segments, in question order), `depth` (of the
first gold), `depths` (of every gold), `context_tokens` (the context's tokens, between the chat
prefix and the question), `task`, `answers`, `source`, `id`.
End of the first held-out prompt, decoded:

```
{prompt_tail}
```

## Build

- seed: {cfg['seed']}
- fingerprint: `{stats['fingerprint']}`; content digests: {json.dumps(stats['digest'])}
- tokenizer digest: `{stats['tokenizer']}` (saved in `tokenizer/`)

```yaml
{OmegaConf.to_yaml(OmegaConf.create(cfg)).strip()}
```
"""
    (out / "README.md").write_text(card, encoding="utf-8")


def build(overrides: Sequence[str], out: Path) -> DataBundle:
    """Compose the config, build (or load from cache) and write the folder `out` with its card."""
    if out.exists() and any(out.iterdir()) and not (out / BUILD_FILE).exists():
        raise FileExistsError(f"{out} exists and is not a dataset folder; choose another out=")
    cfg = as_train_config(compose_config(list(overrides)))  # typed: a typo fails naming the key
    bundle = build_datasets(cfg.data, model_tokenizer(cfg.model))
    save_built(bundle, out, replace=True)
    write_card(bundle, out, "python -m scripts.build_dataset " + " ".join([*overrides, f"out={out}"]))
    return bundle


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = CommandParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="train.py overrides (data=..., model=...) and out=DIR")
    args = parser.parse_args(argv)
    outs = [a.split("=", 1)[1] for a in args.overrides if a.startswith("out=")]
    if len(outs) != 1:
        parser.error("give the output folder once, as out=DIR")
    try:
        bundle = build([a for a in args.overrides if not a.startswith("out=")], Path(outs[0]))
    except (UnknownKeyError, ConfigCompositionException) as err:
        parser.error(str(err).splitlines()[0])
    summary = {"out": outs[0], "tasks": bundle.stats["tasks"], "fingerprint": bundle.stats["fingerprint"]}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
