"""Every CP mode under MindSpore (MCCL on CPU, msrun with 2 and 4 workers, the mesh of
``init_device_mesh("cpu", ...)`` under ``HP_PLATFORM=mindspore``) equals the single-device
MindSpore layer and the torch layer with the same weights: output shard, input-gradient shard and
every parameter gradient summed over the ranks, also with shards of different lengths and with
ulysses giving a q/k head to several ranks. Bad input raises torch's ValueErrors on every rank.

The msrun jobs are shared with tests/platform/test_mindspore_platform.py (one job per world size,
see ``msrun_harness.cp_worker_job``); the torch side of the comparisons runs on forked gloo ranks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mindspore")

import msrun_cp_worker as worker  # noqa: E402  (tests/distributed is on sys.path under pytest)
from distributed_harness import run_ranks  # noqa: E402
from msrun_harness import cp_worker_job, run_msrun, section_data  # noqa: E402

from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh  # noqa: E402
from hyperpar_gdn.platform import get_platform  # noqa: E402

WORLDS = (2, 4)
# docs/maths.md: fp32 max abs error <= 1e-4 relative to each tensor's scale. float64: rounding only
# (measured <= 2e-13 against MindSpore's single device and torch).
TOL = {"float32": 1e-4, "float64": 1e-10}
ERROR_KEYS = {"output", "grad_input", *(f"grad_{name}" for name in worker.PARAMS)}


def _too_far(
    errors: dict[str, float], tol: float, cp_truth: dict[str, float], single_truth: dict[str, float]
) -> dict[str, float]:
    """The entries above ``tol`` where CP is also further from the float64 truth than twice the
    single-device layer is (the torch CP test's rule: some float32 gradients, e.g. of dt_bias
    under a padding mask, sum terms that nearly cancel, and single device and CP both sit about
    5e-4 from the truth there)."""
    return {k: v for k, v in errors.items() if not (v <= tol or cp_truth[k] <= 2 * single_truth[k])}


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"cp{w}")
@pytest.mark.parametrize("mode", worker.MODES)
def test_mode_matches_single_device_and_torch(mode: str, world: int) -> None:
    per_rank = section_data(cp_worker_job(world), "cp")
    assert len(per_rank) == world
    for rank, results in enumerate(per_rank):
        assert results["mesh"] == ["cpu", "mindspore", True], results["mesh"]
        for case in worker.CASES:
            entry = results[f"{case}/{mode}"]
            if mode in worker.HEAD_MODES and not worker.ulysses_splits(case, world):
                assert "skipped" in entry, (
                    f"rank {rank} {case}: {mode} ran with heads not divisible by {world}"
                )
                continue
            assert entry["grad_names"] == sorted(worker.PARAMS), entry["grad_names"]
            single_truth = results[f"{case}/single_device_vs_truth"]
            for reference in ("vs_mindspore", "vs_torch"):
                errors = entry[reference]
                assert set(errors) == ERROR_KEYS, sorted(errors)
                bad = _too_far(errors, TOL[case.dtype], entry["vs_truth"], single_truth)
                assert not bad, f"rank {rank} {case} {mode} {reference}: {bad}"


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"cp{w}")
def test_single_device_mindspore_layer_matches_torch(world: int) -> None:
    """The references agree with each other, so the CP checks above compare like with like."""
    for rank, results in enumerate(section_data(cp_worker_job(world), "cp")):
        for case in worker.CASES:
            errors = results[f"{case}/single_device_vs_torch"]
            assert set(errors) == ERROR_KEYS
            bad = {k: v for k, v in errors.items() if not v <= TOL[case.dtype]}
            assert not bad, f"rank {rank} {case}: {bad}"


def _torch_bytes(rank: int, world: int, case: worker.Case) -> dict[str, int]:
    """bytes_sent of one CP forward+backward per mode on torch (gloo), for the same case."""
    platform = get_platform()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    x, cot, mask = worker.case_inputs(case)
    local = worker.shard_bounds(case, world, rank)
    sent = {}
    for mode in worker.MODES:
        if mode in worker.HEAD_MODES and not worker.ulysses_splits(case, world):
            continue
        layer = LinearAttentionContextParallel(mode=mode).apply(worker.torch_layer(case), mesh)
        platform.collectives.reset_bytes()
        worker.platform_run(
            platform, layer, x[:, local], cot[:, local], None if mask is None else mask[:, local], case.dtype
        )
        sent[mode] = platform.collectives.reset_bytes()
    return sent


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"cp{w}")
@pytest.mark.parametrize("case", [worker.CASES[0], worker.CASES[-1]], ids=str)
def test_bytes_sent_match_torch(world: int, case: worker.Case) -> None:
    """Both platforms count the same logical traffic for the same layer, modes and shards."""
    torch_bytes = run_ranks(_torch_bytes, world, case, timeout_s=120)
    for rank, results in enumerate(section_data(cp_worker_job(world), "cp")):
        ms_bytes = {mode: results[f"{case}/{mode}"]["bytes_sent"] for mode in torch_bytes[rank]}
        assert ms_bytes == torch_bytes[rank], (
            f"rank {rank}: MindSpore {ms_bytes} vs torch {torch_bytes[rank]}"
        )
        assert all(v > 0 for v in ms_bytes.values()), ms_bytes


def _torch_bad_input(rank: int, world: int) -> dict[str, Any]:
    from hyperpar_gdn.models import GatedDeltaNet

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    return worker.bad_input_checks(
        get_platform(), mesh, lambda hk, h: GatedDeltaNet(worker.HIDDEN, hk, h, 16, 8)
    )


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"cp{w}")
def test_bad_input_raises_torchs_value_errors_on_every_rank(world: int) -> None:
    ms_outcomes = section_data(cp_worker_job(world), "bad_input")
    torch_outcomes = run_ranks(_torch_bad_input, world, timeout_s=60)
    for rank in range(world):
        ms_rank, torch_rank = ms_outcomes[rank], torch_outcomes[rank]
        assert ms_rank.pop("in_step") == list(range(world)), (
            f"rank {rank}: ranks out of step after the errors"
        )
        torch_rank.pop("in_step")
        assert set(ms_rank) == set(torch_rank), sorted(set(ms_rank) ^ set(torch_rank))
        for check, (kind, message) in ms_rank.items():
            assert kind == "ValueError", f"rank {rank} {check}: {kind}: {message}"
            assert [kind, message] == torch_rank[check], (
                f"rank {rank} {check}: {message!r} vs torch {torch_rank[check]}"
            )


def test_mesh2d_cp_axis_through_verify() -> None:
    """CP along the cp axis of a (dp=2, cp=2) mesh, checked by verify.compare_with_reference."""
    for rank, results in enumerate(section_data(cp_worker_job(4), "mesh2d")):
        assert results["cp_ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert results["dp_ranks"] == [rank % 2, rank % 2 + 2]
        for mode in worker.MODES:
            errors, cp_truth = results[mode]["vs_single"], results[mode]["vs_truth"]
            assert set(errors) == set(cp_truth) == ERROR_KEYS, sorted(errors)
            bad = _too_far(errors, TOL["float32"], cp_truth, results["single_vs_truth"])
            assert not bad, f"rank {rank} {mode}: {bad}"


def test_a_stalled_peer_gives_a_named_collective_error_in_time() -> None:
    """Rank 1 stays alive but never joins: rank 0 fails by itself after MS_CPU_COMM_OP_TIMEOUT."""
    outcome = cp_worker_job(2)
    stalled, waiting = section_data(outcome, "stall")[::-1]
    assert "stalled_s" in stalled
    kind, message = waiting["error"]
    assert kind == "CollectiveError", f"{kind}: {message}"
    assert message.startswith("collective all_gather over global ranks [0, 1] failed on rank 0"), message
    assert waiting["timeout_s"] - 1 <= waiting["waited_s"] <= waiting["timeout_s"] + 10, waiting


def test_selfcheck_runs_under_msrun() -> None:
    """scripts/selfcheck.py under msrun prints the torch run's table: every one-level mode of the
    library's list ok, the two-level ones skipped (2 workers) with the reason."""
    from hyperpar_gdn.planning.plan import MODES, TWO_LEVEL_MODES

    script = Path(__file__).resolve().parents[2] / "scripts" / "selfcheck.py"
    args = ["--seq-len", "64", "--hidden", "32", "--head-dim", "16", "--timeout-s", "60"]
    outcome = run_msrun(script, 2, args, timeout_s=180)
    log = outcome.logs.get("worker_0.log", "")
    assert outcome.returncode == 0 and not outcome.timed_out, outcome.describe()
    assert "platform=mindspore ranks=2 T=64 B=2 hidden=32" in log, log
    for mode in MODES:
        assert re.search(rf"^{mode}\s+\S+ \(\w[\w.]*\)\s+[\d.]+s\s+ok$", log, re.MULTILINE), log
    for mode in TWO_LEVEL_MODES:
        assert re.search(rf"^{re.escape(mode)}\s+skipped: two levels need 4 or more ranks", log, re.M), log
    expected = f"selfcheck: {len(MODES)}/{len(MODES)} ok, {len(TWO_LEVEL_MODES)} skipped"
    assert log.rstrip().endswith(expected), log


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"cp{w}")
def test_packed_documents_equal_each_document_alone(world: int) -> None:
    """Global cu_seqlens, every mode (float64): the MindSpore layer under CP against the torch
    layer run on each document alone (documents across shard boundaries, shorter than the conv
    halo, starting exactly at a shard start); also in the head_tail layout, with documents across
    its pieces and with padding."""
    per_rank = section_data(cp_worker_job(world), "packed")
    for rank, results in enumerate(per_rank):
        # and the head_tail layout: packed documents across pieces and padding, every mode
        assert len(results) == (len(worker.PACKED_CASES) + 2) * len(worker.MODES)
        for key, errors in results.items():
            assert set(errors) == ERROR_KEYS, key
            bad = {k: v for k, v in errors.items() if not v <= TOL["float64"]}
            assert not bad, f"rank {rank} {key}: {bad}"
