"""TorchCollectives on real gloo groups: forward and backward against a single-process computation,
``bytes_sent`` accounting, group-rank addressing and argument checks."""

from __future__ import annotations

import pytest
import torch
from distributed_harness import run_ranks

from hyperpar_gdn.platform import get_platform

ROW = (2, 3)  # trailing shape of every all_to_all row
ROW_BYTES = 2 * 3 * 8  # float64

# SPLITS[i][j]: rows rank i sends to rank j. Zeros off and on the diagonal; on 4 ranks, rank 2
# sends nothing at all and rank 1 keeps nothing.
SPLITS = {
    2: [[2, 0], [3, 1]],
    4: [[1, 0, 2, 0], [0, 0, 3, 1], [0, 0, 0, 0], [2, 2, 1, 3]],
}


def _randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def _a2a_leaf(rank: int, splits: list[list[int]]) -> torch.Tensor:
    # twice as wide as a row: the collective gets a non-contiguous view x = leaf[..., ::2]
    return _randn((sum(splits[rank]), ROW[0], 2 * ROW[1]), seed=100 + rank)


def _a2a_weight(rank: int, splits: list[list[int]]) -> torch.Tensor:
    return _randn((sum(row[rank] for row in splits), *ROW), seed=200 + rank)


def _small(rank: int, seed: int) -> torch.Tensor:
    return _randn((3, 2), seed=seed + rank)


def _collectives(rank: int, world_size: int) -> dict[str, object]:
    collectives = get_platform().collectives
    splits = SPLITS[world_size]
    out: dict[str, object] = {}

    leaf = _a2a_leaf(rank, splits).requires_grad_()
    collectives.reset_bytes()
    y = collectives.all_to_all(leaf[..., ::2], splits[rank], [row[rank] for row in splits], None)
    out["a2a_fwd_bytes"] = collectives.reset_bytes()
    (y * _a2a_weight(rank, splits)).sum().backward()
    out["a2a_bwd_bytes"] = collectives.reset_bytes()
    out["a2a"], out["a2a_grad"] = y.detach(), leaf.grad

    x = _small(rank, 300).requires_grad_()
    y = collectives.all_gather(x, None)
    out["gather_fwd_bytes"] = collectives.reset_bytes()
    (y * _randn((world_size, 3, 2), seed=400 + rank)).sum().backward()
    out["gather_bwd_bytes"] = collectives.reset_bytes()
    out["gather"], out["gather_grad"] = y.detach(), x.grad

    x = _small(rank, 500).requires_grad_()
    y = collectives.shift_right(x, None)
    out["shift_fwd_bytes"] = collectives.reset_bytes()
    (y * _small(rank, 600)).sum().backward()
    out["shift_bwd_bytes"] = collectives.reset_bytes()
    out["shift"], out["shift_grad"] = y.detach(), x.grad

    half = torch.arange(4, dtype=torch.bfloat16) + 4 * rank
    out["gather_bf16"] = collectives.all_gather(half, None)
    n = 4 // world_size
    out["a2a_bf16"] = collectives.all_to_all(half, [n] * world_size, [n] * world_size, None)
    return out


def _reference(world_size: int) -> dict[str, list[torch.Tensor]]:
    """The same computations in one process, with autograd doing the backward."""
    splits = SPLITS[world_size]
    ref: dict[str, list[torch.Tensor]] = {}

    leaves = [_a2a_leaf(r, splits).requires_grad_() for r in range(world_size)]
    xs = [leaf[..., ::2] for leaf in leaves]
    offsets = [[sum(splits[i][:j]) for j in range(world_size)] for i in range(world_size)]
    ys = [
        torch.cat([xs[j][offsets[j][i] : offsets[j][i] + splits[j][i]] for j in range(world_size)])
        for i in range(world_size)
    ]
    sum((y * _a2a_weight(i, splits)).sum() for i, y in enumerate(ys)).backward()
    ref["a2a"], ref["a2a_grad"] = [y.detach() for y in ys], [leaf.grad for leaf in leaves]

    xs = [_small(r, 300).requires_grad_() for r in range(world_size)]
    stacked = torch.stack(xs)
    sum((stacked * _randn((world_size, 3, 2), seed=400 + r)).sum() for r in range(world_size)).backward()
    ref["gather"], ref["gather_grad"] = [stacked.detach()] * world_size, [x.grad for x in xs]

    xs = [_small(r, 500).requires_grad_() for r in range(world_size)]
    ys = [torch.zeros(3, 2, dtype=torch.float64)] + xs[:-1]
    sum((y * _small(r, 600)).sum() for r, y in enumerate(ys)).backward()
    ref["shift"] = [y.detach() for y in ys]
    ref["shift_grad"] = [x.grad for x in xs[:-1]] + [torch.zeros(3, 2, dtype=torch.float64)]  # last x unused
    return ref


@pytest.mark.parametrize("world_size", [2, 4], ids=lambda n: f"ranks{n}")
def test_collectives_forward_backward_and_bytes(world_size: int) -> None:
    results = run_ranks(_collectives, world_size, timeout_s=60)
    ref = _reference(world_size)
    splits = SPLITS[world_size]
    for rank, out in enumerate(results):
        for key in ("a2a", "a2a_grad", "gather", "gather_grad", "shift", "shift_grad"):
            torch.testing.assert_close(out[key], ref[key][rank], rtol=0, atol=1e-12, msg=f"{key} rank {rank}")
        sent = sum(splits[rank]) - splits[rank][rank]
        sent_back = sum(row[rank] for row in splits) - splits[rank][rank]
        expected = {
            "a2a_fwd_bytes": sent * ROW_BYTES,
            "a2a_bwd_bytes": sent_back * ROW_BYTES,
            "gather_fwd_bytes": 6 * 8 * (world_size - 1),
            "gather_bwd_bytes": 6 * 8 * (world_size - 1),
            "shift_fwd_bytes": 48 if rank < world_size - 1 else 0,
            "shift_bwd_bytes": 48 if rank > 0 else 0,
        }
        assert {key: out[key] for key in expected} == expected, f"rank {rank}"
        gathered = torch.arange(4 * world_size, dtype=torch.bfloat16).view(world_size, 4)
        assert torch.equal(out["gather_bf16"], gathered)
        n = 4 // world_size
        assert torch.equal(out["a2a_bf16"], gathered[:, rank * n : (rank + 1) * n].flatten())
    assert SPLITS[4][2] == [0, 0, 0, 0] and SPLITS[4][1][1] == 0  # the awkward cases are still there


def _subgroup(rank: int, world_size: int) -> dict[str, object]:
    platform = get_platform()
    collectives = platform.collectives
    group = platform.new_group([1, 2, 3])  # group rank = global rank - 1
    x = torch.full((2,), float(rank))
    if rank == 0:
        with pytest.raises(ValueError, match=r"not a member of the group \[1, 2, 3\]"):
            collectives.all_gather(x, group)
        return {}
    out: dict[str, object] = {
        "gather": collectives.all_gather(x, group).tolist(),
        "shift": collectives.shift_right(x, group).tolist(),
    }
    collectives.reset_bytes()
    if rank == 1:
        collectives.send(x * 10, 2, group)  # group rank 2 = global rank 3
    if rank == 3:
        out["recv"] = collectives.recv(x, 0, group).tolist()  # group rank 0 = global rank 1
    out["p2p_bytes"] = collectives.reset_bytes()
    out["ints"] = collectives.all_gather_int(10 * rank, group)
    out["ints_bytes"] = collectives.reset_bytes()
    collectives.barrier(group)
    total = torch.full((3,), float(rank))
    out["sum"] = collectives.all_reduce_sum(total, group).tolist()
    out["sum_bytes"] = collectives.reset_bytes()
    out["sum_in_place"] = total.tolist()
    return out


def test_subgroup_addresses_group_ranks() -> None:
    results = run_ranks(_subgroup, 4, timeout_s=60)
    assert results[0] == {}
    for rank in (1, 2, 3):
        out = results[rank]
        assert out["gather"] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
        assert out["shift"] == ([[0.0, 0.0]] if rank == 1 else [[float(rank - 1)] * 2])[0]
        assert out["sum"] == out["sum_in_place"] == [6.0] * 3
        assert out["sum_bytes"] == 3 * 4 * 2
        assert out["ints"] == [10, 20, 30] and out["ints_bytes"] == 8 * 2
    assert results[3]["recv"] == [10.0, 10.0]
    assert [results[r]["p2p_bytes"] for r in (1, 2, 3)] == [8, 0, 0]


def _bad_arguments(rank: int, world_size: int) -> list[str]:
    collectives = get_platform().collectives
    x = torch.zeros(3, 2)
    messages = []
    cases = [
        lambda: collectives.all_to_all(x, [1, 1], [1, 1], None),  # sums to 2, x has 3 rows
        lambda: collectives.all_to_all(x, [3], [3], None),  # one split, two ranks
        lambda: collectives.all_to_all(x, [4, -1], [1, 1], None),
        lambda: collectives.all_to_all(torch.tensor(1.0), [1, 0], [1, 0], None),
        lambda: collectives.send(x, rank, None),
        lambda: collectives.recv(x, 2, None),
        lambda: collectives.all_reduce_sum(x.t(), None),
    ]
    for case in cases:
        with pytest.raises(ValueError) as err:
            case()
        messages.append(str(err.value))
    # nothing above communicated: the group still works
    messages.append(str(collectives.all_reduce_sum(torch.ones(1)).item()))
    return messages


def test_bad_arguments_raise_before_communicating() -> None:
    messages = run_ranks(_bad_arguments, 2, timeout_s=60)[1]
    assert "send_splits=[1, 1] sum to 2 but x has 3 rows" in messages[0]
    assert "world=2" in messages[1] and "send_splits=[3]" in messages[1]
    assert "must be >= 0" in messages[2]
    assert "0-d tensor" in messages[3]
    assert "dst=1" in messages[4] and "this is rank 1" in messages[4]
    assert "src=2" in messages[5]
    assert "contiguous" in messages[6]
    assert messages[7] == "2.0"


def _ring_exchange(rank: int, world_size: int, group_peers: bool) -> dict[str, object]:
    """One round of a ring over the subgroup [1, 2, 3] (both directions at once), with peers
    passed as group ranks or, as on torch without ``group_peer=``, as global ranks."""
    from hyperpar_gdn.platform import torch_collectives

    torch_collectives._GROUP_PEERS = group_peers
    collectives = get_platform().collectives
    group = get_platform().new_group([1, 2, 3])
    if rank == 0:
        return {}
    me = rank - 1
    x = torch.full((2,), float(rank))
    got = collectives.exchange(
        [(x, (me + 1) % 3), (10 * x, (me + 2) % 3)], [(x, (me + 2) % 3), (x, (me + 1) % 3)], group
    )
    return {"got": [t.tolist() for t in got], "bytes": collectives.reset_bytes()}


@pytest.mark.parametrize("group_peers", [True, False], ids=["group_peer", "global-peers"])
def test_exchange_is_one_round_in_both_directions(group_peers: bool) -> None:
    results = run_ranks(_ring_exchange, 4, group_peers, timeout_s=60)
    for rank in (1, 2, 3):
        before, after = (rank - 2) % 3 + 1, rank % 3 + 1  # global ranks of group ranks me -/+ 1
        assert results[rank]["got"] == [[float(before)] * 2, [10.0 * after] * 2], f"rank {rank}"
        assert results[rank]["bytes"] == 2 * 2 * 4
