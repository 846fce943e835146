"""Sequence parallelism: the slices of a micro-batch, and what `trainer.sequence_parallel` refuses at start-up.

The 2-rank run against one process is in tests/test_distributed.py (marked distributed)."""
from __future__ import annotations

import pytest
import torch

from data_builders.collate import collate
from models.training.sequence_parallel import IGNORE, shard
from tests.conftest import TINY
from train import run


def test_slices_put_back_together_are_the_shifted_padded_batch():
    rows = [{"input_ids": list(range(1, 12)), "labels": [IGNORE] * 8 + [9, 10, 11]},
            {"input_ids": list(range(20, 27)), "labels": [IGNORE] * 5 + [25, 26]}]
    batch = collate(rows, pad_id=0)  # (2, 11)
    parts = [shard(batch, r, 3, pad_id=0) for r in range(3)]
    assert [p["input_ids"].shape for p in parts] == [(2, 4)] * 3  # 11 tokens padded to 12
    ids = torch.cat([p["input_ids"] for p in parts], dim=1)
    assert ids[:, :11].tolist() == batch["input_ids"].tolist() and ids[:, 11].tolist() == [0, 0]
    assert torch.cat([p["position_ids"] for p in parts], dim=1).tolist() == [list(range(12))] * 2
    shifted = torch.cat([p["shift_labels"] for p in parts], dim=1)
    # position p's target is token p + 1, across the slice boundaries (position 3 -> token 4 on another rank)
    assert shifted[0].tolist() == [IGNORE] * 7 + [9, 10, 11] + [IGNORE] * 2
    assert shifted[1].tolist() == [IGNORE] * 4 + [25, 26] + [IGNORE] * 6
    assert "attention_mask" not in parts[0]


@pytest.mark.parametrize("overrides,message", [
    (["trainer.sequence_parallel=2"], "DeepSpeed"),
    (["trainer=zero2", "trainer.sequence_parallel=2", "model.attention=diff_v1"], "two maps per head"),
    (["trainer=zero2", "trainer.sequence_parallel=2", "model.attn_implementation=eager"], "sdpa or flash_attention_2"),
    (["trainer=zero2", "trainer.sequence_parallel=2", "data.packing=true"], "would attend to each other"),
    (["trainer=zero2", "trainer.sequence_parallel=3"], "must divide the"),
])
def test_what_sequence_parallelism_cannot_run_fails_at_start_up(compose_cfg, tmp_path, monkeypatch, overrides, message):
    import train

    # as if launched on 2 ranks; validation runs before the process group is joined
    monkeypatch.setattr(train, "dist_info", lambda: train.DistInfo(rank=0, local_rank=0, world_size=2))
    with pytest.raises(ValueError, match=message):
        run(compose_cfg(*TINY, *overrides), tmp_path)
    assert not (tmp_path / "tokenizer").exists()
