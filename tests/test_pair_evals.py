"""analysis.pair_evals: eval JSONs of one item set side by side, Δ paired by item id, mismatches refused."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from analysis.evaluation.comparability import probe_settings
from analysis.evaluation.config import EvalConfig, KVProbeConfig, probe_metric
from analysis.evaluation.probes import run_probe
from analysis.evaluation.result import Checkpoint, ProbeResult
from analysis.pair_evals import main
from data_builders.probes import kv_probe


def result(probe: str, correct: dict[tuple[int, int], float], metric: str = "best_subspan_em") -> ProbeResult:
    """(query, position) -> correctness; position -1 is closed-book."""
    outcomes = [{"id": f"q{q}@{p}", "query": f"q{q}", "position": p, "label": "closed_book" if p < 0 else str(p),
                 "prediction": "", "answers": ["a"], "correct": c, "extra": {}} for (q, p), c in correct.items()]
    return ProbeResult(probe, outcomes, {"metric": metric})


def test_rows_per_arm_and_the_paired_difference(tmp_path, capsys):
    plain = {(q, p): float(p == 9) for q in range(10) for p in (-1, 0, 9)}  # only the last slot answered
    arm = {**plain, **{(q, 0): 1.0 for q in range(5)}}  # +5 items right at gold 0, none lost
    result("mdqa", plain).save_json(tmp_path / "plain.json")
    result("mdqa", arm).save_json(tmp_path / "arm.json")
    assert main([str(tmp_path / "plain.json"), f"arm={tmp_path / 'arm.json'}", "--figure",
                 str(tmp_path / "fig.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("| arm | closed-book | gold 0 | gold 9 | mean over gold positions "
                        "| Δ vs plain [95% CI, questions resampled] | items |")
    plain_row, arm_row = lines[2].split(" | "), lines[3].split(" | ")
    assert plain_row[2].startswith("0.000") and plain_row[3] == "1.000 [1.000, 1.000]" and plain_row[4] == "0.500"
    assert arm_row[2].startswith("0.500 [") and arm_row[4] == "0.750"
    assert arm_row[5].startswith("+0.250 [") and arm_row[5].endswith("] *") and arm_row[6] == "20 |"
    assert (tmp_path / "fig.png").stat().st_size > 0
    by_position = lines[lines.index("Δ vs plain at each position, paired by item [95% CI, questions resampled]:") + 2:]
    assert by_position[0] == "| arm | closed-book | gold 0 | gold 9 |"
    arm_cells = by_position[2].split(" | ")
    assert arm_cells[1] == "+0.000 [+0.000, +0.000]" and arm_cells[3] == "+0.000 [+0.000, +0.000] |"
    assert arm_cells[2].startswith("+0.500 [") and arm_cells[2].endswith("] *")  # 5 of 10 gained at gold 0


def test_shared_items_restricts_every_row_to_the_items_all_answered(tmp_path, capsys):
    plain = {(q, p): float(q < 10) for q in range(20) for p in (0, 9)}  # 20 questions: the first 10 right
    arm = {(q, p): 1.0 for q in range(10) for p in (0, 9)}  # the first 10 questions only
    result("mdqa", plain).save_json(tmp_path / "plain.json")
    result("mdqa", arm).save_json(tmp_path / "arm.json")
    args = [str(tmp_path / "plain.json"), f"arm={tmp_path / 'arm.json'}"]
    assert main(args) == 0
    plain_row = capsys.readouterr().out.splitlines()[2].split(" | ")
    assert plain_row[3] == "0.500" and plain_row[5] == "40 |"  # every plain item
    assert main([*args, "--shared-items"]) == 0
    lines = capsys.readouterr().out.splitlines()
    plain_row, arm_row = lines[2].split(" | "), lines[3].split(" | ")
    assert plain_row[3] == "1.000" and plain_row[5] == "20 |" and arm_row[4].startswith("+0.000")
    result("mdqa", {(99, 0): 1.0}).save_json(tmp_path / "other.json")
    assert main([str(tmp_path / "plain.json"), f"x={tmp_path / 'other.json'}", "--shared-items"]) == 1
    assert "no item id" in capsys.readouterr().err


def test_the_baseline_takes_a_name_and_a_path_with_an_equals_sign_stays_a_path(tmp_path, capsys):
    plain = {(q, p): float(p == 9) for q in range(4) for p in (0, 9)}
    folder = tmp_path / "trainer.lr=0.001"  # a Hydra sweep's folder name: a path, not NAME=PATH
    folder.mkdir()
    result("mdqa", plain).save_json(folder / "mdqa_step0.json")
    result("mdqa", {**plain, (0, 0): 1.0}).save_json(tmp_path / "arm.json")
    assert main([f"base={folder}", f"arm={tmp_path / 'arm.json'}"]) == 0
    out = capsys.readouterr().out
    assert "| Δ vs base [95% CI, questions resampled] |" in out and "\n| base | 0.000 [" in out
    assert "Δ vs base at each position" in out and "| arm: change vs base |" in out and "plain" not in out
    assert main([str(folder), f"arm={tmp_path / 'arm.json'}"]) == 0
    assert "\n| plain | 0.000 [" in capsys.readouterr().out
    assert main([f"base={tmp_path / 'missing'}", f"arm={tmp_path / 'arm.json'}"]) == 1
    assert str(tmp_path / "missing") in capsys.readouterr().err


def test_a_result_of_another_probe_or_metric_fails_naming_the_file(tmp_path, capsys):
    cells = {(0, 0): 1.0}
    result("mdqa", cells).save_json(tmp_path / "plain.json")
    result("kv", cells).save_json(tmp_path / "kv.json")
    result("mdqa", cells, metric="exact").save_json(tmp_path / "other.json")
    for path in ("kv.json", "other.json"):
        assert main([str(tmp_path / "plain.json"), f"x={tmp_path / path}"]) == 1
        assert str(tmp_path / path) in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "plain.json"), str(tmp_path / "kv.json")])  # no NAME=


def test_an_item_id_twice_in_one_result_fails_naming_it(tmp_path, capsys):
    result("mdqa", {(0, 0): 1.0, (1, 0): 0.0}).save_json(tmp_path / "plain.json")
    twice = result("mdqa", {(0, 0): 1.0, (1, 0): 0.0})
    twice.outcomes.append(dict(twice.outcomes[0]))  # q0@0 answered twice: pairing by id would pick one silently
    twice.save_json(tmp_path / "twice.json")
    assert main([str(tmp_path / "plain.json"), f"twice={tmp_path / 'twice.json'}"]) == 1
    captured = capsys.readouterr()
    assert "twice: item id 'q0@0' occurs more than once" in captured.err and captured.out == ""


def loglik_result(values: dict[tuple[int, int], float], answers: dict | None = None) -> ProbeResult:
    """(query, position) -> log-likelihood (and a fixed correctness); `answers`: position -> extra["answer"]."""
    outcomes = [{"id": f"q{q}@{p}", "query": f"q{q}", "position": p, "label": str(p), "prediction": "",
                 "answers": ["a"], "correct": 0.0, "loglik": v,
                 "extra": {"answer": answers[p]} if answers else {}} for (q, p), v in values.items()]
    return ProbeResult("mdqa", outcomes, {"metric": "best_subspan_em"})


def test_contrasts_by_log_likelihood_and_their_change(tmp_path, capsys):
    """Every position minus the strong end within each result, and the change of that contrast: a shift that
    moves every position alike (a new answer format) changes no contrast."""
    base = {(q, p): -10.0 + (2.0 if p == 9 else 0.0) + 0.25 * q for q in range(8) for p in (0, 4, 9)}
    shifted = {k: v - 3.0 for k, v in base.items()}  # every position 3 nats lower
    debiased = {**base, **{(q, 4): base[q, 4] + 1.5 for q in range(8)}}  # the middle lifted by 1.5 nats
    for name, values in (("base", base), ("shifted", shifted), ("debiased", debiased)):
        loglik_result(values).save_json(tmp_path / f"{name}.json")
    assert main([str(tmp_path / "base.json"), f"shifted={tmp_path / 'shifted.json'}",
                 f"debiased={tmp_path / 'debiased.json'}", "--score", "loglik"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [cell.split(" [")[0] for cell in lines[2].split(" | ")[1:4]] == ["-9.125", "-9.125", "-7.125"]
    table = lines[lines.index("|  | gold 0 − gold 9 | gold 4 − gold 9 |"):]
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in table[2:7]}
    assert rows["plain"] == ["-2.000 [-2.000, -2.000] *", "-2.000 [-2.000, -2.000] * |"]
    assert rows["shifted: change vs plain"] == ["+0.000 [+0.000, +0.000]", "+0.000 [+0.000, +0.000] |"]
    assert rows["debiased: change vs plain"] == ["+0.000 [+0.000, +0.000]", "+1.500 [+1.500, +1.500] * |"]
    assert main([str(tmp_path / "base.json"), f"d={tmp_path / 'debiased.json'}", "--score", "loglik",
                 "--strong", "0"]) == 0
    assert "|  | gold 4 − gold 0 | gold 9 − gold 0 |" in capsys.readouterr().out


def test_log_likelihood_asked_of_results_without_it_fails_by_name(tmp_path, capsys):
    result("mdqa", {(0, 0): 1.0}).save_json(tmp_path / "plain.json")
    result("mdqa", {(0, 0): 1.0}).save_json(tmp_path / "arm.json")
    assert main([str(tmp_path / "plain.json"), f"arm={tmp_path / 'arm.json'}", "--score", "loglik"]) == 1
    assert "plain, arm has no 'loglik'" in capsys.readouterr().err


def test_answers_table_shows_the_format(tmp_path, capsys):
    long_copy = {"kind": "gold", "first_line_words": 16, "short_em": 0.0, "whole_word": 1.0, "copies_gold": 1.0}
    short = {"kind": "distractor", "first_line_words": 2, "short_em": 0.0, "whole_word": 0.0, "copies_gold": 0.0}
    values = {(q, p): -5.0 for q in range(4) for p in (0, 9)}
    loglik_result(values, {0: short, 9: long_copy}).save_json(tmp_path / "plain.json")
    loglik_result(values, {0: short, 9: short}).save_json(tmp_path / "arm.json")
    assert main([str(tmp_path / "plain.json"), f"arm={tmp_path / 'arm.json'}"]) == 0
    out = capsys.readouterr().out
    assert "| plain | 9 | 1.000 | 0.000 | 0.000 | 16.0 | 0.000 | 1.000 |" in out
    assert "| arm | 9 | 0.000 | 1.000 | 0.000 | 2.0 | 0.000 | 0.000 |" in out


def valprobing_result(loglik: dict[tuple[int, int], float], task: str = "code") -> ProbeResult:
    """(set, piece) -> the gold's log-likelihood; bins of 3 pieces, nothing answered (`correct` nan)."""
    outcomes = [{"id": f"{task}-s{s}-{p:04d}", "query": None, "position": p // 3, "label": str(p // 3 * 3),
                 "prediction": "", "answers": [f"gold {p}"], "correct": math.nan, "loglik": v,
                 "extra": {"set": s, "piece": p}}
                for (s, p), v in loglik.items()]
    return ProbeResult(f"valprobing_{task}", outcomes, {"metric": "name_in_output"})


def test_valprobing_folders_are_reported_by_avg_and_gap(tmp_path, capsys):
    """Bins of 3 over 6 pieces: the base −4 then −2 nats (Avg −3, Gap 2); the fine-tune lifts the first bin by
    1 nat (Avg −2.5, Gap 1), so Δ Avg is +0.5 and Δ Gap −1. Each folder holds two tasks, an older step of one and
    a metrics file, which are not read."""
    base = {(s, p): -4.0 if p < 3 else -2.0 for s in range(2) for p in range(6)}
    tuned = {k: v + 1.0 if k[1] < 3 else v for k, v in base.items()}
    for folder, values, step in (("base", base, 0), ("tuned", tuned, 150)):
        valprobing_result(values).save_json(tmp_path / folder / f"valprobing_code_step{step}.json")
        valprobing_result(values, "document").save_json(tmp_path / folder / f"valprobing_document_step{step}.json")
        (tmp_path / folder / f"metrics_step{step}.json").write_text("{}")
    valprobing_result(base).save_json(tmp_path / "tuned" / "valprobing_code_step10.json")  # older: not read
    assert main([str(tmp_path / "base"), f"tuned={tmp_path / 'tuned'}", "--score", "loglik",
                 "--figure", str(tmp_path / "vp.png")]) == 0
    out = capsys.readouterr().out
    assert "| plain | -3.0 [-3.0, -3.0] | 2.0 | -3.0 [-3.0, -3.0] | 2.0 |" in out
    assert "| tuned | -2.5 [-2.5, -2.5] | 1.0 | -2.5 [-2.5, -2.5] | 1.0 |" in out
    assert "| tuned | code | +0.5 [+0.5, +0.5] | -1.0 |" in out and "| tuned | document | +0.5 [" in out
    assert "gold 0" not in out and "## VaLProbing" not in out  # no table of hundreds of positions; one section
    assert (tmp_path / "vp_loglik.png").stat().st_size > 0 and "![valprobing](vp_loglik.png)" in out
    assert main([str(tmp_path / "base"), f"tuned={tmp_path / 'tuned'}"]) == 1  # FILM's score: nothing answered
    assert "plain, tuned has no 'correct' in its valprobing_code outcomes" in capsys.readouterr().err


def test_folders_pair_probe_by_probe(tmp_path, capsys):
    """Two probes in each folder: a section each, a figure each; a folder without one of the baseline's probes
    fails, naming the folder and the probe."""
    cells = {(q, p): float(p == 9) for q in range(4) for p in (0, 9)}
    for folder in ("base", "arm"):
        result("mdqa", cells).save_json(tmp_path / folder / "mdqa_step0.json")
        result("kv", cells, metric="kv_em").save_json(tmp_path / folder / "kv_step0.json")
    assert main([str(tmp_path / "base"), f"arm={tmp_path / 'arm'}", "--figure", str(tmp_path / "f.png")]) == 0
    out = capsys.readouterr().out
    assert out.index("## kv") < out.index("## mdqa") and out.count("| arm | 0.000 [") == 2
    assert (tmp_path / "f_kv.png").is_file() and (tmp_path / "f_mdqa.png").is_file()
    (tmp_path / "arm" / "kv_step0.json").unlink()
    assert main([str(tmp_path / "base"), f"arm={tmp_path / 'arm'}"]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "arm") in err and "'kv'" in err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), f"arm={tmp_path / 'arm'}"]) == 1
    assert "no <probe>_step<N>.json" in capsys.readouterr().err


def kv_result(path: Path, n_pairs: int, seed: int = 0, answer: str = "x") -> Path:
    """A kv eval JSON as scripts.eval_checkpoint writes one: synthetic items of `n_pairs` pairs (drawn with `seed`),
    their settings and item digests, every item answered `answer` with a log-likelihood."""
    cfg = EvalConfig(probe_examples=2, kv=KVProbeConfig(n_pairs=n_pairs))
    items = kv_probe(None, n_pairs, None, n_examples=2, seed=seed)
    result = run_probe(items, lambda chunk: [answer] * len(chunk), probe_metric("kv", cfg),
                       probe_settings("kv", cfg, items), loglik_fn=lambda chunk: [[-1.0]] * len(chunk))
    result.checkpoint = Checkpoint(f"/checkpoints/{answer}", answer * 64)
    return result.save_json(path)


def test_evaluations_not_asked_alike_are_refused_naming_the_setting(tmp_path, capsys):
    """Issue 66: kv evaluations of 10 and 20 pairs shared item ids (kv-0@0 ...) and were paired by them."""
    ten, twenty = kv_result(tmp_path / "A" / "kv_step3.json", 10), kv_result(tmp_path / "B" / "kv_step3.json", 20)
    capsys.readouterr()  # the progress bars of answering
    assert main([str(ten), f"other={twenty}", "--score", "loglik"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"error: kv positions: [0, 1, 4, 7, 9] in {ten}, [0, 4, 9, 14, 19] in {twenty}; slots: [10] in {ten}, [20] in "
        f"{twenty}: not asked alike, so nothing pairs them; pair evaluations made with the same probe settings\n")
    redrawn = kv_result(tmp_path / "C" / "kv_step3.json", 10, seed=1)  # the same settings, other pairs
    capsys.readouterr()
    assert main([str(ten), f"other={redrawn}"]) == 1
    assert (f"error: kv: 10 of the 10 item ids both asked (first kv-0@0) hold another prompt or other answers in "
            f"{redrawn} than in {ten}") in capsys.readouterr().err


def test_evaluations_of_the_same_items_pair_whatever_checkpoint_and_old_files_too(tmp_path, capsys):
    base = kv_result(tmp_path / "base" / "kv_step0.json", 10, answer="x")
    tuned = kv_result(tmp_path / "tuned" / "kv_step3.json", 10, answer="y")  # another checkpoint's answers
    assert ProbeResult.load_json(base).checkpoint != ProbeResult.load_json(tuned).checkpoint
    assert main([str(base), f"tuned={tuned}"]) == 0
    assert "| tuned | 0.000 [" in capsys.readouterr().out
    old = json.loads(tuned.read_text())  # a file written before results kept the checkpoint and item digests
    for key in ("checkpoint", "items_fingerprint"):
        del old[key]
    for o in old["outcomes"]:
        del o["item_digest"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert main([str(base), f"old={tmp_path / 'old.json'}"]) == 0
    assert "| old | 0.000 [" in capsys.readouterr().out
    old["settings"]["slots"] = [20]  # settings alone still tell results apart
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert main([str(base), f"old={tmp_path / 'old.json'}"]) == 1
    assert f"error: kv slots: [10] in {base}, [20] in {tmp_path / 'old.json'}: not asked alike" in capsys.readouterr().err


def test_interventions_pair_with_the_plain_answers_though_their_prompts_differ(tmp_path, capsys):
    cells = {(q, p): float(p == 9) for q in range(4) for p in (0, 9)}
    plain, truncated = result("mdqa", cells), result("mdqa", cells)
    plain.settings.update({"slots": [10], "intervention": "none", "query_aware": False})
    truncated.settings.update({"slots": [5], "intervention": "truncate-5", "order": None, "keep": 5,
                               "query_aware": False, "comparable_with_reference": False})
    for o in plain.outcomes:
        o["item_digest"] = "p" * 16
    for o in truncated.outcomes:
        o["item_digest"] = "t" * 16  # fewer documents: another prompt of the same question
    plain.save_json(tmp_path / "plain.json")
    truncated.save_json(tmp_path / "truncated.json")
    assert main([str(tmp_path / "plain.json"), f"truncate={tmp_path / 'truncated.json'}"]) == 0
    assert "| truncate | 0.000 [" in capsys.readouterr().out


@pytest.mark.parametrize("write, says", [
    (lambda path: path.write_text("not json\n"), "not an evaluation result, not even JSON (Expecting value"),
    (lambda path: path.write_bytes(b"\x89PNG\r\n"), "not an evaluation result, not even JSON ('utf-8' codec"),
    (lambda path: path.write_text('{"eval/kv/acc_mean": 0.5}'),
     "not an evaluation result: no per-item outcomes in it (an eval/metrics_step<N>.json holds metric values only)"),
])
def test_a_file_that_is_no_result_fails_naming_it(tmp_path, capsys, write, says):
    base = kv_result(tmp_path / "kv_step0.json", 10)
    write(tmp_path / "metrics_step0.json")
    capsys.readouterr()
    bad = tmp_path / "metrics_step0.json"
    for args in ([str(base), f"x={bad}"], [str(bad), f"x={base}"]):  # as the baseline or as an arm
        assert main(args) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {bad}: {says}") and err.count("\n") == 1
        assert err.endswith("give an eval/<probe>_step<N>.json (scripts.eval_checkpoint, train.py), or the folder "
                            "holding it\n")
