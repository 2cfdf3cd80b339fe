"""A cost model of the GDN context-parallel modes, and the mode it predicts fastest.

Per GDN layer and rank, forward plus backward, for a sequence of T tokens over cp ranks (B rows,
H value heads and Hk key heads of dims K and V, conv width W, n fragments = cp, or 2 cp for the
head_tail layout), with a link of bandwidth ``bw`` bytes/s and latency ``lat`` s per message and
``flops`` FLOP/s of small matmuls:

======================  =====================================  =================================
mode                    bytes sent (worst rank)                rounds on the critical path
======================  =====================================  =================================
ulysses                 2 B T/cp (conv_dim+2H+value_dim)        4 all-to-alls (cp-1 messages each)
                        (cp-1)/cp e  (e: input dtype bytes)
p2p                     2 B H K V 4                            2 (n-1) hops, each a message and
                                                               one K x K x V product
all_gather              2 (cp-1) B H K (V+K) 4                 2 collectives (cp-1 messages each)
scan                    2 ceil(log2 n) B H K (V+K) 4           2 ceil(log2 n) rounds, each a
                                                               message and two K x K x (K+V)
                                                               products
======================  =====================================  =================================

The state modes (p2p, all_gather, scan) also move the conv halo (2 B (W-1) conv_dim e) and run a
widened forward pass on every shard but the first: about T/cp H (6 K^2 + 4 K V) B extra FLOPs
(the K extra state columns, Q_eff and its transpose). all_gather folds up to cp-1 summaries
(2 (cp-1) B H K^2 V, each way); scan composes two maps per round (4 B H K^2 (K+V) each way).
Summary memory per layer: all_gather holds cp summaries, cp B H K (V+K) 4 bytes; p2p one state;
scan three maps (P, E and the one received). ulysses needs num_v_heads divisible by cp.

Predicted seconds = latency x messages on the critical path + bytes on the critical path / bw +
extra FLOPs / flops. The model omits what every mode shares (the shard's own chunk work) and the
length exchange of 8 bytes per rank; it ranks modes, it does not time a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hyperpar_gdn.distributed.cp.scan import scan_rounds

__all__ = ["LINKS", "Link", "ModeCost", "Plan", "plan_context_parallel"]

PLANNED_MODES = ("ulysses", "p2p", "all_gather", "scan")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class Link:
    """What a rank's link and compute offer: ``bandwidth`` bytes/s per device, ``latency`` s per
    message, ``flops`` FLOP/s of the small fp32 matmuls of the summaries."""

    bandwidth: float
    latency: float
    flops: float


# Defaults per device kind (override any field through plan_context_parallel's keywords):
# gpu: NVLink-class links inside a node; gpu_internode: 200-400 Gb/s NICs; npu: HCCS on Ascend
# 910B; cpu: gloo over loopback on a small shared machine.
LINKS = {
    "gpu": Link(bandwidth=300e9, latency=10e-6, flops=50e12),
    "gpu_internode": Link(bandwidth=40e9, latency=20e-6, flops=50e12),
    "npu": Link(bandwidth=56e9, latency=15e-6, flops=50e12),
    "cpu": Link(bandwidth=2e9, latency=50e-6, flops=50e9),
}


@dataclass(frozen=True)
class ModeCost:
    """One mode's predicted cost per GDN layer and rank, forward plus backward."""

    mode: str
    feasible: bool
    bytes_sent: float
    messages: float  # on the critical path
    extra_flops: float
    summary_bytes: float
    seconds: float
    reason: str = ""  # why not feasible

    def describe(self) -> str:
        if not self.feasible:
            return f"{self.mode}: not possible ({self.reason})"
        return (
            f"{self.mode}: {self.seconds * 1e3:.3f} ms/layer (sent {self.bytes_sent / 2**20:.2f} MiB, "
            f"{self.messages:.0f} messages in sequence, {self.extra_flops / 1e9:.2f} GFLOP extra, "
            f"summaries {self.summary_bytes / 2**20:.2f} MiB)"
        )


@dataclass(frozen=True)
class Plan:
    """The modes ranked by predicted seconds (feasible ones first) and the inputs of the model."""

    ranking: tuple[ModeCost, ...]
    inputs: dict

    @property
    def choice(self) -> str:
        return self.ranking[0].mode

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


def plan_context_parallel(
    *,
    seq_len: int,
    cp: int,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_kernel_size: int = 4,
    batch: int = 1,
    dtype: str = "bfloat16",
    layout: str = "contiguous",
    device: str = "gpu",
    bandwidth: float | None = None,
    latency: float | None = None,
    flops: float | None = None,
    modes: Sequence[str] = PLANNED_MODES,
) -> Plan:
    """Rank the CP modes of a GDN layer by the cost model of this module's docstring.

    ``device`` picks a :data:`LINKS` entry; ``bandwidth`` (bytes/s), ``latency`` (s) and ``flops``
    override its fields. Returns a :class:`Plan`: ``plan.choice``, ``plan.ranking`` (every mode's
    :class:`ModeCost`, fastest first, infeasible ones last), ``plan.why()``.

    Example (Qwen3.5-27B's GDN heads, 256K tokens on 32 GPUs)::

        plan = plan_context_parallel(seq_len=262144, cp=32, num_k_heads=16, num_v_heads=48,
                                     head_k_dim=128, head_v_dim=128)
        plan.choice          # 'scan'
    """
    for name, value in (
        ("seq_len", seq_len),
        ("cp", cp),
        ("batch", batch),
        ("conv_kernel_size", conv_kernel_size),
    ):
        _check(name, value)
    for name, value in (("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads)):
        _check(name, value)
    _check("head_k_dim", head_k_dim)
    _check("head_v_dim", head_v_dim)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"plan_context_parallel: dtype={dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
    if device not in LINKS:
        raise ValueError(f"plan_context_parallel: device={device!r}; choose one of {', '.join(LINKS)}")
    if layout not in ("contiguous", "head_tail"):
        raise ValueError(f"plan_context_parallel: layout={layout!r}; choose 'contiguous' or 'head_tail'")
    unknown = [m for m in modes if m not in PLANNED_MODES]
    if unknown or not modes:
        raise ValueError(
            f"plan_context_parallel: modes={list(modes)}; choose among {', '.join(PLANNED_MODES)}"
        )
    link = LINKS[device]
    overrides = {"bandwidth": bandwidth, "latency": latency, "flops": flops}
    link = replace(link, **{k: float(v) for k, v in overrides.items() if v is not None})
    if min(link.bandwidth, link.flops) <= 0 or link.latency < 0:
        raise ValueError(f"plan_context_parallel: bandwidth and flops must be > 0, latency >= 0; got {link}")
    geometry = _Geometry(
        seq_len, cp, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel_size, batch
    )
    costs = [
        _COSTS[m](geometry, DTYPE_BYTES[dtype], 2 * cp if layout == "head_tail" else cp, link) for m in modes
    ]
    ranking = tuple(sorted(costs, key=lambda c: (not c.feasible, c.seconds)))
    inputs = {"T": seq_len, "cp": cp, "H": num_v_heads, "K": head_k_dim, "V": head_v_dim, "dtype": dtype}
    return Plan(ranking=ranking, inputs=inputs | {"device": device})


@dataclass(frozen=True)
class _Geometry:
    t: int
    cp: int
    hk: int
    h: int
    k: int
    v: int
    w: int
    b: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.hk * self.k + self.h * self.v

    def halo_bytes(self, e: int) -> float:
        return 2 * self.b * (self.w - 1) * self.conv_dim * e

    def widened_flops(self) -> float:
        return self.b * self.t / self.cp * self.h * (6 * self.k**2 + 4 * self.k * self.v)

    def summary(self) -> float:  # one packed map [S | M], fp32
        return self.b * self.h * self.k * (self.v + self.k) * 4


def _seconds(link: Link, messages: float, critical_bytes: float, flops: float) -> float:
    return messages * link.latency + critical_bytes / link.bandwidth + flops / link.flops


def _ulysses(g: _Geometry, e: int, n: int, link: Link) -> ModeCost:
    sent = 2 * g.b * g.t / g.cp * (g.conv_dim + 2 * g.h + g.h * g.v) * (g.cp - 1) / g.cp * e
    messages = 4 * (g.cp - 1)
    feasible = g.h % g.cp == 0
    reason = "" if feasible else f"num_v_heads={g.h} is not divisible by cp={g.cp}"
    return ModeCost(
        "ulysses", feasible, sent, messages, 0.0, 0.0, _seconds(link, messages, sent, 0.0), reason
    )


def _p2p(g: _Geometry, e: int, n: int, link: Link) -> ModeCost:
    state = g.b * g.h * g.k * g.v * 4
    hops = 2 * (n - 1)
    step_flops = 2 * g.b * g.h * g.k**2 * g.v
    flops = g.widened_flops() + hops * step_flops
    sent = 2 * state + g.halo_bytes(e)
    seconds = _seconds(link, hops + 2, hops * state + g.halo_bytes(e), flops)
    return ModeCost("p2p", True, sent, hops + 2, flops, 2 * state, seconds)


def _all_gather(g: _Geometry, e: int, n: int, link: Link) -> ModeCost:
    sent = 2 * (g.cp - 1) * g.summary() + g.halo_bytes(e)
    messages = 2 * (g.cp - 1) + 2
    flops = g.widened_flops() + 2 * 2 * (n - 1) * g.b * g.h * g.k**2 * g.v
    seconds = _seconds(link, messages, sent, flops)
    return ModeCost("all_gather", True, sent, messages, flops, g.cp * g.summary(), seconds)


def _scan(g: _Geometry, e: int, n: int, link: Link) -> ModeCost:
    rounds = 2 * scan_rounds(n)
    sent = rounds * g.summary() + g.halo_bytes(e)
    flops = g.widened_flops() + rounds * 4 * g.b * g.h * g.k**2 * (g.k + g.v)
    seconds = _seconds(link, rounds + 2, sent, flops)
    return ModeCost("scan", True, sent, rounds + 2, flops, 3 * g.summary(), seconds)


_COSTS = {"ulysses": _ulysses, "p2p": _p2p, "all_gather": _all_gather, "scan": _scan}


DEVICE_KINDS = {"cuda": "gpu", "npu": "npu"}  # a mesh's device_type -> a LINKS entry (else cpu)


def plan_for_model(
    model: object,
    mesh: object,
    *,
    seq_len: int,
    layout: str = "contiguous",
    dtype: str = "bfloat16",
    **link: float,
) -> Plan:
    """:func:`plan_context_parallel` for the GDN layers of ``model`` (``HybridLM`` or transformers'
    Qwen3.5 models; every GDN layer of a model has the same shape) over the 1-D CP ``mesh``, with
    the link of the mesh's device kind (``link``: ``bandwidth``, ``latency``, ``flops``)."""
    from hyperpar_gdn.distributed.decoder_layers import find_decoder, mixer_of
    from hyperpar_gdn.distributed.mesh import as_cp_mesh
    from hyperpar_gdn.ops.gdn.layer import LayerDims

    unknown = sorted(set(link) - {"bandwidth", "latency", "flops"})
    if unknown:
        raise TypeError(
            f"plan_for_model: unknown keywords {unknown}; the link takes bandwidth, latency, flops"
        )
    cp_mesh = as_cp_mesh(mesh)
    _, text_model = find_decoder(model)
    gdn = [
        m for i, b in enumerate(text_model.layers) for kind, m in [mixer_of(i, b)] if kind == "linear_attn"
    ]
    if not gdn:
        raise ValueError(f"{type(model).__name__} has no GDN layers: there is no mode to choose")
    dims = LayerDims.of(gdn[0])
    return plan_context_parallel(
        seq_len=seq_len,
        cp=cp_mesh.size(),
        num_k_heads=dims.num_k_heads,
        num_v_heads=dims.num_v_heads,
        head_k_dim=dims.head_k_dim,
        head_v_dim=dims.head_v_dim,
        conv_kernel_size=dims.conv_kernel_size,
        dtype=dtype,
        layout=layout,
        device=DEVICE_KINDS.get(cp_mesh.device_type, "cpu"),
        **link,
    )
