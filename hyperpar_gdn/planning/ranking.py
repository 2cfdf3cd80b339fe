"""Rank the GDN context-parallel modes by the cost model of :mod:`.cost_model`.

:func:`plan_context_parallel` takes a layer's geometry, T, cp, the dtype, a device kind's
:data:`~.cost_model.MACHINES` entry (links inside and between nodes, devices per node, FLOP rate;
every field overridable) and, for the two-level modes, ``inner_size``; it returns a
:class:`Ranking`, the modes ranked by predicted seconds. :func:`~.choice.choose_plan` turns its
first into the :class:`~.plan.CPPlan` that ``mode="auto"`` runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hyperpar_gdn.planning.cost_model import MACHINES, Geometry, Link, Machine, ModeCost, mode_cost
from hyperpar_gdn.planning.cost_model_tp import cp_machine, tp_exchange, tp_rank_geometry
from hyperpar_gdn.planning.plan import LAYOUTS, MODES, TWO_LEVEL_MODES

__all__ = [
    "DTYPE_BYTES",
    "MACHINES",
    "MACHINE_KEYWORDS",
    "Link",
    "Machine",
    "ModeCost",
    "Ranking",
    "machine_kind",
    "plan_context_parallel",
    "with_figures",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class Ranking:
    """The modes ranked by predicted seconds (feasible ones first) and the inputs of the model."""

    ranking: tuple[ModeCost, ...]
    inputs: dict

    @property
    def choice(self) -> str:
        return self.ranking[0].mode

    @property
    def inner_size(self) -> int | None:
        """The choice's ranks per inner group (two-level modes), else None."""
        return self.ranking[0].inner_size

    def why(self) -> str:
        """One line: the choice, its cost, and the runner-up's."""
        best = self.ranking[0]
        shape = ", ".join(f"{k}={v}" for k, v in self.inputs.items())
        rest = "; ".join(c.describe() for c in self.ranking[1:])
        return f"mode {best.mode} predicted fastest for {shape}: {best.describe()}; then {rest}"


def _check(name: str, value: object, *, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"plan_context_parallel: {name} must be an int >= {minimum}; got {value!r}")
    return value


# Long for its docstring: the public entry point documents every argument.
def plan_context_parallel(
    *,
    seq_len: int,
    cp: int,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_kernel_size: int = 4,
    hidden_size: int | None = None,
    batch: int = 1,
    dtype: str = "bfloat16",
    layout: str = "contiguous",
    device: str = "gpu",
    bandwidth: float | None = None,
    latency: float | None = None,
    inter_bandwidth: float | None = None,
    inter_latency: float | None = None,
    devices_per_node: int | None = None,
    flops: float | None = None,
    inner_size: int | None = None,
    modes: Sequence[str] | None = None,
    tp: int = 1,
    num_experts: int = 0,
) -> Ranking:
    """Rank the CP modes of a GDN layer by the cost model of :mod:`.cost_model`.

    ``hidden_size`` (the layer's input width) prices ``ulysses_hidden``, which is ranked last as not
    possible without it. ``device`` picks a :data:`MACHINES` entry; ``bandwidth`` (bytes/s) and ``latency`` (s) override
    its links inside a node, ``inter_bandwidth`` and ``inter_latency`` those between nodes,
    ``devices_per_node`` and ``flops`` the rest. ``inner_size`` (ranks per inner group) adds the
    two-level modes ``ulysses+p2p``, ``ulysses+all_gather``, ``ulysses+scan`` to the ranking;
    ``modes`` restricts it. ``tp`` (tensor parallelism, the innermost mesh axis) prices each
    mode on a TP rank's Hk/tp q/k and H/tp value heads, CP ranks tp devices apart, and adds TP's
    all-reduces of the layer and its MLP (``num_experts``: a MoE block's router gradient too) to
    every mode's ``tp_seconds`` (:mod:`.cost_model_tp`; needs ``hidden_size``). Returns a
    :class:`Ranking`: ``ranked.choice``, ``ranked.inner_size``, ``ranked.ranking`` (every mode's
    :class:`ModeCost`, fastest first, infeasible ones last), ``ranked.why()``.

    Example (Qwen3.5-27B's GDN heads, 128K tokens on 128 GPUs, 16 nodes of 8)::

        ranked = plan_context_parallel(seq_len=131072, cp=128, num_k_heads=16, num_v_heads=48,
                                       head_k_dim=128, head_v_dim=128, inner_size=8)
        ranked.choice, ranked.inner_size     # ('ulysses+scan', 8)
    """
    for name, value in (
        ("seq_len", seq_len),
        ("cp", cp),
        ("batch", batch),
        ("conv_kernel_size", conv_kernel_size),
        ("num_k_heads", num_k_heads),
        ("num_v_heads", num_v_heads),
        ("head_k_dim", head_k_dim),
        ("head_v_dim", head_v_dim),
        ("tp", tp),
    ):
        _check(name, value)
    _check("num_experts", num_experts, minimum=0)
    if num_k_heads % tp:
        raise ValueError(
            f"plan_context_parallel: num_k_heads={num_k_heads} is not divisible by tp={tp} (a TP rank "
            "takes whole q/k heads with their value heads)"
        )
    if tp > 1 and hidden_size is None:
        raise ValueError(
            f"plan_context_parallel: tp={tp} needs hidden_size= (TP all-reduces the hidden states)"
        )
    for name, value in (
        ("devices_per_node", devices_per_node),
        ("inner_size", inner_size),
        ("hidden_size", hidden_size),
    ):
        if value is not None:
            _check(name, value)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"plan_context_parallel: dtype={dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
    if device not in MACHINES:
        raise ValueError(f"plan_context_parallel: device={device!r}; choose one of {', '.join(MACHINES)}")
    if layout not in LAYOUTS:
        raise ValueError(f"plan_context_parallel: layout={layout!r}; choose 'contiguous' or 'head_tail'")
    allowed = MODES + (TWO_LEVEL_MODES if inner_size is not None else ())
    modes = allowed if modes is None else tuple(modes)
    unknown = [m for m in modes if m not in allowed]
    if unknown or not modes:
        raise ValueError(
            f"plan_context_parallel: modes={list(modes)}; choose among {', '.join(allowed)}"
            + ("" if inner_size is not None else " (the two-level modes need inner_size)")
        )
    machine = with_figures(
        MACHINES[device], bandwidth, latency, inter_bandwidth, inter_latency, devices_per_node, flops
    )
    geometry = Geometry(
        seq_len, cp, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel_size, batch,
        DTYPE_BYTES[dtype], head_tail=layout == "head_tail", hidden=hidden_size,
    )  # fmt: skip
    exchange = tp_exchange(geometry, tp, machine, num_experts=num_experts)
    local, cp_view = tp_rank_geometry(geometry, tp), cp_machine(machine, tp)
    costs = [
        replace(mode_cost(m, local, cp_view, inner_size=inner_size), tp_bytes=exchange.payload) for m in modes
    ]
    costs = [
        replace(c, tp_seconds=exchange.seconds)
        if c.feasible
        else replace(c, reason=c.reason + (f" (a TP rank's heads at tp={tp})" if tp > 1 else ""))
        for c in costs
    ]
    ranking = tuple(sorted(costs, key=lambda c: (not c.feasible, c.seconds)))
    inputs = {"T": seq_len, "cp": cp, "H": num_v_heads, "K": head_k_dim, "V": head_v_dim, "dtype": dtype}
    inputs |= {"tp": tp} if tp > 1 else {}
    return Ranking(ranking=ranking, inputs=inputs | {"device": device})


def with_figures(
    base: Machine,
    bandwidth: float | None,
    latency: float | None,
    inter_bandwidth: float | None,
    inter_latency: float | None,
    devices_per_node: int | None,
    flops: float | None,
) -> Machine:
    """``base`` with the given fields replaced, checked (bandwidths and flops > 0, latencies >= 0)."""

    def link(old: Link, bw: float | None, lat: float | None) -> Link:
        return Link(old.bandwidth if bw is None else float(bw), old.latency if lat is None else float(lat))

    machine = replace(
        base,
        intra=link(base.intra, bandwidth, latency),
        inter=link(base.inter, inter_bandwidth, inter_latency),
        devices_per_node=base.devices_per_node if devices_per_node is None else devices_per_node,
        flops=base.flops if flops is None else float(flops),
    )
    rates = (machine.intra.bandwidth, machine.inter.bandwidth, machine.flops)
    if min(rates) <= 0 or min(machine.intra.latency, machine.inter.latency) < 0:
        raise ValueError(
            f"plan_context_parallel: bandwidth and flops must be > 0, latency >= 0; got {machine}"
        )
    return machine


DEVICE_KINDS = {"cuda": "gpu", "npu": "npu"}  # a mesh's device_type -> a MACHINES entry (else cpu)
MACHINE_KEYWORDS = ("bandwidth", "latency", "inter_bandwidth", "inter_latency", "devices_per_node", "flops")


def machine_kind(device_type: str) -> str:
    """The :data:`MACHINES` entry of a mesh's ``device_type``: ``cuda`` -> gpu, ``npu`` -> npu, else cpu."""
    return DEVICE_KINDS.get(device_type, "cpu")
