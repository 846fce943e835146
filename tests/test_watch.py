"""The watch (issue 64): position signals on the task's own prompts, aggregated by slot, logged under watch/."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from torch import nn

from analysis.evaluation.result import ProbeResult
from analysis.evaluation.watch import (
    WatchConfig,
    WatchItem,
    WatchPanel,
    in2_items,
    mdqa_items,
    measure_item,
    measure_logliks,
    slot_mass,
    validate_watch,
)
from models.training.checkpoint import list_checkpoints
from models.training.loss import labelled_nll
from models.training.objectives.base import sample_sums
from models.training.slot_loss import SlotLoss, slot_of
from models.training.state import TrainerState
from tests.conftest import TINY
from train import run

UNITS = ((2, 6), (6, 10), (10, 14), (14, 18))  # four documents of four tokens after a two-token prefix


class OneSlotModel(nn.Module):
    """The last hidden state is a function of one span of the input alone: every other token has zero Jacobian.
    It answers the calls `analysis.measure.jacobian` makes (one pass, or a cached prefix and then the last token)."""

    def __init__(self, span: tuple[int, int], vocab: int = 50, d: int = 8):
        super().__init__()
        self.span, self.emb, self.proj, self.head = span, nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab)

    device = torch.device("cpu")

    def get_input_embeddings(self) -> nn.Module:
        return self.emb

    def forward(self, inputs_embeds, cache=None, use_cache=False, logits_to_keep=None, output_hidden_states=False):
        full = inputs_embeds if cache is None else torch.cat([cache, inputs_embeds], 1)  # (B, L, d)
        h = torch.tanh(self.proj(full[:, self.span[0]:self.span[1]].sum(1)))  # (B, d)
        return SimpleNamespace(cache=full, hidden_states=(h[:, None].expand(-1, inputs_embeds.shape[1], -1),),
                               logits=self.head(h)[:, None])  # (B, 1, V)


def item(gold: int, length: int = 20) -> WatchItem:
    return WatchItem("in2", "q", gold, tuple(range(length)), UNITS, UNITS[gold], ((1,),))


@pytest.mark.parametrize("gold", [0, 2, 3])
def test_a_model_that_reads_one_slot_puts_all_its_mass_there(gold):
    torch.manual_seed(0)
    mass, loglik = measure_item(OneSlotModel(UNITS[gold]), item(gold), 0, WatchConfig(num_probes=2), layers=4)
    assert loglik < 0
    assert mass.gold == pytest.approx(1.0, abs=1e-12)
    assert mass.units == pytest.approx([1.0 if k == gold else 0.0 for k in range(4)], abs=1e-12)
    assert mass.documents == pytest.approx(1.0)


class CachedLastTokenRounds(transformers.LlamaForCausalLM):
    """A tiny model whose forward of a last token over a cached prefix rounds differently from a forward of the whole
    sequence, as bf16 kernels do on SmolLM2 (~0.1 in a logit over its 30 layers; tiny models round alike)."""

    def forward(self, input_ids=None, inputs_embeds=None, cache=None, **kwargs):
        out = super().forward(input_ids=input_ids, inputs_embeds=inputs_embeds, cache=cache, **kwargs)
        if inputs_embeds is not None and cache is not None:
            out.logits = out.logits * 1.001  # a shift of every logit would leave log p as it is
        return out


def test_a_jacobian_rows_log_p_is_the_plain_forwards():
    """A Jacobian row's log p comes from the forward its Jacobian uses; it must equal a log-p-alone row's (one plain
    forward) bit for bit, or a run's log p would switch rounding between the steps that measure a Jacobian and those
    that do not (under bf16 on SmolLM2, prefix + last token against one pass: ~0.08 nats an answer)."""
    torch.manual_seed(0)
    model = CachedLastTokenRounds(transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                           num_key_value_heads=1, intermediate_size=64, vocab_size=64))
    units = tuple((2 + 12 * k, 14 + 12 * k) for k in range(4))
    ids = torch.randint(0, 64, (2, 52), generator=torch.Generator().manual_seed(3)).tolist()
    items = [WatchItem("mdqa", f"q{n}", slot, tuple(ids[n]), units, units[slot], ((5, 7, 9), (11,)))
             for n in range(2) for slot in (0, 3)]
    with_jacobian = [measure_item(model, it, i, WatchConfig(num_probes=2), layers=2)[1] for i, it in enumerate(items)]
    assert with_jacobian == measure_logliks(model, items)


def test_slot_mass_by_hand():
    sq = np.full(20, 0.01)
    sq[[3, 7, 8, 19]] += [1.0, 2.0, 1.0, 3.8]  # unit 0: 1.04, unit 1: 3.04, units 2-3: 0.04 each, the rest 3.84
    mass = slot_mass(sq, UNITS, UNITS[1], layers=4)
    assert mass.units == pytest.approx([0.13, 0.38, 0.005, 0.005]) and mass.gold == pytest.approx(0.38)
    assert mass.documents == pytest.approx(0.52)
    assert 0 < sum(mass.prior_units) < 1 and 0 < mass.alpha < 1  # the prior puts mass outside the units too


def panel(rows: dict) -> WatchPanel:
    cfg = WatchConfig(slots=[0, 4, 9], middle=4, strong={"in2": 9})
    p = WatchPanel(cfg, [], layers=4)
    for (question, slot), gold in rows.items():
        p.latest[f"in2/{question}/{slot}"] = {"question": question, "slot": slot, "gold": gold,
                                              "units": [gold, 0.1], "prior_units": [0.2, 0.2]}
    return p


def test_the_contrast_is_within_question_and_pools_the_latest_measurements():
    p = panel({("a", 0): 0.2, ("a", 4): 0.05, ("a", 9): 0.2, ("b", 4): 0.1, ("b", 9): 0.1, ("c", 9): 0.3})
    out = p.jacobian_metrics()
    assert out["watch/in2/gold_share_contrast"] == pytest.approx(np.mean([math.log(0.25), 0.0]))  # c has no slot 4
    assert out["watch/in2/gold_share@4"] == pytest.approx(0.075)
    assert out["watch/in2/gold_share@9"] == pytest.approx(0.2)


def test_the_rotation_measures_every_prompt_at_the_ends_and_one_every_k_steps_between():
    p = WatchPanel(WatchConfig(every=3), [item(0), item(1), item(2)], layers=4)
    assert p.jacobian_due(0, first=True, last=False) == [0, 1, 2]
    assert [p.jacobian_due(s, first=False, last=False) for s in (1, 2, 3)] == [[], [], [0]]
    p.cursor = 2
    assert p.jacobian_due(6, first=False, last=False) == [2] and p.jacobian_due(9, False, True) == [0, 1, 2]


def test_in2_prompts_move_the_gold_through_the_same_context():
    # prefix 2 tokens, context 12 tokens with the gold at 6..9, question 3, answer 2, eos 1
    prefix, context, question, answer = [1, 2], list(range(100, 112)), [7, 8, 9], [55, 56]
    rec = {"id": "r", "input_ids": prefix + context + question + answer + [0], "prompt_len": 17,
           "gold_spans": [[8, 11]], "context_tokens": 12, "answers": ["x"],
           "labels": [-100] * 17 + answer + [0]}
    items = in2_items([rec], 2, WatchConfig(questions=1, slots=[0, 4, 9]))
    gold = context[6:9]
    for it in items:
        ids = list(it.ids)
        assert ids[:2] == prefix and ids[-3:] == question and len(ids) == 17
        assert ids[it.gold[0]:it.gold[1]] == gold and sorted(ids[2:14]) == sorted(context)
        assert it.targets == (tuple(answer),)
    assert [it.gold[0] for it in items] == [2, 2 + round(4 / 9 * 9), 2 + 9]


def test_watch_settings_are_checked_by_name():
    with pytest.raises(ValueError, match=r"watch.middle=4 and watch.strong.kv=3 must be two different slots"):
        validate_watch(WatchConfig(sets=["kv"], strong={"kv": 3}))
    with pytest.raises(FileNotFoundError, match=r"watch.sets has mdqa: watch.data_dir=nowhere holds no "):
        validate_watch(WatchConfig(sets=["mdqa"], data_dir="nowhere"))
    with pytest.raises(ValueError, match=r"watch.slots=\[0, 4, 12\]: kv prompts have 10 slots"):
        validate_watch(WatchConfig(sets=["kv"], slots=[0, 4, 12], strong={"kv": 0}))
    with pytest.raises(ValueError, match=r"watch.loglik_questions=4 measures the log p of the Jacobian's "
                                         r"watch.questions=8 and more: give 0 or >= 8"):
        validate_watch(WatchConfig(loglik_questions=4))
    with pytest.raises(ValueError, match=r"with watch.loglik=true"):
        validate_watch(WatchConfig(loglik_questions=10, loglik=False))


def test_a_change_is_told_only_by_prompts_measured_again():
    """A run under way: question b's prompts were measured at step 0 alone (its log p not yet again), so the change
    is question a's, not pulled to 0 by b."""
    from analysis.evaluation.watch import position_signals

    header = {"step": 0, "kind": "panel", "sets": ["mdqa"], "slots": [4, 9], "middle": 4, "strong": {"mdqa": 9}}
    rows = [header] + [{"step": 0, "kind": "loglik", "set": "mdqa", "question": q, "slot": slot, "loglik": -3.0}
                       for q in ("a", "b") for slot in (4, 9)]
    rows += [{"step": 6, "kind": "loglik", "set": "mdqa", "question": "a", "slot": slot, "loglik": -1.0 if slot == 4
              else -3.0} for slot in (4, 9)]
    contrast = next(s for s in position_signals(rows) if s.key == "watch/mdqa/loglik_contrast")
    assert contrast.change.value == pytest.approx(2.0) and contrast.change.n == 1 and contrast.steps == (0, 6)


# ---------------------------------------------------------------------------------------------- the training loss


def test_the_slot_loss_is_each_samples_mean_nll_by_gold_slot_over_the_window():
    loss = SlotLoss(n_slots=10, window=2, middle=4, strong=9)
    depths = torch.tensor([0.0, 4 / 9, 1.0, 4 / 9])
    assert slot_of(depths, 10).tolist() == [0, 4, 9, 4]
    loss.observe(depths, torch.tensor([2.0, 6.0, 3.0, 2.0]), torch.tensor([2.0, 3.0, 3.0, 1.0]))
    first = loss.end_step()
    assert first["watch/train/nll@4"] == pytest.approx(2.0) and first["watch/train/nll_contrast"] == pytest.approx(1.0)
    loss.observe(torch.tensor([1.0]), torch.tensor([4.0]), torch.tensor([1.0]))
    assert loss.end_step()["watch/train/nll@9"] == pytest.approx(2.5)  # (1.0 + 4.0) / 2 over the window
    loss.observe(torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([1.0]))
    assert "watch/train/nll@4" not in loss.end_step()  # the first step left the window


def test_rows_of_a_needle_mix_stay_out_of_the_slot_loss():
    """debias=kv_mix puts kv rows into every micro-batch (the last ones), with the kv gold pair's depth: the
    training loss read per gold slot of the task must not count them."""
    from data_builders.collate import collate

    rows = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "depth": 0.0},
            {"input_ids": [1, 2, 3], "labels": [-100, -100, 3], "depth": 4 / 9},
            {"input_ids": [4, 5, 6, 7], "labels": [-100, -100, 6, 7], "depth": 4 / 9}]
    batch = collate(rows, 0, depths=True, mixed=1)
    assert batch["mixed"].tolist() == [False, False, True] and "mixed" not in collate(rows, 0, depths=True)
    loss = SlotLoss(n_slots=10, window=1, middle=4, strong=9)
    targets = batch["labels"][:, 1:]  # (B, L-1): position t predicts token t + 1
    nll = torch.tensor([[1.0, 3.0, 0.0], [0.0, 5.0, 0.0], [0.0, 9.0, 9.0]])
    loss.tap(batch)(nll, targets)
    metrics = loss.end_step()
    assert metrics["watch/train/nll@0"] == pytest.approx(2.0)
    assert metrics["watch/train/nll@4"] == pytest.approx(5.0)  # the task's row alone, not the kv row's 9.0


def test_labelled_nll_hands_its_tap_the_per_token_nll_and_computes_the_same_loss():
    torch.manual_seed(0)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=32))
    ids = torch.randint(0, 64, (2, 12))
    labels = torch.full_like(ids, -100)
    labels[0, 8:11], labels[1, 5:7] = ids[0, 8:11], ids[1, 5:7]
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids),
             "sample_ids": torch.tensor([[0] * 12, [1] * 12])}
    seen = []
    plain, _ = labelled_nll(model, batch)
    tapped, _ = labelled_nll(model, batch, tap=lambda nll, targets: seen.append((nll, targets)))
    assert torch.equal(plain, tapped)
    sums, counts = sample_sums(*seen[0], batch["sample_ids"], 2)
    per_token, _ = labelled_nll(model, batch, per_token=True)
    assert counts.tolist() == [3.0, 2.0] and torch.allclose(sums, per_token.sum(1), atol=1e-6)


# ---------------------------------------------------------------------------------------------- in a run

WATCH = ["data.num_eval=14", "eval.num_examples=8", "watch.questions=2", "watch.every=2", "watch.loglik_every=2"]


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_logs_the_watch_at_its_cadence_and_trains_as_without_it(compose_cfg, tmp_path):
    run(compose_cfg(*TINY, *WATCH, "trainer.max_steps=4"), tmp_path / "on")
    run(compose_cfg(*TINY, *WATCH[:2], "trainer.max_steps=4", "watch=off"), tmp_path / "off")
    on, off = rows(tmp_path / "on"), rows(tmp_path / "off")
    losses = {r["step"]: r["train/loss"] for r in on if "train/loss" in r}
    assert losses == {r["step"]: r["train/loss"] for r in off if "train/loss" in r}  # the same numbers, exactly
    assert not any(k.startswith("watch/") for r in off for k in r)
    measured = sorted({r["step"] for r in on if "watch/in2/gold_share_contrast" in r})
    assert measured == [0, 2, 4]  # every prompt at 0 and 4, one at step 2
    assert sorted({r["step"] for r in on if "watch/in2/loglik_contrast" in r}) == [0, 2, 4]
    assert all(any(k.startswith("watch/train/nll@") for k in r) for r in on if "train/loss" in r)
    journal = [json.loads(line) for line in (tmp_path / "on" / "watch.jsonl").read_text().splitlines()]
    # the ends measure every prompt's Jacobian and log p in one pass; step 2 one prompt's, and every prompt's log p
    assert {(r["step"], r["kind"]) for r in journal} == {(0, "panel"), (0, "jacobian"), (2, "jacobian"),
                                                         (2, "loglik"), (4, "jacobian")}
    assert len([r for r in journal if r["step"] == 2 and r["kind"] == "jacobian"]) == 1
    assert len([r for r in journal if r["step"] == 4 and r["kind"] == "jacobian"]) == 6
    summary = (tmp_path / "on" / "summary.md").read_text()
    assert "## Position signals" in summary and "watch/in2/loglik_contrast" in summary


def test_compare_shows_the_watch_first(compose_cfg, tmp_path):
    from analysis.compare import CompareConfig, compare

    run(compose_cfg(*TINY, *WATCH, "trainer.max_steps=2"), tmp_path / "run")
    report = compare([tmp_path / "run"], CompareConfig(probes=["in2"], out=str(tmp_path / "report"))).read_text()
    assert report.index("## Position signals") < report.index("## Inputs")
    assert "in2: log p, gold at 4 − at 9 (nats)" in report and "(steps 0 → 2)" in report


def test_a_resumed_run_watches_as_an_uninterrupted_one(compose_cfg, tmp_path):
    run(compose_cfg(*TINY, *WATCH, "trainer.max_steps=4"), tmp_path / "whole")
    run(compose_cfg(*TINY, *WATCH, "trainer.max_steps=4", "trainer.save_every=2"), tmp_path / "cut")
    # as if killed after its step-2 checkpoint: its later rows are measured again
    (tmp_path / "cut" / "finished.json").unlink()
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step-4")
    run(compose_cfg(*TINY, *WATCH, "trainer.max_steps=4", "trainer.save_every=2", "trainer.resume_from=latest"),
        tmp_path / "cut")
    whole, cut = rows(tmp_path / "whole"), rows(tmp_path / "cut")
    keys = lambda rs: {(r["step"], k): v for r in rs for k, v in r.items()  # noqa: E731
                       if k.startswith("watch/") and k != "watch/wall_s"}
    assert keys(cut) == keys(whole)
    journal = [json.loads(line) for line in (tmp_path / "cut" / "watch.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"]) for r in journal] == [
        (r["step"], r["kind"]) for r in map(json.loads, (tmp_path / "whole" / "watch.jsonl").read_text().splitlines())]


def test_a_run_kept_in_flight_resumes_on_a_fresh_machine_as_if_never_stopped(compose_cfg, tmp_path):
    """A LoRA run killed after its step-2 checkpoint, kept (`Keep(weights=True)`) and restored into another folder, as
    on a fresh machine, resumes there to the losses and watch rows of an uninterrupted run; once it finished, the
    keep holds its logs and final adapters without the optimizer's state."""
    from analysis.report.metrics_log import stored_run_id
    from scripts.jobs import Keep

    run(compose_cfg(*TINY, "trainer.max_steps=1", "trainer.save_every=0", "jacobian=off"), tmp_path / "base")
    base = tmp_path / "base" / "checkpoints" / "step-1"
    lora = [*(o for o in TINY if not o.startswith("model.")), *WATCH, "model=trained_tiny", f"model.pretrained={base}",
            "peft=lora", "peft.r=4", "trainer.max_steps=4"]
    run(compose_cfg(*lora), tmp_path / "whole")
    out, kept, fresh = tmp_path / "out", tmp_path / "kept", tmp_path / "fresh"
    # wandb offline, as the SmolLM2 recipes log: the kept run's wandb files stay behind, its run id goes with it
    run(compose_cfg(*lora, "trainer.save_every=2", "logger.mode=offline"), out / "runs" / "0")
    (out / "runs" / "0" / "finished.json").unlink()  # as if killed after its step-2 checkpoint
    shutil.rmtree(out / "runs" / "0" / "checkpoints" / "step-4")
    for folder in (out, fresh):
        folder.mkdir(exist_ok=True)
        (folder / "plan.json").write_text("{}")
    patterns = ["runs/*/metrics.jsonl", "runs/*/finished.json"]
    Keep(kept, out, patterns, "plan.json", weights=True).save()
    ckpt = kept / "runs" / "0" / "checkpoints" / "step-2"
    assert (ckpt / "optimizer.pt").is_file() and not (kept / "runs" / "0" / "wandb").exists()
    Keep(kept, fresh, patterns, "plan.json", weights=True).restore()
    run(compose_cfg(*lora, "trainer.save_every=2", "logger.mode=offline", "trainer.resume_from=latest"),
        fresh / "runs" / "0")
    whole, resumed = rows(tmp_path / "whole"), rows(fresh / "runs" / "0")
    losses = lambda rs: {r["step"]: r["train/loss"] for r in rs if "train/loss" in r}  # noqa: E731
    watched = lambda rs: {(r["step"], k): v for r in rs for k, v in r.items()  # noqa: E731
                          if k.startswith("watch/") and k != "watch/wall_s"}
    assert losses(resumed) == losses(whole) and watched(resumed) == watched(whole)
    assert stored_run_id(fresh / "runs" / "0") == stored_run_id(out / "runs" / "0")  # the same wandb run goes on
    Keep(kept, fresh, patterns, "plan.json", weights=True).save()
    assert [c.name for c in list_checkpoints(kept / "runs" / "0")] == ["step-4"]
    final = sorted(p.name for p in (kept / "runs" / "0" / "checkpoints" / "step-4").iterdir())
    assert "adapter_model.safetensors" in final and not [name for name in final if name.endswith(".pt")]
    assert sorted(p.name for p in (kept / "runs" / "0").iterdir()) == ["checkpoints", "finished.json", "metrics.jsonl"]


def fake_eval(path, questions: dict[str, tuple[float, float]]) -> None:
    """An mdqa log-likelihood evaluation: each question's log p at gold 4 and gold 9."""
    outcomes = [{"id": f"{q}@{p}", "query": q, "position": p, "label": str(p), "prediction": "", "answers": ["a"],
                 "correct": math.nan, "loglik": v, "extra": {}}
                for q, (at4, at9) in questions.items() for p, v in ((4, at4), (9, at9))]
    ProbeResult("mdqa", outcomes, {}).save_json(path)


def test_the_tracking_report_ranks_a_signal_that_follows_the_test_change(tmp_path, monkeypatch):
    """Fake runs whose watched contrast changes as their test contrast does (and a valley that does not): rho 1 for
    the first, exact p over the 720 orders of 6 runs; within a run, a signal that rises as the dev contrast."""
    from scripts import watch_tracking as wt

    grid, out = tmp_path / "grid", tmp_path / "out"
    questions = [f"q{k}" for k in range(5)]
    fake_eval(grid / "evals" / "mdqa_test" / "base" / "eval" / "mdqa_step0.json", {q: (-3.0, -1.0) for q in questions})
    for rank, n in enumerate(wt.RUNS):
        fake_eval(grid / "evals" / "mdqa_test" / f"run-{n}" / "eval" / "mdqa_step150.json",
                  {q: (-3.0 + 0.1 * rank, -1.0) for q in questions})
        run_dir = out / "runs" / str(n)
        run_dir.mkdir(parents=True)
        header = {"step": 0, "kind": "panel", "sets": ["mdqa"], "slots": [4, 9], "middle": 4, "strong": {"mdqa": 9},
                  "every": 3, "loglik_every": 0, "questions": {"mdqa": 2}}
        watch = [header] + [{"step": step, "kind": "loglik", "set": "mdqa", "question": q, "slot": slot,
                             "loglik": -2.0 + (0.2 * rank * step / 150 if slot == 4 else 0.0)}
                            for step in (0, 150) for q in ("a", "b") for slot in (4, 9)]
        (run_dir / "watch.jsonl").write_text("".join(json.dumps(r) + "\n" for r in watch))
        metrics = [{"step": s, "train/loss": 1.0, "valley/vanilla/middle_mass": 0.3 + 0.01 * ((rank * 7) % 3) * s,
                    "watch/mdqa/loglik_contrast": 0.002 * rank * s} for s in range(0, 151, 25)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
        (run_dir / "finished.json").write_text('{"step": 150}')
    for n in wt.WITHIN:
        for step in range(0, 151, 25):
            target = "base" if step == 0 else str(n)
            fake_eval(wt.eval_file(wt.eval_dir(out, "dev", target, step), step),
                      {q: (-3.0 + 0.01 * step, -1.0) for q in questions})
    (grid / "runs").mkdir()
    monkeypatch.setattr(wt, "GRID", grid)
    result = wt.tracking(out, "kept", 150, 25)
    found = {r["signal"]: r for r in result.across}
    assert found["watch/mdqa/loglik_contrast"]["rho"] == pytest.approx(1.0)
    assert found["watch/mdqa/loglik_contrast"]["p_value"] == pytest.approx(2 / 720) and found[
        "watch/mdqa/loglik_contrast"]["exact"]
    assert abs(found["valley/vanilla/middle_mass"]["rho"]) < 0.9
    assert found["watch/mdqa/loglik_contrast"]["seed_orders"] == (3, 3)  # each setting's seeds ordered as the test
    # middle mass changes as (0, 1, 2, 0, 1, 2) over runs 2..9 while the test rises with the run: 4-5 the other way
    assert found["valley/vanilla/middle_mass"]["seed_orders"] == (2, 3)
    within = {(r["run"], r["signal"]): r for r in result.within}
    assert within[(4, "watch/mdqa/loglik_contrast")]["rho"] == pytest.approx(1.0)
    assert within[(4, "watch/mdqa/loglik_contrast")]["steps"] == list(range(0, 151, 25))
    assert within[(4, wt.CLOCK)]["rho"] == pytest.approx(1.0)  # the dev contrast rises with the step here
    report = wt.write_report(out, tmp_path / "report", result).read_text()
    assert "| `watch/mdqa/loglik_contrast` | 6 | +1.00 | 0.003 |" in report
    assert (tmp_path / "report" / "tracking.png").is_file()

    # another experiment's two watched runs, following the same rule, add two points: 8 runs, exact p over 8!
    other = tmp_path / "lift_middle"
    runs = [{"n": k, "arm": "x", "setting": "", "seed": k, "overrides": []} for k in (0, 1)]
    other.mkdir()
    (other / "plan.json").write_text(json.dumps({"runs": runs, "dev": "mdqa_dev", "evaluations": {
        "mdqa_test": {"probe": "mdqa", "part": "test", "args": []}}}))
    fake_eval(other / "evals" / "mdqa_test" / "base" / "eval" / "mdqa_step0.json", {q: (-3.0, -1.0) for q in questions})
    for k, rank in ((0, 6), (1, 7)):
        fake_eval(other / "evals" / "mdqa_test" / f"run-{k}" / "eval" / "mdqa_step150.json",
                  {q: (-3.0 + 0.1 * rank, -1.0) for q in questions})
        shutil.copytree(out / "runs" / "2", other / "runs" / str(k))
        watch = [json.loads(line) for line in (other / "runs" / str(k) / "watch.jsonl").read_text().splitlines()]
        for row in watch[1:]:
            row["loglik"] = -2.0 + (0.2 * rank * row["step"] / 150 if row["slot"] == 4 else 0.0)
        (other / "runs" / str(k) / "watch.jsonl").write_text("".join(json.dumps(r) + "\n" for r in watch))
    with_other = wt.tracking(out, "kept", 150, 25, [other])
    more = {r["signal"]: r for r in with_other.across}
    assert more["watch/mdqa/loglik_contrast"]["runs"] == [*wt.RUNS, "lift_middle/0", "lift_middle/1"]
    assert more["watch/mdqa/loglik_contrast"]["rho"] == pytest.approx(1.0)
    assert more["watch/mdqa/loglik_contrast"]["p_value"] == pytest.approx(2 / 40320)
    report = wt.write_report(out, tmp_path / "report", with_other).read_text()
    assert "add points (`--also`): lift_middle/0, lift_middle/1." in report

    # a run still training is left out of the across-run test (its changes are not end-minus-start) and named
    (out / "runs" / "9" / "finished.json").unlink()
    partial = wt.tracking(out, "kept", 150, 25)
    assert {r["signal"]: r for r in partial.across}["watch/mdqa/loglik_contrast"]["runs"] == [2, 3, 4, 5, 8]
    assert partial.training == {9: 150}
    assert "still training, not counted: run 9 (step 150 of 150)." in wt.write_report(
        out, tmp_path / "report", partial).read_text()
    # nor named among the runs whose own test evaluations give their change
    assert wt.tracking(out, "own", 150, 25).own_test == [2, 3, 4, 5, 8]


def test_a_folder_filled_from_the_keep_counts_its_finished_runs(tmp_path):
    """A fresh machine's folder, restored from --keep, knows which runs finished: it trains only the others, the
    report ranks the finished ones (a run without finished.json reads as still training), and a finished run's
    larger panel is measured on its kept final adapters, or left out when its weights were not kept."""
    from scripts import watch_tracking as wt
    from scripts.jobs import Keep

    out, kept, fresh = tmp_path / "out", tmp_path / "kept", tmp_path / "fresh"
    for n, finished in ((2, True), (3, False), (5, True)):
        run_dir = out / "runs" / str(n)
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 150, "train/loss": 1.0}) + "\n")
        if finished:
            (run_dir / "finished.json").write_text('{"step": 150}')
    final = out / "runs" / "2" / "checkpoints" / "step-150"
    final.mkdir(parents=True)
    names = ("adapter_config.json", "adapter_model.safetensors", "optimizer.pt")
    for name in names:
        (final / name).write_text(name)
    TrainerState(150, 0, files={name: len(name) for name in names}).write(final)
    (out / wt.PLAN).write_text("{}")
    Keep(kept, out, wt.KEPT, wt.PLAN, weights=True).save()
    (fresh / wt.PLAN).parent.mkdir(parents=True)
    Keep(kept, fresh, wt.KEPT, wt.PLAN, weights=True).restore()
    done = {j.name: j.done for j in wt.train_jobs(fresh, {2: [], 3: [], 5: []}, [])}
    assert done == {"train:2": True, "train:3": False, "train:5": True}  # run 3 had not finished: nothing kept
    assert sorted(p.name for p in (fresh / "runs" / "2" / "checkpoints" / "step-150").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "trainer_state.json"]  # loads the model; resumes nothing
    panels = {j.name for j in wt.panel_jobs(fresh, 150, 25, training=True)}
    assert "panel:2:150" in panels and "panel:3:25" in panels  # kept weights; run 3 trains here
    assert not any(name.startswith("panel:5:") for name in panels)  # finished elsewhere, its weights not kept


def test_the_within_runs_are_evaluated_on_dev_right_after_they_train(tmp_path):
    from scripts import watch_tracking as wt

    runs = {n: [f"seed={n}"] for n in wt.RUNS}
    order = [j.name for j in wt.in_order(wt.train_jobs(tmp_path, runs, []),
                                         wt.dev_jobs(tmp_path, 50, 25, "data", []))]
    assert order == ["train:2", "dev:base:0", "train:3", "dev:3:25", "dev:3:50", "train:4", "dev:4:25", "dev:4:50",
                     "train:5", "train:8", "train:9"]


def test_the_smollm2_recipes_watch_mdqa_dev_questions_and_kv(compose_cfg, tmp_path):
    """+exp=in2_smol's watch (mdqa with 10 documents and kv with 10 pairs) on the tiny model and a synthetic NQ file:
    dev questions the training never sees, their gold at slots 0, 4 and 9, logged under watch/mdqa and watch/kv."""
    from data_builders.mdqa import write_jsonl_gz
    from scripts.investigations.synthetic_oracle import oracle_records
    from tests.test_train import SMOL

    nq = write_jsonl_gz(tmp_path / "nq" / "nq-open-oracle.jsonl.gz", oracle_records(160, seed=3))
    run(compose_cfg("+exp=in2_smol", *SMOL, f"data.path={nq}", "watch.questions=2", "watch.every=1",
                    "trainer.max_steps=2"), tmp_path / "run")
    journal = [json.loads(line) for line in (tmp_path / "run" / "watch.jsonl").read_text().splitlines()]
    asked = {(r["set"], r["question"]) for r in journal if r["kind"] == "jacobian"}
    assert {s for s, _ in asked} == {"mdqa", "kv"} and len(asked) == 4
    logged = {k for r in rows(tmp_path / "run") for k in r}
    assert {"watch/mdqa/gold_share_contrast", "watch/kv/gold_share_contrast", "watch/mdqa/loglik_contrast",
            "watch/mdqa/unit_share@9", "watch/kv/prior_share@0"} <= logged


def test_the_mdqa_watch_asks_dev_questions_that_the_dev_evaluation_does_not(tmp_path):
    from data_builders.mdqa import write_jsonl_gz
    from data_builders.probes import mdqa_probe
    from data_builders.question_split import EvaluationPart, QuestionSplit
    from data_builders.tokenizer import train_bpe_tokenizer
    from scripts.investigations.synthetic_oracle import oracle_records

    records = oracle_records(160, seed=3)
    nq = write_jsonl_gz(tmp_path / "nq-open-oracle.jsonl.gz", records)
    tokenizer = train_bpe_tokenizer([r["ctxs"][0]["text"] for r in records], 400)
    split, dev = QuestionSplit(), dict(heldout=QuestionSplit(), part=EvaluationPart.dev, closed_book=False, n_docs=10)
    every_dev = {str(it.query) for it in mdqa_probe(nq, positions=[0], **dev)}
    sampled = {str(it.query) for it in mdqa_probe(nq, positions=[0], n_examples=4, seed=0, **dev)}
    items = mdqa_items(WatchConfig(questions=3, skip_examples=4), nq, split, tokenizer, chat_template=False)
    asked = {it.question for it in items}
    assert len(asked) == 3 and asked <= every_dev - sampled
    assert sorted({it.slot for it in items}) == [0, 4, 9] and all(len(it.units) == 10 for it in items)
    assert all(it.units[it.slot] == it.gold for it in items)


def test_the_rotation_takes_the_sets_in_turns(tmp_path):
    """Two sets of 6 prompts each: the rotation alternates them, so that kv is not left at its first measurement
    until every mdqa prompt has had its turn."""
    from analysis.evaluation.watch import build_panel
    from data_builders.mdqa import write_jsonl_gz
    from data_builders.question_split import QuestionSplit
    from data_builders.tokenizer import train_bpe_tokenizer
    from scripts.investigations.synthetic_oracle import oracle_records

    records = oracle_records(160, seed=3)
    nq = write_jsonl_gz(tmp_path / "nq-open-oracle.jsonl.gz", records)
    tokenizer = train_bpe_tokenizer([r["ctxs"][0]["text"] for r in records], 400)
    panel = build_panel(WatchConfig(sets=["mdqa", "kv"], questions=2, skip_examples=4), 2, tokenizer, False, QuestionSplit(),
                        nq)
    assert [it.set for it in panel.items] == ["mdqa", "kv"] * 6
    assert [(it.question, it.slot) for it in panel.items if it.set == "mdqa"][:3] == [
        (panel.items[0].question, slot) for slot in (0, 4, 9)]  # a question's slots still measured one after another


def test_a_second_run_from_the_same_model_reads_its_first_panel_back(compose_cfg, tmp_path):
    for name in ("a", "b"):
        run(compose_cfg(*TINY, *WATCH, "trainer.max_steps=1", "trainer.save_every=0", "seed=7"), tmp_path / name)
    first = [[r for r in map(json.loads, (tmp_path / name / "watch.jsonl").read_text().splitlines())
              if r["step"] == 0 and r["kind"] == "jacobian"] for name in ("a", "b")]
    assert len(first[0]) == 6 and first[0] == first[1]  # the same rows, seconds included: read, not measured
    assert list((Path(os.environ["POSDEBIAS_CACHE"]) / "watch").glob("*.json"))


def smol_run(tmp_path, *overrides: str):
    """+exp=in2_smol's config on the tiny model and a synthetic NQ file (its mdqa watch asks dev questions of it)."""
    from data_builders.mdqa import write_jsonl_gz
    from scripts.investigations.synthetic_oracle import oracle_records
    from tests.test_train import SMOL
    from train import compose_config

    nq = tmp_path / "nq" / "nq-open-oracle.jsonl.gz"
    if not nq.is_file():
        write_jsonl_gz(nq, oracle_records(160, seed=3))
    return compose_config(["+exp=in2_smol", *SMOL, f"data.path={nq}", *overrides])


MORE = ["watch.questions=1", "watch.loglik_questions=3", "watch.every=1", "trainer.max_steps=2"]


def test_log_p_is_measured_on_more_questions_than_the_jacobian(tmp_path):
    """watch.loglik_questions: the first question of each set in the Jacobian's rotation, two more by log p alone at
    the first and last step; the training is the same as without them."""
    run(smol_run(tmp_path, *MORE), tmp_path / "more")
    run(smol_run(tmp_path, *MORE[:1], *MORE[2:]), tmp_path / "fewer")
    journal = [json.loads(line) for line in (tmp_path / "more" / "watch.jsonl").read_text().splitlines()]
    assert journal[0]["questions"] == {"mdqa": 1, "kv": 1} and journal[0]["loglik_questions"] == {"mdqa": 3, "kv": 3}
    kinds = lambda step, kind: [r for r in journal if r["step"] == step and r["kind"] == kind]  # noqa: E731
    assert len(kinds(0, "jacobian")) == len(kinds(2, "jacobian")) == 6 and len(kinds(1, "jacobian")) == 1
    assert len(kinds(0, "loglik")) == len(kinds(2, "loglik")) == 12 and not kinds(1, "loglik")
    assert {r["question"] for r in kinds(2, "jacobian")}.isdisjoint({r["question"] for r in kinds(2, "loglik")})
    losses = lambda name: {r["step"]: r["train/loss"] for r in rows(tmp_path / name) if "train/loss" in r}  # noqa: E731
    assert losses("more") == losses("fewer")
    fewer = [json.loads(line) for line in (tmp_path / "fewer" / "watch.jsonl").read_text().splitlines()]
    jacobians = lambda journal: [{k: v for k, v in r.items() if k != "seconds"}  # noqa: E731
                                 for r in journal if r["kind"] == "jacobian"]
    assert jacobians(journal) == jacobians(fewer)  # the Jacobian's questions and numbers are those without the extras
    # the pooled log p signals are logged where every question's log p was measured, never a mix of old and new
    assert sorted({r["step"] for r in rows(tmp_path / "more") if "watch/mdqa/loglik_contrast" in r}) == [0, 2]
    assert sorted({r["step"] for r in rows(tmp_path / "fewer") if "watch/mdqa/loglik_contrast" in r}) == [0, 1, 2]
    from analysis.evaluation.watch import position_signals

    contrast = next(s for s in position_signals(journal) if s.key == "watch/mdqa/loglik_contrast")
    assert contrast.change.n == 3  # the log p contrast's change over all three questions


def test_the_watch_of_a_saved_checkpoint_is_what_its_run_logged(tmp_path):
    """scripts.watch_checkpoint on the final checkpoint gives the rows the run logged at its last step, and with
    --start those of step 0: the same numbers, so a panel measured later is the run's own."""
    from scripts.watch_checkpoint import main

    run(smol_run(tmp_path, *MORE), tmp_path / "run")
    journal = [json.loads(line) for line in (tmp_path / "run" / "watch.jsonl").read_text().splitlines()]
    ckpt = tmp_path / "run" / "checkpoints" / "step-2"
    assert main([str(ckpt), "--out", str(tmp_path / "end.jsonl")]) == 0
    assert main([str(ckpt), "--start", "--out", str(tmp_path / "start.jsonl")]) == 0
    for name, step in (("end", 2), ("start", 0)):
        again = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        logged = [r for r in journal if r["step"] == step and r["kind"] != "panel"]
        assert again[0]["kind"] == "panel" and again[0]["step"] == step
        assert [(r["kind"], r["set"], r["question"], r["slot"]) for r in again[1:]] == [
            (r["kind"], r["set"], r["question"], r["slot"]) for r in logged]
        for a, b in zip(again[1:], logged):
            assert a["loglik"] == pytest.approx(b["loglik"], abs=1e-6)  # the two ends differ by ~0.07
            if a["kind"] == "jacobian":
                assert a["units"] == pytest.approx(b["units"], abs=1e-6)

    # a larger panel than the run's, and a setting the tool does not change, named
    assert main([str(ckpt), "watch.loglik_questions=4", "watch.every=0", "--out", str(tmp_path / "more.jsonl")]) == 0
    more = [json.loads(line) for line in (tmp_path / "more.jsonl").read_text().splitlines()]
    assert more[0]["loglik_questions"] == {"mdqa": 4, "kv": 4} and {r["kind"] for r in more[1:]} == {"loglik"}
    assert main([str(ckpt), "trainer.lr=1"]) == 2
    assert main([str(ckpt), "watch.loglik_questions=999"]) == 2  # more questions than the file's dev part: named
    from scripts.watch_checkpoint import default_out

    assert default_out(ckpt, 2, False, []) == (tmp_path / "run" / "watch_checkpoints" / "step-2.jsonl").resolve()
    assert default_out(ckpt, 2, False, ["watch.every=0"]).name.startswith("step-2-")


def fake_panel(path, step: int, contrast: float, questions: int = 3) -> None:
    """A larger-panel file (scripts.watch_checkpoint's rows): each question's log p at gold 4 and 9."""
    header = {"step": step, "kind": "panel", "sets": ["mdqa"], "slots": [4, 9], "middle": 4, "strong": {"mdqa": 9},
              "every": 0, "loglik_every": 0, "questions": {"mdqa": 1}, "loglik_questions": {"mdqa": questions}}
    rows = [{"step": step, "kind": "loglik", "set": "mdqa", "question": f"q{k}", "slot": slot,
             "loglik": -5.0 + (contrast + 0.1 * k if slot == 4 else 0.0)} for k in range(questions) for slot in (4, 9)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in [header, *rows]))


def test_the_larger_panel_is_measured_after_each_run_and_ranked_like_the_watch(tmp_path, monkeypatch):
    from scripts import watch_tracking as wt

    trains = wt.train_jobs(tmp_path, {n: [] for n in wt.RUNS}, [])
    order = [j.name for j in wt.in_order(trains, wt.panel_jobs(tmp_path, 50, 25, training=True))]
    assert order == ["train:2", "panel:start:0", "panel:2:50", "train:3", "panel:3:25", "panel:3:50", "train:4",
                     "panel:4:25", "panel:4:50", "train:5", "panel:5:50", "train:8", "panel:8:50", "train:9",
                     "panel:9:50"]
    assert wt.panel_jobs(tmp_path, 50, 25, training=False) == []  # nothing trained: nothing to measure yet
    (tmp_path / "runs" / "2" / "checkpoints" / "step-50").mkdir(parents=True)  # run 2 finished here
    (tmp_path / "runs" / "2" / "finished.json").write_text("{}")
    assert [j.name for j in wt.panel_jobs(tmp_path, 50, 25, training=False)] == ["panel:start:0", "panel:2:50"]
    command = wt.panel_jobs(tmp_path, 50, 25, training=True)[0].command
    assert "--start" in command and "watch.loglik_questions=81" in command

    grid, out = tmp_path / "grid", tmp_path / "out"
    questions = [f"q{k}" for k in range(5)]
    fake_eval(grid / "evals" / "mdqa_test" / "base" / "eval" / "mdqa_step0.json", {q: (-3.0, -1.0) for q in questions})
    fake_panel(wt.panel_file(out, "start", 0), 0, -2.0)
    for rank, n in enumerate(wt.RUNS):
        fake_eval(grid / "evals" / "mdqa_test" / f"run-{n}" / "eval" / "mdqa_step150.json",
                  {q: (-3.0 + 0.1 * rank, -1.0) for q in questions})
        fake_panel(wt.panel_file(out, str(n), 150), 150, -2.0 + 0.3 * rank)
        (out / "runs" / str(n)).mkdir(parents=True)
        (out / "runs" / str(n) / "finished.json").write_text('{"step": 150}')
    for rank, n in enumerate(wt.RUNS):
        if n not in wt.WITHIN:
            continue
        # the panel and the dev contrast rise but dip at step 75, together; step 150 as above
        for step, value in zip(range(25, 151, 25), (-1.9, -1.8, -2.5, -1.75, -1.72, -2.0 + 0.3 * rank)):
            if step < 150:
                fake_panel(wt.panel_file(out, str(n), step), step, value)
            fake_eval(wt.eval_file(wt.eval_dir(out, "dev", str(n), step), step),
                      {q: (value - 1.0, -1.0) for q in questions})
    fake_eval(wt.eval_file(wt.eval_dir(out, "dev", "base", 0), 0), {q: (-3.0, -1.0) for q in questions})
    (grid / "runs").mkdir()
    monkeypatch.setattr(wt, "GRID", grid)
    result = wt.tracking(out, "kept", 150, 25)
    key = wt.PANEL_SIGNAL + "watch/mdqa/loglik_contrast"
    across = {r["signal"]: r for r in result.across}[key]
    assert across["rho"] == pytest.approx(1.0) and across["changes"] == pytest.approx([0.3 * k for k in range(6)])
    within = {(r["run"], r["signal"]): r for r in result.within}
    assert within[(3, key)]["rho"] == pytest.approx(1.0) and within[(3, key)]["steps"] == list(range(0, 151, 25))
    assert within[(3, wt.CLOCK)]["rho"] < 1.0  # step 75 dips: the panel follows the dev contrast, not the clock
    # the panel's first question is the watch's own (its header's questions): its contrast alone, at each checkpoint
    own = wt.WATCH_QUESTIONS_SIGNAL + "watch/mdqa/loglik_contrast"
    assert within[(3, own)]["values"] == pytest.approx([-2.0, -1.9, -1.8, -2.5, -1.75, -1.72, -1.7])
    assert {r["signal"]: r for r in result.across}[own]["changes"] == pytest.approx([0.3 * k for k in range(6)])
    # every fake dev question moves alike: the dev contrast against itself ranks the checkpoints perfectly
    reaches = [(r["run"], r["checkpoints"], r["split_half_median"]) for r in result.within_reach]
    assert reaches == [(3, 7, 1.0), (4, 7, 1.0)]
    report = wt.write_report(out, tmp_path / "report", result).read_text()
    assert "Run 3's dev contrast against itself: two random halves of its 5 questions rank its 7 checkpoints" in report

    # run 4's panel measured at its ends alone: no rho over 2 checkpoints, said as such rather than a row of nan
    for step in range(25, 150, 25):
        wt.panel_file(out, "4", step).unlink()
    report = wt.write_report(out, tmp_path / "report", wt.tracking(out, "kept", 150, 25)).read_text()
    assert f"| 4 | `{key}` |" not in report and "nan" not in report
    assert f"no rho: run 4: `{key}` (2)" in report


def test_the_watchs_own_questions_are_the_panels_first_whichever_rows_hold_them(tmp_path):
    """A panel measured with watch.every > 0 writes the watch's own questions as Jacobian rows (their log p beside the
    Jacobian) and the extra ones as log p rows: the watch's questions are still the first `questions` of the file."""
    from scripts import watch_tracking as wt

    header = {"step": 150, "kind": "panel", "sets": ["mdqa"], "questions": {"mdqa": 1}, "loglik_questions": {"mdqa": 2}}
    rows = [{"step": 150, "kind": kind, "set": "mdqa", "question": q, "slot": slot, "loglik": value}
            for kind, q, values in (("jacobian", "own", (-4.0, -1.0)), ("loglik", "extra", (-2.0, -1.0)))
            for slot, value in zip((4, 9), values)]
    path = wt.panel_file(tmp_path, "3", 150)
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in [header, *rows]))
    assert wt.watch_questions([header, *rows]) == {"own"}
    values = wt.panel_values(tmp_path, 3, 150)
    assert values[wt.WATCH_QUESTIONS_SIGNAL + "watch/mdqa/loglik_contrast"] == pytest.approx(-3.0)
    assert values[wt.PANEL_SIGNAL + "watch/mdqa/loglik_contrast"] == pytest.approx(-2.0)  # both questions


def test_the_report_says_what_a_measurement_on_other_questions_can_reach(tmp_path, monkeypatch):
    """The kept grid's dev evaluation against its test evaluation, and the test against itself by random halves: here
    every question orders the runs alike, so both rank them perfectly; one noisy question set breaks the halves."""
    from scripts import watch_tracking as wt

    monkeypatch.setattr(wt, "GRID", tmp_path)
    assert wt.reach() is None  # no kept evaluations: nothing to say
    questions = [f"q{k}" for k in range(8)]
    for part in ("mdqa_dev", "mdqa_test"):
        fake_eval(tmp_path / "evals" / part / "base" / "eval" / "mdqa_step0.json", {q: (-3.0, -1.0) for q in questions})
        for rank, n in enumerate(wt.RUNS):
            fake_eval(tmp_path / "evals" / part / f"run-{n}" / "eval" / "mdqa_step150.json",
                      {q: (-3.0 + 0.1 * rank * (2 if part == "mdqa_dev" else 1), -1.0) for q in questions})
    found = wt.reach(splits=50)
    assert found["dev_rho"] == pytest.approx(1.0) and found["dev_p_value"] == pytest.approx(2 / 720)
    assert found["test"] == pytest.approx([0.1 * k for k in range(6)]) and found["split_half_median"] == pytest.approx(1)
    assert found["seed_order_kept"] == {"2-3": 1.0, "4-5": 1.0, "8-9": 1.0}
    rng = np.random.default_rng(0)
    for n in wt.RUNS:  # test changes that are noise around one value: the halves disagree
        fake_eval(tmp_path / "evals" / "mdqa_test" / f"run-{n}" / "eval" / "mdqa_step150.json",
                  {q: (-3.0 + float(rng.normal()), -1.0) for q in questions})
    noisy = wt.reach(splits=200)
    assert noisy["split_half_at_least_0.8"] < 0.5
    # run 3 above run 2 on half of the questions, below on the other half: no half orders them alike with the other
    for n, sign in ((2, 1.0), (3, -1.0)):
        fake_eval(tmp_path / "evals" / "mdqa_test" / f"run-{n}" / "eval" / "mdqa_step150.json",
                  {q: (-3.0 + sign * (1 if k % 2 else -1), -1.0) for k, q in enumerate(questions)})
    assert wt.reach(splits=50)["seed_order_kept"]["2-3"] == 0.0
    assert "two random halves of its 8 questions" in "\n".join(wt.reach_lines(noisy))
