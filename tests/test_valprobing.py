"""VaLProbing: the builder (pieces, sets, FILM's skip rule, token positions, presets), FILM's scoring (hand-made
answers, bin edges with and without FILM's quirk), the paired comparison, and the probe in every path."""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from analysis import stats
from analysis.evaluation.config import EvalConfig, ValProbingConfig, check_probes, probe_metric
from analysis.evaluation.generate import encode_prompt
from analysis.evaluation.probes import build_probes
from analysis.evaluation.result import LOGLIK, ProbeResult
from analysis.evaluation.scoring import label_or_description, name_in_output, word_recall
from analysis.evaluation.valprobing import compare, summarize
from analysis.report.valprobing import report_lines
from data_builders.valprobing import (
    PIECES_DIR,
    PIECES_FILES,
    PRESETS,
    Shape,
    Task,
    build_set,
    build_task,
    occurrences,
    read_pieces,
)
from tests.conftest import shared_data_file

CHAT_TEMPLATE = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SENTENCES = [f"Study {k} shows that model {k} reads every part of its long input well." for k in range(12)]
FUNCTIONS = [(f"func_{k}", f"    a = load({k})\n    b = step_{k}(a)\n    return b") for k in range(11)]
# func_x's middle line is also the last line of func_0... : its key occurs twice in any context with both
FUNCTIONS.append(("func_x", "    c = 1\n    return b\n    pass"))
# Q1 is a prefix of Q10 and Q11 (not ambiguous: ids are whole words); Q7 is in the pool twice (ambiguous)
ENTITIES = [(f"Q{k}", f"Label {k}", f"description of thing {k}") for k in range(12)] + [("Q7", "Other", "a twin id")]
SMALL = Shape({Task.document: 12, Task.code: 12, Task.database: 13}, sets=2, bin_width=4)


def _write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    folder = root / PIECES_DIR
    _write(folder / PIECES_FILES[Task.document],
           [{"sentence": s, "piece": " ".join(s.split()[2:10])} for s in SENTENCES])
    _write(folder / PIECES_FILES[Task.code],
           [{"function_name": n, "function_define": d, "piece": d.split("\n")[1].strip()} for n, d in FUNCTIONS])
    _write(folder / PIECES_FILES[Task.database], [{"id": i, "label": lab, "dcpt": d} for i, lab, d in ENTITIES])
    return root


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    texts = SENTENCES + [d for _, d in FUNCTIONS] + [" ".join(e) for e in ENTITIES] + ["Below is a context"]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|user|>", "<|assistant|>"]))
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[UNK]", pad_token="[UNK]")
    out.add_tokens(["<|user|>", "<|assistant|>"], special_tokens=True)
    out.chat_template = CHAT_TEMPLATE
    return out


def _pool(data_dir: Path, task: Task):
    return read_pieces(task, data_dir / PIECES_DIR / PIECES_FILES[task])


# ---------------------------------------------------------------------------------------------- the builder


def test_pieces_render_as_film_shows_them(data_dir):
    doc, code, db = (_pool(data_dir, t)[0] for t in Task)
    assert (doc.text, doc.answers) == (SENTENCES[0], (SENTENCES[0],)) and doc.key in doc.text
    assert code.text == "def func_0:\n    a = load(0)\n    b = step_0(a)\n    return b"
    assert (code.key, code.answers) == ("b = step_0(a)", ("func_0",))
    assert db.text == "<id: Q0, label: Label 0, description: description of thing 0>"
    assert (db.key, db.answers) == ("Q0", ("Label 0", "description of thing 0"))


@pytest.mark.parametrize("task, row, message", [
    (Task.document, {"sentence": "a b c"}, "field 'piece' must be a non-empty string"),
    (Task.document, {"sentence": "a b c", "piece": "x y"}, "is not part of its sentence"),
    (Task.code, {"function_name": "f", "function_define": "    a\n    b", "piece": 3}, "field 'piece'"),
    (Task.database, {"id": "Q1", "label": "", "dcpt": "d"}, "field 'label' must be a non-empty string"),
])
def test_a_bad_pieces_row_fails_naming_file_line_and_field(tmp_path, task, row, message):
    path = _write(tmp_path / "p.jsonl.gz", [row])
    with pytest.raises(ValueError, match=message) as err:
        read_pieces(task, path)
    assert f"{path}:1" in str(err.value)


def test_skip_rule_is_whole_word_key_occurrence():
    assert occurrences("Q1", "<id: Q1, ...>\n<id: Q10, ...>\n<id: Q11, ...>") == 1
    assert occurrences("Q7", "<id: Q7, a>\n<id: Q7, b>") == 2
    assert occurrences("return b", "    return b\n    return bb\n    return b") == 2


def test_sets_are_seeded_distinct_draws_and_ambiguous_keys_are_skipped(data_dir):
    code = _pool(data_dir, Task.code)
    first, again, other = build_set(Task.code, code, 12, 0, 0), build_set(Task.code, code, 12, 0, 0), \
        build_set(Task.code, code, 12, 1, 0)
    assert [p.key for p in first.pieces] == [p.key for p in again.pieces]
    assert [p.key for p in first.pieces] != [p.key for p in other.pieces]
    assert len({p.text for p in first.pieces}) == 12
    # the whole pool: func_x's key "return b" is every other function's last line
    assert [first.pieces[i].answers[0] for i in first.skipped] == ["func_x"]
    db = build_set(Task.database, _pool(data_dir, Task.database), 13, 0, 0)
    assert sorted(db.pieces[i].key for i in db.skipped) == ["Q7", "Q7"]
    for (start, end), piece in zip(first.spans, first.pieces):
        assert first.context[start:end] == piece.text


@pytest.mark.parametrize("chat", [False, True])
def test_items_bins_card_and_token_positions(data_dir, tokenizer, chat):
    built = build_task(Task.document, _pool(data_dir, Task.document), SMALL, tokenizer, chat_template=chat)
    assert len(built.items) == 24 and built.skipped == 0
    item = built.items[5]
    assert (item.id, item.position, item.n_positions, item.label, item.probe) == (
        "document-s0-0005", 1, 3, "4", "valprobing_document")
    question = f'In above context, which sentence contains the piece "{item.extra["key"]}"?'
    assert item.prompt.endswith(f"### Instruction:\n{question}")
    for it in built.items:
        ids = encode_prompt(tokenizer, it.prompt, chat)
        start = it.segments[it.extra["piece"]][0]
        piece_words = it.prompt[start:].split()[:3]
        at = it.extra["token_position"]
        assert tokenizer.convert_ids_to_tokens(ids[at:at + 3]) == piece_words
    card = built.cards[0]
    assert card.context_tokens == sum(len(tokenizer(s)["input_ids"]) for s in SENTENCES)
    assert card.longest_prompt_tokens >= card.context_tokens


def test_a_context_too_long_for_the_model_fails_naming_the_setting(data_dir, tokenizer):
    shape = Shape(dict(SMALL.pieces), 1, 4, max_prompt_tokens=50)
    with pytest.raises(ValueError, match=r"eval\.valprobing\.pieces: a document context of 12 pieces .* over the 50"):
        build_task(Task.document, _pool(data_dir, Task.document), shape, tokenizer)


@pytest.mark.slow  # 32K-token prompts, 12 of them, tokenized with offsets: ~35 s
def test_film32k_preset_item_counts_on_films_pieces(tokenizer):
    pieces = {t: read_pieces(t, shared_data_file(f"{PIECES_DIR}/{PIECES_FILES[t]}")) for t in Task}
    shape = PRESETS["film32k"]
    counts = {}
    for task in Task:
        built = build_task(task, pieces[task], shape, tokenizer)
        counts[task] = (len(built.items) + built.skipped, built.skipped)
    assert {t: c[0] for t, c in counts.items()} == {Task.document: 3200, Task.code: 3200, Task.database: 3000}
    assert counts[Task.code][1] > 0  # FILM skipped 313 of its 3,200 code items for the same reason


# ---------------------------------------------------------------------------------------------- FILM's scores


def test_word_recall_is_films_lowercased_whitespace_word_set():
    gold = ["The Model reads models."]
    assert word_recall("the model READS models.", gold) == 1.0
    assert word_recall("the model reads models", gold) == 0.75  # "models." keeps its dot
    assert word_recall("", gold) == 0.0
    assert word_recall("model model model", ["model model"]) == 1.0  # a set: repeats count once


def test_code_name_is_case_sensitive_substring_with_dots_stripped():
    assert name_in_output("The function is generateURL.", ["generateURL"]) == 1.0
    assert name_in_output("generateurl", ["generateURL"]) == 0.0
    assert name_in_output("it is run_all", ["run_all."]) == 1.0


def test_database_label_or_description_ignoring_case():
    answers = ["New York State Route 191", "highway in New York."]
    assert label_or_description("label: new york state route 191", answers) == 1.0
    assert label_or_description("It is a HIGHWAY IN NEW YORK", answers) == 1.0
    assert label_or_description("a road", answers) == 0.0


def test_metrics_by_probe():
    cfg = EvalConfig()
    assert [probe_metric(p, cfg).name for p in ("valprobing_document", "valprobing_code", "valprobing_database")] == \
        ["word_recall", "name_in_output", "label_or_description"]


def _result(scores: dict[tuple[int, int], float], width: int = 3, probe: str = "valprobing_code") -> ProbeResult:
    """Outcomes of (set, piece) -> score, bins of `width` pieces."""
    outcomes = [{"id": f"code-s{s}-{p:04d}", "query": None, "position": p // width, "label": str(p // width * width),
                 "correct": v, "extra": {"set": s, "piece": p}} for (s, p), v in scores.items()]
    return ProbeResult(probe, outcomes)


# 2 sets x 6 pieces, bins of 3: set 0 scores 1 1 0 | 0 0 1, set 1 scores 1 0 0 | 1 1 1
HAND = {(0, 0): 1.0, (0, 1): 1.0, (0, 2): 0.0, (0, 3): 0.0, (0, 4): 0.0, (0, 5): 1.0,
        (1, 0): 1.0, (1, 1): 0.0, (1, 2): 0.0, (1, 3): 1.0, (1, 4): 1.0, (1, 5): 1.0}


def test_bins_sets_avg_and_gap_by_hand():
    s = summarize(_result(HAND))
    assert s.labels == ["0", "3"]
    np.testing.assert_allclose(s.by_set, [[2 / 3, 1 / 3], [1 / 3, 1.0]])
    np.testing.assert_allclose(s.by_bin, [0.5, 2 / 3])
    np.testing.assert_allclose(s.spread, [1 / 6, 1 / 3])  # population sd of two values: half their distance
    assert s.avg.value == pytest.approx((0.5 + 2 / 3) / 2)
    assert s.gap == pytest.approx(2 / 3 - 0.5)
    assert s.avg.low <= s.avg.value <= s.avg.high and s.n_items == 12


def test_film_bins_leave_out_each_bins_last_position():
    s = summarize(_result(HAND), film_bins=True)  # pieces 2 and 5 of each set are out
    np.testing.assert_allclose(s.by_set, [[1.0, 0.0], [0.5, 1.0]])
    assert s.avg.value == pytest.approx((0.75 + 0.5) / 2) and s.gap == pytest.approx(0.25) and s.n_items == 8


def test_a_skipped_item_leaves_its_set_mean_over_the_rest():
    scores = {k: v for k, v in HAND.items() if k != (1, 1)}
    s = summarize(_result(scores))
    assert s.by_set[1, 0] == pytest.approx(0.5)  # (1 + 0) / 2, the set still weighs one half of the bin


def test_paired_comparison():
    base = _result(HAND)
    tuned = _result({k: 1.0 for k in HAND})
    c = compare(base, tuned)
    assert c.delta_avg.value == pytest.approx(1.0 - (0.5 + 2 / 3) / 2)
    assert c.delta_gap == pytest.approx(0.0 - (2 / 3 - 0.5))
    same = compare(base, base)
    assert same.delta_avg.value == 0.0 and same.gap_p == 1.0
    with pytest.raises(ValueError, match="share no item"):
        compare(base, _result({(5, 0): 1.0}))


def test_report_has_the_table_the_deltas_and_the_figure(tmp_path):
    lines = report_lines({"base": {"valprobing_code": _result(HAND)},
                          "tuned": {"valprobing_code": _result({k: 1.0 for k in HAND})}}, tmp_path / "vp.png")
    text = "\n".join(lines)
    assert "| base | 58.3 [" in text and "| tuned | code | +41.7 [" in text
    assert (tmp_path / "vp.png").is_file() and "![valprobing](vp.png)" in text


def test_linear_interval_covers_a_mean_of_bin_means():
    """Coverage of `stats.linear_interval` over 400 simulated runs: 4 cells of 0/1 items and 4 of continuous
    scores, the statistic the mean of the cell means."""
    rng = np.random.default_rng(3)
    rates = np.array([0.2, 0.5, 0.7, 0.9])
    strata = np.repeat(np.arange(8), 25)
    stat = stats.Linear(strata, (1 / 8,) * 8)
    truth = (rates.sum() + 4 * 0.3) / 8
    hits = 0
    for rep in range(400):
        binary = (rng.random((4, 25)) < rates[:, None]).astype(float)
        continuous = rng.normal(0.3, 1.0, (4, 25))
        iv = stats.linear_interval(np.concatenate([binary.ravel(), continuous.ravel()]), stat, n_boot=1000, seed=rep)
        hits += iv.low <= truth <= iv.high
    assert abs(hits / 400 - 0.95) <= 0.03


def test_linear_interval_counts_nonfinite_and_an_empty_stratum_is_nan():
    iv = stats.linear_interval([1.0, math.nan, 0.0, 1.0], stats.Linear(np.array([0, 0, 1, 1]), (0.5, 0.5)))
    assert iv.nonfinite == 1 and iv.value == pytest.approx(0.75)
    assert math.isnan(stats.linear_interval([math.nan, 1.0], stats.Linear(np.array([0, 1]), (0.5, 0.5))).value)


# ---------------------------------------------------------------------------------------------- a probe like the others


def test_a_run_without_the_pieces_fails_at_start_up_naming_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"eval\.data_dir: .*valprobing/code_functions\.jsonl\.gz is not a file"):
        check_probes(EvalConfig(probes=["valprobing_code"], data_dir=str(tmp_path)))
    with pytest.raises(ValueError, match=r"set eval\.data_dir .* or eval\.valprobing\.path"):
        check_probes(EvalConfig(probes=["valprobing_code"]))
    with pytest.raises(ValueError, match=r"eval\.valprobing\.preset='huge': known presets are film32k, smollm2_8k"):
        check_probes(EvalConfig(probes=["valprobing_code"], data_dir=str(tmp_path),
                                valprobing=ValProbingConfig(preset="huge")))


def test_build_probes_builds_every_task_at_the_settings(data_dir, tokenizer):
    cfg = EvalConfig(probes=["valprobing_document", "valprobing_database"], data_dir=str(data_dir),
                     valprobing=ValProbingConfig(pieces=8, sets=3, bin_width=4, max_prompt_tokens=10_000))
    check_probes(cfg)
    items = build_probes(cfg, tokenizer)
    assert len(items["valprobing_document"]) == 24
    assert {it.n_positions for it in items["valprobing_database"]} == {2}


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=len(tokenizer), max_position_embeddings=2048)
    folder = tmp_path_factory.mktemp("models") / "tiny"
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_eval_checkpoint_and_compare_report_avg_and_gap(model_dir, data_dir, tmp_path, capsys):
    from analysis import compare as compare_cli
    from scripts import eval_checkpoint

    args = ["probes=[valprobing_code,valprobing_database]", f"data_dir={data_dir}", "valprobing.pieces=8",
            "valprobing.sets=2", "valprobing.bin_width=4", "max_new_tokens=3", "device=cpu", f"out={tmp_path / 'ev'}"]
    assert eval_checkpoint.main([str(model_dir), *args]) == 0
    printed = capsys.readouterr().out
    assert "code: Avg" in printed and "database: Avg" in printed
    card = (tmp_path / "ev" / "eval" / "valprobing_step0.md").read_text()
    assert "| the model |" not in card and "code Avg" in card
    assert (tmp_path / "ev" / "plots" / "valprobing_step0.png").is_file()
    saved = ProbeResult.load_json(tmp_path / "ev" / "eval" / "valprobing_code_step0.json")
    assert all("token_position" in o["extra"] and "loglik" in o for o in saved.outcomes)
    assert saved.settings["metric"] == "name_in_output" and saved.settings["preset"] == "smollm2_8k"

    out = tmp_path / "cmp"
    assert compare_cli.main([str(model_dir), str(model_dir), "--probes", "valprobing_code", "--data-dir",
                             str(data_dir), "--valprobing-pieces", "8", "--valprobing-sets", "2",
                             "--valprobing-bin-width", "4", "--max-new-tokens", "3", "--out", str(out), "--device",
                             "cpu", "--no-loglik"]) == 0
    report = (out / "report.md").read_text()
    assert "## VaLProbing" in report and "| code | +0.0 [+0.0, +0.0] | +0.0 | 1.000 |" in report
    assert (out / "valprobing.png").is_file()


def test_compare_without_the_pieces_fails_before_loading(tmp_path, capsys):
    from analysis import compare as compare_cli

    assert compare_cli.main(["no-such-model", "--probes", "valprobing_code", "--data-dir", str(tmp_path)]) == 1
    assert "--data-dir: " in capsys.readouterr().err


def test_valprobing_during_training_and_in_the_run_summary(compose_cfg, data_dir, tmp_path):
    from tests.conftest import TINY
    from train import run

    cfg = compose_cfg(*TINY, "trainer.max_steps=2", "eval.probes=[valprobing_database]", "eval.probe_every=2",
                      f"eval.data_dir={data_dir}", "eval.valprobing.pieces=8", "eval.valprobing.sets=2",
                      "eval.valprobing.bin_width=4", "eval.valprobing.max_new_tokens=2")
    metrics = run(cfg, tmp_path)
    assert "eval/valprobing_database/acc@0" in metrics and "eval/valprobing_database/acc@4" in metrics
    result = ProbeResult.load_json(tmp_path / "eval" / "valprobing_database_step2.json")
    assert len(result.outcomes) == 16 and all("loglik" in o for o in result.outcomes)
    summary = (tmp_path / "summary.md").read_text()
    assert "## VaLProbing (Avg and Gap)" in summary
    assert "| database | FILM score x100 |" in summary and "| database | log p(gold), nats |" in summary


def test_loglik_alone_answers_nothing_and_reports_the_likelihood(model_dir, data_dir, tmp_path, capsys):
    from scripts import eval_checkpoint

    args = ["probes=[valprobing_document]", f"data_dir={data_dir}", "valprobing.pieces=8", "valprobing.sets=2",
            "valprobing.bin_width=4", "valprobing.answers=false", "device=cpu", f"out={tmp_path / 'ev'}"]
    assert eval_checkpoint.main([str(model_dir), *args]) == 0
    printed = capsys.readouterr().out
    assert "document: Avg" in printed and "(log p(gold answer), nats: nothing answered)" in printed
    saved = ProbeResult.load_json(tmp_path / "ev" / "eval" / "valprobing_document_step0.json")
    assert all(math.isnan(o["correct"]) and o["prediction"] == "" and math.isfinite(o["loglik"])
               for o in saved.outcomes)
    assert saved.settings["answers"].startswith("not asked")
    card = (tmp_path / "ev" / "eval" / "valprobing_step0.md").read_text()
    assert "### By log p(gold answer), nats" in card and "### By FILM score" not in card
    assert (tmp_path / "ev" / "plots" / "valprobing_step0_loglik.png").is_file()
    assert not (tmp_path / "ev" / "plots" / "valprobing_step0.png").exists()
    # the log-likelihood's own Avg: the mean of the cells (set x bin) of the saved values
    s = summarize(saved, score=LOGLIK)
    cells = {}
    for o in saved.outcomes:
        cells.setdefault((o["extra"]["set"], o["position"]), []).append(o["loglik"])
    assert s.avg.value == pytest.approx(np.mean([np.mean(v) for v in cells.values()]))
    with pytest.raises(ValueError, match="would measure nothing"):
        check_probes(EvalConfig(probes=["valprobing_document"], data_dir=str(data_dir), loglik=False,
                                valprobing=ValProbingConfig(answers=False)))


def test_the_card_command_writes_the_card_and_items(model_dir, data_dir, tmp_path, capsys):
    from scripts import build_valprobing

    out = tmp_path / "card"
    assert build_valprobing.main(["--tokenizer", str(model_dir), "--data-dir", str(data_dir), "--tasks", "code",
                                  "--pieces", "12", "--sets", "2", "--bin-width", "4", "--out", str(out)]) == 0
    assert "| code | 0 | 12 |" in (out / "card.md").read_text() and "items: code 22 (2 skipped)" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    assert len(rows) == 22 and {r["bin"] for r in rows} == {0, 1, 2}
