"""The training objectives (issue 65): each objective's losses, step by step, are those it gave before the objectives
became plug-ins (tests/data/objective_losses.json, recorded by the code before the registry; `python -m
tests.test_objectives --record` records them again)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from data_builders.mdqa import write_jsonl_gz
from scripts.investigations.synthetic_oracle import oracle_records
from tests.conftest import TINY
from train import compose_config, run

RECORDED = Path(__file__).resolve().parent / "data" / "objective_losses.json"
STEPS = 3
MDQA = ["model=qwen2_tiny", *TINY, "data.context_len=512", "data.in2.n_docs=3", "peft.r=4", "watch=off"]
DISTILL = [*MDQA, "debias.distill.keep_wrong=true", "debias.distill.max_new_tokens=4"]
# objective -> the overrides of a few tiny steps (IN2 on the embedded synthetic data, or mdqa-layout NQ)
CASES = {
    "mean": [*TINY, "watch=off"],
    "depth_weight": [*TINY, "watch=off", "debias=depth_weight", "debias.prior_alpha=0.5"],
    "group_dro": [*TINY, "watch=off", "debias=group_dro", "debias.eta=0.5"],
    "loss_weight": [*TINY, "watch=off", "debias=loss_weight", "debias.loss_ema=0.5"],
    "pos2distill": ["+exp=in2_smol_distill", *DISTILL],
    "pos2distill_guard": ["+exp=in2_smol_distill", *DISTILL, "debias=pos2distill_guard"],
}
NQ_CASES = ("pos2distill", "pos2distill_guard")


def losses_of(case: str, folder: Path, nq: Path) -> list[float]:
    data = [f"data.path={nq}"] if case in NQ_CASES else []
    run(compose_config([*CASES[case], *data, f"trainer.max_steps={STEPS}", "trainer.save_every=0"]), folder)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


@pytest.fixture(scope="module")
def nq_file(tmp_path_factory) -> Path:
    return write_jsonl_gz(tmp_path_factory.mktemp("nq") / "nq-open-oracle.jsonl.gz", oracle_records(160, seed=3))


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_objective_trains_as_before_the_registry(case, tmp_path, nq_file):
    recorded = json.loads(RECORDED.read_text())[case]
    assert losses_of(case, tmp_path, nq_file) == pytest.approx(recorded, rel=1e-5)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python -m tests.test_objectives --record")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        nq = write_jsonl_gz(Path(tmp) / "nq" / "nq-open-oracle.jsonl.gz", oracle_records(160, seed=3))
        numbers = {case: losses_of(case, Path(tmp) / case, nq) for case in sorted(CASES)}
    RECORDED.parent.mkdir(exist_ok=True)
    RECORDED.write_text(json.dumps(numbers, indent=1) + "\n")
    print(f"wrote {RECORDED}")


def test_a_new_objective_is_a_registered_class_and_its_settings(tmp_path, monkeypatch):
    """What a new objective takes: a class registered by name, whose own settings are debias.settings.*; train.py
    runs it as any other (here: the mean loss scaled, so its losses are the mean objective's times the scale)."""
    from dataclasses import dataclass

    from models.training.loss import causal_lm_loss
    from models.training.objectives import TrainingObjective, base, register

    @dataclass
    class Scaled:
        scale: float = 1.0

    monkeypatch.setattr(base, "REGISTRY", dict(base.REGISTRY))

    @register
    class ScaledMean(TrainingObjective):
        name = "scaled_mean"
        batch_depths = False
        Settings = Scaled

        def __call__(self, model, batch, device=None, tap=None):
            return self.settings.scale * causal_lm_loss(model, batch, device, tap=tap)

    run(compose_config([*CASES["mean"], "debias.objective=scaled_mean", "+debias.settings.scale=2.0",
                        f"trainer.max_steps={STEPS}", "trainer.save_every=0"]), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    recorded = json.loads(RECORDED.read_text())["mean"]
    assert [r["train/loss"] for r in rows if "train/loss" in r][:1] == pytest.approx([2 * recorded[0]], rel=1e-5)
    with pytest.raises(ValueError, match=r"debias.settings.scal: scaled_mean has no such setting; did you mean "
                                         r"debias.settings.scale\?"):
        run(compose_config([*CASES["mean"], "debias.objective=scaled_mean", "+debias.settings.scal=2.0"]), tmp_path)
    with pytest.raises(ValueError, match=r"debias.objective='nope' is not known \(known: .*mean.*scaled_mean"):
        run(compose_config([*CASES["mean"], "debias.objective=nope"]), tmp_path / "nope")


def test_another_objectives_settings_are_refused_by_name():
    from train import as_train_config, dist_info, validate

    cfg = as_train_config(compose_config([*CASES["mean"], "debias=group_dro", "debias.loss_ema=0.5"]))
    with pytest.raises(ValueError, match=r"debias.loss_ema=0.5 set with debias.objective=group_dro: they are another "
                                         r"objective's"):
        validate(cfg, dist_info())
