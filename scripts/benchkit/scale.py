"""``bench_scale``'s parts: the CP modes measured on this machine, and the cost model far away.

- :func:`measure_modes` (a rank of :func:`benchkit.ranks.on_ranks`): one GDN layer's
  forward+backward per mode on this rank: the bytes the platform's collectives sent (less the
  8-byte length exchange), the message-sending calls (send, all_to_all, all_gather,
  shift_right; a collective is one call and its backward runs inside it, uncounted: for p2p and
  scan the sends are the rounds) and its times in alternating rounds beside the same layer
  without CP on the rank's T/cp tokens; :func:`probe_machine` measures the link and the chunk
  rule's FLOP rate.
- :func:`measured_rows`: the worst rank per mode (the slowest rank per round) and what the mode
  adds to the layer without CP, beside ``plan_context_parallel``'s prediction for the ``cpu``
  machine calibrated with the probe.
- :func:`predicted_rows`: the model's ranking for real GDN geometries (:data:`GEOMETRIES`) at
  :data:`FAR_CPS` x :data:`FAR_TOKENS` on the ``gpu`` and ``npu`` machines, nodes of 8 devices,
  two-level modes with one node as the inner group.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchkit.timing import alternating_rounds, slowest_per_round
from hyperpar_gdn.planning.plan import STATE_MODES, TWO_LEVEL_MODES

__all__ = [
    "FAR_CPS",
    "FAR_TOKENS",
    "GEOMETRIES",
    "ONE_LEVEL",
    "TWO_LEVEL",
    "measure_modes",
    "measured_rows",
    "predicted_rows",
]

ONE_LEVEL = ("ulysses", *STATE_MODES)  # ulysses_hidden needs the hidden size, not in these geometries
TWO_LEVEL = TWO_LEVEL_MODES
COUNTED = ("send", "all_to_all", "all_gather", "shift_right")
# GDN heads (16 q/k heads of 128 in both): Qwen3.5-27B from transformers' Qwen3.5 defaults,
# Qwen3.5-397B-A17B as public copies of its config.json give it (64 value heads, hidden 4096)
GEOMETRIES = {
    "Qwen3.5-27B": {"num_k_heads": 16, "num_v_heads": 48, "head_k_dim": 128, "head_v_dim": 128},
    "Qwen3.5-397B-A17B": {"num_k_heads": 16, "num_v_heads": 64, "head_k_dim": 128, "head_v_dim": 128},
}
FAR_CPS = (8, 16, 32, 64, 128, 256)
FAR_TOKENS = (131072, 262144, 524288, 1048576)
NODE = 8  # devices per node of the far predictions, and their inner group


def _modes(cp: int, heads: dict[str, int], inner: int) -> list[tuple[str, int | None]]:
    """(mode, inner_size) pairs this cp can run: ulysses where cp divides the value heads, the
    two-level modes where ``inner`` splits cp into two levels and divides the heads."""
    pairs = [(m, None) for m in ONE_LEVEL if m != "ulysses" or heads["num_v_heads"] % cp == 0]
    if 1 < inner < cp and cp % inner == 0 and heads["num_v_heads"] % inner == 0:
        pairs += [(m, inner) for m in TWO_LEVEL]
    return pairs


def measure_modes(rank: int, cp: int, job: dict[str, Any]) -> dict[str, dict[str, float]]:
    """This rank's ``{mode: {"bytes", "calls", "samples"}}`` (forward+backward of one layer: what
    a counted warm-up sent, then the seconds of alternating rounds, every mode once per round), the
    ``"local"`` entry (the same layer without CP on this rank's T/cp tokens: the work every mode
    shares) and ``"machine"``: what the cost model's ``cpu`` machine is calibrated with, measured
    here (:func:`probe_machine`)."""
    import torch

    from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
    from hyperpar_gdn.models import GatedDeltaNet

    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    comm = mesh.platform.collectives
    calls = {"n": 0}

    def counting(name: str) -> Any:
        original = getattr(comm, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            return original(*args, **kwargs)

        return call

    out: dict[str, Any] = {"machine": probe_machine(rank, mesh, job)}
    for name in COUNTED:  # instance attributes: this process's collectives only
        setattr(comm, name, counting(name))
    heads = job["heads"]
    steps = {}
    for mode, inner in [("local", None), *_modes(cp, heads, job["inner_size"])]:
        torch.manual_seed(0)
        layer = GatedDeltaNet(
            job["hidden"],
            heads["num_k_heads"],
            heads["num_v_heads"],
            heads["head_k_dim"],
            heads["head_v_dim"],
        )
        if mode != "local":
            LinearAttentionContextParallel(mode, inner_size=inner).apply(layer, mesh)
        x = torch.randn(1, job["seq_len"] // cp, job["hidden"], requires_grad=True)
        steps[mode] = lambda layer=layer, x=x: layer(x).sum().backward()
        comm.reset_bytes()  # a counted warm-up: what one forward+backward sends
        calls["n"] = 0
        steps[mode]()
        sent = comm.reset_bytes() - 8 * (cp - 1) * (mode != "local")
        out[mode] = {"bytes": sent, "calls": calls["n"]}
    group = mesh.get_group()
    times = alternating_rounds(steps, repeats=job["repeats"], warmup=0, barrier=lambda: comm.barrier(group))
    for mode, samples in times.items():
        out[mode]["samples"] = samples
    return out


def probe_machine(rank: int, mesh: Any, job: dict[str, Any]) -> dict[str, float]:
    """This machine as the cost model sees it, measured on ranks 0 and 1 (the others wait):
    ``latency`` (half a round trip of 8 bytes), ``bandwidth`` (bytes/s of a 4 MiB one-way message,
    latency removed), both medians of 10 round trips; and ``flops``: the chunk rule's forward
    and backward on this rank's T/cp tokens, its FLOPs (the model's ``shared_flops``) over the
    median time."""
    import torch

    from hyperpar_gdn.ops.gdn import chunk_gated_delta_rule
    from hyperpar_gdn.planning.cost_model import Geometry

    comm, group = mesh.platform.collectives, mesh.get_group()
    heads, t = job["heads"], job["seq_len"] // mesh.size()
    trips: dict[int, list[float]] = {8: [], 4 << 20: []}
    for size in trips:
        buf = torch.zeros(size // 4)
        for _ in range(11):
            comm.barrier(group)
            t0 = time.perf_counter()
            if rank == 0:
                comm.send(buf, 1, group)
                comm.recv(buf, 1, group)
            elif rank == 1:
                buf = comm.recv(buf, 0, group)
                comm.send(buf, 0, group)
            trips[size].append(time.perf_counter() - t0)
    latency = statistics.median(trips[8][1:]) / 2
    bandwidth = (4 << 20) / max(statistics.median(trips[4 << 20][1:]) / 2 - latency, 1e-9)
    hk, h, dk, dv = (heads[n] for n in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"))
    torch.manual_seed(rank)
    q, k = (torch.randn(1, t, hk, dk, requires_grad=True) for _ in range(2))
    v = torch.randn(1, t, h, dv, requires_grad=True)
    g, beta = -torch.rand(1, t, h), torch.rand(1, t, h)
    rule = []
    for _ in range(3):
        t0 = time.perf_counter()
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        o.sum().backward()
        rule.append(time.perf_counter() - t0)
    geometry = Geometry(job["seq_len"], mesh.size(), hk, h, dk, dv, 4, 1, 4)
    return {
        "latency": latency,
        "bandwidth": bandwidth,
        "flops": geometry.shared_flops() / statistics.median(rule),
        "rule_seconds": statistics.median(rule),
    }


def measured_machine(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """The ``cpu`` machine as measured: rank 0's link, the slowest rank's chunk-rule FLOP rate."""
    link = per_rank[0]["machine"]
    return {
        "bandwidth": link["bandwidth"],
        "latency": link["latency"],
        "flops": min(r["machine"]["flops"] for r in per_rank),
    }


def measured_rows(cp: int, job: dict[str, Any], per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: the worst rank's measurement beside ``plan_context_parallel``'s prediction for
    the ``cpu`` machine calibrated with this run's :func:`probe_machine` (link and FLOP rate).
    ``added_seconds`` is what the mode adds to the layer without CP on the same T/cp tokens
    (``local_seconds``): the quantity the model's ``predicted_seconds`` predicts."""
    from hyperpar_gdn import plan_context_parallel

    modes = [m for m in per_rank[0] if m not in ("machine", "local")]
    inner = job["inner_size"] if any("+" in m for m in modes) else None
    machine = measured_machine(per_rank)
    plan = plan_context_parallel(
        seq_len=job["seq_len"],
        cp=cp,
        dtype="float32",
        device="cpu",
        inner_size=inner,
        inter_bandwidth=machine["bandwidth"],
        inter_latency=machine["latency"],
        **machine,
        **job["heads"],
    )
    predicted = {c.mode: c for c in plan.ranking}
    local = slowest_per_round([r["local"]["samples"] for r in per_rank])
    rows = []
    for mode in modes:
        worst = {key: max(r[mode][key] for r in per_rank) for key in ("bytes", "calls")}
        rounds = slowest_per_round([r[mode]["samples"] for r in per_rank])
        cost = predicted[mode]
        rows.append(
            {"cp": cp, "mode": mode, "inner_size": cost.inner_size, **worst}
            | {"seconds": statistics.median(rounds), "local_seconds": statistics.median(local)}
            | {"added_seconds": statistics.median(a - b for a, b in zip(rounds, local, strict=True))}
            | {"samples": rounds, "local_samples": local, "machine": machine}
            | {
                "predicted_bytes": cost.bytes_sent,
                "predicted_messages": cost.messages,
                "predicted_seconds": cost.seconds,
                "predicted_shared_seconds": cost.shared_seconds,
            }
        )
    return rows


def predicted_rows() -> list[dict[str, Any]]:
    """The model's choice and every mode's seconds per (model, device, T, cp), bf16: ``choice``
    over every mode (two-level ones with a node as the inner group from cp 16), ``one_level``
    the best one-level mode, ``layer_seconds`` the choice's predicted step per GDN layer (rule
    work included, fwd+bwd) and ``state_bytes`` / ``state_mib`` every mode's CP state memory per
    rank (the summaries it holds at once)."""
    from hyperpar_gdn import plan_context_parallel

    rows = []
    for model, heads in GEOMETRIES.items():
        for device in ("gpu", "npu"):
            for t in FAR_TOKENS:
                for cp in FAR_CPS:
                    inner = NODE if cp > NODE else None
                    plan = plan_context_parallel(seq_len=t, cp=cp, device=device, inner_size=inner, **heads)
                    seconds = {c.mode: c.seconds if c.feasible else None for c in plan.ranking}
                    state = {c.mode: c.summary_bytes for c in plan.ranking if c.feasible}
                    best, one = plan.ranking[0], next(c for c in plan.ranking if "+" not in c.mode)
                    rows.append(
                        {"model": model, "device": device, "seq_len": t, "cp": cp, "choice": plan.choice}
                        | {"inner_size": plan.inner_size, "seconds": seconds, "one_level": one.mode}
                        | {
                            "shared_seconds": best.shared_seconds,
                            "layer_seconds": best.seconds + best.shared_seconds,
                        }
                        | {"state_bytes": state, "state_mib": best.summary_bytes / 2**20}
                    )
    return rows
