"""Rank the (tp, cp) splits of a number of devices for a whole Qwen3.5 model.

:func:`rank_tp_cp_splits` prices, for every tp that splits the model (dp = 1, tp x cp = devices,
tp innermost), one GDN decoder layer's step on one rank, forward and backward, and the memory of
the largest rank:

- cp: the fastest CP mode of :func:`~.ranking.plan_context_parallel` at that tp (a TP rank's
  heads; two-level modes with a node's CP ranks as the inner group), or none at cp = 1, where the
  rank's H/tp heads may still starve the chunk kernel (``Machine.saturating_heads``);
- rule: the chunk rule's own work on T/cp tokens x H/tp heads (the same in every split);
- tp: the TP all-reduces of the layer (:mod:`.cost_model_tp`);
- fsdp (``fsdp=True``): the layer's weights gathered over the dp x cp ranks in the forward and
  again in the backward, and its gradients reduce-scattered: three rings of (n-1)/n of the
  rank's share of the layer in ``dtype``, over the inter-node link once the ranks span nodes;
- memory: :func:`hyperpar_gdn.planning.memory.largest_rank` at that (tp, cp), the mode chosen,
  ``ac`` and ``fsdp`` as given (no framework runtime: a device's allocator).

Left out, as in the CP model: the projections' and MLP's FLOPs (the same per rank in every split:
TP splits their columns, CP their tokens), softmax attention's layers, and any overlap of
communication with compute. Splits are ranked by predicted seconds, those over ``budget_gib``
after those within it, those the model's heads forbid last (with the reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.planning.choice import two_level_inner_size
from hyperpar_gdn.planning.cost_model import MACHINES, Geometry
from hyperpar_gdn.planning.cost_model_tp import allreduce_seconds, tp_exchange, tp_rank_geometry
from hyperpar_gdn.planning.memory import StepOptions, largest_rank
from hyperpar_gdn.planning.model_shape import LINEAR, ModelShape
from hyperpar_gdn.planning.rank_shape import tp_shape
from hyperpar_gdn.planning.ranking import DTYPE_BYTES, Ranking, plan_context_parallel, with_figures

__all__ = ["Split", "rank_tp_cp_splits"]


@dataclass(frozen=True)
class Split:
    """One (tp, cp) split: seconds per GDN decoder layer by term (``cp_seconds`` the chosen mode's
    cost, ``rule_seconds``, ``tp_seconds``, ``fsdp_seconds``), the TP payload bytes per layer and
    rank, ``memory_bytes`` of the largest rank, ``state_bytes`` (the mode's CP summaries per
    layer), ``fits`` the budget, ``reason`` (why not possible, else the ranking's line)."""

    tp: int
    cp: int
    feasible: bool
    mode: str | None = None
    inner_size: int | None = None
    cp_seconds: float = float("inf")
    rule_seconds: float = 0.0
    tp_seconds: float = 0.0
    fsdp_seconds: float = 0.0
    tp_bytes: float = 0.0
    memory_bytes: int = 0
    state_bytes: float = 0.0
    fits: bool = True
    reason: str = ""

    @property
    def layer_seconds(self) -> float:
        return self.cp_seconds + self.rule_seconds + self.tp_seconds + self.fsdp_seconds

    def describe(self) -> str:
        if not self.feasible:
            return f"tp {self.tp} x cp {self.cp}: not possible ({self.reason})"
        mode = self.mode or "no CP"
        return (
            f"tp {self.tp} x cp {self.cp}, {mode}: {self.layer_seconds * 1e3:.2f} ms/layer (cp "
            f"{self.cp_seconds * 1e3:.2f}, rule {self.rule_seconds * 1e3:.2f}, "
            f"tp {self.tp_seconds * 1e3:.2f}, "
            f"fsdp {self.fsdp_seconds * 1e3:.2f}), {self.memory_bytes / 2**30:.1f} GiB per rank"
            + ("" if self.fits else " (over the budget)")
        )


def rank_tp_cp_splits(
    config: Any,
    *,
    devices: int,
    seq_len: int,
    batch: int = 1,
    dtype: str = "bfloat16",
    layout: str = "contiguous",
    device: str = "gpu",
    fsdp: bool = True,
    ac: bool = True,
    budget_gib: float | None = None,
    **machine: float,
) -> tuple[Split, ...]:
    """Every tp dividing ``devices`` (cp = devices / tp), ranked (see the module docstring).

    ``config``: the model's sizes (a config.json dict, a transformers or our config, or a
    :class:`~hyperpar_gdn.planning.memory.ModelShape`); ``machine``: overrides of the
    :data:`~.cost_model.MACHINES` entry (as :func:`~.ranking.plan_context_parallel`'s keywords).

    Example (Qwen3.5-27B over one node of 8 GPUs at 128K tokens)::

        for split in rank_tp_cp_splits(config, devices=8, seq_len=131072):
            print(split.describe())
    """
    shape = config if isinstance(config, ModelShape) else ModelShape.of(config)
    for name, value in (("devices", devices), ("seq_len", seq_len), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"rank_tp_cp_splits: {name} must be an int >= 1; got {value!r}")
    if layout not in ("contiguous", "head_tail"):
        raise ValueError(f"rank_tp_cp_splits: layout={layout!r}; choose 'contiguous' or 'head_tail'")
    if dtype not in DTYPE_BYTES or device not in MACHINES:
        raise ValueError(f"rank_tp_cp_splits: dtype={dtype!r} ({', '.join(DTYPE_BYTES)}), device={device!r}")
    base = with_figures(MACHINES[device], *(machine.get(k) for k in _KEYS))
    heads = {
        "num_k_heads": shape.linear_num_key_heads,
        "num_v_heads": shape.linear_num_value_heads,
        "head_k_dim": shape.linear_key_head_dim,
        "head_v_dim": shape.linear_value_head_dim,
        "conv_kernel_size": shape.linear_conv_kernel_dim,
        "hidden_size": shape.hidden_size,
    }
    splits = []
    for tp in (t for t in range(1, devices + 1) if devices % t == 0):
        cp = devices // tp
        try:
            local, why = tp_shape(shape, tp), None
        except ValueError as error:  # the sizes tp does not divide
            why = str(error)
        if why is None and layout == "head_tail" and cp > 1 and seq_len % (2 * cp):
            why = f"seq_len={seq_len} is not a multiple of 2 cp = {2 * cp} (head_tail)"
        if why is None and seq_len % cp:
            why = f"seq_len={seq_len} is not a multiple of cp={cp}"
        if why is not None:
            splits.append(Split(tp, cp, False, reason=why))
            continue
        common = dict(seq_len=seq_len, batch=batch, dtype=dtype, layout=layout, device=device, **machine)
        if cp == 1:
            ranked, (cp_s, rule_s, tp_s, tp_b) = None, _no_cp(shape, heads, tp, base, common)
            mode = inner = None
            state = 0.0
        else:
            inner = two_level_inner_size(range(0, cp * tp, tp), tp=tp, per_node=base.devices_per_node)
            ranked = plan_context_parallel(
                cp=cp, tp=tp, inner_size=inner, num_experts=shape.num_experts, **heads, **common
            )
            best = ranked.ranking[0]
            mode, inner, state = best.mode, best.inner_size, best.summary_bytes
            cp_s, rule_s, tp_s, tp_b = best.seconds, best.shared_seconds, best.tp_seconds, best.tp_bytes
        fsdp_s = 0.0
        if fsdp and cp > 1:
            gathered = local.layer_parameters(LINEAR) * DTYPE_BYTES[dtype]
            link = base.inter if devices > base.devices_per_node else base.intra
            fsdp_s = 3 * allreduce_seconds(gathered, cp, link) / 2  # a ring gather: half an all-reduce
        opts = StepOptions(
            seq_len=seq_len, rows=batch, cp=cp, tp=tp, world_size=devices, cp_mode=mode or "p2p",
            layout=layout, ac=ac, dtype="bf16" if DTYPE_BYTES[dtype] == 2 else "fp32", fsdp=fsdp,
            attention="fused",
        )  # fmt: skip
        memory = largest_rank(shape, opts).total
        fits = budget_gib is None or memory <= budget_gib * 2**30
        reason = ranked.why() if isinstance(ranked, Ranking) else f"tp={tp} holds every token: no CP"
        splits.append(
            Split(tp, cp, True, mode, inner, cp_s, rule_s, tp_s, fsdp_s, tp_b, memory, state, fits, reason)
        )
    return tuple(sorted(splits, key=lambda s: (not s.feasible, not s.fits, s.layer_seconds)))


_KEYS = ("bandwidth", "latency", "inter_bandwidth", "inter_latency", "devices_per_node", "flops")


def _no_cp(shape: Any, heads: dict, tp: int, machine: Any, common: dict) -> tuple[float, ...]:
    """(cp seconds, rule seconds, tp seconds, tp bytes) of a layer at cp = 1: no CP exchange, the
    rule's work on all T tokens at the rate of a rank's H/tp heads, TP's all-reduces."""
    g = Geometry(
        common["seq_len"], 1, heads["num_k_heads"], heads["num_v_heads"], heads["head_k_dim"],
        heads["head_v_dim"], heads["conv_kernel_size"], common["batch"], DTYPE_BYTES[common["dtype"]],
        hidden=heads["hidden_size"],
    )  # fmt: skip
    local = tp_rank_geometry(g, tp)
    rule = local.shared_flops() / machine.flops
    starved = local.shared_flops() * (1 / machine.rate(local.b * local.h) - 1 / machine.flops)
    exchange = tp_exchange(g, tp, machine, num_experts=shape.num_experts)
    return starved, rule, exchange.seconds, exchange.payload
