"""Teacher-forced answer log-likelihood: log p(gold answer | prompt), a measure of position that no answer format
can move.

Accuracy scores what a model writes; a fine-tune that teaches short answers changes it at every position at
once, and `best_subspan_em` credits a long sentence copied from the last document. log p(answer | prompt with
the gold at k), summed over the answer's tokens, asks instead how much the document at k raised the answer,
whatever the model would have written; its closed-book value is what the model knew without documents. The
contrast middle minus strong end, in nats and paired by question, is the debiasing effect a fine-tune should
move (docs/REAL_MODEL.md).

Cost: one prompt pass per item (`logits_to_keep=1`: no full-vocabulary logits over the prompt), then every alias
of the answer as one batch over the prompt's cache. The aliases share the prompt pass, so the measure costs
about one bare forward pass over the prompts. Asked together with greedy answers (`answers_and_logliks`), it
shares their prefill too: each batch of prompts is prefilled once, the aliases are scored over that cache and the
answers continue it.

An answer is tokenized as the model would continue the prompt: after a chat template's assistant header
directly, after a text prompt ending in a non-space character (`Answer:`, `value:`) with one space before it.
IN2 items carry the answer tokens they were trained on (`ProbeItem.targets`), which are used as they are.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from analysis.evaluation.generate import GenerateFn, encode_prompt, greedy_generate, prefix_caches
from data_builders.probes import ProbeItem
from models.attention.patching import installed_interventions
from models.build import at_least_fp32

N_ALIASES = 3  # the first aliases of an answer scored; an item's value is the best of them
LOGLIK_DEFINITION = ("log p(answer | prompt) in nats, summed over the answer's tokens, teacher-forced, the best of the "
                     "first aliases (analysis.evaluation.loglik)")

LoglikFn = Callable[[Sequence[ProbeItem]], list[list[float]]]


def continuation_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, answer: str, chat_template: bool) -> list[int]:
    """Token ids of `answer` as a continuation of `prompt` (see the module docstring)."""
    lead = "" if chat_template or not prompt or prompt[-1].isspace() else " "
    return list(tokenizer(lead + answer.strip(), add_special_tokens=False)["input_ids"])


def answer_targets(item: ProbeItem, tokenizer: PreTrainedTokenizerBase, chat_template: bool,
                   n_aliases: int = N_ALIASES) -> list[list[int]]:
    """The token ids of the item's first `n_aliases` answers as continuations of its prompt (module docstring)."""
    if item.targets is not None:
        return [list(t) for t in item.targets[:n_aliases]]
    if not isinstance(item.prompt, str):
        raise ValueError(f"item {item.id}: a token-id prompt needs its answer tokens (ProbeItem.targets)")
    return [continuation_ids(tokenizer, item.prompt, a, chat_template) for a in item.answers[:n_aliases]
            if a.strip()]


@torch.no_grad()
def sequence_logprobs(model: PreTrainedModel, prompt: Sequence[int], targets: Sequence[Sequence[int]],
                      cache: Any = None, cached: int = 0) -> list[float]:
    """log p(target | prompt) summed over each target's tokens: one pass over the prompt, then every target
    as one right-padded batch over its cache (a causal model's padding after a sequence cannot reach it).
    `cache`: the KV cache of the prompt's first `cached` tokens, which the pass then continues (it is extended)."""
    out = model(input_ids=torch.tensor([list(prompt[cached:])], device=model.device), cache=cache, use_cache=True,
                logits_to_keep=1)
    return continuation_logprobs(model, out.logits[0, -1], out.cache, targets)


@torch.no_grad()
def continuation_logprobs(model: PreTrainedModel, last_logits: torch.Tensor, cache: Any,
                          targets: Sequence[Sequence[int]]) -> list[float]:
    """log p(target | prompt) of each target from the prompt's last logits (V,), which predict every target's first
    token, and the prompt's KV cache, over which the rest is one right-padded batch (the cache is extended)."""
    device = model.device
    first = torch.log_softmax(at_least_fp32(last_logits), dim=-1)  # (V,)
    scores = [float(first[t[0]]) if len(t) else math.nan for t in targets]
    longer = [i for i, t in enumerate(targets) if len(t) > 1]
    if not longer:
        return scores
    width = max(len(targets[i]) for i in longer)
    ids = torch.zeros((len(longer), width), dtype=torch.long)
    for row, i in enumerate(longer):
        ids[row, : len(targets[i])] = torch.tensor(list(targets[i]))
    cache.batch_repeat_interleave(len(longer))
    rest = model(input_ids=ids[:, :-1].to(device), cache=cache, use_cache=True).logits  # (A, T-1, V)
    logp = torch.log_softmax(at_least_fp32(rest), dim=-1).gather(-1, ids[:, 1:, None].to(device))[..., 0]  # (A, T-1)
    for row, i in enumerate(longer):
        scores[i] += float(logp[row, : len(targets[i]) - 1].sum())
    return scores


def shares_prefill(model: PreTrainedModel) -> bool:
    """Whether `answers_and_logliks` may give `model`'s answers and log-likelihoods from one prefill: not with an
    installed attention intervention (Ms-PoE orders its heads on the first forward's last query; calibration
    installs segments a batch), nor when the model's generation config asks generate for a cache of its own kind
    (static, hybrid), which refuses the one passed to it."""
    return (not installed_interventions(model.modules())
            and getattr(model.generation_config, "cache_implementation", None) is None)


@torch.no_grad()
def prefill_and_score(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor,
                      targets: Sequence[Sequence[Sequence[int]]]) -> tuple[Any, list[list[float]]]:
    """A batch of left-padded prompts (ids, mask: (B, L)) prefilled over its first L - 1 columns, and
    log p(target | prompt) of every row's targets (`targets[row]`) scored over that cache: the cache (of L - 1
    columns again, the targets cropped off) and the scores, row by row, as `sequence_logprobs` gives them up to
    float rounding. The alias j of every row is one pass: the row's last prompt token and the alias's tokens but
    its last, right-padded (padding after a row's tokens cannot reach them); only the target tokens' positions are
    normalized over the vocabulary."""
    device = model.device
    lengths = mask.sum(dim=-1)  # (B,) each row's prompt length
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)  # left padding: a row's first token at position 0
    # A cache of full layers: a sliding-window layer keeps only its window and cannot crop the targets off again;
    # the window is in the attention mask either way.
    cache = DynamicCache()
    if ids.shape[1] > 1:
        model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1], cache=cache,
              use_cache=True, logits_to_keep=1)
    scores = [[math.nan] * len(row) for row in targets]
    for j in range(max((len(row) for row in targets), default=0)):
        tokens = [list(row[j]) if j < len(row) else [] for row in targets]
        width = max(1, max(len(t) for t in tokens))  # the last prompt token and all but the alias's last token
        new = torch.zeros((len(targets), width), dtype=torch.long)
        new_mask = torch.zeros_like(new)
        new[:, 0], new_mask[:, 0] = ids[:, -1].cpu(), 1
        for r, t in enumerate(tokens):
            new[r, 1: len(t)] = torch.tensor(t[:-1], dtype=torch.long)
            new_mask[r, 1: len(t)] = 1
        logits = model(input_ids=new.to(device), attention_mask=torch.cat([mask[:, :-1], new_mask.to(device)], dim=1),
                       position_ids=(lengths - 1)[:, None] + torch.arange(width, device=device), cache=cache,
                       use_cache=True).logits  # (B, width, V)
        cache.crop(-width)  # a negative count removes that many of the newest tokens
        rows = [r for r, t in enumerate(tokens) if t]
        if not rows:
            continue
        row_of = torch.tensor([r for r in rows for _ in tokens[r]], device=device)
        column = torch.tensor([c for r in rows for c in range(len(tokens[r]))], device=device)
        wanted = torch.tensor([tok for r in rows for tok in tokens[r]], device=device)
        picked = at_least_fp32(logits[row_of, column])  # (N, V): the target tokens' positions only
        logp = picked.gather(-1, wanted[:, None])[:, 0] - torch.logsumexp(picked, dim=-1)  # (N,)
        sums = torch.zeros(len(targets), dtype=logp.dtype, device=device).index_add_(0, row_of, logp)
        for r, value in zip(rows, sums[rows].tolist()):
            scores[r][j] = value
    return cache, scores


def answers_and_logliks(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int, batch_size: int,
    chat_template: bool = False, first_line_only: bool = False, batch_tokens: int | None = None,
    n_aliases: int = N_ALIASES, progress: bool = True,
) -> tuple[GenerateFn, LoglikFn]:
    """A `generate_fn` and a `loglik_fn` for `run_probe` that share each prompt's prefill: the greedy answers of
    `greedy_generate` (the same batches), whose prefill `prefill_and_score` also scores the aliases on. `run_probe`
    asks a chunk's answers, then its log-likelihoods, which the answers' pass computed; items the answers did not
    come before, or whose prefill did not score them, are scored on their own (`answer_logliks`). The same values
    as the two passes apart up to float rounding, for the cost of one prompt pass instead of two. Only for a model
    that `shares_prefill`."""
    if not shares_prefill(model):
        raise ValueError("answers_and_logliks: this model's answers cannot continue a prefill of their own (an "
                         "installed attention intervention or a generation config's cache_implementation)")
    scored: dict[str, Any] = {}

    def generate(items: Sequence[ProbeItem]) -> list[str]:
        prompts = [encode_prompt(tokenizer, it.prompt, chat_template) for it in items]
        targets = [answer_targets(it, tokenizer, chat_template, n_aliases) for it in items]
        values: list[list[float] | None] = [None] * len(items)

        def prefill(rows: Sequence[int], ids: torch.Tensor, mask: torch.Tensor) -> Any:
            cache, scores = prefill_and_score(model, ids, mask, [targets[i] for i in rows])
            for i, row_scores in zip(rows, scores):
                values[i] = row_scores
            return cache

        texts = greedy_generate(model, tokenizer, prompts, max_new_tokens, batch_size, progress, first_line_only,
                                batch_tokens, prefill=prefill)
        scored.update(items=list(items), values=values)
        return texts

    def loglik(items: Sequence[ProbeItem]) -> list[list[float]]:
        same = scored and len(items) == len(scored["items"]) and all(a is b for a, b in zip(items, scored["items"]))
        values = scored.pop("values") if same else [None] * len(items)
        scored.clear()
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
            for i, v in zip(missing, answer_logliks(model, tokenizer, [items[i] for i in missing], chat_template,
                                                    n_aliases, progress)):
                values[i] = v
        return values

    return generate, loglik


def answer_logliks(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, items: Sequence[ProbeItem], chat_template: bool = False,
    n_aliases: int = N_ALIASES, progress: bool = True, shared_prefix: bool = False,
) -> list[list[float]]:
    """log p(alias | prompt) of the first `n_aliases` aliases of every item (nats, summed over the alias's
    tokens), in item order. With `shared_prefix`, items in a row that share a long context continue one prefill
    of it (`analysis.evaluation.generate.prefix_caches`). The model is put in eval mode and its previous mode
    restored."""
    was_training = model.training
    model.eval()
    try:
        if shared_prefix:
            prompts = [encode_prompt(tokenizer, it.prompt, chat_template) for it in items]
            return [sequence_logprobs(model, prompts[i], answer_targets(items[i], tokenizer, chat_template, n_aliases),
                                      cache, cached)
                    for i, cached, cache in prefix_caches(model, prompts, progress, "log-likelihood (shared prefix)")]
        return [sequence_logprobs(model, encode_prompt(tokenizer, it.prompt, chat_template),
                                  answer_targets(it, tokenizer, chat_template, n_aliases))
                for it in tqdm(items, desc="log-likelihood", disable=not progress)]
    finally:
        model.train(was_training)


def model_loglik_fn(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, chat_template: bool = False,
                    n_aliases: int = N_ALIASES, progress: bool = True, shared_prefix: bool = False) -> LoglikFn:
    """A `loglik_fn` for `run_probe`: `answer_logliks` on `model`."""
    return lambda items: answer_logliks(model, tokenizer, items, chat_template, n_aliases, progress, shared_prefix)


def best(logliks: Sequence[float]) -> float:
    """An item's value: the best of its aliases (nan without any finite one)."""
    finite = [v for v in logliks if math.isfinite(v)]
    return max(finite) if finite else math.nan
