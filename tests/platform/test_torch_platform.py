"""TorchPlatform: selection, process-group lifecycle, and the fork harness the distributed tests use."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from distributed_harness import RanksFailed, launch_ranks, run_ranks

from hyperpar_gdn.platform import PLATFORMS, get_platform, platform_name
from hyperpar_gdn.platform.torch_collectives import TorchCollectives
from hyperpar_gdn.platform.torch_ops import TorchOps
from hyperpar_gdn.platform.torch_platform import TorchPlatform

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# --- selection --------------------------------------------------------------------------------------
def test_unknown_hp_platform_lists_valid_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HP_PLATFORM", "tpu")
    for call in (platform_name, get_platform):
        with pytest.raises(ValueError) as err:
            call()
        assert "'tpu'" in str(err.value)
        assert all(name in str(err.value) for name in PLATFORMS)


def test_hp_platform_cpu_selects_torch_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HP_PLATFORM", "cpu")
    platform = get_platform()
    assert isinstance(platform, TorchPlatform)
    assert (platform.name, platform.backend, platform.device) == ("cpu", "gloo", torch.device("cpu"))
    assert isinstance(platform.ops, TorchOps)
    assert isinstance(platform.collectives, TorchCollectives)
    assert get_platform("cpu") is platform


def test_unknown_torch_platform_name() -> None:
    with pytest.raises(ValueError, match="'xpu'.*cpu, cuda, npu"):
        TorchPlatform("xpu")


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed")
def test_npu_without_torch_npu_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="torch_npu"):
        TorchPlatform("npu")


def test_importing_the_platform_does_not_import_torch_npu() -> None:
    code = (
        "import sys; import hyperpar_gdn.platform.torch_platform; "
        "from hyperpar_gdn.platform import get_platform; get_platform('cpu'); "
        "assert 'torch_npu' not in sys.modules, 'torch_npu imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_rank_and_world_size_before_init(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    platform = TorchPlatform("cpu")
    assert (platform.rank(), platform.world_size(), platform.is_initialized()) == (0, 1, False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert (platform.rank(), platform.world_size()) == (3, 8)
    with pytest.raises(RuntimeError, match="init_distributed"):
        platform.new_group([0, 1])
    assert platform.adopt_mesh(object()) is None


# --- process groups (in forked ranks: the pytest process never owns a group) -----------------------
def _single_process(rank: int, world_size: int) -> dict[str, object]:
    for var in LAUNCH_VARS:
        os.environ.pop(var, None)
    platform = get_platform("cpu")
    platform.init_distributed(timeout_s=10)
    platform.init_distributed(timeout_s=10)  # idempotent
    x = torch.tensor([1.5, 2.5])
    info = {
        "rank": platform.rank(),
        "world": platform.world_size(),
        "backend": dist.get_backend(),
        "gathered": platform.collectives.all_gather(x, None).tolist(),
        "summed": platform.collectives.all_reduce_sum(x.clone()).tolist(),
    }
    platform.destroy()
    info["after_destroy"] = platform.is_initialized()
    return info


def test_init_without_launcher_env_makes_a_one_rank_group() -> None:
    (info,) = run_ranks(_single_process, 1, init=False, timeout_s=30)
    assert info == {
        "rank": 0,
        "world": 1,
        "backend": "gloo",
        "gathered": [[1.5, 2.5]],
        "summed": [1.5, 2.5],
        "after_destroy": False,
    }


def _partial_env(rank: int, world_size: int) -> str:
    os.environ.pop("WORLD_SIZE")
    with pytest.raises(ValueError) as err:
        get_platform("cpu").init_distributed(timeout_s=5)
    return str(err.value)


def test_init_with_incomplete_env_names_the_missing_variable() -> None:
    (message,) = run_ranks(_partial_env, 1, init=False, timeout_s=30)
    assert "RANK set but WORLD_SIZE missing" in message


def _groups(rank: int, world_size: int) -> dict[str, object]:
    platform = get_platform()
    platform.init_distributed(timeout_s=10)  # already joined by the harness: a no-op
    odd = platform.new_group([1, 3])
    with pytest.raises(ValueError, match=r"ranks=\[3, 1\]"):
        platform.new_group([3, 1])
    with pytest.raises(ValueError, match=r"ranks=\[0, 4\]"):
        platform.new_group([0, 4])
    info: dict[str, object] = {"rank": platform.rank(), "world": platform.world_size()}
    if rank in (1, 3):
        info["odd"] = (dist.get_rank(odd), dist.get_world_size(odd))
        info["odd_sum"] = platform.collectives.all_reduce_sum(torch.tensor([float(rank)]), odd).item()
    return info


def test_env_init_and_new_group_on_four_ranks() -> None:
    infos = run_ranks(_groups, 4, timeout_s=30, rendezvous="env")  # torchrun's env:// path
    assert [(i["rank"], i["world"]) for i in infos] == [(r, 4) for r in range(4)]
    assert infos[1]["odd"] == (0, 2) and infos[3]["odd"] == (1, 2)
    assert infos[1]["odd_sum"] == infos[3]["odd_sum"] == 4.0
    assert "odd" not in infos[0] and "odd" not in infos[2]


# --- the harness ------------------------------------------------------------------------------------
def _environment(rank: int, world_size: int) -> dict[str, object]:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "OMP_NUM_THREADS", "HP_PLATFORM", "EXTRA")
    return {
        **{key: os.environ.get(key) for key in keys},
        "threads": torch.get_num_threads(),
        "initialized": get_platform().is_initialized(),
    }


@pytest.mark.parametrize("rendezvous", ["file", "env"])
def test_harness_sets_launcher_environment(rendezvous: str) -> None:
    envs = run_ranks(_environment, 2, env={"EXTRA": "x"}, timeout_s=30, rendezvous=rendezvous)
    for rank, env in enumerate(envs):
        assert env == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1" if rendezvous == "env" else None,
            "OMP_NUM_THREADS": "1",
            "HP_PLATFORM": "cpu",
            "EXTRA": "x",
            "threads": 1,
            "initialized": True,
        }


def _raise_on_odd(rank: int, world_size: int) -> int:
    if rank % 2:
        raise KeyError(f"boom on rank {rank}")
    return rank


def test_harness_reports_every_failing_rank() -> None:
    with pytest.raises(RanksFailed) as err:
        run_ranks(_raise_on_odd, 4, timeout_s=30)
    outcome = err.value.outcome
    assert sorted(outcome.errors) == [1, 3] and outcome.results == {0: 0, 2: 2}
    assert "boom on rank 1" in str(err.value) and "boom on rank 3" in str(err.value)
    assert isinstance(err.value, AssertionError)


def _die_then_barrier(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    get_platform().collectives.barrier(None)
    return rank


def test_harness_collects_dead_ranks_and_peers_fail_fast() -> None:
    outcome = launch_ranks(_die_then_barrier, 3, timeout_s=30, grace_s=10)
    assert outcome.dead == {1: 3}
    assert sorted(outcome.errors) == [0, 2]  # their barrier lost its peer
    assert all(re.search(r"(closed|reset) by peer", outcome.errors[r]) for r in (0, 2))
    assert outcome.wall_s < 10


def _hang(rank: int, world_size: int) -> int:
    if rank == 0:
        time.sleep(60)
    return rank


def test_harness_kills_a_job_past_its_deadline() -> None:
    start = time.monotonic()
    outcome = launch_ranks(_hang, 2, timeout_s=1)
    assert outcome.timed_out == [0] and outcome.results == {1: 1}
    assert "in _hang" in outcome.stacks[0]  # where it hung, from faulthandler
    assert time.monotonic() - start < 10
    with pytest.raises(RanksFailed, match=r"timed out \[0\]"):
        run_ranks(_hang, 2, timeout_s=0.5)


def test_harness_refuses_a_parent_with_a_process_group() -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="parent process owns a default process group"):
            run_ranks(_environment, 1, timeout_s=10)
    finally:
        dist.destroy_process_group()


def _attempt(rank: int, world: int, late_rank: int | None) -> list[float]:
    """One torchrun attempt: join the group (``late_rank`` some seconds after the others), make a
    subgroup, reduce over both."""
    if rank == late_rank:
        time.sleep(3.0)  # its peers read the store first: a stale address would be theirs to take
    platform = get_platform("cpu")
    platform.init_distributed(timeout_s=20)
    try:
        x = torch.full((1,), float(rank + 1))
        platform.collectives.all_reduce_sum(x, platform.new_group(list(range(world))))
        platform.collectives.all_reduce_sum(x, None)
        return x.tolist()
    finally:
        platform.destroy()


def test_each_torchrun_attempt_meets_afresh_in_the_agents_store() -> None:
    """Two attempts in one store that outlives them (torchrun's agent store): the second meets under
    its own prefix, although the first left the addresses of its finished ranks there. Without the
    prefix rank 0 of the second attempt takes rank 1's stale address (rank 1 comes late) and fails
    with 'Connection refused' at the process-group timeout."""
    import multiprocessing

    from hyperpar_gdn.platform.launch_rank import start_store_host

    host, port = start_store_host(multiprocessing.get_context("fork"), 60)
    try:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
        env["TORCHELASTIC_RUN_ID"] = "job"
        for attempt, late in ((0, None), (1, 1)):
            env["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
            results = run_ranks(_attempt, 2, late, init=False, env=env, timeout_s=60)
            assert results == [[6.0], [6.0]], f"attempt {attempt}: {results}"
    finally:
        host.kill()
        host.join()
