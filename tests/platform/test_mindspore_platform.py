"""The MindSpore platform: one process (a 1-rank local world, the layer, from_torch, the helpers)
and msrun jobs with 2 and 4 MCCL workers (every collective's values, gradients and byte counts).

The msrun jobs are shared with tests/distributed/test_context_parallel_mindspore.py
(``msrun_harness.cp_worker_job``): each world size starts msrun once per session.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

ms = pytest.importorskip("mindspore")

from msrun_harness import cp_worker_job, section_data  # noqa: E402
from tiny_models import gdn_layer_config, move_off_init  # noqa: E402

from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh  # noqa: E402
from hyperpar_gdn.distributed.verify import relative_error  # noqa: E402
from hyperpar_gdn.models import GatedDeltaNet as TorchGatedDeltaNet  # noqa: E402
from hyperpar_gdn.models.mindspore import GatedDeltaNet, GatedRMSNorm  # noqa: E402
from hyperpar_gdn.platform import get_platform  # noqa: E402
from hyperpar_gdn.platform.mindspore_collectives import MindSporeGroup  # noqa: E402
from hyperpar_gdn.platform.mindspore_platform import MindSporePlatform  # noqa: E402

WORLDS = (2, 4)
PARAM_NAMES = [
    "in_proj_qkv.weight",
    "in_proj_z.weight",
    "in_proj_b.weight",
    "in_proj_a.weight",
    "conv1d.weight",
    "dt_bias",
    "A_log",
    "norm.weight",
    "out_proj.weight",
]


@pytest.fixture
def local() -> MindSporePlatform:
    """A platform joined to the 1-rank local world (no launcher variables in this process)."""
    platform = MindSporePlatform()
    platform.init_distributed(timeout_s=30)
    yield platform
    platform.destroy()


def _torch_layer(dtype: torch.dtype = torch.float32, hk: int = 2, h: int = 4) -> TorchGatedDeltaNet:
    torch.manual_seed(0)
    layer = TorchGatedDeltaNet(32, hk, h, 16, 8)
    move_off_init(layer, 0.1)
    return layer.to(dtype)


def _torch_run(
    layer: Any, x: np.ndarray, cot: np.ndarray, dtype: torch.dtype
) -> tuple[Any, Any, dict[str, Any]]:
    xt = torch.tensor(x, dtype=dtype, requires_grad=True)
    out = layer(xt)
    out.backward(torch.tensor(cot, dtype=dtype))
    return out.detach().numpy(), xt.grad.numpy(), {n: p.grad.numpy() for n, p in layer.named_parameters()}


# --- one process ------------------------------------------------------------------------------


def test_local_world_without_launcher(local: MindSporePlatform) -> None:
    assert (local.rank(), local.world_size(), local.is_initialized()) == (0, 1, True)
    assert local.device == "CPU"
    assert ms.get_context("mode") == ms.PYNATIVE_MODE
    assert local.new_group([0]) is local.new_group([0])
    with pytest.raises(ValueError, match=r"new_group ranks=\[1\] must be distinct ranks in \[0, 1\)"):
        local.new_group([1])


def test_get_platform_builds_the_mindspore_platform() -> None:
    platform = get_platform("mindspore")
    assert isinstance(platform, MindSporePlatform) and platform.name == "mindspore"


def test_init_errors_name_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="timeout_s=0 must be positive"):
        MindSporePlatform().init_distributed(timeout_s=0)
    monkeypatch.setenv("MS_ROLE", "MS_WORKER")
    monkeypatch.delenv("MS_SCHED_PORT", raising=False)
    with pytest.raises(ValueError, match="MS_ROLE='MS_WORKER' set but .*MS_SCHED_PORT"):
        MindSporePlatform().init_distributed()
    monkeypatch.delenv("MS_ROLE")
    monkeypatch.setenv("MS_WORKER_NUM", "2")
    with pytest.raises(ValueError, match="MS_WORKER_NUM set but MS_ROLE missing"):
        MindSporePlatform().init_distributed()
    assert MindSporePlatform().world_size() == 2  # read from the launcher variable before init
    with pytest.raises(ValueError, match="device_target='GPU' is not supported"):
        MindSporePlatform("GPU")


def test_collectives_before_init_and_with_foreign_groups(local: MindSporePlatform) -> None:
    x = local.from_numpy(np.ones((2, 3)))
    with pytest.raises(RuntimeError, match="needs an initialized platform"):
        MindSporePlatform().collectives.all_gather(x, None)
    with pytest.raises(RuntimeError, match=r"new_group\(\[0\]\) needs init_distributed"):
        MindSporePlatform().new_group([0])
    with pytest.raises(TypeError, match="group must be a MindSporeGroup .* got str"):
        local.collectives.all_gather(x, "mccl_world_group")
    with pytest.raises(ValueError, match=r"global rank 0 is not a member of the group \[1, 2\]"):
        local.collectives.all_gather(x, MindSporeGroup("other", (1, 2)))


def test_local_collectives_are_copies_with_gradients(local: MindSporePlatform) -> None:
    comm = local.collectives
    x = local.from_numpy(np.arange(6.0).reshape(3, 2))
    assert np.array_equal(local.to_numpy(comm.all_to_all(x, [3], [3], None)), local.to_numpy(x))
    assert local.to_numpy(comm.all_gather(x, None)).shape == (1, 3, 2)
    assert np.array_equal(local.to_numpy(comm.all_reduce_sum(x)), local.to_numpy(x))
    cot = local.from_numpy(np.full((3, 2), 2.0))
    shifted, dx = ms.value_and_grad(lambda t: comm.shift_right(t, None), sens_param=True)(x, cot)
    assert not local.to_numpy(shifted).any() and not local.to_numpy(dx).any()
    gathered, dx = ms.value_and_grad(lambda t: comm.all_gather(t, None)[0], sens_param=True)(x, cot)
    assert np.array_equal(local.to_numpy(dx), np.full((3, 2), 2.0))
    with pytest.raises(
        ValueError, match=r"send dst=1 must be another group rank in \[0, 1\); this is rank 0"
    ):
        comm.send(x, 1, None)
    comm.barrier(None)
    assert comm.reset_bytes() == 0  # nothing left this rank


MS_DTYPE_NAMES = {
    "float32": "Float32",
    "float64": "Float64",
    "bfloat16": "BFloat16",
    "int64": "Int64",
    "bool": "Bool",
}


@pytest.mark.parametrize("dtype", sorted(MS_DTYPE_NAMES))
def test_from_numpy_to_numpy_round_trip(local: MindSporePlatform, dtype: str) -> None:
    array = np.array([[0.0, 1.0], [2.5, -3.0]])
    x = local.from_numpy(array, dtype=dtype)
    assert str(x.dtype) == MS_DTYPE_NAMES[dtype]
    back = local.to_numpy(x)
    expected = array.astype(np.float32 if dtype == "bfloat16" else dtype)
    assert back.dtype == expected.dtype and np.array_equal(back, expected)
    with pytest.raises(ValueError, match="dtype='float8' is not supported"):
        local.from_numpy(array, dtype="float8")


def test_manual_seed_makes_layers_reproducible(local: MindSporePlatform) -> None:
    def params(seed: int) -> dict[str, np.ndarray]:
        local.manual_seed(seed)
        return {n: local.to_numpy(p) for n, p in GatedDeltaNet(16, 2, 2, 8, 8).parameters_and_names()}

    first, again, other = params(3), params(3), params(4)
    assert all(np.array_equal(first[n], again[n]) for n in first)
    assert not np.array_equal(first["in_proj_qkv.weight"], other["in_proj_qkv.weight"])
    assert not np.array_equal(first["conv1d.weight"], other["conv1d.weight"])


def test_layer_has_the_torch_layers_constructor_and_parameters() -> None:
    ms_layer, torch_layer = (
        GatedDeltaNet(32, 2, 4, 16, 8, 3, 1e-5),
        TorchGatedDeltaNet(32, 2, 4, 16, 8, 3, 1e-5),
    )
    ms_shapes = {n: tuple(p.shape) for n, p in ms_layer.parameters_and_names()}
    assert ms_shapes == {n: tuple(p.shape) for n, p in torch_layer.named_parameters()}
    assert sorted(ms_shapes) == sorted(PARAM_NAMES)
    assert {p.name for p in ms_layer.trainable_params()} == set(PARAM_NAMES)
    assert isinstance(ms_layer.norm, GatedRMSNorm) and ms_layer.norm.variance_epsilon == 1e-5
    for attr in ("hidden_size", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel_size"):
        assert getattr(ms_layer, attr) == getattr(torch_layer, attr), attr
    with pytest.raises(ValueError, match="num_v_heads=3 must be a multiple of num_k_heads=2"):
        GatedDeltaNet(32, 2, 3, 16, 8)
    with pytest.raises(ValueError, match=r"hidden_states must be \[B, T, hidden_size=32\]; got \(2, 5, 31\)"):
        ms_layer(ms.ops.zeros((2, 5, 31), ms.float32))


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-4), (torch.float64, 1e-12)], ids=["float32", "float64"]
)
def test_from_torch_matches_torch_outputs_and_gradients(
    local: MindSporePlatform, dtype: torch.dtype, tol: float
) -> None:
    torch_layer = _torch_layer(dtype)
    ms_layer = GatedDeltaNet.from_torch(torch_layer)
    name = str(dtype).removeprefix("torch.")
    assert {str(p.dtype) for p in ms_layer.get_parameters()} == {name.capitalize()}
    rng = np.random.default_rng(0)
    x, cot = rng.standard_normal((2, 75, 32)), rng.standard_normal((2, 75, 32))
    out, (dx,), grads = local.value_and_grads(
        lambda inp: ms_layer(inp),
        [local.from_numpy(x, dtype=name)],
        local.from_numpy(cot, dtype=name),
        ms_layer,
    )
    ref_out, ref_dx, ref_grads = _torch_run(torch_layer, x, cot, dtype)
    assert sorted(grads) == sorted(PARAM_NAMES)
    errors = {
        "output": relative_error(local.to_numpy(out), ref_out),
        "grad_input": relative_error(local.to_numpy(dx), ref_dx),
    }
    errors.update({n: relative_error(local.to_numpy(g), ref_grads[n]) for n, g in grads.items()})
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, bad


def test_from_torch_copies_transformers_layer(local: MindSporePlatform) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(1)
    hf = Qwen3_5GatedDeltaNet(gdn_layer_config(key_head_dim=16), 0)
    move_off_init(hf, 0.1)
    ms_layer = GatedDeltaNet.from_torch(hf)
    assert ms_layer.norm.variance_epsilon == hf.norm.variance_epsilon
    x = np.random.default_rng(2).standard_normal((2, 70, 32))
    with torch.no_grad():
        expected = hf(torch.tensor(x, dtype=torch.float32)).numpy()
    actual = local.to_numpy(ms_layer(local.from_numpy(x)))
    assert relative_error(actual, expected) <= 1e-4


def test_load_torch_state_dict_names_what_is_wrong() -> None:
    layer = GatedDeltaNet(32, 2, 4, 16, 8)
    state = _torch_layer().state_dict()
    del state["A_log"]
    with pytest.raises(ValueError, match=r"the torch state dict lacks \[.A_log.\]"):
        layer.load_torch_state_dict(state)
    with pytest.raises(
        ValueError,
        match=r"in_proj_qkv.weight: the torch state dict has shape \(64, 32\), the cell \(96, 32\)",
    ):
        layer.load_torch_state_dict(TorchGatedDeltaNet(32, 1, 4, 16, 8).state_dict())


def test_context_parallel_on_a_one_rank_mesh_and_undo(local: MindSporePlatform) -> None:
    """apply() patches the Cell's construct (MindSpore cells have no forward); undo() restores it."""
    torch_layer = _torch_layer()
    layer, reference = GatedDeltaNet.from_torch(torch_layer), GatedDeltaNet.from_torch(torch_layer)
    mesh = init_device_mesh("mindspore", (1,), mesh_dim_names=("cp",))
    x = local.from_numpy(np.random.default_rng(3).standard_normal((2, 40, 32)))
    LinearAttentionContextParallel(mode="p2p").apply(layer, mesh)
    assert "construct" in vars(layer)
    assert relative_error(local.to_numpy(layer(x)), local.to_numpy(reference(x))) <= 1e-6
    LinearAttentionContextParallel.undo(layer)
    assert "construct" not in vars(layer)
    with pytest.raises(ValueError, match="GatedDeltaNet has no context parallelism applied"):
        LinearAttentionContextParallel.undo(layer)


# --- msrun: 2 and 4 MCCL workers ----------------------------------------------------------------


def _expected_all_to_all(world: int, rank: int) -> tuple[np.ndarray, np.ndarray, int]:
    """What the worker's all_to_all gives on ``rank``: rank r sends (r + 2j) % 3 rows to rank j;
    rank r's x has rows 16r + [0, 1], [2, 3], ...; the cotangent is rank + 1 everywhere."""
    send = [[(r + 2 * j) % 3 for j in range(world)] for r in range(world)]
    x = [16 * r + np.arange(sum(send[r]) * 2.0).reshape(-1, 2) for r in range(world)]
    parts = []
    for r in range(world):
        start = sum(send[r][:rank])
        parts.append(x[r][start : start + send[r][rank]])
    out = np.concatenate(parts)
    dx = np.concatenate([np.full((send[rank][j], 2), j + 1.0) for j in range(world)])
    row_bytes = 2
    sent_rows = sum(send[rank]) - send[rank][rank]
    recv_rows = sum(send[j][rank] for j in range(world)) - send[rank][rank]
    return out, dx, (sent_rows + recv_rows) * row_bytes  # forward rows out, backward rows back


ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2}


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"cp{w}")
def test_differentiable_collectives_values_gradients_and_bytes(world: int) -> None:
    for rank, data in enumerate(section_data(cp_worker_job(world), "collectives")):
        for dtype, size in ITEMSIZE.items():
            got = data[f"all_to_all/{dtype}"]
            out, dx, elements = _expected_all_to_all(world, rank)
            assert got["dtype"] == MS_DTYPE_NAMES[dtype]
            assert np.array_equal(np.array(got["out"]).reshape(out.shape), out), (rank, dtype, got["out"])
            assert np.array_equal(np.array(got["dx"]).reshape(dx.shape), dx), (rank, dtype, got["dx"])
            assert got["bytes"] == elements * size, (rank, dtype, got["bytes"])

            got = data[f"all_gather/{dtype}"]
            gathered = np.stack([np.full((2, 3), r + 1.0) for r in range(world)])
            assert np.array_equal(np.array(got["out"]), gathered)
            # rank r's cotangent for slice k is (r + 1)(k + 1): rank k gets (k + 1) * sum_r (r + 1)
            assert np.array_equal(
                np.array(got["dx"]), np.full((2, 3), (rank + 1.0) * world * (world + 1) / 2)
            )
            assert got["bytes"] == 2 * 6 * size * (world - 1)  # forward gather + backward reduce-scatter

            got = data[f"shift_right/{dtype}"]
            assert got["out"] == [float(rank)] * 2  # rank r - 1 sent r; zeros on rank 0
            assert got["dx"] == ([10.0 * (rank + 2)] * 2 if rank < world - 1 else [0.0, 0.0])
            assert got["bytes"] == 2 * size * ((rank < world - 1) + (rank > 0))
        assert data["all_to_all/empty"] == [0, 3]
        assert data["all_gather/empty"] == [world, 0, 3]


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"cp{w}")
def test_send_recv_all_reduce_and_subgroups(world: int) -> None:
    for rank, data in enumerate(section_data(cp_worker_job(world), "collectives")):
        if rank > 0:
            assert data["recv"] == {"values": [10.0 * (rank - 1) + i for i in range(4)], "dtype": "Float64"}
        assert data["send_bytes"] == (32 if rank < world - 1 else 0)
        assert data["all_gather_int"] == {
            "values": [10 * r + 3 for r in range(world)],
            "bytes": 8 * (world - 1),
        }
        for dtype, size in (("float32", 4), ("float64", 8)):
            got = data[f"all_reduce_sum/{dtype}"]
            assert got["total"] == [world * (world + 1) / 2] * 3
            assert got["input_after"] == [rank + 1.0] * 3  # not in place, unlike torch (documented)
            assert got["bytes"] == 3 * size * (world - 1)
        if world < 4:
            assert "subgroup" not in data
            continue
        sub = data["subgroup"]
        half = world // 2
        members = list(range(0, half)) if rank < half else list(range(half, world))
        assert sub["ranks"] == members and sub["same_handle"]
        assert sub["all_gather"] == [r + 1.0 for r in members]
        assert sub["all_to_all"] == [float(r) for r in members]
        position = members.index(rank)
        assert sub["shift_right"] == [float(members[position - 1] + 1) if position else 0.0]
        assert sub["all_reduce_sum"] == [float(sum(r + 1 for r in members))]
        kind, message = sub["foreign_group"]
        assert kind == "ValueError" and f"global rank {rank} is not a member of the group" in message
