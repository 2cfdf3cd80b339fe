"""The local GDN kernel's choice where fla cannot run (the main test venv: fla's package without
triton): ``auto`` is ours with the reason, ``"fla"`` is one error line naming what is missing,
before any change to a layer; the native kernel is the one every call runs. fla's kernels
themselves are tested under Triton's interpreter in their own environment (``tests_fla/``,
``.ci/fla_env``)."""

from __future__ import annotations

import importlib.util

import pytest
from distributed_harness import run_ranks

from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
from hyperpar_gdn.models import GatedDeltaNet
from hyperpar_gdn.ops.gdn.kernels import resolve_kernel
from hyperpar_gdn.planning.plan import CPPlan


def test_auto_is_ours_where_fla_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = resolve_kernel("auto", platform="cpu")
    assert (cpu.name, cpu.reason) == ("native", "auto on cpu: fla's Triton kernels need CUDA or Ascend")
    cuda = resolve_kernel("auto", platform="cuda")
    assert cuda.name == "native" and "triton not installed (pip install 'hyperpar-gdn[fla]')" in cuda.reason
    assert resolve_kernel("native", platform="mindspore").name == "native"


def test_asking_for_fla_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # without triton the CPU's first answer is that it is missing (the interpreter needs it too)
    with pytest.raises(ValueError, match=r"^kernel='fla' cannot run on platform 'cpu': triton not installed"):
        resolve_kernel("fla", platform="cpu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # as if both were installed
    with pytest.raises(
        ValueError, match=r"^kernel='fla' cannot run on platform 'cpu': .*TRITON_INTERPRET=1\)$"
    ):
        resolve_kernel("fla", platform="cpu")
    monkeypatch.undo()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(
        ValueError, match=r"^kernel='fla' cannot run on platform 'cuda': triton not installed"
    ):
        resolve_kernel("fla", platform="cuda")
    with pytest.raises(
        ValueError, match="kernel='cuda' is not a GDN kernel; choose one of auto, fla, native"
    ):
        CPPlan(mode="p2p", kernel="cuda")


def test_fla_refused_on_every_rank_before_any_change() -> None:
    def worker(rank: int, world: int) -> tuple[str, bool]:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        layer = GatedDeltaNet(32, 2, 4, 8, 8)
        forward = layer.forward
        try:
            LinearAttentionContextParallel("p2p", kernel="fla").apply(layer, mesh)
        except ValueError as error:
            return str(error), layer.forward == forward
        return "no error", False

    for message, unchanged in run_ranks(worker, 2, timeout_s=120):
        assert "kernel='fla' cannot run on platform 'cpu'" in message and unchanged, message


def test_the_style_names_the_kernel_it_runs() -> None:
    def worker(rank: int, world: int) -> str:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        style = LinearAttentionContextParallel("all_gather")
        style.apply(GatedDeltaNet(32, 2, 4, 8, 8), mesh)
        return style.kernel_choice.name

    assert run_ranks(worker, 2, timeout_s=120) == ["native", "native"]
