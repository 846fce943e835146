"""Batching: a seeded, resumable, rank-sharded stream of padded or packed micro-batches.

Padded: each micro-batch is B samples right-padded to the longest (`attention_mask` marks the real
tokens). Packed (`data.packing`): each micro-batch is B rows of `pack_len` tokens, each row several
samples end to end with `position_ids` restarting at 0 per sample and no `attention_mask`, from
which transformers builds a block-diagonal causal mask (sdpa, eager, flex) or the sequence
boundaries (flash_attention_2): no token attends across samples, and no compute goes to padding
beyond each row's tail. Either way `num_tokens` counts the real tokens (it is not a model input).
With `depths` (the per-sample objectives of models.training.objectives) a batch also carries `depths` (S,), each
sample's gold depth, and `sample_ids` (B, L), the sample each token belongs to (-1: padding). With `teacher`
(debias=pos2distill, padded batches only) it also carries each sample's teacher sequence, padded as the samples
are: `teacher_input_ids`, `teacher_labels`, `teacher_attention_mask` (B, Lt), and `gold_slots` (B,); with a
teacher slot chosen per sample (debias=pos2distill_best) also `teacher_slots` (B,).
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from data_builders.distill_data import TEACHER_SLOT  # a split may hold each sample's own teacher slot
from data_builders.needle_mix import check_mix_rows

TEACHER_COLUMNS = ("teacher_input_ids", "teacher_labels", "gold_slot")  # what a batch's teacher part is made of


def _padded(sequences: Sequence[Sequence[int]], labels: Sequence[Sequence[int]], pad_id: int, multiple: int = 1
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, labels, attention_mask), each (B, L): right-padded with `pad_id`, -100 and 0 to the longest,
    rounded up to a multiple of `multiple`."""
    width = -(-max(len(ids) for ids in sequences) // multiple) * multiple
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)  # (B, L)
    padded_labels = torch.full((len(sequences), width), -100, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)  # (B, L)
    for i, (ids, lab) in enumerate(zip(sequences, labels)):
        n = len(ids)
        input_ids[i, :n] = torch.as_tensor(ids)
        padded_labels[i, :n] = torch.as_tensor(lab)
        attention_mask[i, :n] = 1
    return input_ids, padded_labels, attention_mask


def collate(rows: Sequence[dict[str, Any]], pad_id: int, depths: bool = False, teacher: bool = False,
            pad_to_multiple_of: int = 1, mixed: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad `input_ids` (with `pad_id`) and `labels` (with -100) to the longest row, rounded up to a multiple
    of `pad_to_multiple_of`; with `teacher` the rows' `teacher_input_ids` and `teacher_labels` too, to their own
    longest. `mixed`: the last rows are debias.needle_mix's, not the task's; with `depths` the batch then says which
    (`mixed`, (S,) bool), so that what is read per gold slot of the task (the watch's training loss) skips them."""
    input_ids, labels, attention_mask = _padded([r["input_ids"] for r in rows],
                                                [r.get("labels", r["input_ids"]) for r in rows], pad_id,
                                                pad_to_multiple_of)
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask,
             "num_tokens": attention_mask.sum()}
    if depths:  # one sample per row
        batch["sample_ids"] = torch.where(attention_mask.bool(), torch.arange(len(rows))[:, None], -1)
        batch["depths"] = torch.tensor([r["depth"] for r in rows], dtype=torch.float64)
        if mixed:
            batch["mixed"] = torch.arange(len(rows)) >= len(rows) - mixed
    if teacher:
        ids, lab, mask = _padded([r["teacher_input_ids"] for r in rows], [r["teacher_labels"] for r in rows], pad_id,
                                 pad_to_multiple_of)
        batch |= {"teacher_input_ids": ids, "teacher_labels": lab, "teacher_attention_mask": mask,
                  "gold_slots": torch.tensor([r["gold_slot"] for r in rows], dtype=torch.long)}
        if TEACHER_SLOT in rows[0]:  # chosen per sample (debias=pos2distill_best)
            batch["teacher_slots"] = torch.tensor([r[TEACHER_SLOT] for r in rows], dtype=torch.long)
    return batch


def collate_packed(packs: Sequence[Sequence[dict[str, Any]]], pack_len: int, pad_id: int, depths: bool = False
                   ) -> dict[str, torch.Tensor]:
    """One row of `pack_len` tokens per pack: its samples end to end, then padding (-100 labels).

    `position_ids` count from 0 in every sample and in the padding tail, which is thereby a segment
    of its own (attended only by itself, never labelled).
    """
    input_ids = torch.full((len(packs), pack_len), pad_id, dtype=torch.long)  # (R, P)
    labels = torch.full((len(packs), pack_len), -100, dtype=torch.long)  # (R, P)
    position_ids = torch.zeros((len(packs), pack_len), dtype=torch.long)  # (R, P)
    sample_ids = torch.full((len(packs), pack_len), -1, dtype=torch.long)  # (R, P)
    real, n_samples = 0, 0
    for i, pack in enumerate(packs):
        start = 0
        for r in pack:
            n = len(r["input_ids"])
            input_ids[i, start:start + n] = torch.as_tensor(r["input_ids"])
            labels[i, start:start + n] = torch.as_tensor(r.get("labels", r["input_ids"]))
            position_ids[i, start:start + n] = torch.arange(n)
            sample_ids[i, start:start + n] = n_samples
            start, n_samples = start + n, n_samples + 1
        if start > pack_len:
            raise ValueError(f"a pack of {start} tokens exceeds pack_len={pack_len}")
        position_ids[i, start:] = torch.arange(pack_len - start)
        real += start
    batch = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "num_tokens": torch.tensor(real)}
    if depths:
        batch["sample_ids"] = sample_ids
        batch["depths"] = torch.tensor([r["depth"] for pack in packs for r in pack], dtype=torch.float64)
    return batch


def pack_in_order(lengths: Sequence[int], order: Sequence[int], pack_len: int) -> list[list[int]]:
    """Sample indices per pack: `order` read in turn, a pack closed when the next sample does not fit.

    Reading in order (no best-fit search) keeps a curriculum's order and makes the packs a function
    of the order alone, which is what an exact resume needs.
    """
    packs: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        n = lengths[i]
        if n > pack_len:
            raise ValueError(f"sample {i} has {n} tokens, more than data.pack_len={pack_len}")
        if used + n > pack_len:
            packs.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        packs.append(current)
    return packs


class BatchStream:
    """Endless micro-batches over epochs; each epoch is a permutation seeded by (seed, epoch).

    The permutation is read as units: single samples (padded batches), or packs of samples that fill
    `pack_len` tokens (`pack_in_order`; packed batches). Global micro-batch g is the slice
    [g*B*w, (g+1)*B*w) of an epoch's units (B = micro-batch size, w = world size) and rank r takes its
    r-th block of B units. So ranks see distinct shards, and w ranks with accumulation a see exactly
    the units, in the same micro-batch blocks, that one process sees with accumulation a*w. Units
    left over at the end of an epoch are skipped. `position` counts micro-batches drawn by this rank;
    restoring it continues the exact same order after a resume. With `ordered_first_epoch` epoch 0
    reads the dataset in stored order (a curriculum's short-first order), later epochs shuffle.
    `depths`: batches carry each sample's gold depth, `teacher` its teacher sequence (see `collate`). `mix`,
    `mix_rows` (padded batches only): the last `mix_rows` rows of every micro-batch are rows of `mix` instead
    (debias.needle_mix), read in turn by global micro-batch, so a resume continues them exactly too.
    `pad_to_multiple_of` (padded batches): each batch's width rounded up to a multiple (`collate`).
    """

    def __init__(
        self,
        dataset,
        micro_batch_size: int,
        pad_id: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        label_context: bool = False,
        ordered_first_epoch: bool = False,
        pack_len: int | None = None,
        depths: bool = False,
        mix: Sequence[dict[str, Any]] = (),
        mix_rows: int = 0,
        teacher: bool = False,
        pad_to_multiple_of: int = 1,
    ):
        self.dataset, self.micro_batch_size, self.pad_id = dataset, micro_batch_size, pad_id
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.label_context, self.ordered_first_epoch, self.pack_len = label_context, ordered_first_epoch, pack_len
        self.depths, self.mix, self.mix_rows = depths, mix, mix_rows if mix else 0
        self.teacher, self.pad_to_multiple_of = teacher, pad_to_multiple_of
        if self.mix_rows:
            check_mix_rows(self.mix_rows, micro_batch_size, bool(pack_len))
        if teacher and (pack_len or self.mix_rows):
            raise ValueError("teacher sequences (debias=pos2distill) are batched padded, without mixed rows")
        # A datasets.Dataset: one column view, made once (building it per batch costs more than the read).
        columns = ["input_ids", "labels"] + (["depth"] if depths else []) + (list(TEACHER_COLUMNS) if teacher else [])
        if teacher and TEACHER_SLOT in getattr(dataset, "column_names", ()):
            columns.append(TEACHER_SLOT)
        self._columns = dataset.select_columns(columns) if hasattr(dataset, "column_names") else None
        self._lengths = self._sample_lengths() if pack_len else None
        self._epochs: dict[int, list[list[int]]] = {}  # epoch -> its units, for the epoch in use
        self._counts: dict[int, int] = {}  # epoch -> micro-batches per rank (packing: they vary by epoch)
        self.position = 0
        if self.per_epoch(0) < 1:
            packs = f" ({len(self._units(0))} packs of {pack_len} tokens)" if pack_len else ""
            what = f"{len(dataset)} training samples{packs}"
            raise ValueError(f"{what} cannot fill one global micro-batch of {micro_batch_size} x {world_size} ranks "
                             "(raise data.num_train)")

    def _sample_lengths(self) -> list[int]:
        if self._columns is not None:  # the lengths from Arrow, without reading the tokens into Python
            import pyarrow.compute as pc

            return pc.list_value_length(self._columns.with_format("arrow")["input_ids"]).to_pylist()
        return [len(r["input_ids"]) for r in self.dataset]

    def _permutation(self, epoch: int) -> list[int]:
        if epoch == 0 and self.ordered_first_epoch:
            return list(range(len(self.dataset)))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def _units(self, epoch: int) -> list[list[int]]:
        if epoch not in self._epochs:
            perm = self._permutation(epoch)
            self._epochs = {epoch: pack_in_order(self._lengths, perm, self.pack_len) if self.pack_len
                            else [[i] for i in perm]}
        return self._epochs[epoch]

    def per_epoch(self, epoch: int) -> int:
        """Micro-batches per rank in `epoch` (with packing the number of packs varies by epoch)."""
        if not self.pack_len:
            return len(self.dataset) // (self.micro_batch_size * self.world_size)
        if epoch not in self._counts:  # kept: `_locate` walks every epoch before the current one
            self._counts[epoch] = len(self._units(epoch)) // (self.micro_batch_size * self.world_size)
        return self._counts[epoch]

    def _locate(self, position: int) -> tuple[int, int]:
        """(epoch, micro-batch index in it) of the `position`-th micro-batch."""
        if not self.pack_len:
            return divmod(position, self.per_epoch(0))
        epoch = 0
        while position >= (n := self.per_epoch(epoch)):
            position, epoch = position - n, epoch + 1
        return epoch, position

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        B = self.micro_batch_size
        while True:
            epoch, k = self._locate(self.position)
            start = (k * self.world_size + self.rank) * B
            units = self._units(epoch)[start : start + B]
            drawn = self.position * self.world_size + self.rank  # this micro-batch's global index
            self.position += 1
            rows = self._rows([i for unit in units for i in unit])
            if not self.pack_len:
                if self.mix_rows:
                    k = self.mix_rows
                    rows = rows[: B - k] + [self.mix[(drawn * k + j) % len(self.mix)] for j in range(k)]
                yield collate(rows, self.pad_id, self.depths, self.teacher, self.pad_to_multiple_of, self.mix_rows)
                continue
            row = iter(rows)
            yield collate_packed([[next(row) for _ in unit] for unit in units], self.pack_len, self.pad_id,
                                 self.depths)

    def _rows(self, indices: list[int]) -> list[dict[str, Any]]:
        if self._columns is not None:  # one columnar read per batch
            cols = self._columns[indices]
            rows = [{"input_ids": i, "labels": lab} for i, lab in zip(cols["input_ids"], cols["labels"])]
            for r, d in zip(rows, cols["depth"] if self.depths else ()):
                r["depth"] = d
            for name in (name for name in cols if name not in ("input_ids", "labels", "depth")):
                for r, value in zip(rows, cols[name]):
                    r[name] = value
        else:
            rows = [self.dataset[i] for i in indices]
        if self.label_context:  # language-model loss on every token, not only on the answer
            rows = [{**r, "labels": r["input_ids"]} for r in rows]
        return rows
