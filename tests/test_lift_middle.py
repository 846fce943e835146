"""Issue 65's arms as configs: the best-slot teacher of debias=pos2distill_best (its choice, its strong samples,
its refusals, a tiny run), the kv rows of debias=kv_mix, and every arm of +exp=lift_middle composed and validated."""
from __future__ import annotations

import json
import re
import uuid

import numpy as np
import pytest
import torch
from datasets import Dataset

from data_builders.collate import collate
from data_builders.config import DataConfig, In2Config, validate_data
from data_builders.distill_data import choose_teachers, distill_split
from data_builders.needle_mix import retrieval_samples
from data_builders.probes import synthetic_filler
from data_builders.tokenizer import train_bpe_tokenizer
from models.training.distill import adaptive_weights, position_kd_loss
from models.training.distributed import DistInfo
from scripts import reads_middle
from tests.test_pos2distill import nq_file  # noqa: F401 (the fixture)
from tests.test_train import MDQA3
from train import as_train_config, run, validate

CANDIDATES = [0, 2]


def _split(targets=((5, 6), (7,), (8, 9, 4)), slots=(1, 2, 0)):
    """Three samples: prompt [1, 2, slot], then its target and eos 3; candidate prompts [10 + c, slot] per candidate."""
    rows = {"input_ids": [], "prompt_len": [], "teacher_candidate_ids": [], "gold_slot": [], "labels": [], "id": [],
            "context_tokens": [], "depth": []}
    for i, (target, slot) in enumerate(zip(targets, slots)):
        prompt = [1, 2, slot]
        rows["input_ids"].append([*prompt, *target, 3])
        rows["labels"].append([-100] * 3 + [*target, 3])
        rows["prompt_len"].append(3)
        rows["teacher_candidate_ids"].append([[10 + c, slot] for c in CANDIDATES])
        rows["gold_slot"].append(slot)
        rows["id"].append(f"train-{i}")
        rows["context_tokens"].append(3)
        rows["depth"].append(slot / 2)
    return Dataset.from_dict(rows)


def test_each_sample_is_taught_from_the_candidate_where_its_target_is_likeliest():
    train = _split()
    asked = []

    def logprobs(queries):
        asked.extend(queries)
        # sample 0 reads best at slot 0, sample 1 at slot 2, sample 2 ties (the first candidate wins)
        return [-1.0, -2.0, -3.0, -0.5, -1.0, -1.0]

    chosen, choice = choose_teachers(train, CANDIDATES, logprobs)
    assert [list(t) for _, t in asked] == [[5, 6], [5, 6], [7], [7], [8, 9, 4], [8, 9, 4]]  # targets, no eos
    assert [list(p) for p, _ in asked[:2]] == [[10, 1], [12, 1]]
    assert choice.slots == [0, 2, 0] and choice.counts(CANDIDATES) == {"0": 2, "2": 1}
    assert chosen["teacher_slot"] == [0, 2, 0]
    assert [list(p) for p in chosen["teacher_prompt_ids"]] == [[10, 1], [12, 2], [10, 0]]
    with pytest.raises(ValueError, match="returned 5 values for 6 queries"):
        choose_teachers(train, CANDIDATES, lambda q: [0.0] * 5)
    with pytest.raises(ValueError, match="other data.in2.teacher_candidates"):
        choose_teachers(train, [0, 1, 2], logprobs)


def test_the_chosen_slot_reaches_the_batch_and_marks_the_strong_samples():
    chosen, _ = choose_teachers(_split(), CANDIDATES, lambda q: [-1.0, -2.0, -3.0, -0.5, -1.0, -1.0])
    split = distill_split(chosen, [[5], [7, 7], [8]], eos=3)
    assert split["teacher_slot"] == [0, 2, 0] and split["gold_slot"] == [1, 2, 0]
    batch = collate([split[i] for i in range(3)], pad_id=0, teacher=True)
    assert batch["teacher_slots"].tolist() == [0, 2, 0]
    strong = batch["gold_slots"] == batch["teacher_slots"]
    assert strong.tolist() == [False, True, True]


def test_strong_samples_given_per_sample_weigh_as_the_one_strong_slot_does():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(6, 4, 11, generator=g), torch.randn(6, 4, 11, generator=g)
    mask = torch.ones(6, 4, dtype=torch.bool)
    gold = torch.tensor([0, 1, 2, 2, 1, 0])
    fixed, _ = position_kd_loss(student, teacher, mask, gold, preserve=0.7, strong_position=2)
    per_sample, stats = position_kd_loss(student, teacher, mask, gold, preserve=0.7, strong=gold == 2)
    torch.testing.assert_close(per_sample, fixed, rtol=0, atol=0)
    assert stats["strong"] == 2
    # teachers at slot 0 for some samples and slot 2 for others: both kinds of strong samples weigh `preserve`
    own = torch.tensor([True, False, False, True, False, True])
    weights = adaptive_weights(torch.rand(6, generator=g) + 0.1, gold, preserve=0.7, strong=own)
    assert torch.allclose(weights[own], torch.full((3,), 0.7))
    assert (weights[~own] > 0).all()


@pytest.mark.parametrize("overrides, message", [
    (["data.in2.teacher_candidates=[]"], r"chooses each sample's teacher among the slots of "
                                         r"data.in2.teacher_candidates"),
    (["data.in2.teacher_candidates=[0]"], r"one candidate is debias=pos2distill with data.in2.teacher_slot"),
    (["data.in2.teacher_candidates=[0,10]"], r"each must be a slot in \[0, data.in2.n_docs=10\)"),
    (["data.in2.teacher_candidates=[9,-1]"], r"names a slot twice \(-1 is slot 9\)"),
    (["data.in2.teacher_slot=0"], r"one teacher slot, or candidates to choose it from per sample, not both"),
    (["debias.distill.strong_position=0"], r"takes each sample's strong slot from its own teacher"),
    (["peft=none"], r"debias.objective=pos2distill_best needs peft=lora"),
])
def test_pos2distill_best_refuses_at_start_up_naming_the_key(compose_cfg, nq_file, overrides, message):  # noqa: F811
    cfg = as_train_config(compose_cfg("+exp=lift_middle", "debias=pos2distill_best", f"data.path={nq_file}",
                                      *overrides))
    with pytest.raises(ValueError, match=message):
        validate(cfg, DistInfo())


def test_teacher_candidates_are_refused_outside_the_mdqa_layout():
    with pytest.raises(ValueError, match=r"data.in2.teacher_candidates=\[0, -1\]: .*only data.in2.layout=mdqa"):
        validate_data(DataConfig(in2=In2Config(teacher_candidates=[0, -1])))


def test_a_tiny_run_chooses_its_teachers_and_distils_along_each_gold(compose_cfg, nq_file, tmp_path):  # noqa: F811
    # the preset's gold targets: every sample a target though the random tiny model answers nothing right, and no
    # answer generated (debias.distill.keep_wrong is refused with them)
    run(compose_cfg("+exp=in2_smol_distill", "debias=pos2distill_best", f"data.path={nq_file}", *MDQA3,
                    "trainer.max_steps=2", "trainer.save_every=0"), tmp_path)
    choice = json.loads((tmp_path / "teacher_choice.json").read_text())
    assert choice["candidates"] == [0, 2]  # -1 is the last of 3 documents
    assert sum(choice["counts"].values()) == len(choice["samples"]) == 64
    for sample in choice["samples"]:
        best = max(range(2), key=lambda j: sample["logprobs"][j])
        assert sample["teacher_slot"] == choice["candidates"][best] and all(np.isfinite(sample["logprobs"]))
    targets = json.loads((tmp_path / "distill_responses.json").read_text())
    assert targets["counts"] == {"samples": 64, "kept": 64, "dropped_longer_than_context_len": 0}
    assert all("answer" not in s and s["target"] for s in targets["samples"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert all(np.isfinite(r["debias/kl_mean"]) and r["debias/kl_mean"] >= 0 for r in trained)


CHAT = ("{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_kv_mix_rows_are_kv_probe_prompts_of_ten_pairs_in_the_chat_template():
    tok = train_bpe_tokenizer(synthetic_filler(300) + ["0123456789abcdef-", "<|user|> <|assistant|> <|end|>"], 600)
    tok.chat_template = CHAT
    rows = retrieval_samples(tok, 60, 2048, ["kv"], seed=5, chat_template=True, kv_pairs=10)
    slots = set()
    for row in rows:
        first_label = next(i for i, t in enumerate(row["labels"]) if t >= 0)
        prompt = tok.decode(row["input_ids"][:first_label])
        answer = tok.decode(row["input_ids"][first_label:-1])
        uuids = re.findall(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", prompt.replace(" ", ""))
        assert prompt.replace(" ", "").startswith("<|user|>") and prompt.replace(" ", "").endswith("<|assistant|>")
        assert len(uuids) == 2 * 10 + 1  # ten pairs, then the key asked
        assert str(uuid.UUID(answer.replace(" ", ""))) in uuids  # the value, without a leading space
        slots.add(round(row["depth"] * 9))
    assert slots == set(range(10))  # the gold pair at every slot


def test_kv_pairs_out_of_range_is_refused():
    from data_builders.needle_mix import NeedleMixConfig, validate_needle_mix

    with pytest.raises(ValueError, match=r"debias.needle_mix.kv_pairs=1 must be in \[2, 16\]"):
        validate_needle_mix(NeedleMixConfig(share=0.25, kv_pairs=1), 4, False)


@pytest.mark.parametrize("arm", ["pos2distill_best", "kv_mix", "loss_weight", "pos2distill"])
def test_every_arm_of_the_experiment_composes_and_validates(compose_cfg, nq_file, arm):  # noqa: F811
    cfg = as_train_config(compose_cfg("+exp=lift_middle", f"debias={arm}", f"data.path={nq_file}"))
    validate(cfg, DistInfo())
    assert cfg.data.near_duplicates.passage_jaccard == 0.5 and cfg.data.num_train == 2200
    assert cfg.trainer.precision == "bf16" and cfg.trainer.max_steps == 150
    longer = as_train_config(compose_cfg("+exp=lift_middle", f"debias={arm}", f"data.path={nq_file}",
                                         "trainer.max_steps=450"))
    assert longer.trainer.max_steps == 450  # issue 65's arm d: the command line, over the experiment
    # the experiment runs the teacher pass of the distilling arms once, before their other runs
    assert reads_middle.distills("lift_middle", arm, []) is arm.startswith("pos2distill")


def test_a_tiny_kv_mix_run_trains_on_mdqa_rows_and_kv_rows(compose_cfg, nq_file, tmp_path):  # noqa: F811
    # the tiny tokenizer spells a UUID out: two pairs fit its 512 tokens where the real model's ten do
    run(compose_cfg("+exp=lift_middle", "debias=kv_mix", f"data.path={nq_file}", *MDQA3,
                    "debias.needle_mix.kv_pairs=2", "debias.needle_mix.pool=8", "trainer.max_steps=2",
                    "trainer.save_every=0"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
    assert all(np.isfinite(r["train/loss"]) for r in rows if "train/loss" in r)
