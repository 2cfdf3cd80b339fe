"""``bench_published``'s case: the cost model against device runs that others published.

Each :class:`Setup` holds what a public report gives (its source, the layer's shape, the device's
link figures, the one figure that gives the chunk kernel's rate) and the figures it measured;
:func:`prediction_rows` prices each measured point with
:func:`hyperpar_gdn.planning.cost_model.mode_cost` and prints the ratio predicted / published.
Nothing here is measured on this machine.

Where the report measured a whole GDN layer (projections included) the projections are added as
the same term in every mode: 6 x tokens per rank x the projections' weights, at the device's
matrix rate (``matmul_flops``). The serving report measures a whole model's prefill (forward
only): there the prediction is the one-device time over cp plus, per GDN layer, the forward half
of the p2p relay (the widened pass, cp - 1 hops of one state).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from hyperpar_gdn.planning.cost_model import CHUNK, MACHINES, Geometry, Link, Machine, mode_cost

__all__ = ["SETUPS", "Setup", "auto_rows", "growth_rows", "prediction_rows"]


@dataclass(frozen=True)
class Setup:
    """One published set of runs: ``heads`` (num_k_heads, num_v_heads, head_k_dim, head_v_dim),
    ``machine`` from the report's device figures, ``rate_from`` (T, seconds): the one-device
    fwd+bwd (or prefill) time that gives the kernel rate, and ``points``: (mode, cp, T, ms)."""

    name: str
    source: str
    heads: tuple[int, int, int, int]
    machine: Machine
    rate_from: tuple[int, float]
    points: tuple[tuple[str, int, int, float], ...]
    hidden: int | None = None  # projections counted when the report timed a whole layer
    matmul_flops: float = 0.0
    prefill_layers: int = 0  # > 0: a whole model's prefill with this many GDN layers
    notes: tuple[str, ...] = field(default=())

    def geometry(self, t: int, cp: int) -> Geometry:
        hk, h, k, v = self.heads
        return Geometry(t, cp, hk, h, k, v, 4, 1, 2)

    def calibrated(self) -> Machine:
        """The machine with the kernel rate of the one-device figure (the model's rule FLOPs over
        the published seconds)."""
        t, seconds = self.rate_from
        if self.prefill_layers:
            return self.machine
        return replace(self.machine, flops=self.geometry(t, 1).shared_flops() / seconds)


H800 = Machine(Link(200e9, 10e-6), Link(25e9, 20e-6), devices_per_node=8, flops=1.0, saturating_heads=33)
NPU = replace(MACHINES["npu"], flops=1.0)
SETUPS = (
    Setup(
        name="fla CP, H800",
        source="https://github.com/fla-org/flash-linear-attention/pull/691",
        heads=(64, 64, 128, 128),
        machine=H800,
        rate_from=(32768, 15.56e-3),
        points=(("all_gather", 4, 32768, 5.73), ("ulysses", 4, 32768, 10.591)),
        notes=(
            "the rule alone (no projections), bf16, B = 1 assumed; its CP gathers [S_ext | M] as all_gather does",
            "NVLink of an H800: 400 GB/s both ways, 200 GB/s per direction",
        ),
    ),
    Setup(
        name="Ascend GDN layer, CP8",
        source="https://github.com/mindspore-ai/hyper-parallel/issues/195",
        heads=(16, 32, 128, 128),
        machine=NPU,
        rate_from=(65536, 0.27),
        points=(
            ("p2p", 8, 65536, 67.336),
            ("ulysses", 8, 65536, 98.427),
            ("p2p", 8, 131072, 151.257),
            ("ulysses", 8, 131072, 279.313),
        ),
        hidden=4096,
        matmul_flops=0.6 * 313e12,
        notes=(
            "a whole linear-attention layer (projections included), Triton kernels on Ascend NPUs",
            "kernel rate: one GDN layer at 64K tokens, fwd+bwd 0.27 s on one NPU (the same project's Triton port)",
            "hidden 4096 (16 q/k and 32 value heads of 128 are Qwen3.5-9B's); matrix rate 60% of 313 TFLOP/s",
        ),
    ),
    Setup(
        name="prefill with a state relay",
        source="the serving report's Qwen3.5-9B bf16 prefill (DESIGN notes, section 13)",
        heads=(16, 32, 128, 128),
        machine=MACHINES["gpu"],
        rate_from=(32768, 2.731),
        points=(("p2p", 2, 32768, 1568.0), ("p2p", 4, 32768, 979.0), ("p2p", 8, 32768, 805.0)),
        prefill_layers=24,
        notes=(
            "time to first token of the whole model, forward only; the device is not given: the gpu machine's links",
            "at 8K tokens it reports CP4 1.88x and CP8 1.37x faster than one device",
        ),
    ),
)


def _projection_seconds(s: Setup, t: int, cp: int) -> float:
    if s.hidden is None:
        return 0.0
    hk, h, k, v = s.heads
    weights = s.hidden * (2 * hk * k + 2 * h * v + 2 * h) + h * v * s.hidden
    return 6 * t / cp * weights / s.matmul_flops


def _prefill_seconds(s: Setup, t: int, cp: int) -> float:
    """One device's time over cp, plus per GDN layer the forward half of the p2p relay: the
    widened forward (6 K^2 + 2 C K FLOPs per token and head more) and cp - 1 hops of one state."""
    g, m = s.geometry(t, cp), s.machine
    widened = g.b * t / cp * g.h * (6 * g.k**2 + 2 * CHUNK * g.k) / m.rate(g.b * g.h)
    hops = (cp - 1) * (m.intra.latency + g.b * g.h * g.k * g.v * 4 / m.intra.bandwidth)
    return s.rate_from[1] / cp + s.prefill_layers * (widened + hops)


def predicted_seconds(s: Setup, mode: str, cp: int, t: int) -> float:
    """The model's seconds for one published point (a layer's fwd+bwd, or a prefill)."""
    if s.prefill_layers:
        return _prefill_seconds(s, t, cp)
    cost = mode_cost(mode, s.geometry(t, cp), s.calibrated())
    return cost.seconds + cost.shared_seconds + _projection_seconds(s, t, cp)


def prediction_rows() -> list[dict[str, Any]]:
    """Every published point beside the model's prediction and their ratio."""
    rows = []
    for s in SETUPS:
        for mode, cp, t, ms in s.points:
            predicted = predicted_seconds(s, mode, cp, t) * 1e3
            rows.append(
                {"setup": s.name, "mode": mode, "cp": cp, "seq_len": t, "published_ms": ms}
                | {"predicted_ms": predicted, "ratio": predicted / ms}
            )
    return rows


def growth_rows() -> list[dict[str, Any]]:
    """The Ascend report's weak scaling (8K and 16K tokens per rank, CP4 -> CP8, fwd+bwd growth)
    beside the model's: ratio of (1 + predicted growth) to (1 + published growth)."""
    s = SETUPS[1]
    published = {
        ("p2p", 8192): 0.023,
        ("ulysses", 8192): 0.28,
        ("p2p", 16384): 0.138,
        ("ulysses", 16384): 0.743,
    }
    rows = []
    for (mode, per_rank), growth in published.items():
        four, eight = (predicted_seconds(s, mode, cp, per_rank * cp) for cp in (4, 8))
        predicted = eight / four - 1
        rows.append(
            {"setup": s.name, "mode": mode, "tokens_per_rank": per_rank, "published_growth": growth}
            | {"predicted_growth": predicted, "ratio": (1 + predicted) / (1 + growth)}
        )
    return rows


def auto_rows() -> list[dict[str, Any]]:
    """Per training setup and (cp, T): the mode the model ranks first among the published ones
    and among all one-level modes, beside the fastest published mode."""
    from hyperpar_gdn.planning.plan import MODES

    rows = []
    for s in SETUPS:
        if s.prefill_layers:
            continue
        for cp, t in sorted({(cp, t) for _, cp, t, _ in s.points}):
            published = {m: ms for m, c, tt, ms in s.points if (c, tt) == (cp, t)}
            costs = [mode_cost(m, s.geometry(t, cp), s.calibrated()) for m in MODES]
            ranked = sorted((c for c in costs if c.feasible), key=lambda c: c.seconds)
            among = min(published, key=lambda m: predicted_seconds(s, m, cp, t))
            rows.append(
                {
                    "setup": s.name,
                    "cp": cp,
                    "seq_len": t,
                    "fastest_published": min(published, key=published.get),
                }
                | {"auto": ranked[0].mode, "auto_among_published": among}
            )
    return rows
