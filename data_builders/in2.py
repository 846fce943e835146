"""IN2 assembly: answer-bearing segments placed at every depth of a long context (An et al. 2024).

Sources (data_builders.sources) give passages and questions; pools (data_builders.pools) tokenize
every passage once into segments; a sample concatenates segment token ids, so no assembled context
is ever re-tokenized. One sample, as token ids:

    [chat prefix] context question-piece [chat suffix] answer eos      (labels: answer and eos only)
    context = tail of a distractor | whole distractors | GOLD | whole distractors ... | head of a distractor

Depth. Of the C context tokens, F are free (not gold). Each gold segment draws its number of free
tokens before it, p_i, uniformly from {0, ..., F} (in training, `data.in2.depth_law` may choose
another law: `offset_law`), independently of the other golds; its depth is p_i / F. Sorting the
p_i gives the layout, and each gap between golds is filled with whole distractor segments plus
one partial segment (a segment's tail at the start of a gap, a segment's head at the end of the
context), so every gold starts exactly at its drawn position. Depth is thus
uniform at token resolution (1/F) instead of taking one value per slot, and the golds of an
integration sample are placed independently. The cost: a context opens and closes mid-segment,
like an excerpt. `depth` is the depth of the first gold the question names (`gold_spans[0]`);
`depths` holds every gold's, in the order of `gold_spans`. short_qa samples have no free tokens
(the question with its evidence only) and depth 0.

Distractors never come from an evidence passage and never contain a normalized answer (nor a
question's extra `forbid` strings). Same config and seed, same bytes.

This module assembles Arrow tables; data_builders.build turns them into fingerprinted datasets and caches them.
"""
from __future__ import annotations

import collections
import functools
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
import pyarrow as pa
from datasets import Features, List, Value
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from data_builders.config import DataConfig, DepthLaw, config_dict
from data_builders.depth_prior import depth_prior
from data_builders.pools import Pool, build_pool, encode, pool_stats, tokenizer_digest
from data_builders.sources import SourceData, SourceSplit, load_source, normalize
from data_builders.tokenizer import default_cache_dir, encode_pieces, train_bpe_tokenizer

QUESTION_TEMPLATE = "\n\n{instruction}Question: {question}\nAnswer:"
CHAT_QUESTION_TEMPLATE = "\n\n{instruction}Question: {question}"  # the chat template opens the answer turn
SEGMENT_SEPARATOR = "\n"
TASKS = ("fine_grained", "integration", "short_qa")
RECORD_FEATURES = Features(
    {
        "input_ids": List(Value("int32")),  # prompt + answer + eos
        "labels": List(Value("int32")),  # -100 except the answer tokens and eos
        "prompt_len": Value("int32"),  # tokens before the answer
        "gold_spans": List(List(Value("int32"))),  # [start, end) of each gold segment, question order
        "depth": Value("float64"),  # depth of gold_spans[0] in [0, 1]
        "depths": List(Value("float64")),  # depth of every gold segment, same order
        "context_tokens": Value("int32"),  # context tokens only (between chat prefix and question)
        "task": Value("string"),  # fine_grained | integration | short_qa
        "answers": List(Value("string")),
        "source": Value("string"),
        "id": Value("string"),
    }
)
_BLOCK = 1000  # samples per Arrow record batch


@dataclass
class PromptFormat:
    """Token pieces around a context: [prefix] context question [suffix] answer eos."""

    prefix: np.ndarray  # (p,) int32
    suffix: np.ndarray  # (s,) int32
    separator: list[int]
    eos: int
    instruction: Optional[str] = None
    chat: bool = False
    answer_lead: bool = False

    @property
    def eos_ids(self) -> np.ndarray:
        return np.asarray([self.eos], np.int32)

    @property
    def overhead(self) -> int:
        return len(self.prefix) + len(self.suffix) + 1

    def question_text(self, question: str, lead: str = "") -> str:
        template = CHAT_QUESTION_TEMPLATE if self.chat else QUESTION_TEMPLATE
        instruction = f"{self.instruction}\n" if self.instruction else ""
        text = template.format(instruction=instruction, question=question)
        # Cloze-style: the prompt ends with the fact's opening words, so the answer completes them.
        return f"{text} {lead}" if self.answer_lead and lead and not self.chat else text

    def answer_text(self, answer: str) -> str:
        return answer if self.chat else " " + answer


@dataclass(frozen=True, eq=False)  # identity hashing: items key the token cache, hashing fields is slow
class Item:
    """A question ready for assembly."""

    question: str
    answers: tuple[str, ...]
    task: str  # fine_grained | integration
    golds: tuple[int, ...]  # pool segments holding the evidence, in the order the question names them
    exclude: frozenset[int]  # passages no distractor may come from (the evidence passages)
    forbid: tuple[str, ...]  # normalized strings no distractor may contain
    lead: str = ""  # words that open the answer (used with data.in2.answer_lead)


@dataclass
class Plan:
    """One sample before its ids are gathered: pieces of pool units in context order."""

    item: Item
    task: str
    q_ids: np.ndarray  # (q,) int32 question piece
    a_ids: np.ndarray  # (a,) int32 answer piece (without eos)
    segs: list[int]  # pool segment of each piece
    lo: list[int]  # each piece is tokens lo:hi of its unit (segment + separator)
    hi: list[int]
    gold_pieces: list[int]  # piece index of each gold, in question order
    depths: list[float]  # depth of each gold, in question order


def make_format(tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> PromptFormat:
    """Prompt pieces for `tokenizer`; with `cfg.in2.chat_template`, the template's text around the user turn."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; IN2 answers end with one")
    separator = encode_pieces(tokenizer, [SEGMENT_SEPARATOR])[0]
    prefix: list[int] = []
    suffix: list[int] = []
    if cfg.in2.chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("data.in2.chat_template=true, but the tokenizer has no chat template")
        marker = "\ue000USER\ue000"  # a private-use marker no template contains
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
        )
        before, after = text.split(marker)
        prefix, suffix = encode_pieces(tokenizer, [before, after])
    return PromptFormat(
        np.asarray(prefix, np.int32), np.asarray(suffix, np.int32), separator, tokenizer.eos_token_id,
        cfg.in2.instruction, cfg.in2.chat_template, cfg.in2.answer_lead,
    )


def corpus_texts(split: SourceSplit, cfg: DataConfig) -> list[str]:
    """Every string a training sample can contain, for training a tokenizer on the corpus."""
    none = np.zeros(0, np.int32)
    fmt = PromptFormat(none, none, [], 0, cfg.in2.instruction, cfg.in2.chat_template, cfg.in2.answer_lead)
    return list(split.passages) + [fmt.question_text(q.question, q.lead) for q in split.questions]


def resolve(split: SourceSplit, pool: Pool, skipped: dict[str, int]) -> list[Item]:
    """Items of `split`, each evidence passage mapped to its gold segment; unusable questions go to `skipped`.

    A passage that fits one segment is its gold; a longer one gives the segment holding the first answer
    occurrence, unless the question needs whole passages (counted `evidence_longer_than_segment`) or the
    answer was cut by the segmentation (`answer_cut_by_segmentation`).
    """
    norm = functools.lru_cache(maxsize=None)(normalize)  # answers repeat a lot
    items = []
    for q in split.questions:
        answers = tuple(a for a in map(norm, q.answers) if a)
        golds: list[int] = []
        for e in q.evidence:
            segs = pool.segments_of(e)
            if len(segs) == 1:
                golds.append(segs[0])
                continue
            hit = next((s for s in segs if any(a in pool.norm[s] for a in answers)), None)
            if hit is None or q.whole or not q.extractive:
                cut = q.extractive and not q.whole and any(a in normalize(split.passages[e]) for a in answers)
                reason = "answer_cut_by_segmentation" if cut else "evidence_longer_than_segment"
                skipped[reason] = skipped.get(reason, 0) + 1
                break
            golds.append(hit)
        else:
            if q.extractive and not any(a in pool.norm[g] for g in golds for a in answers):
                skipped["answer_cut_by_segmentation"] = skipped.get("answer_cut_by_segmentation", 0) + 1
                continue
            forbid = (answers if q.extractive else ()) + tuple(norm(f) for f in q.forbid)
            items.append(Item(q.question, q.answers, q.task, tuple(golds), frozenset(q.evidence),
                              tuple(f for f in forbid if f), q.lead))
    return items


class _Pieces:
    """Question and answer token ids of items, tokenized in batches on first use.

    A large source has far more questions than a build draws, so only drawn ones are tokenized.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, fmt: PromptFormat):
        self.tokenizer, self.fmt = tokenizer, fmt
        self.cache: dict[Item, tuple[np.ndarray, np.ndarray]] = {}  # item -> (question ids, answer ids)

    def prefetch(self, items: list[Item]) -> None:
        todo = [it for it in dict.fromkeys(items) if it not in self.cache]
        if not todo:
            return
        texts = [self.fmt.question_text(it.question, it.lead) for it in todo]
        texts += [self.fmt.answer_text(it.answers[0]) for it in todo]
        ids = [np.asarray(x, np.int32) for x in encode(self.tokenizer, texts)]
        for k, it in enumerate(todo):
            self.cache[it] = (ids[k], ids[len(todo) + k])

    def __call__(self, item: Item) -> tuple[np.ndarray, np.ndarray]:
        self.prefetch([item])
        return self.cache[item]


class _Distractors:
    """Answer-free distractor segments for one sample; segments repeat only once fresh ones run short."""

    def __init__(self, pool: Pool, item: Item, rng: random.Random):
        self.pool, self.item, self.random = pool, item, rng.random
        self.rejected = 0  # draws in a row that held an answer or came from an evidence passage
        self.stale = 0  # draws in a row that were already used
        self.repeats = False  # set after 100 stale draws in a row: the fresh segments are (nearly) used up
        self.used: set[int] = set()

    def _rejects(self, s: int) -> bool:
        if self.pool.passage[s] in self.item.exclude:
            return True
        text = self.pool.norm[s]
        for f in self.item.forbid:
            if f in text:
                return True
        return False

    def draw(self) -> int:
        n, used = len(self.pool), self.used
        while True:
            s = int(self.random() * n)  # random() is several times faster than randrange()
            if self._rejects(s):
                self.rejected += 1
                if self.rejected > 20 * n + 1000:
                    raise ValueError(
                        f"no distractor segment is free of the answers to {self.item.question!r}: "
                        "the pool is too small"
                    )
                continue
            self.rejected = 0
            if s in used and not self.repeats:
                self.stale += 1
                self.repeats = self.stale >= 100
                continue
            self.stale = 0
            used.add(s)
            return s


def _fill(gap: int, draw: Callable[[], int], unit_len: list[int], plan: Plan, lead: bool) -> None:
    """Append `gap` tokens of distractors to `plan`: whole units and one cut unit.

    The cut unit gives its tail at the start of the gap (`lead`) or its head at the end, so the gap
    closes exactly and the next gold starts at a unit boundary.
    """
    whole, cut = [], None
    while gap > 0:
        s = draw()
        u = unit_len[s]
        if u > gap:
            cut = (s, u - gap, u) if lead else (s, 0, gap)
            break
        whole.append(s)
        gap -= u
    pieces = [(s, 0, unit_len[s]) for s in whole]
    if cut:
        pieces = [cut] + pieces if lead else pieces + [cut]
    for s, lo, hi in pieces:
        plan.segs.append(s)
        plan.lo.append(lo)
        plan.hi.append(hi)


def uniform_offset(free: int, rng: random.Random) -> int:
    """IN2's law: each of the 0..free offsets alike (the held-out split always uses it)."""
    return rng.randint(0, free)


def offset_law(cfg: DataConfig) -> Callable[[int, random.Random], int]:
    """The draw of a training gold's offset among `free` free tokens under `data.in2.depth_law`."""
    law = cfg.in2.depth_law
    if law == DepthLaw.uniform:
        return uniform_offset
    if law == DepthLaw.ends:
        share = cfg.in2.depth_ends

        def ends(free: int, rng: random.Random) -> int:
            p = rng.randint(0, int(share * free))
            return p if rng.random() < 0.5 else free - p

        return ends
    if law == DepthLaw.valley:
        return valley_offset(cfg.in2.prior_layers, cfg.in2.prior_alpha, cfg.in2.prior_power)
    a, b = cfg.in2.depth_beta

    def beta(free: int, rng: random.Random) -> int:
        return round(rng.betavariate(a, b) * free)

    return beta


def valley_offset(layers: int, alpha: float, power: float) -> Callable[[int, random.Random], int]:
    """Offsets p in {0..free} drawn with probability ∝ depth_prior(p / free)^(-power) (one `rng.random()`)."""
    cumulative: dict[int, list[float]] = {}

    def valley(free: int, rng: random.Random) -> int:
        if free not in cumulative:
            depths = np.arange(free + 1) / max(free, 1)
            cumulative[free] = np.cumsum(depth_prior(depths, layers, alpha) ** -power).tolist()
        return rng.choices(range(free + 1), cum_weights=cumulative[free])[0]

    return valley


def plan_sample(
    item: Item, pieces: tuple[np.ndarray, np.ndarray], task: str, budget: int, fmt: PromptFormat, pool: Pool,
    rng: random.Random, offset: Callable[[int, random.Random], int] = uniform_offset,
) -> Optional[Plan]:
    """Layout of one sample with a token `budget`; None when the question and golds alone exceed it."""
    unit_len = pool.unit_len
    gold_units = [unit_len[g] for g in item.golds]
    k = len(gold_units)
    plan = Plan(item, task, pieces[0], pieces[1], [], [], [], [0] * k, [0.0] * k)
    if task == "short_qa":
        free, p = 0, [0] * k
        order = rng.sample(range(k), k)
    else:
        free = budget - fmt.overhead - len(plan.q_ids) - len(plan.a_ids) - sum(gold_units)
        if free < 0:
            return None
        p = [offset(free, rng) for _ in range(k)]
        order = sorted(range(k), key=lambda i: (p[i], i))
    draw = _Distractors(pool, item, rng).draw
    cursor = 0
    for i in order:
        _fill(p[i] - cursor, draw, unit_len, plan, lead=True)
        plan.gold_pieces[i] = len(plan.segs)
        plan.segs.append(item.golds[i])
        plan.lo.append(0)
        plan.hi.append(gold_units[i])
        cursor = p[i]
    _fill(free - cursor, draw, unit_len, plan, lead=False)
    plan.depths = [p[i] / free if free else 0.0 for i in range(k)]
    return plan


def materialize(plan: Plan, pool: Pool, fmt: PromptFormat) -> tuple[np.ndarray, int, list[list[int]], int]:
    """(input_ids, prompt_len, gold_spans, context_tokens) of a plan: slices of the unit array, concatenated."""
    units, start = pool.units, pool.start_list
    parts = [fmt.prefix]
    where = []  # context position of each piece
    pos = 0
    for s, lo, hi in zip(plan.segs, plan.lo, plan.hi):
        parts.append(units[start[s] + lo : start[s] + hi])
        where.append(pos)
        pos += hi - lo
    parts += [plan.q_ids, fmt.suffix, plan.a_ids, fmt.eos_ids]
    ids = np.concatenate(parts)  # (L,) int32
    head = len(fmt.prefix)
    spans = [[head + where[j], head + where[j] + pool.seg_len_list[plan.segs[j]]] for j in plan.gold_pieces]
    return ids, len(ids) - len(plan.a_ids) - 1, spans, pos


def task_counts(shares: dict[str, float], n: int) -> dict[str, int]:
    """Samples per task: `n` split by `shares` with largest remainders (exact and deterministic)."""
    total = sum(shares.values())
    raw = {t: n * shares.get(t, 0.0) / total for t in TASKS}
    counts = {t: int(v) for t, v in raw.items()}
    for t in sorted(TASKS, key=lambda t: counts[t] - raw[t])[: n - sum(counts.values())]:
        counts[t] += 1
    return counts


def _budget(cfg: DataConfig, rng: random.Random, ramp: float = 1.0, template_len: int = 0) -> int:
    """A sample's token budget: from `in2.context_lens`, uniform in [in2.context_len_min, context_len], or fixed.

    `ramp` in (0, 1] shrinks the range's upper end to context_len_min + ramp² (context_len - context_len_min):
    squared, so that short contexts fill most of the ramp's first half (a random-init model learns to
    copy on them; the longer ones then teach it to find the right fact among distractors).
    `template_len`: the chat template's fixed tokens, which the range's lower end counts from (the shortest
    contexts keep their room under a template: SmolLM2's takes 30); context_len stays the hard cap.
    """
    lens, low = cfg.in2.context_lens, cfg.in2.context_len_min
    if lens:
        return rng.choice(lens)
    if low is not None:
        low = min(low + template_len, cfg.context_len)
        return rng.randint(low, round(low + ramp**2 * (cfg.context_len - low)))
    return cfg.context_len


def iter_plans(
    pool: Pool, items: list[Item], n: int, cfg: DataConfig, fmt: PromptFormat, pieces: _Pieces,
    shares: dict[str, float], seed: int, skipped: dict[str, int], ramp_samples: int = 0,
    offset: Callable[[int, random.Random], int] = uniform_offset, law_ramp_samples: int = 0,
) -> Iterator[Plan]:
    """`n` plans, tasks mixed by `shares`; a question too long for its sample's budget is redrawn, counted.

    Over the first `ramp_samples` plans the budgets' upper end ramps up (the curriculum, see `_budget`);
    `offset` draws where each gold starts (`offset_law`); over the first `law_ramp_samples` plans it
    ramps in from uniform (plan i follows it with probability min(1, (i + 1) / law_ramp_samples)).
    """
    rng = random.Random(seed)
    counts = task_counts(shares, n)
    choices = {
        "fine_grained": [it for it in items if it.task == "fine_grained"],
        "integration": [it for it in items if it.task == "integration"],
        "short_qa": items,
    }
    for t, c in counts.items():
        if c and not choices[t]:
            raise ValueError(f"data.in2.tasks.{t} > 0, but the source gives no usable {t} questions")
    tasks = [t for t in TASKS for _ in range(counts[t])]
    rng.shuffle(tasks)

    def ramp(i: int) -> float:
        return min(1.0, (i + 1) / ramp_samples) if ramp_samples else 1.0

    for start in range(0, n, _BLOCK):
        block = [(t, rng.choice(choices[t]), _budget(cfg, rng, ramp(i), len(fmt.prefix) + len(fmt.suffix)))
                 for i, t in enumerate(tasks[start : start + _BLOCK], start)]
        pieces.prefetch([item for _, item, _ in block])
        for i, (task, item, budget) in enumerate(block, start):
            law = offset
            if law_ramp_samples and rng.random() >= min(1.0, (i + 1) / law_ramp_samples):
                law = uniform_offset
            for _ in range(100):
                plan = plan_sample(item, pieces(item), task, budget, fmt, pool, rng, law)
                if plan is not None:
                    break
                skipped["question_too_long_for_context"] = skipped.get("question_too_long_for_context", 0) + 1
                item = rng.choice(choices[task])
            else:
                raise ValueError(f"100 {task} questions in a row do not fit a budget of {budget} tokens")
            yield plan


def _list_array(arrays: list[np.ndarray], dtype) -> pa.Array:
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    values = np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(offsets, pa.array(values))


def _record_batch(rows: dict[str, list]) -> pa.RecordBatch:
    schema = RECORD_FEATURES.arrow_schema
    columns = []
    for name in schema.names:
        if name in ("input_ids", "labels"):
            columns.append(_list_array(rows[name], np.int32))
        else:
            columns.append(pa.array(rows[name], type=schema.field(name).type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def assemble(
    pool: Pool, items: list[Item], n: int, cfg: DataConfig, fmt: PromptFormat, pieces: _Pieces,
    shares: dict[str, float], seed: int, split: str, skipped: dict[str, int], ramp_samples: int = 0,
    offset: Callable[[int, random.Random], int] = uniform_offset, law_ramp_samples: int = 0,
) -> pa.Table:
    """`n` records (RECORD_FEATURES) as an Arrow table; the ramps and `offset` as in `iter_plans`."""
    batches, rows = [], {name: [] for name in RECORD_FEATURES}
    bar = tqdm(total=n, desc=f"assemble {split}", unit="sample", disable=None)
    plans = iter_plans(pool, items, n, cfg, fmt, pieces, shares, seed, skipped, ramp_samples, offset, law_ramp_samples)
    for k, plan in enumerate(plans):
        ids, prompt_len, spans, context_tokens = materialize(plan, pool, fmt)
        labels = ids.copy()
        labels[:prompt_len] = -100
        record = {
            "input_ids": ids, "labels": labels, "prompt_len": prompt_len, "gold_spans": spans,
            "depth": plan.depths[0], "depths": plan.depths, "context_tokens": context_tokens, "task": plan.task,
            "answers": list(plan.item.answers), "source": cfg.source, "id": f"{split}-{k}",
        }
        for name, value in record.items():
            rows[name].append(value)
        if len(rows["id"]) == _BLOCK or k == n - 1:
            batches.append(_record_batch(rows))
            bar.update(len(rows["id"]))
            rows = {name: [] for name in RECORD_FEATURES}
    bar.close()
    return pa.Table.from_batches(batches, schema=RECORD_FEATURES.arrow_schema)


def heldout_documents(pool: Pool, doc_len: int) -> list[list[int]]:
    """Long held-out documents: consecutive units (segment + separator) joined up to `doc_len` tokens."""
    docs, start = [], 0
    for end in pool.offsets[1:].tolist():
        if end - start >= doc_len:
            docs.append(pool.units[start : start + doc_len].tolist())
            start = end
    return docs


def _counts_of(values: Iterable[str]) -> dict[str, int]:
    return dict(sorted(collections.Counter(values).items()))


@dataclass
class Prepared:
    """Everything assembly needs, per split ("train", "eval"): pools, items, shares, seeds."""

    cfg: DataConfig
    source: SourceData
    tokenizer: PreTrainedTokenizerBase
    fmt: PromptFormat
    pools: dict[str, Pool]
    items: dict[str, list[Item]]
    pieces: _Pieces
    shares: dict[str, dict[str, float]]
    seeds: dict[str, int]
    skipped: dict[str, dict[str, int]]

    def ramp_samples(self, split: str, n: int) -> int:
        """Samples over which budgets ramp up: the curriculum's share of the training split."""
        return round(self.cfg.in2.curriculum * n) if split == "train" else 0

    def law_ramp_samples(self, split: str, n: int) -> int:
        """Samples over which the training depth law ramps in from uniform (`data.in2.depth_ramp`)."""
        return round(self.cfg.in2.depth_ramp * n) if split == "train" else 0

    def offset(self, split: str) -> Callable[[int, random.Random], int]:
        """Where golds go: `data.in2.depth_law` in training, uniform in the held-out split."""
        return offset_law(self.cfg) if split == "train" else uniform_offset

    def assemble(self, split: str, n: int) -> pa.Table:
        return assemble(self.pools[split], self.items[split], n, self.cfg, self.fmt, self.pieces,
                        self.shares[split], self.seeds[split], split, self.skipped[split],
                        self.ramp_samples(split, n), self.offset(split), self.law_ramp_samples(split, n))

    def plans(self, split: str, n: int) -> Iterator[Plan]:
        return iter_plans(self.pools[split], self.items[split], n, self.cfg, self.fmt, self.pieces,
                          self.shares[split], self.seeds[split], self.skipped[split], self.ramp_samples(split, n),
                          self.offset(split), self.law_ramp_samples(split, n))


def prepare(cfg: DataConfig, tokenizer: Optional[PreTrainedTokenizerBase] = None) -> Prepared:
    """Load the source, train a BPE when no tokenizer is given, build the pools and resolve the questions."""
    cache_root = default_cache_dir()
    data = load_source(cfg, cache_root / "hf", with_integration=cfg.in2.tasks.integration > 0)
    if tokenizer is None:
        tokenizer = train_bpe_tokenizer(corpus_texts(data.train, cfg), cfg.vocab_size)
    if not tokenizer.is_fast:
        raise ValueError("IN2 pools need a fast tokenizer (character offsets to cut at sentence ends)")
    fmt = make_format(tokenizer, cfg)
    pools = {
        split: build_pool(part.passages, tokenizer, cfg.in2.segment_len, fmt.separator,
                          cache_root if cfg.cache else None, cfg.num_proc, desc=f"segment {split} passages")
        for split, part in (("train", data.train), ("eval", data.heldout))
    }
    if len(pools["train"]) < 2 or len(pools["eval"]) < 2:
        raise ValueError(f"the {cfg.source} source gives too few passages for a training and a held-out pool")
    skipped: dict[str, dict[str, int]] = {"train": {}, "eval": {}}
    items = {
        "train": resolve(data.train, pools["train"], skipped["train"]),
        "eval": resolve(data.heldout, pools["eval"], skipped["eval"]),
    }
    shares = vars(cfg.in2.tasks)
    # Held-out samples score accuracy by depth, which short_qa (no distractors, depth 0) does not have.
    eval_shares = {**shares, "short_qa": 0.0} if sum(shares.values()) > shares["short_qa"] else shares
    return Prepared(
        cfg, data, tokenizer, fmt, pools, items, _Pieces(tokenizer, fmt),
        {"train": shares, "eval": eval_shares}, {"train": cfg.seed, "eval": cfg.seed + 1}, skipped,
    )


def depth_histogram(depths: np.ndarray, bins: int = 10) -> list[int]:
    """Samples per equal-width depth bin (depth 1 in the last), for the dataset card."""
    return np.bincount(np.clip((depths * bins).astype(int), 0, bins - 1), minlength=bins).tolist()


def build_in2(
    cfg: DataConfig, tokenizer: Optional[PreTrainedTokenizerBase] = None
) -> tuple[dict[str, pa.Table], list[list[int]], PreTrainedTokenizerBase, dict[str, Any]]:
    """Train and held-out records (RECORD_FEATURES), long held-out documents, the tokenizer, build stats.

    Without a tokenizer, a BPE is trained on the training corpus. The stats are the dataset card's counts.
    """
    prep = prepare(cfg, tokenizer)
    tables = {"train": prep.assemble("train", cfg.num_train), "eval": prep.assemble("eval", cfg.num_eval)}
    stats = {
        "source": prep.source.name,
        "attribution": prep.source.attribution,
        "config": config_dict(cfg),
        "tokenizer": tokenizer_digest(prep.tokenizer),
        "skipped": {"source": prep.source.skipped, **prep.skipped},
        "questions": {s: _counts_of(it.task for it in its) for s, its in prep.items.items()},
        "tasks": {s: _counts_of(t.column("task").to_pylist()) for s, t in tables.items()},
        # where the golds went (data.in2.depth_law in training): samples per tenth of the depth range
        "depth_histogram": {s: depth_histogram(t.column("depth").to_numpy()) for s, t in tables.items()},
        "pool": {s: pool_stats(p) for s, p in prep.pools.items()},
    }
    if prep.source.split is not None:  # which questions are held out, and how to check it (nq)
        stats["split"] = prep.source.split
    heldout = heldout_documents(prep.pools["eval"], cfg.in2.heldout_doc_len)
    return tables, heldout, prep.tokenizer, stats
