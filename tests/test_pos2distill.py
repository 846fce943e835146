"""debias=pos2distill (models.training.debias): the objective against separate full forwards in float64, its teacher
pass with the adapters off, where its gradient goes, its targets (analysis.evaluation.distill_responses,
data_builders.distill_data), its start-up refusals and a tiny end-to-end run."""
from __future__ import annotations

import json
import logging
import re
import shutil

import numpy as np
import pytest
import torch
from datasets import Dataset
from hydra.errors import ConfigCompositionException
from peft import LoraConfig, get_peft_model
from torch.nn import functional as F

from analysis.evaluation.distill_responses import (
    answers_key,
    cached_answers,
    model_answer_fn,
)
from analysis.evaluation.generate import greedy_generate, greedy_generate_ids
from analysis.evaluation.reuse import computation_key
from data_builders.collate import collate
from data_builders.config import DataConfig, DataSource, In2Config
from data_builders.distill_data import answer_training_samples, distill_split, gold_targets
from data_builders.mdqa import write_jsonl_gz
from data_builders.probes import synthetic_filler
from data_builders.tokenizer import train_bpe_tokenizer
from models.training.debias import DebiasConfig, Pos2DistillConfig
from models.training.distill import sample_kl
from models.training.distributed import DistInfo
from models.training.objectives import Context, StartUp, build
from models.training.objectives.pos2distill import Pos2Distill, student_logits, teacher_logits
from scripts.investigations.synthetic_oracle import oracle_records
from tests.test_answer_record import _model as _reuse_model
from tests.test_debias import _tiny_model
from tests.test_distill import np_reference
from tests.test_train import SMOKE as SMOKE_SIZES
from train import as_train_config, run, validate

STRONG = 2  # the teacher's gold slot in the hand-made batches (3 documents: slots 0, 1, 2)
EOS = 3


def _lora(model, seed=None):
    """`model` with LoRA on every attention projection; with `seed`, B drawn at random (the adapters then matter)."""
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                             task_type="CAUSAL_LM"))
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return model


def _row(student_prompt, teacher_prompt, response, slot):
    target = [*response, EOS]
    return {"input_ids": [*student_prompt, *target], "labels": [-100] * len(student_prompt) + target,
            "teacher_input_ids": [*teacher_prompt, *target], "teacher_labels": [-100] * len(teacher_prompt) + target,
            "depth": slot / STRONG, "gold_slot": slot}


def _rows(spec=((7, 9, 3, 2), (12, 8, 2, 0), (5, 5, 4, 2), (9, 11, 1, 1), (6, 10, 5, 0))):
    """Samples of (student prompt length, teacher prompt length, response length, gold slot): prompts, responses and
    slots of different lengths, a strong sample whose prompts are one, and two weak slots (slot 0 twice)."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for student, teacher, response, slot in spec:
        s = torch.randint(4, 50, (student,), generator=g).tolist()
        t = s if student == teacher else torch.randint(4, 50, (teacher,), generator=g).tolist()
        rows.append(_row(s, t, torch.randint(4, 50, (response,), generator=g).tolist(), slot))
    return rows


def _objective(**distill):
    cfg = DebiasConfig(objective="pos2distill", distill=Pos2DistillConfig(**distill))
    built = DataConfig(in2=In2Config(layout="mdqa", n_docs=STRONG + 1, teacher_slot=STRONG))
    return build(Context(cfg, 2, lambda t: t.clone(), built))


def _target_logits(model, ids, prompt_len):
    """A whole unpadded forward of one sequence: the logits at the positions that predict its target, (T, V)."""
    logits = model(input_ids=torch.tensor([ids])).logits[0]  # (L, V)
    return logits[prompt_len - 1: len(ids) - 1]  # (T, V)


def _by_hand(model, rows, temperature, preserve, guard):
    """The loss from separate full forwards, one sequence at a time: the student (its own prompt, adapters on), the
    teacher (the teacher prompt, adapters off), the reference formula (tests.test_distill.np_reference), and the guard
    T^2 mean over every target token of KL(teacher || policy), the policy being the teacher sequence with adapters on."""
    with torch.no_grad():
        student = [_target_logits(model, r["input_ids"], r["labels"].count(-100)) for r in rows]
        policy = [_target_logits(model, r["teacher_input_ids"], r["teacher_labels"].count(-100)) for r in rows]
        with model.disable_adapter():
            teacher = [_target_logits(model, r["teacher_input_ids"], r["teacher_labels"].count(-100)) for r in rows]
    T, V = max(len(s) for s in student), student[0].shape[-1]
    s_arr, t_arr, mask = np.zeros((len(rows), T, V)), np.zeros((len(rows), T, V)), np.zeros((len(rows), T), bool)
    for i, (s, t) in enumerate(zip(student, teacher)):
        s_arr[i, :len(s)], t_arr[i, :len(t)], mask[i, :len(s)] = s.numpy(), t.numpy(), True
    kd, _, _ = np_reference(s_arr, t_arr, mask, [r["gold_slot"] for r in rows], temperature, preserve, STRONG)
    token_kl = [(F.softmax(t / temperature, -1) * (F.log_softmax(t / temperature, -1) - F.log_softmax(p / temperature, -1))
                 ).sum(-1) for t, p in zip(teacher, policy)]
    return kd + guard * temperature ** 2 * torch.cat(token_kl).mean().item()


@pytest.mark.parametrize("temperature, preserve, guard", [(1.0, 1.0, 0.0), (2.0, 0.7, 0.3)])
def test_loss_equals_separate_full_forwards_by_hand_in_float64(temperature, preserve, guard):
    model = _lora(_tiny_model(), seed=2)
    rows = _rows()
    objective = _objective(temperature=temperature, preserve=preserve, guard=guard)
    loss = objective(model, collate(rows, 0, depths=True, teacher=True))
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(_by_hand(model, rows, temperature, preserve, guard), abs=1e-10, rel=1e-10)
    metrics = objective.metrics()
    targets = sum(len(r["labels"]) - r["labels"].count(-100) for r in rows)
    assert metrics["debias/strong"] == 2 and metrics["debias/tokens"] == targets
    assert ("debias/guard_kl" in metrics) == (guard > 0) and metrics["debias/kl_mean"] > 0
    assert objective.metrics() == {}  # each step's micro-batches once


def test_the_teacher_pass_runs_with_the_adapters_off():
    model = _lora(_tiny_model(), seed=2)
    batch = collate(_rows(), 0, depths=True, teacher=True)
    teacher, mask = teacher_logits(model, batch)
    student, _ = student_logits(model, batch)
    assert not teacher.requires_grad and student.requires_grad and model.training  # the mode is restored
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.add_(1.0)
    again, again_mask = teacher_logits(model, batch)
    assert torch.equal(again, teacher) and torch.equal(again_mask, mask)
    moved, _ = student_logits(model, batch)
    assert (moved - student)[mask].abs().max() > 1e-3


def test_gradients_reach_only_the_lora_parameters():
    model = _lora(_tiny_model(), seed=2)
    _objective(guard=0.5)(model, collate(_rows(), 0, depths=True, teacher=True)).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    lora = {name for name in grads if ".lora_" in name}
    assert lora and all(grads[name] is not None and grads[name].abs().sum() > 0 for name in lora)
    assert all(grads[name] is None for name in set(grads) - lora)


def test_at_step_0_a_sample_at_the_strong_slot_has_kl_0():
    """B = 0: the student on the teacher sequence is the teacher, so a strong sample (its prompt the teacher prompt)
    has KL 0, in a batch padded differently from the teacher's; a weak sample's does not."""
    model = _lora(_tiny_model())
    batch = collate(_rows(((6, 6, 3, STRONG), (15, 9, 2, 0))), 0, depths=True, teacher=True)
    assert batch["input_ids"].shape[1] != batch["teacher_input_ids"].shape[1]
    teacher, mask = teacher_logits(model, batch)
    student, _ = student_logits(model, batch)
    kl, _ = sample_kl(student, teacher, mask)
    assert abs(kl[0].item()) < 1e-12 and kl[1].item() > 1e-6
    objective = _objective(guard=1.0)
    objective(model, batch)
    assert objective.metrics()["debias/guard_kl"] < 1e-12  # the policy is the base


class _Words:
    """A tokenizer stand-in: token k is WORDS[k]."""

    WORDS = ["<pad>", "<s>", "</s>", "<eos>", "Paris", "London", "\n", "the", "answer", "is", "Rome", "x"]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.WORDS[i] for i in ids).replace(" \n ", "\n")


def _train_split(n=5):
    return Dataset.from_dict({
        "input_ids": [[1, 11, 11, 5, 7, 8, 9][: 4 + k % 3] + [4, EOS] for k in range(n)],
        "prompt_len": [4 + k % 3 for k in range(n)], "context_tokens": [2 + k % 3 for k in range(n)],
        "teacher_prompt_ids": [[1, 11, 5, 11, 7][: 3 + k % 2] for k in range(n)],
        "gold_slot": [k % 3 for k in range(n)], "depth": [k % 3 / 2 for k in range(n)],
        "answers": [["Paris", "City of Paris"]] * n, "id": [f"train-{k}" for k in range(n)],
    })


def test_the_responses_keep_only_correct_answers_and_count_the_others():
    train = _train_split()
    scripted = [[4], [5, 6, 4], [7, 8, 9, 4], [10], [4, 11, 11, 11, 11, 11, 11]]  # Paris | London\nParis | ... Paris
    asked = []

    def answer(prompts):
        asked.append([list(p) for p in prompts])
        return scripted

    responses = answer_training_samples(train, answer, _Words(), context_len=12)
    assert asked == [train["teacher_prompt_ids"]]
    # 0 right; 1 wrong (Paris is on its second line); 2 right inside its line; 3 wrong; 4 right but 6 + 7 + 1 > 12
    assert [s["correct"] for s in responses.samples] == [True, False, True, False, True]
    assert responses.targets == [[4], None, [7, 8, 9, 4], None, None]
    assert [s["dropped"] for s in responses.samples] == [None, "wrong", None, "wrong", "longer_than_context_len"]
    assert responses.counts == {"samples": 5, "correct": 3, "kept": 2, "dropped_wrong": 2,
                                "dropped_longer_than_context_len": 1}
    assert json.loads(json.dumps(responses.to_json()))["samples"][1]["first_line"] == "London"
    kept_wrong = answer_training_samples(train, answer, _Words(), context_len=12, keep_wrong=True)
    assert kept_wrong.targets == [[4], [5, 6, 4], [7, 8, 9, 4], [10], None]

    split = distill_split(train, responses.targets, EOS)
    assert split["id"] == ["train-0", "train-2"] and split["gold_slot"] == [0, 2] and split["context_tokens"] == [2, 4]
    assert split["prompt_len"] == [4, 6] and split["depth"] == [0.0, 1.0]
    student = train[2]["input_ids"][: train[2]["prompt_len"]]
    assert split[1]["input_ids"] == student + [7, 8, 9, 4, EOS]
    assert split[1]["labels"] == [-100] * len(student) + [7, 8, 9, 4, EOS]
    teacher = train[2]["teacher_prompt_ids"]
    assert split[1]["teacher_input_ids"] == teacher + [7, 8, 9, 4, EOS]
    assert split[1]["teacher_labels"] == [-100] * len(teacher) + [7, 8, 9, 4, EOS]


def test_gold_targets_are_each_samples_own_target_and_every_one_that_fits_is_kept():
    train = _train_split()
    responses = gold_targets(train, _Words(), context_len=7)
    assert responses.targets == [[4], [4], None, [4], [4]]  # sample 2: its 6-token prompt + Paris + eos > 7
    assert responses.counts == {"samples": 5, "kept": 4, "dropped_longer_than_context_len": 1}
    assert [s["target"] for s in responses.samples] == ["Paris"] * 5
    assert [s["dropped"] for s in responses.samples] == [None, None, "longer_than_context_len", None, None]
    longer_teacher = train.map(lambda row: {"teacher_prompt_ids": [1] * 6})  # the teacher's prompt counts too
    assert gold_targets(longer_teacher, _Words(), context_len=7).targets == [None] * 5
    split = distill_split(train, responses.targets, EOS)
    assert split["id"] == ["train-0", "train-1", "train-3", "train-4"]
    for row in split:  # the student reads its own sequence again, the teacher along the same target
        assert row["labels"][row["prompt_len"]:] == [4, EOS] and row["teacher_input_ids"][-2:] == [4, EOS]


def test_answers_are_cached_by_the_starting_function_with_the_adapters_off(tmp_path):
    model = _lora(_tiny_model())
    settings = {"max_new_tokens": 4}
    calls = []

    def answer(prompts):
        calls.append(len(prompts))
        return [[4]] * len(prompts)

    prompts = [[1, 5, 7], [1, 11]]
    assert cached_answers(answer, model, settings, tmp_path)(prompts) == [[4], [4]]
    assert cached_answers(answer, model, settings, tmp_path)(prompts) == [[4], [4]] and calls == [2]

    def key(prompts=prompts, settings=settings):
        return answers_key(computation_key(model, adapters=False), prompts, settings)

    stored = key()
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if ".lora_B." in n).add_(1.0)
    assert key() == stored  # the adapters are off when it answers
    assert key(prompts[:1]) != stored and key(settings={"max_new_tokens": 5}) != stored
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "embed_tokens" in n).add_(1e-3)
    assert key() != stored


def test_a_repeated_teacher_prompt_is_asked_once(tmp_path):
    """A build with more samples than questions repeats a question's teacher prompt: each distinct prompt (or
    (prompt, target) pair) is answered once, in the chunks and under the cache key it has without the repeats, and
    every sample gets its answer."""
    model = _lora(_tiny_model())
    asked = []

    def answer(part):
        asked.append([list(p) for p in part])
        return [[p[1] + 10] for p in part]

    distinct = [[1, k] for k in range(3)]
    assert cached_answers(answer, model, {}, tmp_path / "a", chunk=2)(distinct) == [[10], [11], [12]]
    repeated = [[1, 0], [1, 1], [1, 0], [1, 2], [1, 1]]
    assert cached_answers(answer, model, {}, tmp_path / "b", chunk=2)(repeated) == [[10], [11], [10], [12], [11]]
    assert asked[2:] == asked[:2] == [[[1, 0], [1, 1]], [[1, 2]]]
    stored = lambda name: sorted(p.name for p in (tmp_path / name).rglob("*.json"))  # noqa: E731
    assert stored("a") == stored("b")
    scored = []

    def score(part):
        scored.append(len(part))
        return [float(target[0]) for _, target in part]

    pairs = [([1, 2], [3]), ([1, 2], [4]), ([1, 2], [3])]
    assert cached_answers(score, model, {}, tmp_path / "c")(pairs) == [3.0, 4.0, 3.0] and scored == [2]


def test_a_run_killed_while_answering_keeps_the_chunks_it_stored(tmp_path):
    """Answered 2 prompts at a time: a run killed in its second chunk stored the first, and the next run asks only
    the prompts not stored, returning every answer in prompt order."""
    model = _lora(_tiny_model())
    prompts = [[1, k] for k in range(5)]
    asked = []

    def answer(part, fail_at=None):
        if len(asked) == fail_at:
            raise KeyboardInterrupt
        asked.append([p[1] for p in part])
        return [[p[1] + 10] for p in part]

    with pytest.raises(KeyboardInterrupt):
        cached_answers(lambda part: answer(part, fail_at=1), model, {}, tmp_path, chunk=2)(prompts)
    assert asked == [[0, 1]]
    assert cached_answers(answer, model, {}, tmp_path, chunk=2)(prompts) == [[10], [11], [12], [13], [14]]
    assert asked == [[0, 1], [2, 3], [4]]
    assert cached_answers(answer, model, {}, tmp_path, chunk=2)(prompts) == [[10], [11], [12], [13], [14]]
    assert len(asked) == 3
    assert cached_answers(answer, model, {}, tmp_path, chunk=3)(prompts) == [[10], [11], [12], [13], [14]]
    assert asked[3:] == [[0, 1, 2], [3, 4]]  # another chunk size batches differently: its own answers


def test_the_model_answers_with_its_adapters_off_as_greedy_generate_decodes(tmp_path):
    """The answers are the base model's greedy tokens (the adapters, B moved, are off while it answers), and they
    decode to greedy_generate's texts."""
    tokenizer = train_bpe_tokenizer(synthetic_filler(100), 300, tmp_path / "bpe")
    prompts = [tokenizer(text)["input_ids"] for text in ("The harbour of", "A long way from the hill the", "It is")]
    base = _reuse_model(0)
    expected = greedy_generate_ids(base, tokenizer, prompts, 6, 2, progress=False, first_line_only=True)
    assert [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected] == greedy_generate(
        base, tokenizer, prompts, 6, 2, progress=False, first_line_only=True)
    model = _lora(_reuse_model(0), seed=3)
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        before = model(ids).logits
        assert not torch.equal(before, base(ids).logits)  # the adapters change the function
    assert model_answer_fn(model, tokenizer, 6, 2, progress=False)(prompts) == expected
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # on again after


@pytest.fixture(scope="module")
def nq_file(tmp_path_factory):
    """An NQ-format oracle file of invented persons (as tests.test_train's)."""
    return write_jsonl_gz(tmp_path_factory.mktemp("nq") / "nq-open-oracle.jsonl.gz", oracle_records(160, seed=3))


SMOKE = SMOKE_SIZES["in2_smol_distill"]  # the tiny model, 3 documents, its wrong answers kept


@pytest.mark.parametrize("overrides, message", [
    (["peft=none"], r"needs peft=lora \(got peft.method=none\)"),
    (["debias=[diff_retrofit,pos2distill]"], r"model.attention=diff_v1"),
    (["data.in2.teacher_slot=null"], r"needs data.in2.teacher_slot"),
    (["data.in2.teacher_slot=10"], r"data.in2.teacher_slot=10 must be a slot in \[0, data.in2.n_docs=10\)"),
    (["debias.distill.strong_position=3"], r"debias.distill.strong_position=3 must be the data's teacher slot, "
                                           r"data.in2.teacher_slot=-1 \(slot 9\)"),
    (["debias.distill.temperature=0"], r"debias.distill.temperature=0.0 must be"),
    (["debias.distill.preserve=-1"], r"debias.distill.preserve=-1.0 must be"),
    (["debias.distill.guard=-0.5"], r"debias.distill.guard=-0.5 must be"),
    (["debias.distill.max_new_tokens=0"], r"debias.distill.max_new_tokens=0 must be"),
    (["debias.distill.targets=gold", "debias.distill.keep_wrong=true"],
     r"debias.distill.keep_wrong=true with debias.distill.targets=gold"),
    (["data.packing=true"], r"data.packing=true"),
    (["debias.needle_mix.share=0.25"], r"debias.needle_mix.share=0.25"),
    (["debias.bins=5", "debias.eta=0.1"], r"debias.bins=5, debias.eta=0.1 set with debias.objective=pos2distill: "
                                          r"they are another objective's"),
    (["debias.prior_alpha=0.5"], r"debias.prior_alpha=0.5"),
    # two objectives in one list, in either order: the last would replace the other silently
    (["debias=[pos2distill,group_dro]"], r"debias=\[...\] names 2 objectives \(group_dro, pos2distill\)"),
    (["debias=[group_dro,pos2distill]"], r"debias=\[...\] names 2 objectives \(group_dro, pos2distill\)"),
    (["debias=[loss_weight,depth_weight,pos2distill]"], r"names 3 objectives \(depth_weight, loss_weight, "),
    (["debias.objective=group_dro"], r"debias.objective=group_dro with debias=pos2distill"),
    (["debias=none", "debias.distill.guard=0.5"], r"debias.distill.guard=0.5 set with debias.objective=mean"),
    # data-level arms: the mdqa layout refuses them
    (["debias=[depth_sampling,pos2distill]"], r"data.in2.layout=mdqa does not use data.in2.depth_law=valley"),
    (["debias=[middle_ramp,pos2distill]"], r"does not use data.in2.depth_law=beta, data.in2.depth_ramp=0.2"),
])
def test_every_start_up_refusal_names_its_key(compose_cfg, nq_file, overrides, message):
    cfg = as_train_config(compose_cfg("+exp=in2_smol_distill", f"data.path={nq_file}", *overrides))
    with pytest.raises(ValueError, match=message):
        validate(cfg, DistInfo())


def test_an_unknown_distill_target_fails_at_composition_naming_the_choices(compose_cfg, nq_file):
    with pytest.raises(ConfigCompositionException, match=re.escape("debias.distill.targets=teacher")) as err:
        compose_cfg("+exp=in2_smol_distill", f"data.path={nq_file}", "debias.distill.targets=teacher")
    assert "Invalid value 'teacher', expected one of [answers, gold]" in str(err.value.__cause__)


def test_refusals_of_data_without_teacher_prompts_and_of_sequence_parallelism(compose_cfg, nq_file):
    cfg = DebiasConfig(objective="pos2distill")
    segments = DataConfig(source=DataSource.nq, path=str(nq_file))
    with pytest.raises(ValueError, match=r"needs data.in2.layout=mdqa"):
        Pos2Distill.validate(StartUp(cfg, segments, segments, "lora", "standard", 1, 1))
    mdqa = DataConfig(source=DataSource.nq, path=str(nq_file), in2=In2Config(layout="mdqa", teacher_slot=0))
    Pos2Distill.validate(StartUp(cfg, mdqa, mdqa, "lora", "standard", 1, 1))
    parallel = as_train_config(compose_cfg("+exp=in2_smol_distill", f"data.path={nq_file}", "trainer=zero2",
                                           "trainer.sequence_parallel=2"))
    with pytest.raises(ValueError, match=r"debias.objective=pos2distill with trainer.sequence_parallel=2"):
        validate(parallel, DistInfo(world_size=2))


def test_a_tiny_run_distils_and_logs_its_kl(compose_cfg, nq_file, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="models.training.objectives.pos2distill")
    run(compose_cfg("+exp=in2_smol_distill", f"data.path={nq_file}", *SMOKE, "trainer.max_steps=2",
                    "trainer.save_every=0", "debias.distill.guard=0.5"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert all(np.isfinite(r["debias/kl_mean"]) and r["debias/kl_mean"] >= 0 and "debias/guard_kl" in r
               for r in trained)
    responses = json.loads((tmp_path / "distill_responses.json").read_text())
    assert responses["counts"]["samples"] == 64 == len(responses["samples"])
    assert responses["counts"]["kept"] + responses["counts"]["dropped_longer_than_context_len"] == 64
    assert f"{responses['counts']['kept']} kept as targets" in caplog.text


def test_a_resumed_run_continues_bitwise(compose_cfg, nq_file, tmp_path):
    """The targets are made again on resume (from the starting function, before the checkpoint is loaded), so the
    batches and losses after the checkpoint are the uninterrupted run's."""
    arm = ["+exp=in2_smol_distill", f"data.path={nq_file}", *SMOKE, "trainer.max_steps=3"]
    full, part = tmp_path / "full", tmp_path / "part"
    run(compose_cfg(*arm), full)
    run(compose_cfg(*arm, "trainer.save_every=2"), part)
    shutil.rmtree(part / "checkpoints" / "step-3")
    run(compose_cfg(*arm, "trainer.resume_from=latest"), part)

    def logged(run_dir):
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: (r["train/loss"], r["debias/kl_mean"]) for r in rows if "train/loss" in r}

    assert logged(part)[3] == logged(full)[3]
