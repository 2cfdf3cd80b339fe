"""Each MindSpore CPU worker's share of the machine (hyperpar_gdn/platform/mindspore_cpu_share.py):
the plan from the launcher's numbers and the environment, its refusals, and in the shared msrun
jobs (2 and 4 workers) the threads and cores every worker's threads ended up with."""

from __future__ import annotations

import os

import pytest

from hyperpar_gdn.platform.mindspore_cpu_share import BIND_VAR, THREADS_VAR, CpuShare, plan_cpu_share


def _plan(
    rank: int,
    size: int,
    usable: list[int],
    online: int,
    *,
    launched: bool = True,
    env: dict[str, str] | None = None,
) -> CpuShare:
    return plan_cpu_share(
        environ=env or {},
        usable_cpus=usable,
        online_cpus=online,
        local_rank=rank,
        local_size=size,
        launched=launched,
    )


def test_a_launcher_gives_each_worker_its_block_of_cores() -> None:
    assert _plan(0, 2, [0, 1], 2) == CpuShare(threads=1, cpus=(0,))
    assert _plan(1, 2, [1, 0], 2) == CpuShare(threads=1, cpus=(1,))
    assert _plan(1, 2, list(range(8)), 8) == CpuShare(threads=4, cpus=(4, 5, 6, 7))
    assert _plan(2, 3, list(range(8)), 8) == CpuShare(threads=2, cpus=(4, 5))  # 2 cores left over


def test_no_binding_where_it_cannot_or_should_not_bind() -> None:
    assert _plan(3, 4, [0, 1], 2) == CpuShare(threads=1, cpus=None)  # fewer cores than workers
    assert _plan(1, 2, [4, 5, 6, 7], 8) == CpuShare(threads=2, cpus=None)  # already restricted
    assert _plan(0, 1, [0, 1], 2) == CpuShare(threads=2, cpus=None)  # one worker on the node
    assert _plan(0, 1, [0, 1], 2, launched=False) == CpuShare(threads=None, cpus=None)  # MindSpore's own


def test_the_environment_overrides_the_plan() -> None:
    env = {THREADS_VAR: "3", BIND_VAR: "0"}
    assert _plan(1, 2, [0, 1], 2, env=env) == CpuShare(threads=3, cpus=None, threads_asked=True)
    assert _plan(1, 2, [2, 5, 7, 9], 16, env={BIND_VAR: "1"}) == CpuShare(threads=2, cpus=(7, 9))
    assert _plan(0, 1, [0, 1], 2, launched=False, env={THREADS_VAR: " 1 "}) == CpuShare(
        threads=1, cpus=None, threads_asked=True
    )
    assert _plan(0, 2, [0, 1], 2, env={THREADS_VAR: "", BIND_VAR: ""}) == CpuShare(threads=1, cpus=(0,))


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({THREADS_VAR: "0"}, "HP_MINDSPORE_THREADS='0' must be a positive integer"),
        ({THREADS_VAR: "two"}, "HP_MINDSPORE_THREADS='two' must be a positive integer"),
        ({BIND_VAR: "yes"}, "HP_MINDSPORE_BIND='yes' must be 1 .* 0 .* or unset"),
        ({BIND_VAR: "1"}, "HP_MINDSPORE_BIND=1 needs a core per worker: 4 workers on this node, 2 usable"),
    ],
    ids=["threads0", "threads-word", "bind-word", "bind-too-few-cores"],
)
def test_bad_settings_name_the_variable_and_the_rule(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _plan(0, 4, [0, 1], 2, env=env)


def test_local_rank_outside_the_node_is_refused() -> None:
    with pytest.raises(ValueError, match=r"local_rank=2 must be in \[0, local_size=2\)"):
        _plan(2, 2, [0, 1], 2)


def test_the_platform_refuses_a_bad_setting_before_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mindspore")
    from hyperpar_gdn.platform.mindspore_platform import MindSporePlatform

    monkeypatch.setenv(THREADS_VAR, "-2")
    platform = MindSporePlatform("CPU")
    with pytest.raises(ValueError, match="HP_MINDSPORE_THREADS='-2' must be a positive integer"):
        platform.init_distributed(timeout_s=30)
    assert not platform.is_initialized()


def test_a_thread_count_asked_for_after_the_first_kernel_is_an_error() -> None:
    ms = pytest.importorskip("mindspore")
    from hyperpar_gdn.platform.mindspore_cpu_share import apply_cpu_share

    (ms.ops.ones((256, 256), ms.float32) @ ms.ops.ones((256, 256), ms.float32)).asnumpy()  # the pool starts
    with pytest.raises(
        RuntimeError, match="HP_MINDSPORE_THREADS=2 cannot take effect: a MindSpore kernel ran"
    ):
        apply_cpu_share(CpuShare(threads=2, cpus=None, threads_asked=True))
    assert apply_cpu_share(CpuShare(threads=None, cpus=None, threads_asked=False)) == CpuShare(None, None)
    usable = tuple(sorted(os.sched_getaffinity(0)))
    assert apply_cpu_share(CpuShare(threads=2, cpus=usable)) == CpuShare(threads=None, cpus=usable)
    assert tuple(sorted(os.sched_getaffinity(0))) == usable


@pytest.mark.parametrize("world", (2, 4), ids=lambda w: f"cp{w}")
def test_msrun_workers_run_on_their_share(world: int) -> None:
    pytest.importorskip("mindspore")
    from msrun_harness import cp_worker_job, section_data

    usable = sorted(os.sched_getaffinity(0))  # msrun's workers start with this process's cores
    blocks = []
    for rank, data in enumerate(section_data(cp_worker_job(world), "cpu_share")):
        want = _plan(rank, world, usable, os.cpu_count() or 1, env=dict(os.environ))
        assert data["share"] == {
            "threads": want.threads,
            "cpus": None if want.cpus is None else list(want.cpus),
        }
        allowed = usable if want.cpus is None else list(want.cpus)
        names = {t["name"] for t in data["threads"]}
        assert any(name.startswith("KernelThread_") for name in names), names  # the pool ran kernels
        for thread in data["threads"]:  # threads started before and after the binding alike
            assert thread["cpus"] == allowed, (rank, thread)
        if want.cpus is not None:
            blocks.append(want.cpus)
    if blocks:  # one block of len(usable) // world cores per worker, none shared
        assert len(blocks) == world
        assert len({c for b in blocks for c in b}) == len(usable) // world * world
