"""Rank the (ep, cp, tp) splits of a number of devices for a whole Qwen3.5 model.

:func:`rank_tp_cp_splits` prices, for every tp that splits the model (dp = 1, tp x cp = devices,
tp innermost) and, for a MoE model, every ep that divides both cp and ``num_experts`` (expert
parallelism takes its ranks from the dp x cp ranks at one TP index, and dp = 1 here: ep | cp),
one GDN decoder layer's step on one rank, forward and backward, and the memory of the largest
rank:

- cp: the fastest CP mode of :func:`~.ranking.plan_context_parallel` at that tp (a TP rank's
  heads; two-level modes with a node's CP ranks as the inner group), or none at cp = 1, where the
  rank's H/tp heads may still starve the chunk kernel (``Machine.saturating_heads``);
- rule: the chunk rule's own work on T/cp tokens x H/tp heads (the same in every split);
- tp: the TP all-reduces of the layer (:mod:`.cost_model_tp`; at ep > 1 the mixer's only: the
  MoE block stays whole over tp);
- ep: the MoE block's dispatch all-to-alls (:mod:`.cost_model_ep`, a balanced router) over the
  EP group, whose ranks sit tp devices apart;
- experts: the MoE block's FLOPs on the rank (routed experts on T/cp x k rows, the shared expert
  on T/cp rows: 18 x rows x C x I, forward and backward) at the machine's ``matmul_flops``,
  divided by tp at ep = 1 (TP splits their columns), whole at ep > 1 (the TP ranks repeat it);
- fsdp (``fsdp=True``): the layer's weights gathered over the dp x cp ranks in the forward and
  again in the backward, and its gradients reduce-scattered: three rings of (n-1)/n of the
  rank's share of the layer in ``dtype``, over the inter-node link once the ranks span nodes
  (a rank's ``E / ep`` experts over the cp / ep ranks that hold the same ones);
- memory: :func:`hyperpar_gdn.planning.memory.largest_rank` at that (ep, tp, cp), the mode chosen,
  ``ac`` and ``fsdp`` as given (no framework runtime: a device's allocator).

Left out, as in the CP model: the projections' and a dense MLP's FLOPs (the same per rank in
every split: TP splits their columns, CP their tokens), softmax attention's layers, a router's
imbalance, and any overlap of communication with compute. Splits are ranked by predicted
seconds, those over ``budget_gib`` after those within it, those the model's heads forbid last
(with the reason). A split whose ep does not divide cp or ``num_experts`` is not a split: it is
never listed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.planning.choice import two_level_inner_size
from hyperpar_gdn.planning.cost_model import MACHINES, Geometry
from hyperpar_gdn.planning.cost_model_ep import ep_exchange
from hyperpar_gdn.planning.cost_model_tp import allreduce_seconds, tp_exchange, tp_rank_geometry
from hyperpar_gdn.planning.memory import StepOptions, largest_rank
from hyperpar_gdn.planning.model_shape import LINEAR, ModelShape
from hyperpar_gdn.planning.rank_shape import tp_shape
from hyperpar_gdn.planning.ranking import DTYPE_BYTES, Ranking, plan_context_parallel, with_figures

__all__ = ["Split", "rank_tp_cp_splits"]


@dataclass(frozen=True)
class Split:
    """One (ep, cp, tp) split: seconds per GDN decoder layer by term (``cp_seconds`` the chosen
    mode's cost, ``rule_seconds``, ``tp_seconds``, ``fsdp_seconds``, ``ep_seconds``,
    ``expert_seconds``), the TP and EP bytes per layer and rank, ``memory_bytes`` of the largest
    rank, ``state_bytes`` (the mode's CP summaries per layer), ``fits`` the budget, ``reason`` (why
    not possible, else the ranking's line)."""

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
    ep: int = 1
    ep_seconds: float = 0.0
    ep_bytes: float = 0.0
    expert_seconds: float = 0.0

    @property
    def layer_seconds(self) -> float:
        terms = (self.cp_seconds, self.rule_seconds, self.tp_seconds, self.fsdp_seconds, self.ep_seconds)
        return sum(terms) + self.expert_seconds

    def describe(self) -> str:
        name = (
            f"ep {self.ep} x tp {self.tp} x cp {self.cp}" if self.ep > 1 else f"tp {self.tp} x cp {self.cp}"
        )
        if not self.feasible:
            return f"{name}: not possible ({self.reason})"
        mode = self.mode or "no CP"
        return (
            f"{name}, {mode}: {self.layer_seconds * 1e3:.2f} ms/layer (cp "
            f"{self.cp_seconds * 1e3:.2f}, rule {self.rule_seconds * 1e3:.2f}, "
            f"tp {self.tp_seconds * 1e3:.2f}, fsdp {self.fsdp_seconds * 1e3:.2f}, "
            f"ep {self.ep_seconds * 1e3:.2f}, experts {self.expert_seconds * 1e3:.2f}), "
            f"{self.memory_bytes / 2**30:.1f} GiB per rank" + ("" if self.fits else " (over the budget)")
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
    eps: tuple[int, ...] | None = None,
    **machine: float,
) -> tuple[Split, ...]:
    """Every tp dividing ``devices`` (cp = devices / tp) and, for a MoE model, every ep of ``eps``
    (default: every divisor of ``num_experts``) that divides that cp, ranked (see the module
    docstring); a dense model's splits have ep 1.

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
    eps = _expert_parallel_sizes(shape, eps)
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
            tp_shape(shape, tp)
            why = None
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
        reason = ranked.why() if isinstance(ranked, Ranking) else f"tp={tp} holds every token: no CP"
        link = base.inter if devices > base.devices_per_node else base.intra
        for ep in (e for e in eps if cp % e == 0):
            local = tp_shape(shape, tp, ep)
            experts = local.expert_parameters() // max(len(local.layer_types), 1)  # a layer's, held
            fsdp_s = 0.0
            if fsdp and cp > 1:  # a ring gather: half an all-reduce; at ep > 1 the experts over cp / ep ranks
                width = DTYPE_BYTES[dtype]
                split = experts if ep > 1 else 0
                gathers = [((local.layer_parameters(LINEAR) - split) * width, cp)]
                if split:
                    gathers.append((split * width, cp // ep))
                fsdp_s = 3 * sum(allreduce_seconds(size, n, link) for size, n in gathers) / 2
            ep_tp_s, ep_tp_b = tp_s, tp_b
            if ep > 1 and tp > 1:  # the MoE block whole over tp: the mixer's all-reduces only
                exchange = tp_exchange(_geometry(heads, common, cp), tp, base, moe_whole=True)
                ep_tp_s, ep_tp_b = exchange.seconds, exchange.payload
            tokens = batch * seq_len / cp
            dispatch = ep_exchange(
                tokens=tokens, top_k=shape.num_experts_per_tok or 0, hidden=shape.hidden_size,
                element_bytes=DTYPE_BYTES[dtype], num_experts=shape.num_experts, ep=ep, machine=base, stride=tp,
            )  # fmt: skip
            opts = StepOptions(
                seq_len=seq_len, rows=batch, cp=cp, tp=tp, ep=ep, world_size=devices, cp_mode=mode or "p2p",
                layout=layout, ac=ac, dtype="bf16" if DTYPE_BYTES[dtype] == 2 else "fp32", fsdp=fsdp,
                attention="fused",
            )  # fmt: skip
            memory = largest_rank(shape, opts).total
            fits = budget_gib is None or memory <= budget_gib * 2**30
            splits.append(
                Split(
                    tp, cp, True, mode, inner, cp_s, rule_s, ep_tp_s, fsdp_s, ep_tp_b, memory, state, fits,
                    reason, ep=ep, ep_seconds=dispatch.seconds, ep_bytes=dispatch.bytes,
                    expert_seconds=_expert_seconds(shape, tokens, tp if ep == 1 else 1, base),
                )
            )  # fmt: skip
    return tuple(sorted(splits, key=lambda s: (not s.feasible, not s.fits, s.layer_seconds)))


def _expert_parallel_sizes(shape: ModelShape, eps: tuple[int, ...] | None) -> tuple[int, ...]:
    """The ep sizes to rank: ``eps`` checked (each divides ``num_experts``), by default every
    divisor of ``num_experts``; (1,) for a dense model."""
    experts = shape.num_experts or 0
    if eps is None:
        return tuple(e for e in range(1, experts + 1) if experts % e == 0) or (1,)
    bad = [
        e for e in eps if isinstance(e, bool) or not isinstance(e, int) or e < 1 or (e > 1 and experts % e)
    ]
    if bad or not eps:
        raise ValueError(
            f"rank_tp_cp_splits: eps={eps!r}: each ep must be an int >= 1 dividing num_experts={experts}"
        )
    return tuple(sorted(set(eps)))


def _expert_seconds(shape: ModelShape, tokens: float, share: int, machine: Any) -> float:
    """The MoE block's SwiGLU FLOPs of ``tokens`` tokens, forward and backward (3 products of
    2 C I FLOPs per row forward, twice that backward), on ``1 / share`` of the columns."""
    if not shape.num_experts or not machine.matmul_flops:
        return 0.0
    c = shape.hidden_size
    rows = tokens * shape.num_experts_per_tok * shape.moe_intermediate_size
    rows += tokens * shape.shared_expert_intermediate_size
    return 18 * rows * c / share / machine.matmul_flops


def _geometry(heads: dict, common: dict, cp: int) -> Geometry:
    return Geometry(
        common["seq_len"], cp, heads["num_k_heads"], heads["num_v_heads"], heads["head_k_dim"],
        heads["head_v_dim"], heads["conv_kernel_size"], common["batch"], DTYPE_BYTES[common["dtype"]],
        hidden=heads["hidden_size"],
    )  # fmt: skip


_KEYS = ("bandwidth", "latency", "inter_bandwidth", "inter_latency", "devices_per_node", "flops")


def _no_cp(shape: Any, heads: dict, tp: int, machine: Any, common: dict) -> tuple[float, ...]:
    """(cp seconds, rule seconds, tp seconds, tp bytes) of a layer at cp = 1: no CP exchange, the
    rule's work on all T tokens at the rate of a rank's H/tp heads, TP's all-reduces."""
    g = _geometry(heads, common, 1)
    local = tp_rank_geometry(g, tp)
    rule = local.shared_flops() / machine.flops
    starved = local.shared_flops() * (1 / machine.rate(local.b * local.h) - 1 / machine.flops)
    exchange = tp_exchange(g, tp, machine, num_experts=shape.num_experts)
    return starved, rule, exchange.seconds, exchange.payload
