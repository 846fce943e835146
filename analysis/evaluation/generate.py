"""Greedy answers from a Hugging Face model: batched by prompt tokens, left-padded, stopped at the first
complete line when only that is scored; optional chat-template prompts and attention calibration; prompts that
share a long context (VaLProbing's sets) answered over one cached prefill of it (`shared_prefix`)."""
from __future__ import annotations

import copy
import itertools
import logging
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList

from data_builders.probes import ProbeItem

if TYPE_CHECKING:
    from models.attention.attn_calibration import AttnCalibration

log = logging.getLogger(__name__)

GenerateFn = Callable[[Sequence[ProbeItem]], list[str]]


BatchContext = Callable[[Sequence[int], int], ContextManager]
# (rows, left-padded ids (B, L), mask (B, L)) -> a KV cache of the batch's first L - 1 columns, which generate continues
Prefill = Callable[[Sequence[int], torch.Tensor, torch.Tensor], Any]


class FirstLineComplete(StoppingCriteria):
    """Done for the rows whose new text has a newline after its first non-blank character."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_width: int) -> None:
        self.tokenizer, self.prompt_width = tokenizer, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_width :], skip_special_tokens=True)
        return torch.tensor(["\n" in t.lstrip() for t in texts], dtype=torch.bool, device=input_ids.device)


def _stop_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The model's eos ids, and the tokenizer's eos: models trained here end answers with it, which a config
    may not list."""
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return eos


def _length_batches(prompts: Sequence[Sequence[int]], batch_size: int, batch_tokens: int | None) -> list[list[int]]:
    """Prompt indices in batches of similar lengths (little compute goes to padding), each of at most
    `batch_size` prompts and `batch_tokens` padded tokens (one prompt at least)."""
    batches: list[list[int]] = []
    for i in sorted(range(len(prompts)), key=lambda i: len(prompts[i])):  # the prompt added sets the width
        if not batches or len(batches[-1]) == batch_size or (
                batch_tokens is not None and (len(batches[-1]) + 1) * len(prompts[i]) > batch_tokens):
            batches.append([])
        batches[-1].append(i)
    return batches


def _left_padded(prompts: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, L) left-padded with `pad`, so every row's last prompt token is at the same column, and
    their attention mask (B, L)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, prompt in enumerate(prompts):
        ids[r, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        mask[r, width - len(prompt):] = 1
    return ids, mask


MIN_SHARED_PREFIX = 256  # tokens: a shorter common prefix is not worth a cache of its own


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def shared_prefix_groups(prompts: Sequence[Sequence[int]], min_shared: int = MIN_SHARED_PREFIX
                         ) -> list[tuple[int, list[int]]]:
    """Runs of consecutive prompts that share their first `min_shared` or more tokens: (the run's common prefix
    length, the prompts' indices). Every prompt keeps at least its last token out of the prefix, so that its own
    pass gives the first answer token's logits; a prompt sharing too little is a run of its own."""
    groups: list[tuple[int, list[int]]] = []
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        if groups:
            shared, rows = groups[-1]
            first = prompts[rows[0]]
            n = min(shared, common_prefix_len(first, prompt), len(prompt) - 1)
            if n >= min_shared:
                groups[-1] = (n, rows + [i])
                continue
        groups.append((len(prompt) - 1, [i]))
    return groups


@torch.no_grad()
def prefix_caches(model: PreTrainedModel, prompts: Sequence[Sequence[int]], progress: bool, desc: str
                  ) -> Iterator[tuple[int, int, Any]]:
    """(prompt index, shared prefix length, a fresh copy of that prefix's KV cache) for every prompt, in order: each
    run of `shared_prefix_groups` is prefilled once and each of its prompts gets a deep copy to extend, so the
    answers are those of full passes up to float rounding (a chunked prefill sums in another order)."""
    groups = shared_prefix_groups(prompts)
    with tqdm(total=len(prompts), desc=desc, disable=not progress) as bar:
        for shared, rows in groups:
            prefix = torch.tensor([list(prompts[rows[0]][:shared])], device=model.device)
            cache = model(input_ids=prefix, use_cache=True, logits_to_keep=1).cache if shared else None
            for i in rows:
                yield i, shared, copy.deepcopy(cache)
                bar.update(1)


@torch.no_grad()
def greedy_generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int,
    progress: bool = True,
    first_line_only: bool = False,
    batch_tokens: int | None = None,
    batch_context: BatchContext | None = None,
    shared_prefix: bool = False,
    prefill: Prefill | None = None,
) -> list[str]:
    """Greedy continuations of token-id prompts, decoded without special tokens, in prompt order.

    Batches are left-padded (so every row's last prompt token is at the same column) and run with
    the KV cache; a batch holds at most `batch_size` prompts and, when set, at most `batch_tokens`
    padded prompt tokens (one prompt at least). Generation stops at the model's eos ids and the tokenizer's eos, and with
    `first_line_only` also once a row's first non-blank line is complete (what `first_line` keeps:
    the scores are those of the full budget, for less compute). The model is put in eval mode and
    its previous mode restored. `batch_context(rows, width)`, when given, is entered around each batch's
    generate call (rows: the prompts' indices, width: the padded length), e.g. to calibrate attention.
    `prefill(rows, ids, mask)`, when given, computes each batch's KV cache of all but its last column, which
    generate then continues (what else it reads off that pass is its own: `loglik.answers_and_logliks`).
    With `shared_prefix`, consecutive prompts that share a long prefix are answered one at a time over one
    cached prefill of it (`prefix_caches`; `batch_size`, `batch_tokens` and `batch_context` do not apply).
    """
    texts: list[str] = [""] * len(prompts)
    if shared_prefix and (batch_context is not None or prefill is not None):
        raise ValueError("shared_prefix answers without batches: it cannot take a batch_context or a prefill")
    answers = (_generate_shared(model, tokenizer, prompts, max_new_tokens, progress, first_line_only) if shared_prefix
               else _generate(model, tokenizer, prompts, max_new_tokens, batch_size, progress, first_line_only,
                              batch_tokens, batch_context, prefill))
    for rows, new in answers:
        for i, text in zip(rows, tokenizer.batch_decode(new, skip_special_tokens=True)):
            texts[i] = text
    return texts


@torch.no_grad()
def greedy_generate_ids(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int,
    progress: bool = True,
    first_line_only: bool = False,
    batch_tokens: int | None = None,
) -> list[list[int]]:
    """`greedy_generate`'s continuations as the token ids the model chose, in prompt order: each row's new tokens up
    to its first stop (the model's eos ids, the tokenizer's eos, the padding after a row that stopped), which is
    left out. The same batches and calls, so the same tokens `greedy_generate` decodes."""
    stops = set(_stop_ids(model, tokenizer)) | {_pad_id(tokenizer)}
    out: list[list[int]] = [[] for _ in prompts]
    for rows, new in _generate(model, tokenizer, prompts, max_new_tokens, batch_size, progress, first_line_only,
                               batch_tokens):
        for i, ids in zip(rows, new.tolist()):
            out[i] = list(itertools.takewhile(lambda t: t not in stops, ids))
    return out


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int,
    progress: bool,
    first_line_only: bool,
    batch_tokens: int | None,
    batch_context: BatchContext | None = None,
    prefill: Prefill | None = None,
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """(prompt indices, their new tokens (B, new)) of each batch, as `greedy_generate` documents it."""
    _warn_too_long(model, prompts, max_new_tokens)
    pad = _pad_id(tokenizer)
    eos = _stop_ids(model, tokenizer)
    batches = _length_batches(prompts, batch_size, batch_tokens)
    was_training = model.training
    model.eval()
    try:
        for rows in tqdm(batches, desc="generate", disable=not progress):
            ids, mask = _left_padded([prompts[i] for i in rows], pad)  # (B, L) each
            width = ids.shape[1]
            ids, mask = ids.to(model.device), mask.to(model.device)
            with batch_context(rows, width) if batch_context is not None else nullcontext():
                cache = prefill(rows, ids, mask) if prefill is not None else None
                out = model.generate(input_ids=ids, attention_mask=mask, cache=cache,
                                     **_greedy_kwargs(tokenizer, max_new_tokens, pad, eos, first_line_only, width))
            yield rows, out[:, width:]  # (B, new)
    finally:
        model.train(was_training)


def _greedy_kwargs(tokenizer: PreTrainedTokenizerBase, max_new_tokens: int, pad: int, eos: list[int],
                   first_line_only: bool, width: int) -> dict[str, Any]:
    """`model.generate`'s settings for plain argmax decoding of prompts `width` tokens wide."""
    return dict(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
        # Hub generation configs may set penalties (Qwen2-Instruct: repetition_penalty=1.05) that generate() would
        # apply; pinned off so this stays plain argmax.
        repetition_penalty=1.0, no_repeat_ngram_size=0, pad_token_id=pad, eos_token_id=eos or None,
        stopping_criteria=StoppingCriteriaList([FirstLineComplete(tokenizer, width)]) if first_line_only else None)


def _generate_shared(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    progress: bool,
    first_line_only: bool,
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """`_generate`'s (rows, new tokens) one prompt at a time, each continuing a copy of its run's prefix cache."""
    _warn_too_long(model, prompts, max_new_tokens)
    pad, eos = _pad_id(tokenizer), _stop_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    try:
        for i, _, cache in prefix_caches(model, prompts, progress, "generate (shared prefix)"):
            ids = torch.tensor([list(prompts[i])], device=model.device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache,
                                 **_greedy_kwargs(tokenizer, max_new_tokens, pad, eos, first_line_only, ids.shape[1]))
            yield [i], out[:, ids.shape[1]:]
    finally:
        model.train(was_training)


def _warn_too_long(model: PreTrainedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    too_long = sum(len(p) + max_new_tokens > limit for p in prompts) if limit else 0
    if too_long:
        log.warning("%d of %d prompts plus %d new tokens exceed the model's max_position_embeddings=%d: "
                    "their answers test length extrapolation", too_long, len(prompts), max_new_tokens, limit)


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str | Sequence[int], chat_template: bool = False
) -> list[int]:
    """Token ids of a probe prompt; token-id prompts pass through untouched."""
    if not isinstance(prompt, str):
        return list(prompt)
    if chat_template:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        return list(ids)
    return tokenizer(prompt)["input_ids"]


def model_generate_fn(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    max_new_tokens: int,
    batch_size: int,
    chat_template: bool = False,
    progress: bool = True,
    first_line_only: bool = False,
    batch_tokens: int | None = None,
    calibration: AttnCalibration | None = None,
    shared_prefix: bool = False,
) -> GenerateFn:
    """A `generate_fn` for `run_probe` that answers items with `greedy_generate` on `model`; text prompts go
    through the chat template when `chat_template`, token-id prompts (in2) never do. With `calibration` (an
    installed `models.attention.attn_calibration`), each batch is answered with its items' segments calibrated;
    with `shared_prefix`, items in a row that share a long context are answered over one prefill of it."""
    if shared_prefix and calibration is not None:
        raise ValueError("attention calibration answers in batches: it cannot share a prefix cache")

    def generate(items: Sequence[ProbeItem]) -> list[str]:
        if calibration is None:
            prompts = [encode_prompt(tokenizer, it.prompt, chat_template) for it in items]
            return greedy_generate(model, tokenizer, prompts, max_new_tokens, batch_size, progress, first_line_only,
                                   batch_tokens, shared_prefix=shared_prefix)
        encoded = [calibration.encode(it.prompt, it.segments or [], chat_template) if isinstance(it.prompt, str)
                   else (list(it.prompt), []) for it in items]
        prompts, spans = [ids for ids, _ in encoded], [s for _, s in encoded]

        def calibrated(rows: Sequence[int], width: int) -> ContextManager:
            return calibration.batch([prompts[i] for i in rows], [spans[i] for i in rows], width)

        return greedy_generate(model, tokenizer, prompts, max_new_tokens, batch_size, progress, first_line_only,
                               batch_tokens, calibrated)

    return generate
