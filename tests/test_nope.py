"""model.rope=false (NoPE): attention scores are unrotated q·k, nothing reads positions, checkpoints stay NoPE."""
from __future__ import annotations

import json

import pytest
import torch
from transformers.models.llama.modeling_llama import repeat_kv

from models.attention.nope import NOPE_KEY, NoRotaryEmbedding
from models.build import Attention, AttnImplementation, ModelConfig, build_model, differs_from_pretrained
from models.training.checkpoint import load_checkpoint_model
from models.training.run_dir import CHECKPOINT_CONFIG
from models.training.state import TrainerState
from tests.conftest import TINY
from train import run

VOCAB, L = 97, 12
INIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
QK = ("q_proj.weight", "k_proj.weight", "q2_proj.weight", "k2_proj.weight")


def tiny(arch="qwen2", rope=True, attention=Attention.standard, seed=0, **kw) -> torch.nn.Module:
    """A random-init model with large query-key products: at the default scale attention is near uniform,
    and RoPE changes the maps (and outputs) too little to tell apart from rounding."""
    torch.manual_seed(seed)
    model = build_model(ModelConfig(arch=arch, init=INIT, rope=rope, attention=attention, **kw), VOCAB)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(QK):
                p.mul_(30)
    return model.eval()


def ids(seed=1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, L), generator=torch.Generator().manual_seed(seed))


def unrotated_maps(model, input_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's attention maps as the model returns them, and softmax(q·kᵀ/√d + causal mask) of its
    unrotated projections."""
    attn, seen = model.model.layers[0].self_attn, {}
    handle = attn.register_forward_pre_hook(lambda m, a, kw: seen.update(h=kw["hidden_states"]), with_kwargs=True)
    with torch.no_grad():
        maps = model(input_ids, output_attentions=True).attentions[0]  # (B, H, L, L)
    handle.remove()
    h, d = seen["h"], attn.head_dim  # (B, L, D)
    q = attn.q_proj(h).view(*h.shape[:2], -1, d).transpose(1, 2)  # (B, H, L, d)
    k = repeat_kv(attn.k_proj(h).view(*h.shape[:2], -1, d).transpose(1, 2), attn.num_key_value_groups)
    scores = (q @ k.transpose(-1, -2)) * attn.scaling  # (B, H, L, L)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    return maps, scores.masked_fill(~causal, float("-inf")).softmax(-1)


def test_nope_attention_scores_are_unrotated_dot_products():
    kw = dict(attn_implementation=AttnImplementation.eager)
    nope_maps, plain = unrotated_maps(tiny(rope=False, **kw), ids())
    torch.testing.assert_close(nope_maps, plain, atol=1e-6, rtol=1e-5)
    rope_maps, rope_plain = unrotated_maps(tiny(rope=True, **kw), ids())  # same weights
    torch.testing.assert_close(rope_plain, plain, atol=1e-6, rtol=1e-5)
    assert (rope_maps - plain).abs().max() > 0.05  # RoPE's maps are not the unrotated ones


@pytest.mark.parametrize("attention", list(Attention))
@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral"])
def test_nope_outputs_do_not_depend_on_positions(arch, attention):
    """Stretched positions (RoPE is invariant to a shift, not to a stretch) change RoPE's logits, not NoPE's."""
    x, mask = ids(), torch.ones(2, L, dtype=torch.long)  # an explicit mask: HF reads no packing from positions
    stretched = (torch.arange(L) * 3 + 5).expand(2, L)

    def logits(model, positions=None):
        with torch.no_grad():
            return model(x, attention_mask=mask, position_ids=positions).logits

    nope = tiny(arch, rope=False, attention=attention)
    assert isinstance(nope.model.rotary_emb, NoRotaryEmbedding) and getattr(nope.config, NOPE_KEY)
    torch.testing.assert_close(logits(nope, stretched), logits(nope), atol=1e-5, rtol=1e-5)
    rope = tiny(arch, rope=True, attention=attention)
    assert (logits(rope, stretched) - logits(rope)).abs().max() > 0.05


@pytest.mark.parametrize("attention", [Attention.standard, Attention.diff_v1])
def test_a_nope_checkpoint_reloads_without_rope(tmp_path, attention):
    model = tiny(rope=False, attention=attention)
    model.save_pretrained(tmp_path / "nope")
    assert json.loads((tmp_path / "nope" / "config.json").read_text())[NOPE_KEY] is True
    x = ids()
    with torch.no_grad():
        expected = model(x).logits
    for reloaded in (load_checkpoint_model(tmp_path / "nope"),
                     build_model(ModelConfig(pretrained=str(tmp_path / "nope"), rope=False), VOCAB).eval()):
        assert isinstance(reloaded.model.rotary_emb, NoRotaryEmbedding)
        with torch.no_grad():
            torch.testing.assert_close(reloaded(x).logits, expected)
    with pytest.raises(ValueError, match="trained without position encoding .*set model.rope=false"):
        build_model(ModelConfig(pretrained=str(tmp_path / "nope")), VOCAB)


def test_lora_on_a_pretrained_rope_model_with_rope_off_keeps_its_base(tmp_path):
    """Adapters need the NoPE base saved beside them: the hub's config would reload it with RoPE."""
    tiny().save_pretrained(tmp_path / "rope")
    tiny(rope=False).save_pretrained(tmp_path / "nope")
    assert not differs_from_pretrained(ModelConfig(pretrained=str(tmp_path / "rope")))
    assert differs_from_pretrained(ModelConfig(pretrained=str(tmp_path / "rope"), rope=False))
    assert not differs_from_pretrained(ModelConfig(pretrained=str(tmp_path / "nope"), rope=False))


def test_a_nope_run_trains_saves_nope_and_refuses_a_rope_resume(compose_cfg, tmp_path):
    run(compose_cfg(*TINY, "model.rope=false", "trainer.max_steps=2", "jacobian=hutchinson", "jacobian.seq_len=64",
                    "jacobian.chunk_len=32", "jacobian.num_probes=2"), tmp_path / "nope")
    ckpt = tmp_path / "nope" / "checkpoints" / "step-2"
    assert json.loads((ckpt / "config.json").read_text())[NOPE_KEY] is True
    assert isinstance(load_checkpoint_model(ckpt).model.rotary_emb, NoRotaryEmbedding)
    measured = ["jacobian=hutchinson", "jacobian.seq_len=64", "jacobian.chunk_len=32", "jacobian.num_probes=2"]
    with pytest.raises(ValueError, match=r"other settings \(another architecture\): model.rope \(False there, True "
                                         r"now\); a resume"):
        run(compose_cfg(*TINY, *measured, "trainer.max_steps=3", f"trainer.resume_from={ckpt}"), tmp_path / "rope")
    # a checkpoint from before the run's config was kept in it: the model's config.json tells
    (ckpt / CHECKPOINT_CONFIG).unlink()
    state = TrainerState.read(ckpt)
    state.files.pop(CHECKPOINT_CONFIG)
    state.write(ckpt)
    with pytest.raises(ValueError, match="trained without RoPE, this run has model.rope=true: set model.rope=false"):
        run(compose_cfg(*TINY, "trainer.max_steps=3", f"trainer.resume_from={ckpt}"), tmp_path / "rope")
