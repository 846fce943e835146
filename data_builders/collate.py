"""Batching: a seeded, resumable, rank-sharded stream of padded micro-batches."""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch


def collate(rows: Sequence[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad `input_ids` (with `pad_id`) and `labels` (with -100) to the longest row."""
    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, L)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, L)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[i, :n] = torch.as_tensor(r["input_ids"])
        labels[i, :n] = torch.as_tensor(r.get("labels", r["input_ids"]))
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


class BatchStream:
    """Endless micro-batches over epochs; each epoch is a permutation seeded by (seed, epoch).

    Global micro-batch g is the slice [g*B*w, (g+1)*B*w) of the permutation (B = micro-batch
    size, w = world size) and rank r takes its r-th block of B samples. So ranks see distinct
    shards, and w ranks with accumulation a see exactly the samples, in the same micro-batch
    blocks, that one process sees with accumulation a*w. `position` counts micro-batches drawn by
    this rank; restoring it continues the exact same order after a resume. With `ordered_first_epoch`
    epoch 0 reads the dataset in stored order (a curriculum's short-first order), later epochs shuffle.
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
    ):
        if len(dataset) < micro_batch_size * world_size:
            raise ValueError(
                f"{len(dataset)} training samples cannot fill one global micro-batch of "
                f"{micro_batch_size} x {world_size} ranks (raise data.num_train)"
            )
        self.dataset, self.micro_batch_size, self.pad_id = dataset, micro_batch_size, pad_id
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.label_context, self.ordered_first_epoch = label_context, ordered_first_epoch
        # A datasets.Dataset: one column view, made once (building it per batch costs more than the read).
        self._columns = dataset.select_columns(["input_ids", "labels"]) if hasattr(dataset, "column_names") else None
        self.per_epoch = len(dataset) // (micro_batch_size * world_size)
        self.position = 0

    def _permutation(self, epoch: int) -> list[int]:
        if epoch == 0 and self.ordered_first_epoch:
            return list(range(len(self.dataset)))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        cached_epoch, perm = -1, []
        B = self.micro_batch_size
        while True:
            epoch, k = divmod(self.position, self.per_epoch)
            if epoch != cached_epoch:
                cached_epoch, perm = epoch, self._permutation(epoch)
            start = (k * self.world_size + self.rank) * B
            chunk = perm[start : start + B]
            self.position += 1
            yield collate(self._rows(chunk), self.pad_id)

    def _rows(self, indices: list[int]) -> list[dict[str, Any]]:
        if self._columns is not None:  # one columnar read per batch
            cols = self._columns[indices]
            rows = [{"input_ids": i, "labels": lab} for i, lab in zip(cols["input_ids"], cols["labels"])]
        else:
            rows = [self.dataset[i] for i in indices]
        if self.label_context:  # language-model loss on every token, not only on the answer
            rows = [{"input_ids": r["input_ids"], "labels": r["input_ids"]} for r in rows]
        return rows
