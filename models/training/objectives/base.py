"""What a training objective is, and the registry that names them (`debias.objective`).

An objective is one module of this package and one YAML of conf/debias/: a subclass of `TrainingObjective`
decorated with `@register`, which says what its batches carry, checks its settings at start-up (`validate`, before
anything is built), computes the micro-batch's loss (`__call__`, as the engine calls `causal_lm_loss`), reports its
diagnostics (`metrics`), keeps its state across checkpoints (`state_dict`), and may prepare its training targets once
before the first step (`prepare`: pos2distill's answers of the starting model). train.py reaches an objective only
through `build` and this interface. Settings: the `debias.*` keys an objective reads are its own; an objective's
`owns` names them, and they are refused with another objective (one at a time).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch

from data_builders.config import DataConfig, DataFormat
from models.training.debias import DebiasConfig
from models.training.loss import IGNORE, Tap, labelled_nll

REGISTRY: dict[str, type[TrainingObjective]] = {}


def register(cls: type[TrainingObjective]) -> type[TrainingObjective]:
    """Class decorator: `debias.objective=<cls.name>` runs `cls`."""
    if cls.name in REGISTRY:
        raise ValueError(f"two objectives are named {cls.name!r}: {REGISTRY[cls.name].__module__} and {cls.__module__}")
    REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    return sorted(REGISTRY)


def objective_class(name: str) -> type[TrainingObjective]:
    if name not in REGISTRY:
        raise ValueError(f"debias.objective={name!r} is not known (known: {', '.join(names())})")
    return REGISTRY[name]


@dataclass(frozen=True)
class StartUp:
    """What an objective's start-up checks read: the settings, no data or model yet."""

    debias: DebiasConfig
    data: DataConfig  # the run's data settings
    built: DataConfig  # those its data is built with (a prebuilt folder's, else `data`)
    peft: str  # peft.method
    attention: str  # model.attention
    jacobian_every: int
    sequence_parallel: int


@dataclass(frozen=True)
class Context:
    """What an objective is built with."""

    cfg: DebiasConfig
    layers: int  # the model's decoder layers (H of the prior)
    all_sum: Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the data-parallel ranks
    built: DataConfig  # the settings the training data was built with


@dataclass
class Preparation:
    """What `prepare` may use: the training split and the run around it. `answers` gives a function that answers
    prompts (token ids) greedily with the starting model, adapters off, each up to `max_new_tokens` and the end of
    its first line, cached by the starting function and the prompts; `logprobs` scores (prompt, target) pairs of
    token ids by the starting model's log p of the target, cached alike: an objective that distils the model's own
    answers needs nothing else of evaluation code (models never import analysis)."""

    train: Any  # the training split (a datasets.Dataset)
    tokenizer: Any
    run_dir: Any  # pathlib.Path
    micro_batch_size: int
    data_parallel: int  # data-parallel groups: a split smaller than one global micro-batch cannot train
    is_main: bool
    answers: Callable[[int], Callable[[Sequence[Sequence[int]]], list[list[int]]]]
    share: Callable[[Any], Any]  # the main process's object on every rank
    logprobs: Optional[Callable[[Sequence[tuple[Sequence[int], Sequence[int]]]], list[float]]] = None


class TrainingObjective:
    """The loss of `debias.objective=<name>` (module docstring)."""

    name: ClassVar[str]
    batch_depths: ClassVar[bool] = True  # its batches carry each sample's gold depth and token owners
    batch_teacher: ClassVar[bool] = False  # its batches carry each sample's teacher sequence
    teacher_pass: ClassVar[bool] = False  # `prepare` has the starting model answer teacher prompts (cached by them)
    owns: ClassVar[tuple[str, ...]] = ()  # its debias.* keys (dotted under debias)
    owns_data: ClassVar[tuple[str, ...]] = ()  # its data.* keys (dotted under data)
    Settings: ClassVar[Optional[type]] = None  # a dataclass of its own settings, given as debias.settings.<key>

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.settings = settings_of(type(self), ctx.cfg)

    @classmethod
    def validate(cls, start: StartUp) -> None:
        """Refuse, naming the key, a setting this objective cannot run with."""

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], device: Any = None,
                 tap: Optional[Tap] = None) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, prep: Preparation) -> Optional[Any]:
        """The training split to train on instead (its targets made), or None to keep it."""
        return None

    def observe(self, metrics: Mapping[str, float]) -> None:
        """The metrics of a measured step (the Jacobian's fitted prior), before the next update."""

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The state of a checkpoint (empty when it was written by another objective, or none)."""


def build(ctx: Context) -> TrainingObjective:
    return objective_class(ctx.cfg.objective)(ctx)


def owned_settings(start: StartUp, name: str) -> list[str]:
    """`debias.<key>=<value>` (and `data.<key>=<value>`) of each setting of another objective than `name` that
    differs from its default."""
    mine = objective_class(name)
    changed = []
    for other, cls in REGISTRY.items():
        for section, keys, own, cfg, default in (("debias", cls.owns, mine.owns, start.debias, DebiasConfig()),
                                                 ("data", cls.owns_data, mine.owns_data, start.data, DataConfig())):
            for key in keys:
                if other != name and key not in own and _get(cfg, key) != _get(default, key):
                    changed.append(f"{section}.{key}={_get(cfg, key)}")
    return sorted(set(changed))


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def settings_of(cls: type[TrainingObjective], cfg: DebiasConfig) -> Any:
    """`debias.settings` as the objective's `Settings` (None without); ValueError naming a key it does not have."""
    if cls.Settings is None:
        if cfg.settings:
            raise ValueError(f"debias.settings={dict(cfg.settings)}: debias.objective={cls.name} has no settings of "
                             "its own")
        return None
    known = {f.name for f in fields(cls.Settings)}
    unknown = sorted(set(cfg.settings) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"; did you mean debias.settings.{close[0]}?" if close else f" (its settings: {', '.join(sorted(known))})"
        raise ValueError(f"debias.settings.{unknown[0]}: {cls.name} has no such setting{hint}")
    return cls.Settings(**cfg.settings)


def validate(start: StartUp) -> None:
    """An objective's own checks, what its batches need, and none of another's settings changed."""
    name = start.debias.objective
    cls = objective_class(name)
    changed = owned_settings(start, name)
    if changed:
        raise ValueError(f"{', '.join(changed)} set with debias.objective={name}: they are another objective's; "
                         "one objective at a time")
    settings_of(cls, start.debias)
    if cls.batch_depths and start.built.format != DataFormat.in2:
        raise ValueError(f"debias.objective={name} weights samples by their gold depth: it needs IN2 data "
                         "(data.format=in2)")
    if cls.batch_depths and start.sequence_parallel > 1:
        raise ValueError(f"debias.objective={name} with trainer.sequence_parallel={start.sequence_parallel}: "
                         "per-sample losses over sequence slices are not implemented; use one of them")
    cls.validate(start)


# ---------------------------------------------------------------------------------------------- shared pieces


def mean_one_clipped(raw: torch.Tensor, cap: float) -> torch.Tensor:
    """w = min(c raw, cap) with c chosen so that mean(w) = 1 (cap >= 1); float64.

    Proportional to `raw` below the cap: each round rescales the unclipped weights to make up the mean,
    and clips those that rise above it; at most len(raw) rounds.
    """
    raw = raw.double()
    clipped = torch.zeros_like(raw, dtype=torch.bool)
    w = raw
    for _ in range(raw.numel()):
        free_total = raw[~clipped].sum()
        scale = (raw.numel() - cap * clipped.sum()) / free_total if free_total > 0 else 0.0
        w = torch.where(clipped, torch.full_like(raw, cap), raw * scale)
        over = (w > cap) & ~clipped
        if not over.any():
            break
        clipped |= over
    return w


def per_sample_nll(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: Any = None,
                   tap: Optional[Tap] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What an objective that weighs samples by their gold depth starts from: each sample's summed NLL and labelled
    tokens (`sample_sums`), each sample's gold depth, and the micro-batch's labelled tokens (`labelled_nll`'s count)."""
    nll, count = labelled_nll(model, batch, device, per_token=True, tap=tap)
    targets = batch["labels"][:, 1:].to(nll.device)
    depths = batch["depths"].to(nll.device)
    sums, counts = sample_sums(nll, targets, batch["sample_ids"].to(nll.device), depths.numel())
    return sums, counts, depths, count


def check_max_weight(cfg: DebiasConfig) -> None:
    """`debias.max_weight` of a weighting objective whose weights average 1."""
    if cfg.max_weight < 1:
        raise ValueError(f"debias.max_weight={cfg.max_weight} must be >= 1 (the weights average 1)")


def sample_sums(nll: torch.Tensor, targets: torch.Tensor, sample_ids: torch.Tensor, n_samples: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed NLL, labelled-token count) per sample, from per-position NLL (`labelled_nll(per_token=True)`).

    `sample_ids` (B, L): the sample each token belongs to (-1: padding); a position's loss is its next
    token's, so it counts towards that token's sample.
    """
    owner = sample_ids[:, -targets.shape[1]:].flatten()  # (N,) owner of each target token
    labelled = (targets.flatten() != IGNORE) & (owner >= 0)
    slot = torch.where(labelled, owner, torch.full_like(owner, n_samples))  # the rest into a spare slot
    sums = nll.new_zeros(n_samples + 1).index_add(0, slot, nll.flatten())
    counts = torch.zeros(n_samples + 1, dtype=torch.float64, device=nll.device).index_add(
        0, slot, labelled.double())
    return sums[:n_samples], counts[:n_samples]
