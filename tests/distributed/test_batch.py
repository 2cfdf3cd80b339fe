"""shard_for_context_parallel on a one-rank mesh and on 2 gloo ranks: shifted labels (none
across padding or packed documents), global or packed positions, cu_seqlens, and the errors."""

from __future__ import annotations

import pytest
import torch
from distributed_harness import run_ranks

from hyperpar_gdn import init_device_mesh, shard_for_context_parallel
from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.platform import get_platform

SOLO = DeviceMesh.from_group(get_platform("cpu"), None, [0])
IDS = torch.arange(10, 20)[None]


def test_labels_are_the_next_token_of_the_whole_sequence() -> None:
    def worker(rank: int, world: int) -> dict[str, list]:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        mask = torch.tensor([[1] * 8 + [0, 0]])
        shard = shard_for_context_parallel(mesh, IDS, attention_mask=mask)
        return {
            k: getattr(shard, k).tolist() for k in ("input_ids", "position_ids", "labels", "attention_mask")
        }

    first, second = run_ranks(worker, 2, timeout_s=60)
    assert first["input_ids"] == [[10, 11, 12, 13, 14]] and second["input_ids"] == [[15, 16, 17, 18, 19]]
    assert first["position_ids"] == [[0, 1, 2, 3, 4]] and second["position_ids"] == [[5, 6, 7, 8, 9]]
    assert first["labels"] == [[11, 12, 13, 14, 15]]  # the last label is the next rank's first token
    assert second["labels"] == [[16, 17, -100, -100, -100]]  # padding is never a label
    assert second["attention_mask"] == [[1, 1, 1, 0, 0]]


def test_packed_documents() -> None:
    by_cu = shard_for_context_parallel(SOLO, IDS, cu_seqlens=torch.tensor([0, 3, 4, 10]))
    by_positions = shard_for_context_parallel(
        SOLO, IDS, position_ids=torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3, 4, 5]])
    )
    for shard in (by_cu, by_positions):
        assert shard.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4, 5]]
        assert shard.labels.tolist() == [[11, 12, -100, -100, 15, 16, 17, 18, 19, -100]]
        assert shard.cu_seqlens.tolist() == [0, 3, 4, 10]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cu_seqlens": torch.tensor([0, 3, 9])}, r"cu_seqlens must end at the sequence length T=10"),
        (
            {
                "cu_seqlens": torch.tensor([0, 3, 10]),
                "position_ids": torch.tensor([[0, 1, 0, 1, 2, 3, 4, 5, 6, 7]]),
            },
            r"cu_seqlens starts documents at \[0, 3\], position_ids at \[0, 2\]",
        ),
        ({"labels": torch.zeros(1, 9, dtype=torch.int64)}, r"labels must have input_ids' shape \[B, T\]"),
    ],
)
def test_bad_input(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shard_for_context_parallel(SOLO, IDS, **kwargs)
