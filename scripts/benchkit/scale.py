"""``bench_scale``'s parts: the CP modes measured on this machine, and the cost model far away.

- :func:`measure_modes` (a rank of :func:`benchkit.ranks.on_ranks`): one GDN layer's
  forward+backward per mode on this rank: the bytes the platform's collectives sent (less the
  8-byte length exchange), the message-sending calls (send, all_to_all, all_gather,
  shift_right; a collective is one call and its backward runs inside it, uncounted: for p2p and
  scan the sends are the rounds) and the median time.
- :func:`measured_rows`: the worst rank per mode beside ``plan_context_parallel``'s prediction
  for the ``cpu`` machine.
- :func:`predicted_rows`: the model's ranking for real GDN geometries (:data:`GEOMETRIES`) at
  :data:`FAR_CPS` x :data:`FAR_TOKENS` on the ``gpu`` and ``npu`` machines, nodes of 8 devices,
  two-level modes with one node as the inner group.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

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

ONE_LEVEL = ("ulysses", "p2p", "all_gather", "scan")
TWO_LEVEL = ("ulysses+p2p", "ulysses+all_gather", "ulysses+scan")
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
    """This rank's ``{mode: {"bytes", "calls", "seconds"}}`` (forward+backward of one layer)."""
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

    for name in COUNTED:  # instance attributes: this process's collectives only
        setattr(comm, name, counting(name))
    heads = job["heads"]
    out = {}
    for mode, inner in _modes(cp, heads, job["inner_size"]):
        torch.manual_seed(0)
        layer = GatedDeltaNet(
            job["hidden"],
            heads["num_k_heads"],
            heads["num_v_heads"],
            heads["head_k_dim"],
            heads["head_v_dim"],
        )
        LinearAttentionContextParallel(mode, inner_size=inner).apply(layer, mesh)
        x = torch.randn(1, job["seq_len"] // cp, job["hidden"], requires_grad=True)
        times, sent, messages = [], 0, 0
        for i in range(job["repeats"] + 1):  # the first is a warm-up
            comm.reset_bytes()
            calls["n"] = 0
            comm.barrier(mesh.get_group())
            t0 = time.perf_counter()
            layer(x).sum().backward()
            if i:
                times.append(time.perf_counter() - t0)
            sent, messages = comm.reset_bytes() - 8 * (cp - 1), calls["n"]
        out[mode] = {"bytes": sent, "calls": messages, "seconds": statistics.median(times)}
    return out


def measured_rows(cp: int, job: dict[str, Any], per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: the worst rank's measurement beside the cost model's prediction (cpu machine)."""
    from hyperpar_gdn import plan_context_parallel

    inner = job["inner_size"] if any("+" in m for m in per_rank[0]) else None
    plan = plan_context_parallel(
        seq_len=job["seq_len"], cp=cp, dtype="float32", device="cpu", inner_size=inner, **job["heads"]
    )
    predicted = {c.mode: c for c in plan.ranking}
    rows = []
    for mode in per_rank[0]:
        worst = {key: max(r[mode][key] for r in per_rank) for key in ("bytes", "calls", "seconds")}
        cost = predicted[mode]
        rows.append(
            {"cp": cp, "mode": mode, "inner_size": cost.inner_size, **worst}
            | {
                "predicted_bytes": cost.bytes_sent,
                "predicted_messages": cost.messages,
                "predicted_seconds": cost.seconds,
                "predicted_shared_seconds": cost.shared_seconds,
            }
        )
    return rows


def predicted_rows() -> list[dict[str, Any]]:
    """The model's choice and every mode's seconds per (model, device, T, cp), bf16."""
    from hyperpar_gdn import plan_context_parallel

    rows = []
    for model, heads in GEOMETRIES.items():
        for device in ("gpu", "npu"):
            for t in FAR_TOKENS:
                for cp in FAR_CPS:
                    inner = NODE if cp > NODE else None
                    plan = plan_context_parallel(seq_len=t, cp=cp, device=device, inner_size=inner, **heads)
                    seconds = {c.mode: c.seconds if c.feasible else None for c in plan.ranking}
                    rows.append(
                        {"model": model, "device": device, "seq_len": t, "cp": cp, "choice": plan.choice}
                        | {"inner_size": plan.inner_size, "seconds": seconds}
                        | {"shared_seconds": plan.ranking[0].shared_seconds}
                    )
    return rows
