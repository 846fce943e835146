"""Benchmark: what the teacher-forced answer log-likelihood costs (`analysis.evaluation.loglik`), on a real model.

    python -m scripts.bench loglik       # SmolLM2-135M-Instruct, mdqa with 10 documents; needs $POSDEBIAS_DATA

The same mdqa prompts (10 documents, gold at 0 / 4 / 9, chat template, dev questions of the held-out split), timed
in one process one after another:

- the floor: one bare forward pass over each prompt (`logits_to_keep=1`, no cache), what any measure of p(answer |
  prompt) must pay at least;
- ours: every item's first 3 answer aliases, one prompt pass and the aliases as a batch over its cache;
- the way it was measured before (issue 39's 645 s for 200 items): one full forward over prompt + alias for each
  alias, one at a time;
- the evaluation's greedy answers (100 new tokens, stopped at the first complete line, as the mdqa probe runs);
- both at once as an evaluation asks them (`answers_and_logliks`): one prefill a batch, the aliases scored over it
  and the answers continuing it.

Each ratio is against the floor, except the last two (greedy answers against ours; both at once against the two
apart). A `max_abs_diff` column checks that ours and the per-alias forwards give the same numbers; the last row says
how many answers are those of the two apart and how far its log-likelihoods are from ours.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

QUESTIONS = 8  # each asked at 3 gold positions: 24 prompts of ~1.4K tokens
ALIASES = 3


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_loglik(questions: int = QUESTIONS) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from analysis.evaluation.generate import encode_prompt, greedy_generate
    from analysis.evaluation.loglik import answer_logliks, answers_and_logliks, continuation_ids
    from data_builders.probes import NQ_FILE, mdqa_probe
    from data_builders.question_split import EvaluationPart, QuestionSplit
    from models.wheel_models import ensure_model

    data = os.environ.get("POSDEBIAS_DATA")
    if not data or not (Path(data) / NQ_FILE).is_file():
        raise SystemExit(f"the loglik benchmark reads $POSDEBIAS_DATA/{NQ_FILE} (docs/REFERENCE.md, Real data)")
    folder = ensure_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    items = mdqa_probe(Path(data) / NQ_FILE, n_docs=10, positions=[0, 4, 9], n_examples=questions, closed_book=False,
                       heldout=QuestionSplit(), part=EvaluationPart.dev)
    prompts = [encode_prompt(tokenizer, it.prompt, chat_template=True) for it in items]
    targets = [[continuation_ids(tokenizer, it.prompt, a, True) for a in it.answers[:ALIASES] if a.strip()]
               for it in items]

    @torch.no_grad()
    def bare() -> None:
        for prompt in prompts:
            model(input_ids=torch.tensor([prompt]), use_cache=False, logits_to_keep=1)

    ours: list[list[float]] = []
    per_alias: list[list[float]] = []

    @torch.no_grad()
    def one_forward_per_alias() -> None:
        for prompt, item_targets in zip(prompts, targets):
            values = []
            for target in item_targets:
                logits = model(input_ids=torch.tensor([prompt + target]), use_cache=False).logits[0]  # (L + T, V)
                logp = torch.log_softmax(logits[len(prompt) - 1: -1].float(), dim=-1)  # (T, V)
                values.append(float(logp.gather(-1, torch.tensor(target)[:, None]).sum()))
            per_alias.append(values)

    bare()  # warm-up: the first pass allocates
    t_bare = _seconds(bare)
    t_ours = _seconds(lambda: ours.extend(answer_logliks(model, tokenizer, items, True, ALIASES, progress=False)))
    t_alias = _seconds(one_forward_per_alias)
    answers: list[str] = []
    t_generate = _seconds(lambda: answers.extend(greedy_generate(model, tokenizer, prompts, 100, 16, progress=False,
                                                                 first_line_only=True, batch_tokens=16384)))
    generate, loglik = answers_and_logliks(model, tokenizer, 100, 16, chat_template=True, first_line_only=True,
                                           batch_tokens=16384, n_aliases=ALIASES, progress=False)
    joint_answers: list[str] = []
    joint: list[list[float]] = []
    t_joint = _seconds(lambda: (joint_answers.extend(generate(items)), joint.extend(loglik(items))))
    diff = max(abs(a - b) for xs, ys in zip(ours, per_alias) for a, b in zip(xs, ys))
    joint_diff = max(abs(a - b) for xs, ys in zip(joint, ours) for a, b in zip(xs, ys))
    tokens = sum(map(len, prompts))
    common = {"prompts": len(prompts), "prompt_tokens": tokens, "aliases": sum(map(len, targets)),
              "threads": torch.get_num_threads()}
    return [
        {"name": "answer log-likelihood (3 aliases, one prompt pass) / bare forward over the same prompts",
         "ratio": t_ours / t_bare, "ours_s": t_ours, "bare_s": t_bare, "goal": "<= 1.2", "max_abs_diff": diff,
         **common},
        {"name": "one full forward per alias (before) / bare forward", "ratio": t_alias / t_bare, "before_s": t_alias,
         "bare_s": t_bare, **common},
        {"name": "greedy answers (100 new tokens, first line, batches of 16) / answer log-likelihood",
         "ratio": t_generate / t_ours, "generate_s": t_generate, "ours_s": t_ours, **common},
        {"name": "greedy answers and their log-likelihood from one prefill a batch / the two apart",
         "ratio": t_joint / (t_generate + t_ours), "joint_s": t_joint, "apart_s": t_generate + t_ours,
         "same_answers": f"{sum(a == b for a, b in zip(joint_answers, answers))}/{len(answers)}",
         "max_abs_diff": joint_diff, **common},
    ]
