"""Dropless top-k dispatch of tokens to their experts' ranks and the combine back (torch).

An EP group of ``ep`` ranks holds ``E`` routed experts, ``E / ep`` consecutive ones per rank
(rank r: experts ``[r E/ep, (r+1) E/ep)``). Each rank routes its own tokens (its router, on its
tokens); every chosen (token, expert) pair is one row:

1. counts: the rows this rank sends to each expert, exchanged so that each rank learns how many
   rows every other rank sends to each of its experts (one all-to-all of ``E`` int64 per rank:
   the receive sizes are known on the host before the rows move, which a dropless exchange needs);
2. dispatch: the rows ``x[token]`` sorted by expert, all-to-all to the experts' ranks;
3. the receiving rank regroups its rows by local expert (they arrive by source rank) and runs its
   experts (:func:`~.grouped.grouped_swiglu`);
4. combine: the outputs go back by the reverse all-to-all, in the order they were sent, and each
   token's output is the sum over its k rows of ``routing weight x expert output``, added at its
   position as transformers' ``Qwen3_5MoeExperts`` adds it.

Both all-to-alls are differentiable (the platform's :meth:`all_to_all`, its backward the reverse
exchange). No token is dropped and no row padded: the rows a rank computes are exactly the pairs
routed to its experts from all ranks of the group.

:func:`count_ep_traffic` records, per dispatch, the rows this rank computed, sent away and
received, and the bytes; docs/expert_parallel.md writes the formula, and
:func:`hyperpar_gdn.planning.cost_model_ep.ep_dispatch_bytes` computes it (framework-free, for the
cost model).

Legend: N tokens on this rank, k experts per token, C hidden size, M = N k rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hyperpar_gdn.expert_parallel.grouped import grouped_swiglu

__all__ = ["EPDispatch", "EPTraffic", "count_ep_traffic", "expert_parallel_experts"]


@dataclass(frozen=True)
class EPDispatch:
    """One dispatch on one rank: ``rows`` computed by its experts, ``sent`` rows it sent to other
    ranks, ``received`` rows it got from other ranks, ``row_bytes`` per row (C x element size)."""

    rows: int
    sent: int
    received: int
    row_bytes: int


@dataclass
class EPTraffic:
    """The dispatches of this process while :func:`count_ep_traffic` is open, in order."""

    dispatches: list[EPDispatch] = field(default_factory=list)

    def rows(self) -> int:
        return sum(d.rows for d in self.dispatches)


_LOG: list[EPTraffic] = []


@contextlib.contextmanager
def count_ep_traffic() -> Iterator[EPTraffic]:
    """Record every expert-parallel dispatch of this process inside the block."""
    log = EPTraffic()
    _LOG.append(log)
    try:
        yield log
    finally:
        _LOG.remove(log)


def expert_parallel_experts(
    x_NC: torch.Tensor,
    top_k_index_Nk: torch.Tensor,
    top_k_weights_Nk: torch.Tensor,
    *,
    gate_up_EIC: torch.Tensor,
    down_ECI: torch.Tensor,
    num_experts: int,
    group: Any,
    collectives: Any,
    experts_fn: Callable[..., torch.Tensor] = grouped_swiglu,
) -> torch.Tensor:
    """The routed experts' output ``[N, C]`` of this rank's tokens, its experts being this rank's
    ``E / ep`` (``gate_up_EIC [E/ep, 2I, C]``, ``down_ECI [E/ep, C, I]``); collective over ``group``.

    ``top_k_index_Nk`` (int) and ``top_k_weights_Nk`` are the router's choice for each token (the
    weights in x's dtype, as transformers' router returns them)."""
    ep = torch.distributed.get_world_size(group)
    local = num_experts // ep
    n, k = top_k_index_Nk.shape
    expert_M = top_k_index_Nk.reshape(-1)
    token_M = torch.arange(n, device=x_NC.device).repeat_interleave(k)
    order_M = torch.argsort(expert_M, stable=True)
    counts_E = torch.bincount(expert_M, minlength=num_experts)
    # [ep, E/ep]: row s = the rows source rank s sends to each of this rank's experts
    received = collectives.all_to_all(counts_E.reshape(ep, local), [1] * ep, [1] * ep, group)
    send_splits = counts_E.reshape(ep, local).sum(1).tolist()
    received_counts = received.tolist()  # the host needs the sizes before the rows move
    recv_splits = [sum(row) for row in received_counts]

    rows_MC = collectives.all_to_all(x_NC[token_M[order_M]], send_splits, recv_splits, group)
    regroup = _by_expert(received_counts, rows_MC.device)  # source-major -> expert-major
    per_expert = [sum(row[j] for row in received_counts) for j in range(local)]
    y_MC = experts_fn(rows_MC[regroup], per_expert, gate_up_EIC, down_ECI)
    back_MC = torch.empty_like(y_MC).index_copy(0, regroup, y_MC)  # source-major again
    out_MC = collectives.all_to_all(back_MC, recv_splits, send_splits, group)

    weighted_MC = out_MC * top_k_weights_Nk.reshape(-1)[order_M, None]
    out_NC = torch.zeros_like(x_NC).index_add(0, token_M[order_M], weighted_MC.to(x_NC.dtype))
    rank = torch.distributed.get_rank(group)
    record = EPDispatch(
        rows=sum(recv_splits),
        sent=sum(send_splits) - send_splits[rank],
        received=sum(recv_splits) - recv_splits[rank],
        row_bytes=x_NC.shape[-1] * x_NC.element_size(),
    )
    for log in _LOG:
        log.dispatches.append(record)
    return out_NC


def _by_expert(received_counts: list[list[int]], device: torch.device) -> torch.Tensor:
    """The permutation of rows that arrived source-major (source s: its rows for local expert 0,
    then 1, ...) into expert-major order (expert j: its rows from source 0, then 1, ...)."""
    starts: list[list[int]] = []
    offset = 0
    for row in received_counts:
        starts.append([])
        for count in row:
            starts[-1].append(offset)
            offset += count
    pieces = [
        torch.arange(starts[s][j], starts[s][j] + received_counts[s][j], device=device)
        for j in range(len(received_counts[0]) if received_counts else 0)
        for s in range(len(received_counts))
    ]
    if not pieces:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat(pieces)
