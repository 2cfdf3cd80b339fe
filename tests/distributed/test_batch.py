"""shard_for_context_parallel on a one-rank mesh and on 2 gloo ranks: shifted labels (none
across padding or packed documents), global or packed positions, cu_seqlens, and the errors.
context_parallel_lm_loss at cp 2 (gloo and msrun) equals torch's cross-entropy over the whole
sequence's logits: the ranks' losses add up to its mean, their hidden-state gradients are its
shards, their head-weight gradients add up to its."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from distributed_harness import run_ranks
from msrun_cp_worker import LM_LOSS_CHUNK, lm_loss_inputs

from hyperpar_gdn import context_parallel_lm_loss, init_device_mesh, shard_for_context_parallel
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


def test_head_tail_shards_are_two_pieces_with_global_positions_and_labels() -> None:
    """cp=2, T=12: rank 0 holds pieces 0 and 3, rank 1 pieces 1 and 2 (3 tokens each); labels
    are shifted on the whole sequence; packed documents and padding cross the pieces."""

    def worker(rank: int, world: int) -> dict[str, list]:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        ids = torch.arange(10, 22)[None]
        mask = torch.tensor([[1] * 10 + [0, 0]])
        shard = shard_for_context_parallel(
            mesh, ids, attention_mask=mask, cu_seqlens=torch.tensor([0, 5, 12]), layout="head_tail"
        )
        try:
            shard_for_context_parallel(mesh, ids[:, :10], layout="head_tail")
            error = "no error"
        except ValueError as err:
            error = str(err)
        fields = ("input_ids", "position_ids", "labels", "attention_mask", "cu_seqlens")
        return {k: getattr(shard, k).tolist() for k in fields} | {"layout": shard.layout, "error": error}

    first, second = run_ranks(worker, 2, timeout_s=60)
    assert first["input_ids"] == [[10, 11, 12, 19, 20, 21]] and second["input_ids"] == [
        [13, 14, 15, 16, 17, 18]
    ]
    # packed: positions restart at the document start 5 (in rank 1's first piece)
    assert first["position_ids"] == [[0, 1, 2, 4, 5, 6]] and second["position_ids"] == [[3, 4, 0, 1, 2, 3]]
    assert first["labels"] == [[11, 12, 13, -100, -100, -100]]  # 20 and 21 are padding, never labels
    assert second["labels"] == [[14, -100, 16, 17, 18, 19]]  # 14's next token opens a document
    assert first["attention_mask"] == [[1, 1, 1, 1, 0, 0]]
    assert first["cu_seqlens"] == second["cu_seqlens"] == [0, 5, 12]
    assert first["layout"] == "head_tail"
    assert "T=10 is not divisible by 4 (2*cp, cp=2)" in first["error"] == second["error"]


def _whole_sequence_lm_loss() -> dict[str, np.ndarray]:
    """torch's mean cross-entropy over the logits of the whole sequence, and its gradients."""
    hidden, head, labels = (torch.tensor(a) for a in lm_loss_inputs())
    hidden.requires_grad_()
    head.requires_grad_()
    logits = hidden @ head.T
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    return {"loss": loss.detach().numpy(), "grad_hidden": hidden.grad.numpy(), "grad_head": head.grad.numpy()}


def _check_cp_lm_loss(per_rank: list[dict]) -> None:
    want = _whole_sequence_lm_loss()
    np.testing.assert_allclose(sum(r["loss"] for r in per_rank), want["loss"], rtol=1e-12)
    got_hidden = np.concatenate([np.asarray(r["grad_hidden"]) for r in per_rank], axis=1)
    np.testing.assert_allclose(got_hidden, want["grad_hidden"], rtol=0, atol=1e-13)
    np.testing.assert_allclose(
        sum(np.asarray(r["grad_head"]) for r in per_rank), want["grad_head"], atol=1e-13
    )
    assert np.abs(got_hidden[1, 9:]).max() == 0  # padding


def test_lm_loss_cp2_gloo() -> None:
    def worker(rank: int, world: int) -> dict:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        hidden, head, labels = lm_loss_inputs()
        local = hidden.shape[1] // world
        window = slice(rank * local, (rank + 1) * local)
        h = torch.tensor(hidden[:, window], requires_grad=True)
        w = torch.tensor(head, requires_grad=True)
        loss = context_parallel_lm_loss(
            h, w, torch.tensor(labels[:, window]), mesh, chunk_tokens=LM_LOSS_CHUNK
        )
        loss.backward()
        assert loss.dtype == torch.float64
        return {"loss": loss.item(), "grad_hidden": h.grad.tolist(), "grad_head": w.grad.tolist()}

    _check_cp_lm_loss(run_ranks(worker, 2, timeout_s=60))


def test_lm_loss_cp2_msrun() -> None:
    pytest.importorskip("mindspore")
    from msrun_harness import cp_worker_job, section_data

    per_rank = section_data(cp_worker_job(2), "lm_loss")
    assert [r["dtype"] for r in per_rank] == ["Float64", "Float64"]
    _check_cp_lm_loss(per_rank)
