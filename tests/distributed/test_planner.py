"""The cost model of ``plan_context_parallel``: its traffic term equals the bytes the layer really
sends (gloo, cp 4, fp32, every mode: the platform's ``bytes_sent``); in bf16 the summary modes
drift from the fp64 truth no more than ulysses (the same launch); the ranking follows its
inputs (summary memory linear in cp, messages in sequence, ulysses refused when cp does not
divide the value heads, latency- or bandwidth-bound links); ``apply_context_parallel`` takes
``mode="auto"`` with ``seq_len`` and refuses bad input with the value and the rule."""

from __future__ import annotations

import math

import pytest
import torch
from benchkit.bf16_drift import DriftShape, drift, run_modes, truth, worst_ratios
from distributed_harness import run_ranks

from hyperpar_gdn import (
    LinearAttentionContextParallel,
    apply_context_parallel,
    init_device_mesh,
    plan_context_parallel,
)
from hyperpar_gdn.models import GatedDeltaNet, HybridLM
from hyperpar_gdn.models.lm import HybridLMConfig

QWEN27B = {"num_k_heads": 16, "num_v_heads": 48, "head_k_dim": 128, "head_v_dim": 128}
SMALL = {"num_k_heads": 4, "num_v_heads": 4, "head_k_dim": 16, "head_v_dim": 8}
T, CP = 64, 4
DRIFT_T, DRIFT_MODES = 2048, ("ulysses", "p2p", "all_gather", "scan")


def _per_mode(rank: int, world: int) -> dict[str, dict]:
    """One launch for both checks: every mode's bytes sent (fp32) and its bf16 drift shards."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    comm = mesh.platform.collectives
    sent = {}
    for mode in ("ulysses", "p2p", "all_gather", "scan"):
        torch.manual_seed(0)
        layer = LinearAttentionContextParallel(mode).apply(GatedDeltaNet(32, 4, 4, 16, 8), mesh)
        x = torch.randn(1, T // world, 32, requires_grad=True)
        comm.reset_bytes()
        layer(x).sum().backward()
        sent[mode] = comm.reset_bytes() - 8 * (world - 1)  # less the shard lengths' exchange
    drift = run_modes(rank, world, DriftShape(), DRIFT_T, DRIFT_MODES)
    return {"bytes": sent, "drift": drift}


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, dict]]:
    return run_ranks(_per_mode, CP, timeout_s=240)


@pytest.mark.timeout(300)
def test_traffic_term_equals_the_bytes_sent(per_rank: list[dict[str, dict]]) -> None:
    plan = plan_context_parallel(seq_len=T, cp=CP, dtype="float32", device="cpu", **SMALL)
    predicted = {c.mode: c.bytes_sent for c in plan.ranking}
    sent = [r["bytes"] for r in per_rank]
    for mode in ("ulysses", "p2p", "all_gather"):  # the worst rank sends exactly the prediction
        assert max(r[mode] for r in sent) == predicted[mode], (mode, [r[mode] for r in sent])
    # scan: the prediction counts full maps in every round; the first windows send states only
    worst = max(r["scan"] for r in sent)
    assert predicted["p2p"] < worst <= predicted["scan"], (worst, predicted["scan"])


@pytest.mark.timeout(300)
def test_bf16_summary_modes_drift_no_more_than_ulysses(per_rank: list[dict[str, dict]]) -> None:
    """bf16 weights and inputs, T = 2048 over cp 4: against the fp64 one-device run of the same
    bf16-rounded layer, each summary mode's relative error (max-abs and RMS; output, input
    gradient, every parameter gradient) is at most 1.2x ulysses'. Measured here: worst ratio
    1.10 (max-abs) and 1.11 (RMS), both on dt_bias' gradient."""
    errors = drift([r["drift"] for r in per_rank], truth(DriftShape(), DRIFT_T))
    assert set(errors) == {"single_bf16", *DRIFT_MODES}
    for metric in ("max", "rms"):
        for mode, (tensor, ratio) in worst_ratios(errors, metric=metric).items():
            assert ratio <= 1.2, f"{mode} {metric} error on {tensor}: {ratio:.3f}x ulysses' ({errors[mode][tensor]})"
    for mode in DRIFT_MODES:  # bf16-sized errors, not a broken run
        assert all(2e-4 < e["max"] < 5e-2 for e in errors[mode].values()), errors[mode]


def test_ranking_follows_the_inputs() -> None:
    big = plan_context_parallel(seq_len=1 << 20, cp=256, **QWEN27B)
    assert big.choice == "scan", big.why()
    costs = {c.mode: c for c in big.ranking}
    assert (
        not costs["ulysses"].feasible
        and "num_v_heads=48 is not divisible by cp=256" in costs["ulysses"].reason
    )
    assert big.ranking[-1].mode == "ulysses"  # refused modes rank last
    assert costs["scan"].messages == 2 * math.ceil(math.log2(256)) + 2
    assert costs["p2p"].messages == 2 * 255 + 2
    small = {c.mode: c for c in plan_context_parallel(seq_len=1 << 20, cp=8, **QWEN27B).ranking}
    assert costs["all_gather"].summary_bytes == 32 * small["all_gather"].summary_bytes  # cp x maps
    assert costs["scan"].summary_bytes == small["scan"].summary_bytes == 3 * 48 * 128 * 256 * 4
    # one message costing a second: fewest messages in sequence wins; free messages and a slow
    # link: fewest bytes in sequence win (at cp 2, p2p's one state each way)
    assert plan_context_parallel(seq_len=4096, cp=8, latency=1.0, **QWEN27B).choice == "scan"
    slow = plan_context_parallel(seq_len=1 << 17, cp=2, latency=0.0, bandwidth=1e6, flops=1e18, **QWEN27B)
    assert slow.choice == "p2p", slow.why()
    assert "predicted fastest" in slow.why() and "MiB" in slow.why()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cp": 0}, "cp must be an int >= 1; got 0"),
        ({"seq_len": 10.5}, "seq_len must be an int >= 1; got 10.5"),
        ({"dtype": "fp8"}, "dtype='fp8'; choose one of float32"),
        ({"device": "tpu"}, "device='tpu'; choose one of gpu"),
        ({"modes": ("ring",)}, "modes=['ring']; choose among ulysses"),
        ({"layout": "zigzag"}, "layout='zigzag'"),
        ({"bandwidth": -1.0}, "bandwidth and flops must be > 0"),
    ],
)
def test_bad_plan_input(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        plan_context_parallel(**({"seq_len": 1024, "cp": 4} | SMALL | options))


def test_auto_mode_on_a_model() -> None:
    """A one-rank mesh: auto needs seq_len and takes the plan's choice; seq_len is refused
    without auto."""

    def worker(rank: int, world: int) -> list[str]:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        config = HybridLMConfig(vocab_size=61, hidden_size=32, num_layers=2)
        errors = []
        for kwargs in ({"mode": "auto"}, {"mode": "p2p", "seq_len": 64}):
            try:
                apply_context_parallel(HybridLM(config), mesh, **kwargs)
            except ValueError as err:
                errors.append(str(err))
        model = apply_context_parallel(HybridLM(config), mesh, mode="auto", seq_len=64)
        errors.append(type(model).__name__)
        return errors

    for errors in run_ranks(worker, 1, timeout_s=60):
        assert errors[0] == errors[1].replace("'p2p', seq_len=64", "'auto', seq_len=None"), errors
        assert "seq_len is given with mode='auto' and only then" in errors[0], errors
        assert errors[2] == "HybridLM"
