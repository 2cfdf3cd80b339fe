"""The cost terms of the GDN context-parallel modes on a machine of nodes of devices.

Per GDN layer and rank, forward plus backward, for T tokens over cp ranks (B rows, H value heads
and Hk key heads of dims K and V, conv width W, n fragments = cp, or 2 cp for head_tail). Rank r
sits in node r // devices_per_node; a message between two nodes takes the ``inter`` link, one
inside a node the ``intra`` link; a round of messages lasts as long as its slowest message.

======================  ==================================  =====================================
mode                    bytes sent (worst rank)             on the critical path
======================  ==================================  =====================================
ulysses                 2 B T/cp (conv_dim+2H+value_dim)    4 all-to-alls; the bytes to other
                        (cp-1)/cp e  (e: input dtype; more  nodes go over ``inter`` meanwhile
                        when cp does not divide Hk)
ulysses_hidden          4 B T/cp hidden (cp-1) e            4 all-to-alls, as ulysses
p2p                     2 B H K V 4                         2 (n-1) hops (one state and one
                                                            K x K x V step each; those from
                                                            node to node over ``inter``)
all_gather              2 (cp-1) B H K (V+K) 4              a ring of cp-1 steps each way
scan                    2 ceil(log2 n) B H K (V+K) 4        2 ceil(log2 n) rounds, two K x K x
                                                            (K+V) products each
ulysses+<state mode>    ulysses over k = inner ranks on     then the state mode over cp/k ranks
                        the node's T k/cp tokens            for H/k heads
======================  ==================================  =====================================

(4: bytes of an fp32 state element; ``Geometry.s`` in general.) The two-level modes' state
mode moves, across nodes, the states of a rank's H/k value heads and the conv halo of the q/k
heads they use (every q/k head of them: a whole one even when k does not divide Hk).
The bytes are the worst rank's; :func:`rank_bytes_sent` gives every rank's, as this implementation
sends them (checked against a trace of the collectives of a cp = 8 step, tests/distributed/
test_fake_cuda_trace.py): scan's first windows send states only (S, not [S | M]); in the head_tail
layout a rank owns two fragments of the chain, so p2p passes two states each way and all_gather
moves two summaries per rank. The state modes also move the conv halo (contiguous: 2 B (W-1)
conv_dim e; head_tail: every rank all-gathers its two fragments' halos, 4 (cp-1) B (W-1) conv_dim e
with the backward's reduce-scatter, a ring of 2 (cp-1) steps) and run a widened pass on every
shard but the first: about B T/cp H (6 K^2 + 2 C K + 2 K V) FLOPs more than the plain pass (the
K extra state columns and Q_eff forward, Q_eff^T dO backward; C = 64), about a quarter of the
rule's own work (measured: +33%, 244 ms against 184 ms for a T=4096, H=4, K=V=128 shard). The shard's
own rule work, the same in every mode, is ``shared_seconds``: about 16.6 B T/cp H (K V + C (K + V))
FLOPs (fwd+bwd, 8.9 GFLOP at T=4096, H=4, K=V=128, C=64, as counted for the kernel); it does not
change the ranking but says how much a mode adds to a layer.

Predicted seconds = latency x messages in sequence + bytes in sequence / bandwidth + extra FLOPs /
rate, each message on the link it crosses. Left out: the projections and the 8-byte length
exchange; overlap of communication with compute (none in this implementation).

The rate is ``flops`` while a rank runs enough heads to fill its device. A fused chunk kernel
(fla's and its ports) spends about :data:`STATE_PASS_SHARE` of its time in the state passes,
whose grid is only (value-dim blocks x rows x heads): with fewer than ``saturating_heads`` rows x
heads on a rank that share slows by saturating_heads / heads. That is what ulysses pays at large
cp (H/cp heads per rank) and the state modes do not (all H heads on every rank): published
device runs show it (docs/benchmarks.md, "The cost model against published device runs").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hyperpar_gdn.planning.plan import HEAD_MODES

__all__ = [
    "MACHINES",
    "Geometry",
    "Link",
    "Machine",
    "ModeCost",
    "mode_cost",
    "rank_bytes_sent",
    "scan_rounds",
]

SHARED_FLOPS_PER_UNIT = 16.6  # rule fwd+bwd FLOPs per token, head and (K V + C (K + V))
CHUNK = 64  # C, the chunk size
STATE_PASS_SHARE = 0.4  # of a fused chunk kernel's time: the state passes, parallel over heads only


def scan_rounds(n: int) -> int:
    """The rounds of the prefix scan (``hyperpar_gdn.distributed.cp.scan``) over n fragments:
    ceil(log2 n) (0 for one fragment)."""
    return max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class Link:
    """One kind of link: ``bandwidth`` bytes/s per device, ``latency`` s per message."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Machine:
    """Nodes of ``devices_per_node`` devices: ``intra`` links inside a node, ``inter`` between
    nodes (per device), ``flops`` FLOP/s of the rule's chunk work on one device,
    ``saturating_heads``: rows x value heads per rank from which the chunk kernel's state passes
    fill the device (its cores over the kernel's blocks per head; 0: no such limit), and
    ``matmul_flops``: FLOP/s of large matrix products on one device (the experts' SwiGLU; 0: not
    priced)."""

    intra: Link
    inter: Link
    devices_per_node: int
    flops: float
    saturating_heads: float = 0.0
    matmul_flops: float = 0.0

    def rate(self, heads: float) -> float:
        """FLOP/s of the chunk work of a rank that runs ``heads`` rows x value heads."""
        if self.saturating_heads <= heads:
            return self.flops
        slow = self.saturating_heads / max(heads, 1e-9)
        return self.flops / (1 - STATE_PASS_SHARE + STATE_PASS_SHARE * slow)


# gpu, npu: published orders of magnitude, not measurements of a cluster (override them):
# NVLink-class 200-450 GB/s per GPU, HCCS on Ascend 910B 56 GB/s per link (a send uses one link),
# 200-400 Gb/s NICs between nodes (25-50 GB/s per device), 5-20 us per message. cpu: gloo between
# processes of one machine as scripts/bench_scale.py measures it on a 2-core x86 host (ping-pong
# of the platform's send/recv: 2.2 GB/s, 0.36 ms per message; the chunk rule forward+backward in
# fp32 on one core: 18 GFLOP/s). saturating_heads: an H100/H800 has 132 SMs and fla's state
# passes run 4 blocks of 32 value columns per head (V = 128): 33; an Ascend 910B has 24 AI cores,
# one block per head: 24 (the CPU has no such limit). matmul_flops: about 40% of the dense bf16
# peak an H100 (989 TFLOP/s) and a 910B (about 320 TFLOP/s) publish, what grouped expert products
# of a few thousand rows reach.
MACHINES = {
    "gpu": Machine(
        Link(300e9, 10e-6),
        Link(40e9, 20e-6),
        devices_per_node=8,
        flops=50e12,
        saturating_heads=33,
        matmul_flops=400e12,
    ),
    "npu": Machine(
        Link(56e9, 15e-6),
        Link(25e9, 20e-6),
        devices_per_node=8,
        flops=50e12,
        saturating_heads=24,
        matmul_flops=130e12,
    ),
    "cpu": Machine(Link(2.2e9, 360e-6), Link(2.2e9, 360e-6), devices_per_node=1 << 20, flops=18e9),
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
    shared_seconds: float = 0.0  # the shard's own rule work, the same in every mode
    reason: str = ""  # why not feasible
    inner_size: int | None = None  # the two-level modes' ranks per inner group
    tp_bytes: float = 0.0  # tensor parallelism's all-reduce payload per rank (.cost_model_tp)
    tp_seconds: float = 0.0  # and its time, the same in every mode (a layer: + shared_seconds)

    def describe(self) -> str:
        name = self.mode if self.inner_size is None else f"{self.mode} (inner_size={self.inner_size})"
        if not self.feasible:
            return f"{name}: not possible ({self.reason})"
        tp = f", TP all-reduces {self.tp_seconds * 1e3:.3f} ms" if self.tp_bytes else ""
        return (
            f"{name}: {self.seconds * 1e3:.3f} ms/layer (sent {self.bytes_sent / 2**20:.2f} MiB, "
            f"{self.messages:.0f} messages in sequence, {self.extra_flops / 1e9:.2f} GFLOP extra, "
            f"summaries {self.summary_bytes / 2**20:.2f} MiB{tp})"
        )


@dataclass(frozen=True)
class Geometry:
    """The layer and the split: ``t`` tokens over ``cp`` ranks, ``b`` rows, ``hk``/``h`` key and
    value heads of dims ``k``/``v``, conv width ``w``, ``e`` bytes per input element, ``head_tail``,
    ``hidden`` the layer's input width, ``s`` bytes per state element (the states and summaries are
    computed in fp32 for bf16, fp16 and fp32 inputs, in fp64 for fp64 inputs)."""

    t: float
    cp: int
    hk: float
    h: float
    k: int
    v: int
    w: int
    b: int
    e: int
    head_tail: bool = False
    hidden: int | None = None  # the model's hidden size (ulysses_hidden's exchanges); None: unknown
    s: int = 4

    @property
    def n(self) -> int:  # fragments in the chain
        return 2 * self.cp if self.head_tail else self.cp

    @property
    def conv_dim(self) -> float:
        return 2 * self.hk * self.k + self.h * self.v

    def halo_path(self) -> tuple[float, int]:
        """(bytes, messages) of the conv halo on the critical path: contiguous, one message forward
        and its gradient back; head_tail, an all-gather ring and its reduce-scatter, 2 (cp-1) steps."""
        one = self.b * (self.w - 1) * self.conv_dim * self.e
        return (4 * one * (self.cp - 1), 2 * (self.cp - 1)) if self.head_tail else (2 * one, 2)

    def halo_rank_bytes(self, rank: int) -> float:
        """The conv halo bytes rank ``rank`` sends. Contiguous: its last W-1 rows to the next rank,
        and the gradient of the previous rank's rows back to it (the first and the last rank send
        one of the two). head_tail: an all-gather of its two fragments' halos, and the backward's
        reduce-scatter."""
        one = self.b * (self.w - 1) * self.conv_dim * self.e
        if self.head_tail:
            return 2 * 2 * one * (self.cp - 1)
        return one * ((rank < self.cp - 1) + (rank > 0))

    def chain_owners(self) -> list[int]:
        """The rank owning each fragment of the chain, in global order."""
        return list(range(self.cp)) + (list(reversed(range(self.cp))) if self.head_tail else [])

    def widened_flops(self) -> float:
        # forward: K more state columns (4 K^2) and Q_eff (2 K^2 + 2 C K); backward: Q_eff^T dO (2 K V)
        return self.b * self.t / self.cp * self.h * (6 * self.k**2 + 2 * CHUNK * self.k + 2 * self.k * self.v)

    def shared_flops(self) -> float:
        unit = self.k * self.v + CHUNK * (self.k + self.v)
        return SHARED_FLOPS_PER_UNIT * self.b * self.t / self.cp * self.h * unit

    def state(self) -> float:  # one state S [K, V] per row and head
        return self.b * self.h * self.k * self.v * self.s

    def summary(self) -> float:  # one packed map [S | M]
        return self.b * self.h * self.k * (self.v + self.k) * self.s


@dataclass(frozen=True)
class Span:
    """Where a group's ranks sit: ``size`` ranks, ``stride`` apart in the CP group (node = rank //
    devices_per_node); the group's first rank is 0 (the worst case: every group looks alike)."""

    size: int
    stride: int
    devices_per_node: int

    def node(self, j: int) -> int:
        return j * self.stride // self.devices_per_node

    def crosses(self) -> bool:
        return self.node(self.size - 1) != self.node(0)

    def peers_in_node(self) -> int:
        return sum(1 for j in range(self.size) if self.node(j) == self.node(0))


def _link(machine: Machine, crosses: bool) -> Link:
    return machine.inter if crosses else machine.intra


def _qk_heads(g: Geometry) -> list[int]:
    """The q/k heads each of the cp ranks holds once ulysses gives it H/cp value heads: every q/k
    head its value heads use (one q/k head can go to several ranks when cp does not divide Hk)."""
    per_rank = round(g.h) // g.cp
    group = max(round(g.h) // max(round(g.hk), 1), 1)  # value heads per q/k head
    return [len({i // group for i in range(j * per_rank, (j + 1) * per_rank)}) for j in range(g.cp)]


def _ulysses_sent(g: Geometry) -> float:
    """Bytes the worst rank sends in ulysses' all-to-alls, forward and backward: rank j takes
    H/cp value heads and the kc_j q/k heads they use, w_j = 2 K kc_j + (H/cp)(V + 2) channels
    per token; rank r sends T/cp [sum_{j != r} w_j + (cp-1) w_r] + 2 (cp-1) T/cp (H/cp) V
    elements (:func:`_ulysses_rank_sent`; the table's formula when cp divides the q/k heads)."""
    return max(_ulysses_rank_sent(g, r) for r in range(g.cp))


def _ulysses_rank_sent(g: Geometry, rank: int) -> float:
    """Bytes rank ``rank`` sends in ulysses' all-to-alls, forward and backward (as
    :func:`_ulysses_sent`, with its own width w_r in place of the widest)."""
    per_rank = round(g.h) // g.cp
    w = [2 * g.k * c + per_rank * (g.v + 2) for c in _qk_heads(g)]
    elements = g.t / g.cp * (sum(w) + (g.cp - 2) * w[rank] + 2 * (g.cp - 1) * per_rank * g.v)
    return g.b * elements * g.e


def _state_rank_sent(mode: str, g: Geometry, rank: int) -> float:
    """Bytes rank ``rank`` sends in p2p, all_gather or scan, forward and backward, halo included."""
    state, summary = g.state(), g.summary()
    owners = g.chain_owners()
    n = len(owners)
    if mode == "p2p":  # forward along the chain, the gradients back along it
        hops = sum(owners[i] == rank != owners[i + 1] for i in range(n - 1))
        hops += sum(owners[i] == rank != owners[i - 1] for i in range(1, n))
        sent = hops * state
    elif mode == "all_gather":  # the packed summaries of its fragments, and their gradients
        sent = 2 * (g.cp - 1) * (n // g.cp) * summary
    else:  # scan: Hillis-Steele over the fragments, forward then over the reversed chain
        sent = 0.0
        for order in (owners, owners[::-1]):
            d = 1
            while d < n:
                for i in range(n - d):
                    if order[i] == rank != order[i + d]:
                        sent += state if i < d else summary  # a window from the start sends S only
                d *= 2
    return sent + g.halo_rank_bytes(rank)


def rank_bytes_sent(mode: str, g: Geometry, rank: int, *, inner_size: int | None = None) -> float:
    """The bytes CP rank ``rank`` sends to other ranks for one GDN layer, forward and backward, in
    ``mode`` (the convention of :mod:`hyperpar_gdn.platform.torch_collectives`); the layer's heads
    must suit the mode (see :func:`mode_cost`)."""
    if mode == "ulysses_hidden":
        return 4 * g.b * g.t / g.cp * g.hidden * (g.cp - 1) * g.e
    if mode == "ulysses":
        return _ulysses_rank_sent(g, rank)
    if "+" not in mode:
        return _state_rank_sent(mode, g, rank)
    k = inner_size
    inner_g = Geometry(g.t * k / g.cp, k, g.hk, g.h, g.k, g.v, g.w, g.b, g.e)
    # across nodes: the rank's value heads and the q/k heads they use (its conv channels)
    hk = _qk_heads(inner_g)[rank % k]
    outer_g = Geometry(g.t, g.cp // k, hk, g.h / k, g.k, g.v, g.w, g.b, g.e, head_tail=g.head_tail, s=g.s)
    outer = 0.0 if g.cp == k else _state_rank_sent(mode.split("+")[1], outer_g, rank // k)
    return _ulysses_rank_sent(inner_g, rank % k) + outer


def _ulysses(g: Geometry, span: Span, m: Machine, *, hidden: bool = False) -> tuple[float, float, float]:
    """(bytes sent, messages, seconds) of the two all-to-alls each way; ``hidden``: those of
    ulysses_hidden (the layer's input to every other rank, the output's partial sums back)."""
    sent = 4 * g.b * g.t / g.cp * g.hidden * (g.cp - 1) * g.e if hidden else _ulysses_sent(g)
    per_peer = sent / max(g.cp - 1, 1)
    near = span.peers_in_node() - 1
    far = g.cp - 1 - near
    seconds = max(near * per_peer / m.intra.bandwidth, far * per_peer / m.inter.bandwidth)
    messages = 4 * (g.cp - 1)
    return sent, messages, seconds + messages * _link(m, far > 0).latency


def _chain_hops(g: Geometry, span: Span) -> tuple[int, int]:
    """(hops inside a node, hops between nodes) along the fragments' chain, one direction."""
    owners = list(range(g.cp)) + (list(reversed(range(g.cp))) if g.head_tail else [])
    far = sum(1 for a, b in zip(owners[:-1], owners[1:], strict=True) if span.node(a) != span.node(b))
    return len(owners) - 1 - far, far


def _state_mode(mode: str, g: Geometry, span: Span, m: Machine) -> tuple[float, float, float, float, float]:
    """(bytes sent, messages, seconds, extra FLOPs, summary memory) of p2p, all_gather or scan;
    the bytes are the worst rank's (:func:`rank_bytes_sent`)."""
    halo, hops = g.halo_path()
    rate = m.rate(g.b * g.h)  # every rank runs all of the group's heads
    worst = max(_state_rank_sent(mode, g, r) for r in range(g.cp))
    link = _link(m, span.crosses())
    seconds = hops * link.latency + halo / link.bandwidth
    if mode == "p2p":
        state = g.state()
        step = 2 * g.b * g.h * g.k**2 * g.v
        near, far = _chain_hops(g, span)
        flops = g.widened_flops() + 2 * (near + far) * step
        for count, hop in ((near, m.intra), (far, m.inter)):
            seconds += 2 * count * (hop.latency + state / hop.bandwidth)
        return worst, 2 * (near + far) + hops, seconds + flops / rate, flops, 2 * state
    if mode == "all_gather":
        sent = 2 * (g.cp - 1) * (g.n // g.cp) * g.summary()
        flops = g.widened_flops() + 4 * (g.n - 1) * g.b * g.h * g.k**2 * g.v
        seconds += 2 * (g.cp - 1) * link.latency + sent / link.bandwidth + flops / rate
        return worst, 2 * (g.cp - 1) + hops, seconds, flops, g.n * g.summary()
    rounds = 2 * scan_rounds(g.n)
    flops = g.widened_flops() + rounds * 4 * g.b * g.h * g.k**2 * (g.k + g.v)
    seconds += rounds * (link.latency + g.summary() / link.bandwidth) + flops / rate
    return worst, rounds + hops, seconds, flops, 3 * g.summary()


def mode_cost(mode: str, g: Geometry, m: Machine, *, inner_size: int | None = None) -> ModeCost:
    """The cost of ``mode`` (one of ulysses, ulysses_hidden, p2p, all_gather, scan, or ``ulysses+<state mode>``
    with ``inner_size``) for ``g`` on ``m``; infeasible (with the reason) where heads forbid it."""
    shared = g.shared_flops() / m.flops
    span = Span(g.cp, 1, m.devices_per_node)
    # The rule work runs on T/cp tokens for all H heads, or (head parallel) on T tokens for H/cp
    # heads (two levels: a node's T k/cp tokens for H/k heads): the same FLOPs, but a rank with
    # few heads runs them below the device's rate; the mode pays that difference.
    heads = g.h / g.cp if mode in HEAD_MODES else g.h / inner_size if "+" in mode and inner_size else g.h
    starved = g.shared_flops() * (1 / m.rate(g.b * heads) - 1 / m.flops)
    cost = _mode_cost(mode, g, m, inner_size, shared, span)
    return replace(cost, seconds=cost.seconds + starved) if cost.feasible else cost


def _mode_cost(
    mode: str, g: Geometry, m: Machine, inner_size: int | None, shared: float, span: Span
) -> ModeCost:
    if mode in HEAD_MODES:
        if g.h % g.cp:
            return _refused(mode, shared, f"num_v_heads={g.h:g} is not divisible by cp={g.cp}")
        if mode == "ulysses_hidden" and g.hidden is None:
            return _refused(mode, shared, "the hidden size is not known (hidden_size=)")
        sent, messages, seconds = _ulysses(g, span, m, hidden=mode == "ulysses_hidden")
        return ModeCost(mode, True, sent, messages, 0.0, 0.0, seconds, shared)
    if "+" not in mode:
        sent, messages, seconds, flops, memory = _state_mode(mode, g, span, m)
        return ModeCost(mode, True, sent, messages, flops, memory, seconds, shared)
    k = inner_size
    if k is None or g.cp % k or g.h % k:
        why = f"inner_size={k} must divide cp={g.cp} and num_v_heads={g.h:g}"
        return _refused(mode, shared, why, inner_size=k)
    outer = g.cp // k
    # ulysses inside each group of k ranks on the group's T k/cp tokens, then the state mode over
    # the cp/k groups (ranks k apart) for H/k heads and their conv channels
    inner_g = Geometry(g.t * k / g.cp, k, g.hk, g.h, g.k, g.v, g.w, g.b, g.e)
    _, messages_u, seconds_u = _ulysses(inner_g, Span(k, 1, m.devices_per_node), m)
    hk = max(_qk_heads(inner_g))  # the q/k heads (conv channels) of the rank that holds most
    outer_g = Geometry(g.t, outer, hk, g.h / k, g.k, g.v, g.w, g.b, g.e, head_tail=g.head_tail, s=g.s)
    outer_span = Span(outer, k, m.devices_per_node)
    if outer == 1:
        messages_s = seconds_s = flops = memory = 0.0
    else:
        _, messages_s, seconds_s, flops, memory = _state_mode(mode.split("+")[1], outer_g, outer_span, m)
    return ModeCost(
        mode,
        True,
        max(rank_bytes_sent(mode, g, r, inner_size=k) for r in range(g.cp)),
        messages_u + messages_s,
        flops,
        memory,
        seconds_u + seconds_s,
        shared,
        inner_size=k,
    )


def _refused(mode: str, shared: float, reason: str, *, inner_size: int | None = None) -> ModeCost:
    inf = float("inf")
    return ModeCost(mode, False, inf, inf, inf, inf, inf, shared, reason, inner_size)
