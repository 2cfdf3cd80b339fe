"""Tensor parallelism in the cost model: a TP rank's GDN layer, and the TP all-reduces.

TP groups are the innermost mesh axis (mesh (dp, cp, tp)): tp devices of a node hold one TP group,
and the ranks of a CP group sit tp devices apart, so a node holds devices_per_node / tp of them
(:func:`cp_machine`). A TP rank runs its GDN layer on Hk/tp q/k heads and H/tp value heads
(:func:`tp_rank_geometry`): the chunk kernel's work and every CP exchange carrying heads (the
state modes' states and summaries, ulysses' activations, the conv halo's channels) scale by 1/tp,
and a rank's rows x heads fall below ``Machine.saturating_heads`` sooner.

TP's own exchanges per GDN decoder layer (the GDN mixer and its MLP or MoE block), per rank,
forward and backward (docs/tensor_parallel.md, counted by
:func:`hyperpar_gdn.tensor_parallel.count_tp_traffic`), with T_r = T/cp local tokens:

=================================  ============  ==========================================
exchange                           all-reduces   payload each
=================================  ============  ==========================================
block outputs (forward)            2             B T_r C e
block inputs' gradients (backward) 2             B T_r C e
whole-held parameters' gradients   1 per param   V_d 4 (the gated norm's weight); a MoE
                                                 block adds its router E C 4 and shared
                                                 expert gate C 4
=================================  ============  ==========================================

(e: the activations' bytes per element, as the CP terms use; gradients of parameters fp32.) Under
expert parallelism (``moe_whole``) the MoE block is whole on every TP rank: only the mixer's two
all-reduces and its norm's gradient remain. A
ring all-reduce of P bytes over tp ranks takes 2 (tp-1) steps in sequence, each sending P/tp
over the TP link (the intra-node link while tp <= devices_per_node): 2 (tp-1) (latency +
P / (tp bandwidth)) seconds, 2 (tp-1)/tp P bytes on the wire per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hyperpar_gdn.planning.cost_model import Geometry, Link, Machine

__all__ = [
    "TPExchange",
    "allreduce_seconds",
    "cp_machine",
    "tp_exchange",
    "tp_exchange_bytes",
    "tp_rank_geometry",
]

BLOCKS = 2  # a GDN decoder layer's TP blocks: the mixer and the MLP (or MoE block)
PARAM_BYTES = 4  # fp32 parameters (master weights under bf16 too)


@dataclass(frozen=True)
class TPExchange:
    """TP's all-reduces of one GDN decoder layer on one rank, forward and backward: ``payload``
    bytes (what :func:`~hyperpar_gdn.tensor_parallel.count_tp_traffic` counts), ``wire`` bytes a
    ring sends, ``messages`` in sequence, ``seconds``."""

    tp: int
    payload: float
    wire: float
    messages: float
    seconds: float


def tp_exchange_bytes(
    *,
    batch: int,
    tokens: float,
    hidden: int,
    e: int,
    head_v_dim: int,
    num_experts: int = 0,
    moe_whole: bool = False,
) -> dict[str, float]:
    """Payload bytes per rank of one GDN decoder layer's TP all-reduces, by kind (``output``,
    ``input_grad``, ``param_grad``: :class:`~hyperpar_gdn.tensor_parallel.TPTraffic`'s kinds) for
    ``tokens`` local tokens of width ``hidden`` in ``e`` bytes (``moe_whole``: the MoE block is
    not split over tp, as under expert parallelism)."""
    activation = batch * tokens * hidden * e
    blocks = 1 if moe_whole else BLOCKS
    params = head_v_dim + (num_experts * hidden + hidden if num_experts and not moe_whole else 0)
    return {
        "output": blocks * activation,
        "input_grad": blocks * activation,
        "param_grad": params * PARAM_BYTES,
    }


def allreduce_seconds(payload: float, n: int, link: Link) -> float:
    """A ring all-reduce of ``payload`` bytes over ``n`` ranks on ``link``."""
    if n == 1:
        return 0.0
    return 2 * (n - 1) * (link.latency + payload / (n * link.bandwidth))


def tp_exchange(
    g: Geometry, tp: int, m: Machine, *, num_experts: int = 0, moe_whole: bool = False
) -> TPExchange:
    """TP's all-reduces of one GDN decoder layer of geometry ``g`` (the whole layer's heads; T/cp
    local tokens; ``g.hidden`` known) at ``tp`` on ``m`` (``moe_whole``: see
    :func:`tp_exchange_bytes`)."""
    if tp == 1:
        return TPExchange(1, 0.0, 0.0, 0.0, 0.0)
    if g.hidden is None:
        raise ValueError("the TP all-reduces carry the hidden states: give hidden_size= with tp > 1")
    kinds = tp_exchange_bytes(
        batch=g.b, tokens=g.t / g.cp, hidden=g.hidden, e=g.e, head_v_dim=g.v, num_experts=num_experts,
        moe_whole=moe_whole,
    )  # fmt: skip
    link = m.intra if tp <= m.devices_per_node else m.inter
    blocks = 1 if moe_whole else BLOCKS
    block = kinds["output"] / blocks
    calls = [block] * (2 * blocks) + [g.v * PARAM_BYTES]
    if num_experts and not moe_whole:
        calls += [num_experts * g.hidden * PARAM_BYTES, g.hidden * PARAM_BYTES]
    payload = sum(kinds.values())
    seconds = sum(allreduce_seconds(p, tp, link) for p in calls)
    return TPExchange(tp, payload, 2 * (tp - 1) / tp * payload, 2 * (tp - 1) * len(calls), seconds)


def tp_rank_geometry(g: Geometry, tp: int) -> Geometry:
    """The geometry of one TP rank's GDN layer: Hk/tp q/k heads and H/tp value heads (whole q/k
    heads with their value heads: ``num_k_heads`` divisible by tp, checked by the caller)."""
    return replace(g, hk=g.hk / tp, h=g.h / tp)


def cp_machine(m: Machine, tp: int) -> Machine:
    """``m`` as a CP group sees it when its ranks sit ``tp`` devices apart: devices_per_node / tp
    of them per node (at least 1: with tp beyond a node every CP hop crosses nodes)."""
    return replace(m, devices_per_node=max(1, m.devices_per_node // tp))
