"""analysis.compare and scripts/eval_checkpoint on a tiny CPU run: report sections, PNGs, clear errors."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image

from analysis import compare as compare_module
from analysis.compare import (
    CompareConfig,
    Entry,
    JacobianProfiles,
    _wandb_table,
    build_parser,
    compare,
    main,
    path_profile,
    short_labels,
)
from analysis.evaluation.checkpoints import CompareError, Target, answer_checkpoint
from analysis.evaluation.config import NeedleProbeConfig
from analysis.evaluation.result import ProbeResult
from analysis.measure.prior import fit_alpha, prior_profile
from analysis.measure.topology import METRIC_KEYS
from analysis.report.figures import plot_position_accuracy, profiles_figure
from data_builders.tokenizer import train_bpe_tokenizer
from scripts import eval_checkpoint
from tests.conftest import ROOT, TINY

JACOBIAN = ["jacobian=hutchinson", "jacobian.seq_len=64", "jacobian.chunk_len=32", "jacobian.num_probes=2"]
# One short needle length at three depths keeps generation to seconds.
FAST = {"needle": NeedleProbeConfig(lengths=[64], depths=[0.0, 0.5, 1.0]), "device": "cpu"}


def assert_png(path) -> None:
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 200 and im.size[1] > 150


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real Hydra run directory (.hydra/config.yaml included): 2 steps, checkpoints step-1 and step-2."""
    run = tmp_path_factory.mktemp("runs") / "runA"
    cmd = [sys.executable, "train.py", *TINY, *JACOBIAN, "trainer.max_steps=2", "trainer.save_every=1",
           f"hydra.run.dir={run}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "eval" / "in2_step2.json").is_file()
    return run


def test_short_labels_tell_paths_apart():
    assert short_labels(["/x/runA/checkpoints/step-1", "/x/runA"]) == ["step-1", "runA"]
    assert short_labels(["/a/runA", "/b/runA"]) == ["a/runA", "b/runA"]


def test_report_has_every_section(run_dir, tmp_path, monkeypatch):
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):  # not $HOME
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    # A checkpoint outside any run (profiles measured), one inside the run (its npz), the run itself.
    standalone = tmp_path / "standalone"
    shutil.copytree(run_dir / "checkpoints" / "step-1", standalone)
    paths = [standalone, run_dir / "checkpoints" / "step-1", run_dir]
    report = compare(paths, CompareConfig(out=tmp_path / "cmp", probes=["needle", "in2"], examples=2, use_wandb=True,
                                          log_wandb="offline", **FAST))

    text = report.read_text()
    for heading in ["# Checkpoint comparison", "## Inputs", "## Probe accuracy", "## Metrics and settings",
                    "## Accuracy by gold position", "### needle", "### in2",
                    "## Position without answer format: log-likelihood of the gold answer", "## Needle grid",
                    "## Jacobian profiles", "### vanilla", "### chunked",
                    "## Valley, prior and rollout metrics", "## Provenance", "## wandb"]:
        assert f"\n{heading}\n" in f"\n{text}", heading
    for key in METRIC_KEYS:
        assert f"`{key}`" in text
    # Rollouts: measured now with the standalone checkpoint's profile, read from rollout.npz for the run's.
    for key in ("rollout/measured/spearman", "rollout/attention_only/w1", "rollout/measured_heads/rmse_log10"):
        rows = [line for line in text.splitlines() if line.startswith(f"| `{key}` |")]
        assert len(rows) == 2  # vanilla and chunked
        assert all("–" not in row and row.count("|") == 5 for row in rows)  # metric and three PATHs, each a value
    assert "Δ" in text
    images = [line.split("(")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert sorted(images) == ["accuracy_in2.png", "accuracy_needle.png", "jacobian_chunked.png",
                              "jacobian_vanilla.png", "loglik_in2.png", "loglik_needle.png", "needle_grid.png"]
    # the contrasts to the first PATH's strong end, and their change against it, by log-likelihood
    contrasts = text.split("### needle")[2].split("### in2")[0]  # the log-likelihood section's needle part
    assert re.search(r"^\|  \| gold [0-9.]+ − gold [0-9.]+ \| gold [0-9.]+ − gold [0-9.]+ \|$", contrasts, re.M)
    # the standalone checkpoint is a copy of step-1: the same function, no change of any contrast
    assert "| step-1: change vs standalone | +0.000 [+0.000, +0.000] | +0.000 [+0.000, +0.000] |" in contrasts
    # Every PATH scored needle alike; in2 too (the run's own JSON was made with the same metric and budget).
    assert "- **needle**: metric substring_match; 16 new tokens; positions [0, 1, 2]; lengths [64]; " in text
    assert "- **in2**: metric exact_match; 8 new tokens" in text
    for name in images:
        assert_png(report.parent / name)
    # Only what the run lacks is computed: its own in2 result is reused, its profiles read from the npz.
    assert f"`runA`: in2: reused {run_dir / 'eval' / 'in2_step2.json'}" in text
    assert "`standalone`: in2: evaluated now" in text
    # step-1 holds the weights standalone is a copy of: one checkpoint, evaluated once
    assert re.search(r"`step-1`: one checkpoint with `standalone` \(the same weights, digest [0-9a-f]{12}\)", text)
    assert "`step-1`: in2: the answers of `standalone`" in text and "`step-1`: in2: evaluated now" not in text
    assert "`standalone`: Jacobian: measured on synthetic documents, L=64" in text
    assert "`step-1`: Jacobian: jacobian.npz of its run, step 1" in text
    saved = ProbeResult.load_json(tmp_path / "cmp" / "eval" / "standalone_in2.json")
    reused = ProbeResult.load_json(run_dir / "eval" / "in2_step2.json")
    assert {o["id"] for o in saved.outcomes} == {o["id"] for o in reused.outcomes}  # the same records
    # --wandb-log offline: the report's PNGs and accuracy tables as one offline wandb run under <out>/wandb/.
    (logged,) = (tmp_path / "cmp" / "wandb").glob("offline-run-*")
    media = logged / "files" / "media"
    assert sorted(p.name.rsplit("_", 2)[0] for p in media.glob("images/compare/*.png")) == sorted(
        name.removesuffix(".png") for name in images)
    (table,) = media.glob("table/compare/accuracy_by_position_*.table.json")
    rows = json.loads(table.read_text())["data"]  # path, probe, position, label, accuracy
    labels, probes = ("standalone", "step-1", "runA"), ("needle", "in2")
    assert {(r[0], r[1]) for r in rows} == {(label, probe) for label in labels for probe in probes}
    assert [r[4] for r in rows if r[:2] == ["runA", "in2"]] == list(reused.accuracy_by_position().values())


def test_probe_options_reach_the_probe_settings():
    args = build_parser().parse_args(["runA", "--kv-path", "kv-140.jsonl.gz", "--mdqa-path", "qa/*.jsonl.gz",
                                      "--distractors", "random", "--needle-lens", "128,256", "--needle-depths", "0,0.5,1"])
    assert (args.kv_path, args.mdqa_path, args.distractors) == ("kv-140.jsonl.gz", "qa/*.jsonl.gz", "random")
    assert args.needle_lens == [128, 256] and args.needle_depths == [0.0, 0.5, 1.0]
    args = build_parser().parse_args(["runA", "--kv-pairs", "20", "--mdqa-docs", "10", "--interventions",
                                      "reorder:ascending,truncate:5,ms_poe,attn_calibration", "--ms-poe-layers", "1,2",
                                      "--calibration-layers", "all"])
    assert (args.kv_pairs, args.mdqa_docs, args.ms_poe_layers, args.calibration_layers) == (20, 10, [1, 2], "all")
    assert args.interventions == ["reorder:ascending", "truncate:5", "ms_poe", "attn_calibration"]
    defaults = build_parser().parse_args(["runA"])
    assert defaults.distractors == "retrieved" and defaults.max_new_tokens is None  # the reference's setup
    assert defaults.interventions == [] and defaults.kv_pairs is None
    for bad in (["--needle-depths", "0,1.5"], ["--distractors", "bm25"], ["--interventions", "shuffle"],
                ["--interventions", "truncate"], ["--calibration-layers", "middle"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["runA", *bad])


def test_wandb_options_log_and_read_summaries(tmp_path):
    assert build_parser().parse_args(["runA", "--wandb-log", "offline"]).wandb_log == "offline"
    assert build_parser().parse_args(["runA"]).wandb_log is None  # off by default
    with pytest.raises(SystemExit):
        build_parser().parse_args(["runA", "--wandb-log", "disabled"])
    # A define_metric summary is a dict ({"min": ..., "last": ...}): the table shows its last value.
    files = tmp_path / "run" / "wandb" / "run-20260101_000000-abc" / "files"
    files.mkdir(parents=True)
    (files / "wandb-summary.json").write_text(json.dumps({"train/loss": {"min": 1.0, "last": 1.25}, "eval/loss": 2.5}))
    entry = Entry(Target(tmp_path / "run", "run", tmp_path / "run", tmp_path / "run", 3), 2, 100)
    assert _wandb_table([entry])[-1].endswith("| 1.250 | 2.500 |")


def test_closed_book_line_and_intervals_plot(tmp_path):
    rng = np.random.default_rng(0)

    def result(p_correct: float) -> ProbeResult:
        outcomes = [
            {"id": f"mdqa-{q}@{label}", "query": f"mdqa-{q}", "position": pos, "label": label, "prediction": "",
             "answers": ["x"], "correct": float(rng.random() < p_correct), "extra": {}}
            for q in range(10) for pos, label in [(0, "0"), (4, "4"), (9, "9"), (-1, "closedbook")]
        ]
        return ProbeResult("mdqa", outcomes)

    png = plot_position_accuracy({"A": result(0.3), "B": result(0.6)}, tmp_path / "mdqa.png", "mdqa")
    assert_png(png)


def test_profiles_figure_draws_each_paths_profile_fitted_prior_and_step0(tmp_path):
    L, H = 48, 4
    rho = prior_profile(L, H, 0.3) * 20.0 * np.random.default_rng(0).lognormal(0.0, 0.1, L)  # (L,)
    step0 = prior_profile(L, H, 0.6)
    entries = [
        Entry(Target(tmp_path / "a", "runA", tmp_path / "a", None, 3), H, 100,
              profiles=JacobianProfiles({"vanilla": rho}, {"vanilla": step0}, "test")),
        Entry(Target(tmp_path / "b", "runB", tmp_path / "b", None, None), H, 100,
              profiles=JacobianProfiles({"chunked": rho}, {}, "test")),  # no vanilla profile: not drawn
    ]
    raw, anchored = profiles_figure([path_profile(e, "vanilla") for e in entries], "vanilla").axes
    fit = fit_alpha(rho, H)
    measured, prior, initial = raw.lines
    np.testing.assert_array_equal(measured.get_ydata(), rho)
    np.testing.assert_allclose(prior.get_ydata(), prior_profile(L, H, fit.alpha) * 10**fit.log10_scale, rtol=1e-12)
    np.testing.assert_array_equal(initial.get_ydata(), step0)
    for line in anchored.lines:
        assert line.get_ydata()[-1] == 1.0
    assert [t.get_text() for t in raw.get_legend().get_texts()] == [
        "runA (step 3)", f"runA prior, H={H}, a={fit.alpha:.3f}", "runA (step 0)"]
    assert [line.get_linestyle() for line in raw.lines] == ["-", "--", ":"]
    assert raw.get_yscale() == anchored.get_yscale() == "log"


@pytest.mark.parametrize("make_bad", [lambda tmp: tmp / "missing", lambda tmp: tmp])
def test_bad_path_fails_naming_it(run_dir, tmp_path, capsys, make_bad):
    bad = make_bad(tmp_path)  # a path that does not exist; a folder that is neither run nor checkpoint
    assert main([str(run_dir), str(bad), "--out", str(tmp_path / "cmp")]) == 1
    assert str(bad) in capsys.readouterr().err
    assert not (tmp_path / "cmp" / "report.md").exists()


def test_cli_exit_code_on_missing_path(tmp_path):
    missing = tmp_path / "no-such-run"
    out = subprocess.run([sys.executable, "-m", "analysis.compare", str(missing)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and str(missing) in out.stderr


def test_incompatible_tokenizers_fail_for_in2(run_dir, tmp_path, capsys):
    other = tmp_path / "other-tokenizer"
    shutil.copytree(run_dir / "checkpoints" / "step-2", other)
    tokenizer = train_bpe_tokenizer(["a different corpus makes a different vocabulary"] * 10, 300, tmp_path)
    tokenizer.save_pretrained(other)
    assert main([str(run_dir), str(other), "--probes", "in2", "--out", str(tmp_path / "cmp")]) == 1
    err = capsys.readouterr().err
    assert "incompatible tokenizers" in err and str(other) in err


def test_eval_checkpoint_writes_outputs(run_dir, tmp_path, capsys):
    ckpt, out = run_dir / "checkpoints" / "step-2", tmp_path / "eval-out"
    argv = [str(ckpt), "probes=[needle,in2]", "examples=1", "needle.lengths=[64]", "needle.depths=[0.0,1.0]",
            "device=cpu", f"out={out}"]
    assert eval_checkpoint.main(argv) == 0
    for probe in ("needle", "in2"):
        result = ProbeResult.load_json(out / "eval" / f"{probe}_step2.json")
        assert result.probe == probe and result.outcomes
        assert_png(out / "plots" / f"{probe}_accuracy_step2.png")
    metrics = json.loads((out / "eval" / "metrics_step2.json").read_text())
    assert {"eval/needle/acc_mean", "eval/in2/acc_mean"} <= set(metrics)
    printed = capsys.readouterr().out
    assert "needle" in printed and "in2" in printed


def test_eval_checkpoint_rejects_unknown_keys(run_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        eval_checkpoint.main([str(run_dir), "not_a_key=1"])
    assert exc.value.code == 2 and "not_a_key" in capsys.readouterr().err


@pytest.mark.parametrize("arg, named", [("probes=[kv,needel]", "Invalid value 'needel', expected one of"),
                                        ("probes=[]", "at least one probe"), ("dtype=fp8", "fp8")])
def test_eval_checkpoint_rejects_bad_choices_before_loading(tmp_path, capsys, arg, named):
    with pytest.raises(SystemExit) as exc:
        eval_checkpoint.main([str(tmp_path / "never-read"), arg])
    assert exc.value.code == 2 and named in capsys.readouterr().err


def test_interventions_sit_beside_the_plain_curves(run_dir, tmp_path):
    from analysis.evaluation.config import MDQAProbeConfig
    from models.attention.attn_calibration import AttnCalibrationConfig
    from models.attention.ms_poe import MsPoEConfig

    ctxs = [{"title": f"title {k}", "text": f"text {k}", "isgold": k == 3} for k in range(6)]
    mdqa = tmp_path / "qa.jsonl"
    mdqa.write_text("".join(json.dumps({"question": f"question {i}", "answers": ["x"], "ctxs": ctxs}) + "\n"
                            for i in range(3)))
    report = compare([run_dir], CompareConfig(
        out=tmp_path / "cmp", probes=["mdqa", "needle"], examples=3, max_new_tokens=2,
        mdqa=MDQAProbeConfig(path=str(mdqa), closed_book=False),
        interventions=["reorder", "truncate:2", "query_aware", "ms_poe", "attn_calibration"],
        needle=NeedleProbeConfig(lengths=[128], depths=[0.0, 1.0]), device="cpu",
        ms_poe=MsPoEConfig(layers="all"), calibration=AttnCalibrationConfig(layers="all")))
    text = report.read_text()
    section = text.split("## Interventions", 1)[1].split("## Jacobian profiles", 1)[0]
    for name in ("plain", "reorder-outside_in", "truncate-2", "query_aware", "ms_poe", "attn_calibration"):
        assert f"| runA | {name} |" in section
    plain_row = next(line for line in section.splitlines() if line.startswith("| runA | plain |"))
    float(plain_row.split("|")[-2])  # the un-intervened answers' wall time, beside each intervention's
    needle_rows = section.split("### needle", 1)[1]
    assert "| runA | ms_poe |" in needle_rows and "reorder" not in needle_rows  # only the probes each changes
    assert "attn_calibration" not in needle_rows  # needle prompts have no documents
    calibrated = ProbeResult.load_json(tmp_path / "cmp" / "eval" / "runA_mdqa_attn_calibration.json")
    assert calibrated.settings["attn_calibration"]["calibrated_rows"] > 0
    for png in ("interventions_mdqa.png", "interventions_mdqa_final_position.png", "interventions_needle.png"):
        assert_png(report.parent / png)
    moved = ProbeResult.load_json(tmp_path / "cmp" / "eval" / "runA_mdqa_reorder-outside_in.json")
    assert {o["extra"]["final_position"] for o in moved.outcomes} == {4}  # rank 4 of 6, outside-in
    with pytest.raises(CompareError, match="changes none of the probes"):
        compare([run_dir], CompareConfig(out=tmp_path / "x", probes=["needle"], examples=1, interventions=["reorder"],
                                         device="cpu"))


def test_a_run_and_its_own_last_checkpoint_are_evaluated_once(run_dir, tmp_path, monkeypatch, capsys):
    answered = []

    def counted(*args, **kwargs):
        answered.append(sorted(args[2]))  # the probes asked
        return answer_checkpoint(*args, **kwargs)

    monkeypatch.setattr(compare_module, "answer_checkpoint", counted)
    last = run_dir / "checkpoints" / "step-2"
    report = compare([run_dir, last], CompareConfig(out=tmp_path / "cmp", probes=["needle"], examples=1, **FAST))
    assert answered == [["needle"]]
    assert f"{run_dir} and {last} are one checkpoint (both {last}): evaluated once\n" in capsys.readouterr().out
    text = report.read_text()
    assert f"`step-2`: one checkpoint with `runA` (both {last}): evaluated once" in text
    assert "`step-2`: needle: the answers of `runA`" in text and "`runA`: needle: evaluated now" in text
    saved = ProbeResult.load_json(tmp_path / "cmp" / "eval" / "runA_needle.json")
    assert saved.checkpoint.path == str(last.resolve()) and len(saved.checkpoint.digest) == 64
    assert saved.fingerprint is not None


def test_results_not_asked_alike_are_refused_naming_the_setting(run_dir, tmp_path):
    """Two runs' own in2 results, no run config to ask them again: the report pairs them only when asked alike."""
    copies = [Path(shutil.copytree(run_dir, tmp_path / name, ignore=shutil.ignore_patterns(".hydra", "wandb")))
              for name in ("a", "b")]
    cfg = CompareConfig(out=tmp_path / "cmp", probes=["in2"], examples=1, device="cpu")
    assert "- `b`: in2: reused" in compare(copies, cfg).read_text()  # asked alike: paired
    saved = copies[1] / "eval" / "in2_step2.json"
    data = json.loads(saved.read_text())
    data["outcomes"][3]["item_digest"] = "0" * 16
    saved.write_text(json.dumps(data))
    with pytest.raises(CompareError, match=rf"^in2: 1 of the \d+ item ids both asked \(first .+\) hold another prompt or "
                                           rf"other answers in {copies[1]} than in {copies[0]}: not asked alike"):
        compare(copies, replace(cfg, out=tmp_path / "cmp2"))
    data["settings"]["max_new_tokens"] = 4
    saved.write_text(json.dumps(data))
    with pytest.raises(CompareError) as err:
        compare(copies, replace(cfg, out=tmp_path / "cmp2"))
    assert str(err.value) == (f"in2 max_new_tokens: 8 in {copies[0]}, 4 in {copies[1]}: not asked alike, so nothing "
                              "pairs them; compare PATHs evaluated with the same settings, or leave in2 out (--probes)")
    assert not (tmp_path / "cmp2").exists()


def test_a_jacobian_off_run_is_compared(run_dir, tmp_path):
    """+exp=in2 jacobian=off: one probe a step pooled over 8 steps, never measured; a profile here draws them at once."""
    run = Path(shutil.copytree(run_dir, tmp_path / "off"))
    for name in ("jacobian.npz", "rollout.npz"):
        (run / name).unlink()
    config = OmegaConf.load(run / ".hydra" / "config.yaml")
    config.jacobian.update({"every": 0, "num_probes": 1, "window": 8})
    OmegaConf.save(config, run / ".hydra" / "config.yaml")
    report = compare([run], CompareConfig(out=tmp_path / "cmp", probes=["needle"], examples=1, **FAST))
    assert "- `off`: Jacobian: measured on synthetic documents, L=64, hutchinson; no step-0 profile" in report.read_text()


def test_out_that_is_a_file_fails_naming_it(run_dir, tmp_path, capsys):
    (tmp_path / "report.md").write_text("an earlier report\n")
    assert main([str(run_dir), "--out", str(tmp_path / "report.md")]) == 1
    assert capsys.readouterr().err == (f"error: --out {tmp_path / 'report.md'}: a file, not a folder: give --out a new "
                                       "folder (or an earlier report's, whose report.md is replaced)\n")
