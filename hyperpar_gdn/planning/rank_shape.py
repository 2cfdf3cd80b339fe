"""The sizes one tensor- and expert-parallel rank holds (:func:`tp_shape`): a
:class:`~.model_shape.ModelShape` whose head counts and intermediate sizes are divided by tp, as
``apply_tensor_parallel`` splits them (the rules of :mod:`.tp_rules`; docs/tensor_parallel.md),
and whose routed experts are divided by ep, as ``apply_expert_parallel`` splits them
(docs/expert_parallel.md). Framework-free.

Per rank at tp: the GDN layer's q/k and value heads (its projections, conv channels, ``A_log``,
``dt_bias``; the gated norm's ``[V_d]`` weight whole), the attention's query heads, its K/V heads
when tp divides them (else one K/V head used of the whole K/V projections every rank holds), the
MLP's and every expert's intermediate columns and the shared expert's; the embedding, the norms,
the LM head, the MoE router and the shared expert's gate whole. So :meth:`RankShape.num_parameters`
is what one rank holds, and :mod:`.memory`'s per-token counts read the local heads.

At ep > 1 a rank holds ``E / ep`` routed experts (:attr:`RankShape.routed_experts`; the router
and its ``E`` logits whole), and its MoE blocks stay whole over tp (the TP plan leaves
expert-parallel blocks alone): every expert's and the shared expert's intermediate columns whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.planning.model_shape import FULL, LINEAR, ModelShape
from hyperpar_gdn.planning.tp_rules import kv_heads_per_rank

__all__ = ["RankShape", "tp_shape", "tp_split_error"]

# the sizes divided by tp (the K/V heads follow their own rule)
SPLIT = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "num_attention_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
MOE = ("moe_intermediate_size", "shared_expert_intermediate_size")


@dataclass(frozen=True)
class RankShape(ModelShape):
    """One TP and EP rank's sizes: ``config``'s, with :data:`SPLIT` divided by ``tp`` (the MoE
    sizes only at ep = 1), ``num_key_value_heads`` the K/V heads the rank uses (tp's share, or 1
    when tp exceeds them) and ``num_experts / ep`` routed experts held."""

    tp: int = 1
    ep: int = 1

    @property
    def routed_experts(self) -> int:
        return self.config.num_experts // self.ep

    def __getattr__(self, name: str) -> Any:
        value = super().__getattr__(name)
        if name in MOE and self.ep > 1:  # an expert-parallel MoE block is whole over tp
            return value
        if name in SPLIT and self.tp > 1:
            return value // self.tp
        if name == "num_key_value_heads" and self.tp > 1:
            return kv_heads_per_rank(value, self.tp)
        return value

    @property
    def kv_whole(self) -> bool:
        """Every rank holds the whole K/V projections (tp is a multiple of the K/V heads)."""
        return self.tp > 1 and self.config.num_key_value_heads % self.tp != 0

    def layer_parameters(self, kind: str) -> int:
        """Parameters one rank holds of a decoder layer of ``kind``."""
        count = super().layer_parameters(kind)
        if kind == FULL and self.kv_whole:  # the whole K/V projections, not the one head used
            per_head = 2 * self.hidden_size * self.head_dim
            count += per_head * (self.config.num_key_value_heads - 1)
        return count

    def weight_copies(self, kind: str) -> int:
        """Elements of the reordered local weights a TP forward builds and the fp32 backward keeps
        per layer of ``kind``: the GDN layer's ``in_proj_qkv`` and conv rows back in ``[q | k | v]``
        order, the routed experts' ``gate_up_proj`` rows back in ``[gate | up]`` order."""
        if self.tp == 1:
            return 0
        size = 0
        if kind == LINEAR:
            size += self.conv_dim * (self.hidden_size + self.linear_conv_kernel_dim)
        if self.num_experts and self.ep == 1:
            size += 2 * self.num_experts * self.moe_intermediate_size * self.hidden_size
        return size


def tp_split_error(shape: ModelShape, tp: int, ep: int = 1) -> str | None:
    """Why ``tp`` and ``ep`` cannot split ``shape`` (the rules ``apply_tensor_parallel`` and
    ``apply_expert_parallel`` check: ep divides ``num_experts``), or None."""
    for name, value in (("tp", tp), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name}={value!r} must be a positive int"
    if ep > 1 and (not shape.num_experts or shape.num_experts % ep):
        return f"ep={ep} does not divide num_experts={shape.num_experts}"
    problems = []
    kinds = set(shape.layer_types)
    names = [n for n in SPLIT if getattr(shape, n)]
    if LINEAR not in kinds:
        names = [n for n in names if not n.startswith("linear_")]
    if FULL not in kinds:
        names = [n for n in names if n != "num_attention_heads"]
    if shape.num_experts:
        names = [n for n in names if n != "intermediate_size" and (ep == 1 or n not in MOE)]
    problems += [f"{n}={getattr(shape, n)}" for n in names if getattr(shape, n) % tp]
    kv = shape.num_key_value_heads
    if FULL in kinds and kv % tp and tp % kv:
        problems.append(f"num_key_value_heads={kv} (tp must divide it or be a multiple of it)")
    if problems:
        return f"tp={tp} does not split {', '.join(problems)}: each must be divisible by tp"
    return None


def tp_shape(shape: ModelShape, tp: int, ep: int = 1) -> ModelShape:
    """The sizes one rank holds at ``tp`` and ``ep`` (``shape`` itself at tp = ep = 1);
    ``ValueError`` naming the sizes that ``tp`` or ``ep`` does not divide."""
    error = tp_split_error(shape, tp, ep)
    if error:
        raise ValueError(error)
    return shape if tp == ep == 1 else RankShape(shape.config, tp, ep)
