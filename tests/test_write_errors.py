"""Writes the file system refuses, and inputs of the wrong kind, said in one line (issue 66): a read-only folder, no
permission, a file over the size limit (data_builders.files.refused_write), POSDEBIAS_CACHE that is a file, weights of
another architecture (models.training.checkpoint.load_model_weights). Tests run as root, which writes through a chmod:
a read-only folder or a refused permission is made by raising the operating system's error where the write begins."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from data_builders.files import FileSystemError, atomic_dir, atomic_file, atomic_write_text
from data_builders.tokenizer import default_cache_dir
from models.training.checkpoint import load_model_weights
from tests.conftest import ROOT


def refuse(monkeypatch, code: int) -> None:
    """Every temporary file fails to open with `code`, as on a read-only mount or a folder without permission."""
    def mkstemp(*args, dir=None, **kwargs):
        raise OSError(code, os.strerror(code), str(Path(dir) / ".x.tmp"))

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


@pytest.mark.parametrize("code, says", [
    (errno.EROFS, "it is on a read-only file system: write elsewhere, or remount it writable"),
    (errno.EACCES, "this user may not write in {folder}: make it writable (chmod, chown), or write elsewhere"),
    (errno.EPERM, "this user may not write in {folder}: make it writable (chmod, chown), or write elsewhere"),
])
def test_a_refused_write_names_the_file_and_what_to_do(tmp_path, monkeypatch, code, says):
    refuse(monkeypatch, code)
    with pytest.raises(FileSystemError) as err:
        atomic_write_text(tmp_path / "out" / "metrics.json", "{}")
    assert err.value.errno == code and isinstance(err.value, OSError)
    assert str(err.value) == f"cannot write {tmp_path / 'out' / 'metrics.json'}: {says.format(folder=tmp_path / 'out')}"


def test_a_file_over_the_size_limit_is_named_with_the_limit(tmp_path):
    """A real `ulimit -f`: the write fails with EFBIG (SIGXFSZ ignored, as a shell's `ulimit` leaves it to kill)."""
    target = tmp_path / "big.txt"
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
            "from data_builders.files import atomic_write_text\n"
            "try:\n    atomic_write_text(sys.argv[1], 'x' * 100_000)\n"
            "except OSError as err:\n    print(type(err).__name__, err.errno, err)")
    done = subprocess.run([sys.executable, "-c", code, str(target)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == (
        f"FileSystemError {errno.EFBIG} cannot write {target}: a file grew larger than its file system or `ulimit -f` "
        "allows: write to another file system (FAT32 holds 4 GiB a file) or raise the limit, or write elsewhere"
    ), done.stderr[-2000:]
    assert not list(tmp_path.iterdir()), "a temporary file was left"


def test_a_folder_write_names_the_folder_and_the_advice(tmp_path, monkeypatch):
    with pytest.raises(FileSystemError, match=rf"^cannot write {tmp_path / 'built'}: a file grew larger than .*, "
                                              "or set POSDEBIAS_CACHE elsewhere$"):
        with atomic_dir(tmp_path / "built", advice="set POSDEBIAS_CACHE elsewhere") as tmp:
            (tmp / "part").write_bytes(b"x")
            raise OSError(errno.EFBIG, "File too large")
    assert not list(tmp_path.iterdir())


def test_an_error_reading_another_file_is_not_called_a_refused_write(tmp_path):
    source = tmp_path / "in" / "data.bin"
    with pytest.raises(PermissionError) as err:
        with atomic_file(tmp_path / "out" / "copy.bin") as f:
            f.write(b"x")
            raise PermissionError(errno.EACCES, "Permission denied", str(source))  # reading the input
    assert not isinstance(err.value, FileSystemError)
    assert not list((tmp_path / "out").iterdir())


def test_posdebias_cache_under_a_file_names_the_variable(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("POSDEBIAS_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.raises(FileSystemError) as err:
        default_cache_dir()
    assert str(err.value) == (f"POSDEBIAS_CACHE={tmp_path / 'file' / 'cache'} lies under {tmp_path / 'file'}, which "
                              "is a file, not a folder: set POSDEBIAS_CACHE to a folder (it is made when missing)")
    monkeypatch.setenv("POSDEBIAS_CACHE", str(tmp_path / "new" / "cache"))
    assert default_cache_dir() == tmp_path / "new" / "cache"  # a folder to make is fine


def tiny_qwen(hidden: int, layers: int = 2) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, vocab_size=100))


def test_weights_of_another_architecture_fail_in_one_line(tmp_path):
    tiny_qwen(64, 4).save_pretrained(tmp_path / "wide")
    with pytest.raises(ValueError) as err:
        load_model_weights(tiny_qwen(32), tmp_path / "wide")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path / 'wide'}: a checkpoint of another architecture: it holds hidden_size=64, "
                              "num_hidden_layers=4")
    assert "the model built here has hidden_size=32, num_hidden_layers=2" in message and "resume it with" in message
    only_weights = tmp_path / "weights"  # no config.json to compare: the first tensor of another shape
    only_weights.mkdir()
    save_file(tiny_qwen(64).state_dict(), only_weights / "model.safetensors")
    with pytest.raises(ValueError, match=r"tensors of another shape than this model's, e\.g\. lm_head\.weight: "
                                         r"100x64 there, 100x32 here: resume it with"):
        load_model_weights(tiny_qwen(32), only_weights)


def test_lora_adapters_of_another_rank_fail_in_one_line(tmp_path):
    from peft import LoraConfig, get_peft_model

    def lora(r: int):
        return get_peft_model(tiny_qwen(32), LoraConfig(r=r, target_modules=["q_proj", "v_proj"]))

    lora(8).save_pretrained(tmp_path / "r8")
    with pytest.raises(ValueError) as err:
        load_model_weights(lora(4), tmp_path / "r8")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path / 'r8'}: LoRA adapters of another shape than this run's (8 tensors; the "
                              "first: size mismatch for ")
