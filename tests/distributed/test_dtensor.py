"""DTensor-lite: placements, global shapes, distribute/gather round trips and their gradients."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed_harness import run_ranks

from hyperpar_gdn.distributed import (
    DeviceMesh,
    DTensor,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)
from hyperpar_gdn.platform import get_platform


def _full(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((2, 8, 4), generator=generator, dtype=torch.float64)


def _weight(rank: int) -> torch.Tensor:
    return _full(seed=10 + rank)


def _one_d(rank: int, world_size: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    full = _full()
    sharded = distribute_tensor(full, mesh, [Shard(-2)])
    local = sharded.to_local().detach().clone().requires_grad_()
    x = DTensor.from_local(local, mesh, [Shard(1)])
    gathered = x.full_tensor()
    (gathered * _weight(rank)).sum().backward()
    replicated = DTensor.from_local(full, mesh, [Replicate()])
    return {
        "placements": (sharded.placements, x.placements),
        "shapes": (tuple(local.shape), x.shape, replicated.shape),
        "local": local.detach(),
        "full": gathered.detach(),
        "grad": local.grad,
        "replicated_is_local": replicated.full_tensor() is full and x.to_local() is local,
        "mesh": x.device_mesh is mesh,
    }


def test_one_d_shard_round_trip_and_gradient() -> None:
    world_size = 4
    results = run_ranks(_one_d, world_size, timeout_s=60)
    full = _full()
    weight_sum = sum(_weight(r) for r in range(world_size))
    for rank, out in enumerate(results):
        rows = slice(2 * rank, 2 * rank + 2)
        assert out["placements"] == ((Shard(1),), (Shard(1),))
        assert out["shapes"] == ((2, 2, 4), (2, 8, 4), (2, 8, 4))
        torch.testing.assert_close(out["local"], full[:, rows], rtol=0, atol=0)
        torch.testing.assert_close(out["full"], full, rtol=0, atol=0)
        # every rank's loss reads this shard: its gradient is the sum of their weights' slices
        torch.testing.assert_close(out["grad"], weight_sum[:, rows], rtol=0, atol=1e-12)
        assert out["replicated_is_local"] and out["mesh"]


PLACEMENTS_2D = {
    "shard0-shard1": (Shard(0), Shard(1)),
    "replicate-shard1": (Replicate(), Shard(1)),
    "shard1-shard1": (Shard(1), Shard(1)),
    "shard2-replicate": (Shard(2), Replicate()),
}


def _two_d(rank: int, world_size: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    full = _full()
    out = {}
    for name, placements in PLACEMENTS_2D.items():
        x = distribute_tensor(full, mesh, placements)
        out[name] = (tuple(x.to_local().shape), x.shape, x.full_tensor(), x.to_local())
    return out


def test_two_d_placements_round_trip() -> None:
    results = run_ranks(_two_d, 4, timeout_s=60)
    full = _full()
    local_shapes = {
        "shard0-shard1": (1, 4, 4),
        "replicate-shard1": (2, 4, 4),
        "shard1-shard1": (2, 2, 4),
        "shard2-replicate": (2, 8, 2),
    }
    for rank, out in enumerate(results):
        i_dp, i_cp = divmod(rank, 2)
        expected_local = {
            "shard0-shard1": full[i_dp : i_dp + 1, 4 * i_cp : 4 * i_cp + 4],
            "replicate-shard1": full[:, 4 * i_cp : 4 * i_cp + 4],
            # Shard(1) twice: dp splits first (outer), then cp splits each dp half
            "shard1-shard1": full[:, 2 * rank : 2 * rank + 2],
            "shard2-replicate": full[:, :, 2 * i_dp : 2 * i_dp + 2],
        }
        for name, (local_shape, shape, gathered, local) in out.items():
            assert local_shape == local_shapes[name], name
            assert shape == (2, 8, 4), name
            torch.testing.assert_close(local, expected_local[name], rtol=0, atol=0, msg=name)
            torch.testing.assert_close(gathered, full, rtol=0, atol=0, msg=name)


def test_placement_checks() -> None:
    mesh = DeviceMesh.from_group(get_platform("cpu"), None, [0], mesh_dim_name="cp")
    x = torch.zeros(3, 5)
    assert Shard(1) == Shard(1) and Shard(1) != Shard(0) and Replicate() == Replicate()
    assert len({Shard(0), Shard(0), Replicate()}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        Shard(0).dim = 1  # type: ignore[misc]
    assert DTensor.from_local(x, mesh, [Shard(-1)]).placements == (Shard(1),)
    with pytest.raises(ValueError, match=r"one entry per mesh dim; the mesh has shape \(1,\)"):
        DTensor.from_local(x, mesh, [Shard(0), Replicate()])
    with pytest.raises(ValueError, match=r"Shard\(dim=2\) is out of range for a tensor with 2 dims"):
        DTensor.from_local(x, mesh, [Shard(2)])
    with pytest.raises(TypeError, match="Shard"):
        DTensor.from_local(x, mesh, ["shard"])  # type: ignore[list-item]


def _uneven(rank: int, world_size: int) -> str:
    mesh = init_device_mesh("cpu", (2,))
    with pytest.raises(ValueError) as err:
        distribute_tensor(torch.zeros(3, 5), mesh, [Shard(0)])
    return str(err.value)


def test_uneven_shards_are_refused() -> None:
    message = run_ranks(_uneven, 2, timeout_s=30)[0]
    assert "tensor dim 0 of size 3" in message and "mesh dim 0 of size 2" in message
    assert "uneven shards are not supported" in message
