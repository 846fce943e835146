"""Model builder: a random-init model from a config, or a pretrained one from a hub id or folder.

Both paths return a Hugging Face `PreTrainedModel`; differential attention and LoRA are applied on
top of it by their own modules, so the loop never needs to know how the model was made.
"""
from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional

import torch
from huggingface_hub import constants as hub_constants  # a dependency of transformers
from huggingface_hub import try_to_load_from_cache
from omegaconf import OmegaConf
from safetensors import SafetensorError
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from data_builders.tokenizer import hub_unreachable, not_on_hub
from models.attention.diff_attention import convert_to_diff_attention
from models.attention.nope import NOPE_KEY, disable_rope, is_nope
from models.wheel_models import is_wheel_model, local_pretrained, wheel_model_name

DIFF_ARCHS = ("qwen2", "llama", "mistral")
WEIGHT_FILES = ("*.safetensors", "*.bin")  # what `from_pretrained` reads: whole, sharded, or LoRA adapters
# the config settings that decide a model's tensors and their shapes (`architecture_difference`)
ARCHITECTURE = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "diff_attention")


class Attention(StrEnum):
    standard = "standard"
    diff_v1 = "diff_v1"  # DIFF Transformer (Ye et al. 2024)
    diff_v2 = "diff_v2"  # doubled query heads sharing K/V, per-token λ


class DiffMode(StrEnum):
    scratch = "scratch"  # paper initialization, for random-init models
    retrofit = "retrofit"  # pretrained attention kept as the positive map: exact at step 0


class AttnImplementation(StrEnum):
    """transformers' attention kernels (`attn_implementation`); diff attention runs on every one."""

    sdpa = "sdpa"  # torch's scaled_dot_product_attention: fused kernels on GPU and CPU
    eager = "eager"  # the explicit softmax(QKᵀ)V: the reference, and the only one that returns the maps
    flash_attention_2 = "flash_attention_2"  # CUDA with the flash-attn package; bf16/fp16 weights
    flex_attention = "flex_attention"  # torch's FlexAttention (its backward needs a GPU)


class DType(StrEnum):
    """Weights dtype, wherever weights are built or loaded (model.dtype, eval_checkpoint, compare, merge_lora)."""

    auto = "auto"  # the dtype the weights were saved in (pretrained weights only)
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"

    @property
    def torch(self) -> torch.dtype | str:
        """The torch dtype, or "auto" (what `from_pretrained` takes for the saved dtype)."""
        return "auto" if self is DType.auto else getattr(torch, self.value)


@dataclass
class DiffConfig:
    mode: DiffMode = DiffMode.scratch  # the model's recipe (conf/recipe/) picks retrofit for pretrained weights
    layers: Any = "all"  # "all" or a list of 0-based layer indices
    lambda_warmup_steps: Optional[int] = None  # steps over which λ ramps in; None: 0 scratch, 200 retrofit


@dataclass
class ModelConfig:
    name: str = "qwen2_tiny"
    pretrained: Optional[str] = None  # hub id or local folder; None = random init from `arch` + `init`
    arch: str = "qwen2"  # model_type for random init (qwen2, llama, mistral, ...)
    init: dict[str, Any] = field(default_factory=dict)  # config kwargs for random init (hidden_size, ...)
    tokenizer: Optional[str] = None  # tokenizer id/folder; None = the pretrained model's, or a BPE trained on the data
    attention: Attention = Attention.standard
    attn_implementation: AttnImplementation = AttnImplementation.sdpa
    diff: DiffConfig = field(default_factory=DiffConfig)
    dtype: DType = DType.float32  # weights dtype
    # false: no position encoding (NoPE, models/nope.py), for the RoPE-invariance check; saved in config.json
    rope: bool = True
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False


def _plain(init: Any) -> dict[str, Any]:
    # Plain containers: HF configs type-check nested fields (rope_parameters) and reject a DictConfig.
    return OmegaConf.to_container(init, resolve=True) if OmegaConf.is_config(init) else dict(init)


def validate_model(cfg: ModelConfig) -> None:
    """Fail at start-up on a model config that cannot be what the user meant, naming the key."""
    if cfg.pretrained and cfg.init:
        raise ValueError(f"model.init {sorted(cfg.init)} sets a random initialization, but model.pretrained="
                         f"{cfg.pretrained} loads trained weights: drop one of them")
    if cfg.attention != Attention.standard and not cfg.pretrained and cfg.arch not in DIFF_ARCHS:
        raise ValueError(f"model.attention={cfg.attention} supports model.arch in {DIFF_ARCHS}, got {cfg.arch!r}")
    if cfg.attn_implementation == AttnImplementation.flash_attention_2:
        if importlib.util.find_spec("flash_attn") is None:
            raise ValueError("model.attn_implementation=flash_attention_2 needs the flash-attn package "
                             "(pip install flash-attn --no-build-isolation) and a CUDA device; or use sdpa")
        if cfg.dtype == DType.float32:
            raise ValueError("model.attn_implementation=flash_attention_2 runs on bf16/fp16 weights: set "
                             "model.dtype=bfloat16 (trainer.precision=bf16 keeps fp32 master weights)")
    if cfg.dtype == DType.auto and not cfg.pretrained:
        raise ValueError("model.dtype=auto keeps the dtype pretrained weights were saved in: a model built from "
                         "model.init has none (set model.dtype=float32, bfloat16 or float16)")
    if is_wheel_model(cfg.pretrained):
        wheel_model_name(cfg.pretrained)  # an unknown name fails here, before anything is fetched
    elif cfg.pretrained:
        check_model_folder(cfg.pretrained, "model.pretrained")
        check_hub_model(cfg.pretrained, "model.pretrained")
    if cfg.pretrained:
        return
    if cfg.arch not in CONFIG_MAPPING:
        raise ValueError(f"model.arch={cfg.arch!r} is not a transformers model_type (e.g. {', '.join(DIFF_ARCHS)})")
    config_cls = CONFIG_MAPPING[cfg.arch]
    declared = set(inspect.signature(config_cls.__init__).parameters) | set(config_cls().to_dict())
    init = _plain(cfg.init)
    # A key the config class neither declares nor consumes (legacy names such as rope_theta are
    # consumed) would be stored as a stray attribute that no model code reads.
    stray = sorted(set(init) - declared & set(config_cls(**init).to_dict()))
    if stray:
        raise ValueError(f"model.init: {', '.join(stray)} not a setting of {config_cls.__name__} "
                         f"(model.arch={cfg.arch}); known: {', '.join(sorted(declared - {'self', 'kwargs'}))}")


def check_model_folder(name_or_path: str, key: str | None = None) -> None:
    """ValueError naming the folder (as `key=folder` when given) when a local model folder cannot be loaded: a file, a
    folder without config.json, or one without weights (found before any data is built or anything loads). A path
    that is not there is left to loading (a hub id, or a checkpoint that a run before this one writes)."""
    path = Path(name_or_path).expanduser()
    if not path.exists():
        return
    what = f"{key}={name_or_path}" if key else name_or_path
    if not path.is_dir():
        raise ValueError(f"{what}: not a folder (give a save_pretrained folder or a hub id)")
    if not ((path / "config.json").is_file() or (path / "adapter_config.json").is_file()):
        raise ValueError(f"{what}: no config.json in it: not a save_pretrained folder")
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES):
        held = ", ".join(sorted(p.name for p in path.iterdir())[:6])
        raise ValueError(f"{what}: no weights in it (no *.safetensors or *.bin file; it holds {held}): copy the "
                         "weights in, or save the model again with save_pretrained")


def check_hub_model(name: str, key: str | None = None) -> None:
    """ValueError naming `key` when `name` is a hub id (no local path of that name) while the hub is offline
    (HF_HUB_OFFLINE) and its cache has no config.json of it: found at start-up, before any data is built. A name
    that is no valid hub id is left to loading."""
    if not hub_constants.HF_HUB_OFFLINE or is_wheel_model(name) or Path(name).expanduser().exists():
        return
    try:
        cached = try_to_load_from_cache(name, "config.json")
    except ValueError:  # not a repo id: loading says what it is
        return
    if not isinstance(cached, str):
        raise ValueError(not_on_hub(name, key))


def architecture_difference(saved: dict[str, Any], built: PretrainedConfig) -> str | None:
    """How the architecture of a saved config.json differs from a built model's (`ARCHITECTURE`), e.g. "it holds
    hidden_size=32, num_hidden_layers=2; the model built here has hidden_size=64, num_hidden_layers=4"; None when
    they agree."""
    ours = built.to_dict()
    keys = [k for k in ARCHITECTURE if (k in saved or k in ours) and saved.get(k) != ours.get(k)]
    if not keys:
        return None
    return (f"it holds {', '.join(f'{k}={saved.get(k)}' for k in keys)}; the model built here has "
            f"{', '.join(f'{k}={ours.get(k)}' for k in keys)}")


def differs_from_pretrained(cfg: ModelConfig) -> bool:
    """Whether `build_model(cfg)` differs from `from_pretrained(cfg.pretrained)`: a random init, or diff
    layers swapped into a checkpoint that had none, or RoPE turned off in one that had it (LoRA adapters
    of such a model need its base saved)."""
    if not cfg.pretrained:
        return True
    if cfg.attention == Attention.standard and cfg.rope:
        return False
    config = AutoConfig.from_pretrained(local_pretrained(cfg.pretrained), trust_remote_code=cfg.trust_remote_code)
    new_diff = cfg.attention != Attention.standard and not getattr(config, "diff_attention", None)
    return new_diff or (not cfg.rope and not is_nope(config))


def build_model(cfg: ModelConfig, vocab_size: int, pad_token_id: int | None = None,
                gather: Callable[[torch.nn.Module], ContextManager] | None = None) -> PreTrainedModel:
    """The configured causal LM: `from_pretrained` when `pretrained` is set, else random init.

    `gather(module)`: a context in which `module`'s weights are whole, for a model partitioned while
    it loads (ZeRO-3: `models.training.engines.gathered`); the diff attention retrofit reads the
    pretrained projections inside it.
    """
    dtype, attention = DType(cfg.dtype).torch, str(cfg.attn_implementation)
    if cfg.pretrained:
        # Importing models.attention.diff_attention registers the diff model types with the Auto classes, so a
        # checkpoint saved with differential attention restores its diff layers (and weights) here.
        try:
            model = AutoModelForCausalLM.from_pretrained(
                local_pretrained(cfg.pretrained), dtype=dtype, trust_remote_code=cfg.trust_remote_code,
                attn_implementation=attention,
            )
        except SafetensorError as err:
            raise ValueError(f"model.pretrained={cfg.pretrained}: a weights file is damaged or cut short ({err}): "
                             "copy the folder again, or save the model again") from err
        except OSError as err:
            if not hub_unreachable(err):
                raise
            raise ValueError(not_on_hub(cfg.pretrained, "model.pretrained")) from err
        embeddings = model.get_input_embeddings().num_embeddings
        if vocab_size > embeddings:  # token ids past the embedding table: an IndexError at the first forward
            which = f"model.tokenizer={cfg.tokenizer}" if cfg.tokenizer else "the data's tokenizer"
            raise ValueError(f"model.pretrained={cfg.pretrained} embeds {embeddings} tokens, {which} has {vocab_size}: "
                             "it is not the model's; use the tokenizer the model was trained with")
    else:
        config = AutoConfig.for_model(cfg.arch, vocab_size=vocab_size, pad_token_id=pad_token_id, **_plain(cfg.init))
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    already_diff = getattr(model.config, "diff_attention", None) is not None
    if cfg.attention != Attention.standard and not already_diff and model.config.model_type not in DIFF_ARCHS:
        raise ValueError(f"model.attention={cfg.attention}: model.pretrained={cfg.pretrained} is a "
                         f"{model.config.model_type} model, and differential attention is swapped into "
                         f"{', '.join(DIFF_ARCHS)} models only: use model.attention=standard, or one of those")
    if cfg.attention != Attention.standard and not already_diff:
        convert_to_diff_attention(
            model,
            version=Attention(cfg.attention).removeprefix("diff_"),
            mode=str(cfg.diff.mode),
            layers=cfg.diff.layers if isinstance(cfg.diff.layers, str) else list(cfg.diff.layers),
            lambda_warmup_steps=cfg.diff.lambda_warmup_steps,
            gather=gather,
        )
    if is_nope(model.config) and cfg.rope:
        # Turning RoPE back on would run the weights in a model they were not trained in.
        raise ValueError(f"model.pretrained={cfg.pretrained} was trained without position encoding "
                         f"(config.json {NOPE_KEY}=true): set model.rope=false")
    if not cfg.rope:
        disable_rope(model)  # diff layers included: they read the model's rotary cos/sin
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside a DeepSpeed engine and/or a peft model (adapters stay injected)."""
    model = getattr(model, "module", model)  # DeepSpeed engine
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 up, fp64 kept
