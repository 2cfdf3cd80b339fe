"""Expert parallelism in the cost model: the dispatch all-to-alls of a MoE block, framework-free.

An EP group of ``ep`` ranks holds the ``E`` routed experts, ``E / ep`` per rank; every (token,
expert) pair a rank's router chose is one row of ``C`` elements (``s`` bytes each). Per MoE
block, forward and backward, rank r sends (the platform's ``bytes_sent`` convention: rows to
other ranks; :func:`ep_dispatch_bytes`, the formula of docs/expert_parallel.md, which
``hyperpar_gdn.expert_parallel``'s dispatch sends exactly)::

    2 (sent_r + received_r) C s + (ep - 1) (E / ep) 8

the dispatch and the combine in the forward, the same two reversed in the backward, and the int64
counts once. ``sent_r`` are the pairs of its own tokens routed to other ranks' experts,
``received_r`` those of other ranks' tokens routed to its experts. A balanced router
(:func:`balanced_pairs`) sends ``N k (ep - 1) / ep`` of a rank's ``N k`` pairs away and receives
as many.

Time (:func:`ep_exchange`): five all-to-alls in sequence (the counts, then four of rows), each a
message to every other rank of the group; a rank's bytes to the peers in its node go over the
``intra`` link, those to other nodes over ``inter`` at the same time, and an all-to-all lasts as
long as the slower of the two (as ulysses' all-to-alls in :mod:`.cost_model`). EP groups are
consecutive ranks of the dp x cp axis at one TP index, ``tp`` devices apart, so a node holds
``devices_per_node / tp`` of a group (at least 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperpar_gdn.planning.cost_model import Machine

__all__ = ["COUNT_BYTES", "EPExchange", "balanced_pairs", "ep_dispatch_bytes", "ep_exchange"]

COUNT_BYTES = 8  # an int64 count per (source rank, expert)
ALL_TO_ALLS = 4  # of rows per MoE block: dispatch and combine, forward and backward


def ep_dispatch_bytes(
    *, sent: float, received: float, hidden: int, element_bytes: int, num_experts: int, ep: int
) -> float:
    """Bytes one rank sends per MoE block, forward and backward, having sent ``sent`` rows to other
    ranks' experts and received ``received`` rows for its own (the module docstring's formula)."""
    if ep == 1:
        return 0.0
    return 2 * (sent + received) * hidden * element_bytes + (ep - 1) * (num_experts // ep) * COUNT_BYTES


def balanced_pairs(tokens: float, top_k: int, ep: int) -> float:
    """The rows a rank sends away (and receives) per dispatch when the router spreads its ``tokens``
    x ``top_k`` pairs evenly over the experts: ``tokens top_k (ep - 1) / ep``."""
    return tokens * top_k * (ep - 1) / ep


@dataclass(frozen=True)
class EPExchange:
    """One MoE block's EP all-to-alls on one rank, forward and backward: ``bytes`` it sends
    (:func:`ep_dispatch_bytes` of a balanced router), ``messages`` in sequence, ``seconds``."""

    ep: int
    bytes: float
    messages: float
    seconds: float


def ep_exchange(
    *,
    tokens: float,
    top_k: int,
    hidden: int,
    element_bytes: int,
    num_experts: int,
    ep: int,
    machine: Machine,
    stride: int = 1,
) -> EPExchange:
    """The all-to-alls of one MoE block at ``ep`` for ``tokens`` tokens per rank (a balanced
    router), the group's ranks ``stride`` devices apart on ``machine`` (``stride`` = tp)."""
    if ep == 1:
        return EPExchange(1, 0.0, 0.0, 0.0)
    pairs = balanced_pairs(tokens, top_k, ep)
    sent = ep_dispatch_bytes(
        sent=pairs, received=pairs, hidden=hidden, element_bytes=element_bytes, num_experts=num_experts, ep=ep
    )
    near = min(ep, max(1, machine.devices_per_node // stride)) - 1  # peers in the rank's node
    far = ep - 1 - near
    per_peer = pairs / (ep - 1) * hidden * element_bytes  # one all-to-all's rows to one peer
    rows = ALL_TO_ALLS * max(
        near * per_peer / machine.intra.bandwidth, far * per_peer / machine.inter.bandwidth
    )
    link = machine.inter if far else machine.intra
    messages = (ALL_TO_ALLS + 1) * (ep - 1)
    counts = (num_experts // ep) * COUNT_BYTES * (ep - 1) / link.bandwidth
    return EPExchange(ep, sent, messages, rows + counts + messages * link.latency)
