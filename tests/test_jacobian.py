"""Jacobian profile: estimators against independent autograd, side-effect freedom, sequences, recorder."""

import copy
import logging

import numpy as np
import pytest
import torch
import transformers
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError
from torch import nn

from analysis.measure.jacobian import (
    Estimator,
    JacobianConfig,
    JacobianRecorder,
    ProfileResult,
    build_eval_sequences,
    jacobian_profile,
    journal_path,
    measure_sets,
    read_jacobian,
)
from analysis.measure.prior import fit_alpha, spearman

V = 128


def tiny(arch: str = "qwen2", layers: int = 2, hidden: int = 64, seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    config_cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[arch]
    cfg = config_cls(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=2 * hidden, vocab_size=V, **kw)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def ids_of(B: int, L: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(seed))  # (B, L)


def full_jacobian_norms(f, model: nn.Module, ids: torch.Tensor) -> np.ndarray:
    """Reference: the whole Jacobian of f(embeds) (d,) per sequence, one backward per output coordinate."""
    rows = []
    for row in ids:
        e = model.get_input_embeddings()(row[None]).detach()  # (1, L, D)
        J = torch.autograd.functional.jacobian(f, e)  # (d, 1, L, D)
        rows.append(J.pow(2).sum(dim=(0, 1, 3)).sqrt())  # (L,)
    return torch.stack(rows).numpy()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_exact_matches_float64_full_jacobian(arch):
    model = tiny(arch, hidden=32).double().eval()  # d=32 output coordinates: 32 reference backwards per row
    ids = ids_of(2, 12)

    def last_hidden(e):
        return model.model(inputs_embeds=e).last_hidden_state[0, -1]  # (d,)

    ref = full_jacobian_norms(last_hidden, model, ids)
    got = jacobian_profile(model, ids, "exact", chunk=12)  # 12 does not divide d=32: a ragged last chunk
    assert got.profile.shape == (2, 12) and got.profile.dtype == np.float64 and got.stderr is None
    np.testing.assert_allclose(got.profile, ref, rtol=1e-6)


@pytest.mark.parametrize("variant", ["mistral_window", "diff_v1", "diff_v2"])
def test_exact_matches_full_forward_for_cached_attention_variants(variant):
    """The profile's prefix-cache forward equals one full forward where the cache is least plain:
    a sliding window shorter than the sequence (the cache crops keys), V1's double-width values."""
    from models.attention.diff_attention import convert_to_diff_attention

    torch.manual_seed(0)
    if variant == "mistral_window":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=V, sliding_window=5))
    else:
        model = tiny(hidden=32)
        convert_to_diff_attention(model, version=variant.removeprefix("diff_"))
    model = model.double().eval()
    ids = ids_of(2, 12)

    def last_hidden(e):
        return model.model(inputs_embeds=e).last_hidden_state[0, -1]  # (d,)

    ref = full_jacobian_norms(last_hidden, model, ids)
    np.testing.assert_allclose(jacobian_profile(model, ids, "exact").profile, ref, rtol=1e-6)
    if variant == "mistral_window":  # a window of 5 in 2 layers reaches back 8 positions, no further
        assert (ref[:, :3] == 0).all() and (ref[:, 3:] > 0).all()


def test_exact_pre_norm_matches_model_without_final_norm():
    model = tiny(hidden=32).double().eval()
    ids = ids_of(2, 10)
    ref_model = copy.deepcopy(model)
    ref_model.model.norm = nn.Identity()

    def pre_norm(e):
        return ref_model.model(inputs_embeds=e).last_hidden_state[0, -1]  # (d,)

    ref = full_jacobian_norms(pre_norm, ref_model, ids)
    got = jacobian_profile(model, ids, "exact", target="pre_norm")
    np.testing.assert_allclose(got.profile, ref, rtol=1e-6)


def test_unbatched_input_gives_unbatched_profile():
    model = tiny()
    ids = ids_of(2, 8)
    both = jacobian_profile(model, ids, "exact")
    one = jacobian_profile(model, ids[1], "exact")
    assert one.profile.shape == (8,)
    np.testing.assert_allclose(one.profile, both.profile[1], rtol=1e-4)


def test_bfloat16_model_close_to_float32():
    model = tiny()
    ids = ids_of(1, 16)
    ref = jacobian_profile(model, ids, "exact").profile
    got = jacobian_profile(copy.deepcopy(model).to(torch.bfloat16), ids, "exact").profile
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, ref, rtol=0.1)


def test_hutchinson_accuracy_and_standard_error_coverage():
    # Probes are shared by all positions of a sequence, so errors along a sequence are strongly
    # correlated; coverage is pooled over independent rows and draws. Nominal 2-sigma coverage is 95%;
    # the delta method with a sample variance from k=64 chi-square-like terms measured ~92-95% here.
    model = tiny()
    ids = ids_of(8, 16)
    exact = jacobian_profile(model, ids, "exact").profile  # (8, 16)
    covered, medians = [], []
    for seed in range(6):
        est = jacobian_profile(model, ids, "hutchinson", 64, generator=torch.Generator().manual_seed(seed))
        err = np.abs(est.profile - exact)
        medians.append(np.median(err / exact))
        covered.append(err <= 2 * est.stderr)
    assert max(medians) <= 0.1
    assert np.mean(covered) >= 0.85


def test_hutchinson_default_generator_is_deterministic():
    model = tiny()
    ids = ids_of(1, 8)
    a = jacobian_profile(model, ids, "hutchinson", 4)
    b = jacobian_profile(model, ids, "hutchinson", 4)
    np.testing.assert_array_equal(a.profile, b.profile)
    np.testing.assert_array_equal(a.stderr, b.stderr)


def test_top_prob_matches_direct_autograd():
    model = tiny().eval()
    ids = ids_of(2, 10)
    ref = []
    for row in ids:
        e = model.get_input_embeddings()(row[None]).detach().requires_grad_(True)  # (1, L, D)
        p = model(inputs_embeds=e).logits[0, -1].softmax(-1).max()
        (g,) = torch.autograd.grad(p, e)  # (1, L, D)
        ref.append(g[0].norm(dim=-1).double().numpy())
    got = jacobian_profile(model, ids, "top_prob")
    np.testing.assert_allclose(got.profile, np.stack(ref), rtol=1e-5)


def test_measurement_has_no_side_effects_on_training():
    model = tiny(attention_dropout=0.5)
    model.train()
    model.lm_head.eval()  # a module deliberately left in eval must stay so
    ids = ids_of(2, 12)
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()

    first = jacobian_profile(model, ids, "hutchinson", 4)
    second = jacobian_profile(model, ids, "hutchinson", 4)

    np.testing.assert_array_equal(first.profile, second.profile)  # dropout was off while measuring
    assert model.training and model.model.layers[0].self_attn.training and not model.lm_head.training
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_training_losses_identical_with_and_without_profiling():
    def train(profile_every_step: bool) -> list[float]:
        model = tiny(attention_dropout=0.3)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(123)
        losses = []
        for step in range(3):
            ids = torch.randint(0, V, (2, 12))  # (B, L), from the global RNG like a data loader
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if profile_every_step:
                jacobian_profile(model, ids, "hutchinson", 2)
        return losses

    assert train(True) == train(False)


def test_mode_restored_after_exception():
    model = tiny()
    model.train()

    def boom(module, args, out):
        assert not module.training
        raise RuntimeError("boom")

    model.model.layers[1].register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        jacobian_profile(model, ids_of(1, 6), "exact")
    assert all(m.training for m in model.modules())


def test_peft_lora_with_zero_b_matches_base_model():
    peft = pytest.importorskip("peft")
    base = tiny()
    ids = ids_of(2, 10)
    lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for target in ["last_hidden", "pre_norm"]:
        ref = jacobian_profile(base, ids, "exact", target=target).profile
        got = jacobian_profile(lora, ids, "exact", target=target).profile
        np.testing.assert_allclose(got, ref, rtol=1e-5)
    ref = jacobian_profile(base, ids, "exact").profile
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    changed = jacobian_profile(lora, ids, "exact").profile
    assert not np.allclose(changed, ref, rtol=1e-3)  # the adapters are in the measured path


class _NoMixing(nn.Module):
    """A replaced attention that keeps its interface but mixes nothing across positions."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, **kwargs):
        out, weights = self.inner(hidden_states, **kwargs)
        return torch.zeros_like(out), weights


def test_replaced_attention_goes_through_public_forward():
    model = tiny()
    for layer in model.model.layers:
        layer.self_attn = _NoMixing(layer.self_attn)
    prof = jacobian_profile(model, ids_of(1, 8), "exact").profile  # (1, L)
    assert np.all(prof[0, :-1] == 0) and prof[0, -1] > 0


def test_measure_sets_uses_the_same_probes_every_call():
    model = tiny()
    seqs = {"vanilla": ids_of(2, 8, 1), "chunked": ids_of(1, 8, 2)}
    cfg = JacobianConfig(num_probes=4, seq_len=8)
    a, b = measure_sets(model, seqs, cfg), measure_sets(model, seqs, cfg)
    assert {k: v.profile.shape for k, v in a.items()} == {"vanilla": (2, 8), "chunked": (1, 8)}
    for name in seqs:
        np.testing.assert_array_equal(a[name].profile, b[name].profile)
        assert a[name].stderr.shape == a[name].profile.shape


def test_measure_sets_batches_sets_without_mixing_their_rows():
    model = tiny()
    seqs = {"vanilla": ids_of(2, 8, 1), "chunked": ids_of(1, 8, 2)}
    got = measure_sets(model, seqs, JacobianConfig(estimator=Estimator.exact, seq_len=8))
    for name, ids in seqs.items():
        np.testing.assert_allclose(got[name].profile, jacobian_profile(model, ids, "exact").profile, rtol=1e-5)


def test_config_choices_are_typed():
    cfg = OmegaConf.structured(JacobianConfig)
    assert OmegaConf.to_object(OmegaConf.merge(cfg, {"estimator": "exact"})).estimator is Estimator.exact
    for key, typo in (("estimator", "hutchinsn"), ("target", "last")):
        with pytest.raises(ValidationError, match=f"Invalid value '{typo}', expected one of"):
            OmegaConf.merge(cfg, {key: typo})


def test_bad_arguments_raise():
    model = tiny()
    with pytest.raises(ValueError, match="'exactly' is not a valid Estimator"):
        jacobian_profile(model, ids_of(1, 4), "exactly")
    with pytest.raises(ValueError, match="'logits' is not a valid JacobianTarget"):
        jacobian_profile(model, ids_of(1, 4), target="logits")
    with pytest.raises(ValueError, match="num_probes"):
        jacobian_profile(model, ids_of(1, 4), num_probes=1)


# --- evaluation sequences ---------------------------------------------------------------------


def docs_with_ids(lengths: list[int]) -> list[np.ndarray]:
    """Document i holds tokens 1000 i, 1000 i + 1, ...: every token names its document and offset."""
    return [1000 * i + np.arange(n) for i, n in enumerate(lengths)]


def test_build_eval_sequences_shapes_chunks_and_distinct_documents():
    L, c = 50, 20
    docs = docs_with_ids([10, 60, 25, 70, 30, 30, 19, 40, 45, 22, 35, 50, 23])
    seqs = build_eval_sequences(docs, L, n_vanilla=2, n_chunked=3, chunk_len=c)
    assert seqs["vanilla"].shape == (2, L) and seqs["chunked"].shape == (3, L)
    assert seqs["vanilla"].dtype == torch.long
    van_docs = (seqs["vanilla"][:, 0] // 1000).tolist()
    assert van_docs == [1, 3]  # the first two documents with >= L tokens
    assert torch.equal(seqs["vanilla"][0], torch.arange(L) + 1000)

    used = []
    for row in seqs["chunked"].numpy():
        doc, offset = row // 1000, row % 1000
        starts = np.flatnonzero(offset == 0)
        np.testing.assert_array_equal(starts, np.arange(0, L, c))  # boundaries at multiples of c
        np.testing.assert_array_equal(offset, np.arange(L) % c)  # each excerpt starts its document
        seq_docs = doc[starts].tolist()
        assert len(set(seq_docs)) == len(seq_docs)
        used += seq_docs
    assert len(set(used)) == len(used) and not set(used) & set(van_docs)
    assert 6 not in used and 0 not in used  # too short for a full excerpt


def test_build_eval_sequences_short_L_is_one_chunk_and_errors():
    docs = docs_with_ids([40, 40, 40, 40])
    seqs = build_eval_sequences(docs, 16, n_vanilla=1, n_chunked=2, chunk_len=300)
    assert seqs["chunked"].shape == (2, 16)
    assert (seqs["chunked"] // 1000)[:, 0].tolist() == [1, 2]
    with pytest.raises(ValueError, match="needs 5 documents"):
        build_eval_sequences(docs, 16, n_vanilla=5, n_chunked=0, chunk_len=8)
    with pytest.raises(ValueError, match="needs 5 distinct documents"):
        build_eval_sequences(docs, 40, n_vanilla=1, n_chunked=1, chunk_len=8)


def test_build_eval_sequences_reuses_documents_with_a_warning(caplog):
    docs = docs_with_ids([40, 40, 40])
    with caplog.at_level(logging.WARNING, logger="analysis.measure.jacobian"):
        seqs = build_eval_sequences(docs, 20, n_vanilla=1, n_chunked=2, chunk_len=10)
    assert "documents repeat" in caplog.text
    for row in seqs["chunked"]:
        assert len(set((row[::10] // 1000).tolist())) == 2


# --- recorder ---------------------------------------------------------------------------------


def fake_profiles(step: int, sets: dict[str, int], L: int, stderr: bool = False) -> dict[str, ProfileResult]:
    """Profiles step + 0.5 + j; standard errors (when asked) step / 100 + j / 1000."""
    return {name: ProfileResult(np.full((n, L), step + 0.5) + np.arange(L),
                                np.full((n, L), step / 100) + np.arange(L) / 1000 if stderr else None)
            for name, n in sets.items()}


def test_recorder_writes_every_step(tmp_path):
    path = tmp_path / "run" / "jacobian.npz"
    sets, L = {"vanilla": 2, "chunked": 3}, 7
    rec = JacobianRecorder(path, sets, L)
    for step in (0, 5, 10):
        rec.add(step, fake_profiles(step, sets, L))
    steps, arrays = read_jacobian(path)  # mid-run: the npz and the journal together
    assert sorted(arrays) == ["chunked", "vanilla"]
    assert arrays["vanilla"].shape == (2, 3, L) and arrays["chunked"].shape == (3, 3, L)
    np.testing.assert_array_equal(steps, [0, 5, 10])
    np.testing.assert_allclose(arrays["chunked"][1, 2], 10.5 + np.arange(L))
    rec.close()
    with np.load(path) as z:
        np.testing.assert_array_equal(z["steps"], [0, 5, 10])
        np.testing.assert_array_equal(z["chunked"], arrays["chunked"])
    assert [p.name for p in path.parent.iterdir()] == ["jacobian.npz"]  # no journal or temp file left behind


def test_recorder_appends_a_journal_and_folds_it_every_fold_every_steps(tmp_path):
    path = tmp_path / "jacobian.npz"
    sets, L = {"vanilla": 1, "chunked": 2}, 5
    rec = JacobianRecorder(path, sets, L, fold_every=3)
    record_bytes = 8 + 4 * 3 * L  # the step, then 1 + 2 profiles of L float32
    for step in range(4):
        rec.add(step, fake_profiles(step, sets, L))
        with np.load(path) as z:
            folded = len(z["steps"])
        assert folded == (3 if step >= 2 else 0)
        assert journal_path(path).stat().st_size == (step + 1 - folded) * record_bytes
    with open(journal_path(path), "ab") as f:  # a record torn by a crash mid-write is ignored
        f.write(b"\x01" * (record_bytes // 2))
    steps, arrays = read_jacobian(path)
    np.testing.assert_array_equal(steps, [0, 1, 2, 3])
    np.testing.assert_allclose(arrays["vanilla"][0, 3], 3.5 + np.arange(L))

    # A crash between the npz rewrite and the journal's truncation leaves records the npz already holds.
    stale = journal_path(path).read_bytes()[:record_bytes]  # step 3's record
    rec2 = JacobianRecorder(tmp_path / "b.npz", sets, L, fold_every=1)
    for step in range(4):
        rec2.add(step, fake_profiles(step, sets, L))
    journal_path(rec2.path).write_bytes(stale)
    np.testing.assert_array_equal(read_jacobian(rec2.path)[0], [0, 1, 2, 3])


def test_recorder_resumes_after_a_crash(tmp_path):
    path = tmp_path / "jacobian.npz"
    sets, L = {"vanilla": 1, "chunked": 2}, 5
    rec = JacobianRecorder(path, sets, L)
    rec.add(0, fake_profiles(0, sets, L))
    rec.add(1, fake_profiles(1, sets, L))
    del rec  # the run dies here

    resumed = JacobianRecorder(path, sets, L)
    np.testing.assert_array_equal(resumed.steps, [0, 1])
    assert resumed.array("chunked").shape == (2, 2, L)
    resumed.add(2, fake_profiles(2, sets, L))
    np.testing.assert_array_equal(read_jacobian(path)[0], [0, 1, 2])

    again = JacobianRecorder(path, sets, L)  # resumed from a checkpoint at step 1: step 2 is measured again
    again.add(2, fake_profiles(7, sets, L))
    np.testing.assert_array_equal(again.steps, [0, 1, 2])
    np.testing.assert_allclose(again.array("vanilla")[0, 2], 7.5 + np.arange(L))

    with pytest.raises(ValueError, match="expects"):
        JacobianRecorder(path, {"vanilla": 3}, L)
    with pytest.raises(ValueError, match="expected shape"):
        again.add(3, {"vanilla": ProfileResult(np.ones((1, L + 1)), None),
                      "chunked": ProfileResult(np.ones((2, L)), None)})


def test_recorder_stores_hutchinson_standard_errors(tmp_path):
    path = tmp_path / "jacobian.npz"
    sets, L = {"vanilla": 1, "chunked": 2}, 5
    rec = JacobianRecorder(path, sets, L)
    for step in range(4):  # step 0 rewrites the npz with stderr arrays, steps 1-3 go to the journal
        rec.add(step, fake_profiles(step, sets, L, stderr=True))
    assert journal_path(path).stat().st_size == 3 * (8 + 2 * 4 * 3 * L)  # step, profiles and stderr
    steps, profiles, stderr = read_jacobian(path, with_stderr=True)  # npz and journal together
    np.testing.assert_array_equal(steps, [0, 1, 2, 3])
    assert {k: v.shape for k, v in stderr.items()} == {k: v.shape for k, v in profiles.items()}
    np.testing.assert_allclose(stderr["chunked"][1, 3], 0.03 + np.arange(L) / 1000, rtol=1e-6)
    np.testing.assert_allclose(profiles["chunked"][1, 3], 3.5 + np.arange(L))
    assert sorted(read_jacobian(path)[1]) == ["chunked", "vanilla"]  # old callers: profiles only
    np.testing.assert_array_equal(rec.stderr("vanilla"), stderr["vanilla"])

    del rec  # the run dies; the resumed recorder continues with the standard errors
    resumed = JacobianRecorder(path, sets, L)
    resumed.add(4, fake_profiles(4, sets, L, stderr=True))
    with pytest.raises(ValueError, match="recorded with standard errors"):
        resumed.add(5, fake_profiles(5, sets, L))  # another estimator mid-run
    resumed.close()
    with np.load(path) as z:
        assert set(z.files) == {"steps", "vanilla", "chunked", "stderr/vanilla", "stderr/chunked"}
        np.testing.assert_allclose(z["stderr/vanilla"][0, 4], 0.04 + np.arange(L) / 1000, rtol=1e-6)

    exact = JacobianRecorder(tmp_path / "exact.npz", sets, L)  # an estimator without standard errors
    exact.add(0, fake_profiles(0, sets, L))
    assert read_jacobian(exact.path, with_stderr=True)[2] == {} and exact.stderr("vanilla") is None


# --- the paper's step-0 finding ---------------------------------------------------------------


def test_step0_profile_matches_cesaro_prior_with_and_without_rope():
    """Random-init 12-layer Qwen2 at L=512: the prior fits with Spearman >= 0.95, RoPE or not.

    Default HF init (initializer_range 0.02), mean of 2 random-token sequences, 8 probes: Spearman
    0.985-0.989 with the prior over 3 init seeds (0.972-0.984 from one sequence, 0.990-0.994 from
    4), 0.9999 between RoPE on and off (same sequences and probes). RoPE off = every rotary
    frequency set to zero, so cos = 1, sin = 0 at every position (a huge rope_theta is not enough:
    the first frequency pair has inverse frequency theta^0 = 1 whatever theta is).
    """
    H, L = 12, 512
    ids = ids_of(2, L)
    profiles = []
    for rope in (True, False):
        model = tiny(layers=H, max_position_embeddings=L)
        if not rope:
            model.model.rotary_emb.inv_freq.zero_()
            model.model.rotary_emb.original_inv_freq.zero_()
        profile = jacobian_profile(model, ids, "hutchinson", 8).profile.mean(0)  # (L,)
        fit = fit_alpha(profile, H)
        assert fit.spearman >= 0.95, (rope, fit)
        profiles.append(profile)
    assert not np.array_equal(*profiles)  # the rotation really was switched off
    assert spearman(*profiles) >= 0.95
