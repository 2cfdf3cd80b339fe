"""DeviceMesh on real gloo groups: row-major layout, per-dim groups, validation before any
communication, and adoption of torch DeviceMeshes."""

from __future__ import annotations

import pytest
import torch
from distributed_harness import run_ranks

from hyperpar_gdn.distributed import DeviceMesh, as_cp_mesh, init_device_mesh
from hyperpar_gdn.platform import get_platform, platform_for_device, resolve_device_type


def _group_sum(mesh: DeviceMesh, dim: str) -> float:
    """Sum of global ranks over this rank's group along ``dim`` (proves the group is real)."""
    value = torch.tensor([float(mesh.get_rank())])
    return mesh.platform.collectives.all_reduce_sum(value, mesh.get_group(dim)).item()


def _two_by_two(rank: int, world_size: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    cp, dp = mesh["cp"], mesh["dp"]
    info: dict[str, object] = {
        "shape": mesh.shape,
        "ndim": mesh.ndim,
        "size": (mesh.size(), mesh.size("dp"), mesh.size(1)),
        "coordinate": mesh.get_coordinate(),
        "local": (mesh.get_local_rank("dp"), mesh.get_local_rank("cp"), mesh.get_rank()),
        "lists": (mesh.get_rank_list("dp"), mesh.get_rank_list("cp")),
        "mesh": mesh.mesh,
        "cp": (cp.ndim, cp.mesh_dim_names, cp.size(), cp.get_local_rank(), cp.rank_list),
        "dp": (dp.mesh_dim_names, dp.get_local_rank(), dp.rank_list),
        "sums": (_group_sum(mesh, "dp"), _group_sum(mesh, "cp")),
        "cp_is_itself": as_cp_mesh(cp) is cp,
        "same_group": cp.get_group() is mesh.get_group("cp"),
    }
    errors = {}
    for name, call in {
        "local_no_dim": lambda: mesh.get_local_rank(),
        "rank_list_2d": lambda: mesh.rank_list,
        "bad_index": lambda: mesh.get_group(2),
        "as_cp": lambda: as_cp_mesh(mesh),
    }.items():
        with pytest.raises(ValueError) as err:
            call()
        errors[name] = str(err.value)
    with pytest.raises(KeyError) as key_err:
        mesh["tp"]
    errors["unknown_name"] = str(key_err.value)
    info["errors"] = errors
    return info


def test_two_by_two_mesh_is_row_major() -> None:
    infos = run_ranks(_two_by_two, 4, timeout_s=60)
    for rank, info in enumerate(infos):
        i_dp, i_cp = divmod(rank, 2)
        cp_ranks, dp_ranks = [2 * i_dp, 2 * i_dp + 1], [i_cp, i_cp + 2]
        assert info["shape"] == (2, 2) and info["ndim"] == 2
        assert info["size"] == (4, 2, 2)
        assert info["coordinate"] == (i_dp, i_cp)
        assert info["local"] == (i_dp, i_cp, rank)
        assert info["lists"] == (dp_ranks, cp_ranks)
        assert info["mesh"] == [[0, 1], [2, 3]]
        assert info["cp"] == (1, ("cp",), 2, i_cp, cp_ranks)
        assert info["dp"] == (("dp",), i_dp, dp_ranks)
        assert info["sums"] == (float(sum(dp_ranks)), float(sum(cp_ranks)))
        assert info["cp_is_itself"] and info["same_group"]
        errors = info["errors"]
        assert "(2, 2)" in errors["local_no_dim"] and "('dp', 'cp')" in errors["local_no_dim"]
        assert "(2, 2)" in errors["rank_list_2d"]
        assert "mesh dim 2 is out of range" in errors["bad_index"]
        assert "needs a 1-D mesh; got shape (2, 2)" in errors["as_cp"]
        assert "'tp'" in errors["unknown_name"] and "('dp', 'cp')" in errors["unknown_name"]


def _three_d(rank: int, world_size: int) -> tuple[object, ...]:
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "cp"))
    return mesh.get_coordinate(), mesh.get_rank_list("pp"), mesh["dp"].rank_list, _group_sum(mesh, "pp")


def test_three_d_mesh_with_a_size_one_dim() -> None:
    results = run_ranks(_three_d, 4, timeout_s=60)
    assert results == [
        ((0, 0, 0), [0, 2], [0], 2.0),
        ((0, 0, 1), [1, 3], [1], 4.0),
        ((1, 0, 0), [0, 2], [2], 2.0),
        ((1, 0, 1), [1, 3], [3], 4.0),
    ]


def _bad_meshes(rank: int, world_size: int) -> dict[str, object]:
    platform = get_platform("cpu")
    calls: list[list[int]] = []
    original = platform.new_group

    def counting_new_group(ranks: list[int]) -> object:
        calls.append(list(ranks))
        return original(ranks)

    platform.new_group = counting_new_group  # type: ignore[method-assign]
    messages = {}
    for name, (device, shape, names) in {
        "product": ("cpu", (3,), None),
        "product_2d": ("cpu", (2, 3), ("dp", "cp")),
        "names_length": ("cpu", (2, 2), ("cp",)),
        "names_unique": ("cpu", (2, 2), ("cp", "cp")),
        "names_str": ("cpu", (4,), "cp"),
        "zero": ("cpu", (0, 4), None),
        "device": ("tpu", (4,), None),
    }.items():
        with pytest.raises(ValueError) as err:
            init_device_mesh(device, shape, mesh_dim_names=names)
        messages[name] = str(err.value)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))  # the groups still line up
    return {"messages": messages, "calls": calls, "sum": _group_sum(mesh, "cp")}


def test_bad_meshes_raise_on_every_rank_before_communicating() -> None:
    results = run_ranks(_bad_meshes, 4, timeout_s=60)
    for result in results:
        messages = result["messages"]
        assert "mesh_shape=(3,) holds 3 ranks but the world size is 4" in messages["product"]
        assert "mesh_shape=(2, 3) holds 6 ranks" in messages["product_2d"]
        assert (
            "mesh_dim_names=('cp',) has 1 names but mesh_shape=(2, 2) has 2 dims" in messages["names_length"]
        )
        assert "('cp', 'cp') must be distinct" in messages["names_unique"]
        assert "mesh_dim_names='cp'" in messages["names_str"]
        assert "mesh_shape=(0, 4)" in messages["zero"]
        assert "device_type='tpu'" in messages["device"] and "mindspore" in messages["device"]
        assert result["calls"] == [[0, 1, 2, 3]]  # only the valid mesh created a group
        assert result["sum"] == 6.0


def _torch_mesh(rank: int, world_size: int) -> dict[str, object]:
    from torch.distributed import get_process_group_ranks
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    torch_mesh = torch_init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    cp = as_cp_mesh(torch_mesh["cp"])
    x = torch.tensor([float(rank)])
    info: dict[str, object] = {
        "type": type(cp).__name__,
        "cp": (cp.size(), cp.get_local_rank(), cp.rank_list, cp.mesh_dim_names, cp.device_type),
        "torch_ranks": get_process_group_ranks(torch_mesh["cp"].get_group()),
        "platform": cp.platform is get_platform("cpu"),
        "gathered": cp.platform.collectives.all_gather(x, cp.get_group()).flatten().tolist(),
    }
    with pytest.raises(ValueError) as err:
        as_cp_mesh(torch_mesh)
    info["not_1d"] = str(err.value)
    with pytest.raises(TypeError) as type_err:
        as_cp_mesh(object())
    info["not_a_mesh"] = str(type_err.value)
    return info


def test_as_cp_mesh_adopts_a_torch_device_mesh() -> None:
    infos = run_ranks(_torch_mesh, 4, timeout_s=60)
    for rank, info in enumerate(infos):
        cp_ranks = [rank - rank % 2, rank - rank % 2 + 1]
        assert info["type"] == "DeviceMesh" and info["platform"]
        assert info["cp"] == (2, rank % 2, cp_ranks, ("cp",), "cpu")
        assert info["torch_ranks"] == cp_ranks
        assert info["gathered"] == [float(r) for r in cp_ranks]
        assert "shape (2, 2)" in info["not_1d"] and "mesh['cp']" in info["not_1d"]
        assert "builtins.object" in info["not_a_mesh"]


def _one_rank(rank: int, world_size: int) -> tuple[object, ...]:
    mesh = init_device_mesh("cpu", (1,))
    return mesh.size(), mesh.get_local_rank(), mesh.rank_list, mesh.mesh_dim_names, repr(mesh)


def test_one_rank_mesh() -> None:
    assert run_ranks(_one_rank, 1, timeout_s=30) == [(1, 0, [0], None, "DeviceMesh('cpu', [0])")]


def test_from_group_without_a_process_group() -> None:
    platform = get_platform("cpu")
    mesh = DeviceMesh.from_group(platform, None, [0], mesh_dim_name="cp")
    assert (mesh.size(), mesh.get_local_rank(), mesh.rank_list, mesh.get_group()) == (1, 0, [0], None)
    with pytest.raises(ValueError, match=r"global rank 0 is not in the mesh ranks \(1, 2\)"):
        DeviceMesh.from_group(platform, None, [1, 2])


# HP_PLATFORM names the framework, device_type the hardware (docs/backends.md, launching). These checks
# read only the environment: nothing is created or joined.
@pytest.mark.parametrize(
    ("hp_platform", "device_type", "expected"),
    [
        ("", "cpu", ("cpu", None)),
        ("", "cuda", ("cuda", None)),
        ("", "npu", ("npu", None)),
        ("", "mindspore", ("mindspore", None)),
        ("cpu", "cpu", ("cpu", None)),
        ("cuda", "cuda", ("cuda", None)),
        ("npu", "npu", ("npu", None)),
        ("mindspore", "cpu", ("mindspore", "CPU")),
        ("mindspore", "npu", ("mindspore", "Ascend")),
        ("mindspore", "mindspore", ("mindspore", None)),
    ],
)
def test_device_type_and_hp_platform_choose_the_platform(
    monkeypatch: pytest.MonkeyPatch, hp_platform: str, device_type: str, expected: tuple[str, str | None]
) -> None:
    monkeypatch.setenv("HP_PLATFORM", hp_platform)
    assert resolve_device_type(device_type) == expected


@pytest.mark.parametrize(
    ("hp_platform", "device_type", "pattern"),
    [
        (
            "mindspore",
            "cuda",
            r"device_type='cuda' cannot be served under HP_PLATFORM='mindspore': MindSpore runs on "
            r"device_type 'cpu' \(MCCL\), 'npu' \(Ascend, HCCL\) or 'mindspore'",
        ),
        ("cpu", "npu", r"device_type='npu' does not match HP_PLATFORM='cpu'.* valid device_type is 'cpu'"),
        ("cuda", "cpu", r"device_type='cpu' does not match HP_PLATFORM='cuda'.* valid device_type is 'cuda'"),
        (
            "npu",
            "mindspore",
            r"device_type='mindspore' does not match HP_PLATFORM='npu'.*HP_PLATFORM=mindspore",
        ),
        ("", "tpu", r"device_type='tpu' is unknown; valid values are cpu, cuda, npu, mindspore"),
        ("gpu", "cpu", r"HP_PLATFORM='gpu' is not a platform; valid values are cpu, cuda, npu, mindspore"),
    ],
)
def test_device_type_the_framework_cannot_serve_is_a_value_error(
    monkeypatch: pytest.MonkeyPatch, hp_platform: str, device_type: str, pattern: str
) -> None:
    monkeypatch.setenv("HP_PLATFORM", hp_platform)
    with pytest.raises(ValueError, match=pattern):
        init_device_mesh(device_type, (1,))


def test_one_mindspore_device_target_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mindspore")
    monkeypatch.setenv("HP_PLATFORM", "mindspore")
    platform = platform_for_device("cpu")  # created, not joined
    assert (platform.name, platform.device_target) == ("mindspore", "CPU")
    assert platform_for_device("mindspore") is platform is get_platform()
    with pytest.raises(ValueError, match=r"'npu' needs MindSpore on 'Ascend', but .* runs on 'CPU'"):
        init_device_mesh("npu", (1,))
