"""``mode="auto"`` made a plan: the cost model's fastest mode for a layer on a CP group.

:func:`choose_plan` takes what decides the choice as plain figures (a GDN layer's dimensions, the
CP group's size and global ranks, the machine kind, the devices per node, the MoE experts) and
returns the :class:`~.plan.CPPlan` to run, its ``reason`` the cost model's line. The caller reads
those figures from its model, mesh and launcher (``hyperpar_gdn.distributed.parallelize``'s
``resolve_plan``, the one place that does); nothing here reads the environment.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyperpar_gdn.ops.gdn.layer import LayerDims
from hyperpar_gdn.planning.cost_model import MACHINES
from hyperpar_gdn.planning.plan import MODES, TWO_LEVEL_MODES, CPPlan
from hyperpar_gdn.planning.ranking import Ranking, plan_context_parallel

__all__ = ["choose_plan", "rank_for_layer", "two_level_inner_size"]


def two_level_inner_size(ranks: Sequence[int], *, tp: int, per_node: int) -> int | None:
    """The inner size that the two-level modes are ranked with on a CP group of global ``ranks``
    (in order), or None (they are not ranked): the CP ranks per node (``per_node`` devices over
    tp) when the group is a block of cp x tp consecutive ranks with its CP ranks tp apart (what two
    levels need) and covers more than one node."""
    ranks, cp = list(ranks), len(ranks)
    block = ranks == list(range(ranks[0], ranks[0] + cp * tp, tp)) and ranks[0] % (cp * tp) < tp
    inner = per_node // tp
    return inner if block and 1 < inner < cp and cp % inner == 0 else None


def rank_for_layer(
    dims: LayerDims,
    *,
    ranks: Sequence[int],
    device: str,
    seq_len: int,
    layout: str = "contiguous",
    dtype: str = "bfloat16",
    inner_size: int | None = None,
    num_experts: int = 0,
    leave_out: Sequence[str] = (),
    **machine: float,
) -> Ranking:
    """:func:`~.ranking.plan_context_parallel` for a GDN layer of ``dims`` (one TP rank's share
    when ``dims.tp`` > 1: the layer is priced at its tp) over the CP group of global ``ranks`` on
    the ``device`` machine (a :data:`~.cost_model.MACHINES` key; ``machine``: its figures
    overridden). Without ``inner_size`` the two-level modes are ranked when the group spans nodes
    (:func:`two_level_inner_size`; ``devices_per_node`` else the machine's). ``leave_out``: modes
    the caller cannot run on this layer (ulysses_hidden over wrapped projections), not ranked."""
    if device not in MACHINES:
        raise ValueError(f"rank_for_layer: device={device!r}; choose one of {', '.join(MACHINES)}")
    tp, cp = dims.tp, len(ranks)
    if inner_size is None:
        per_node = int(machine.get("devices_per_node") or MACHINES[device].devices_per_node)
        inner_size = two_level_inner_size(ranks, tp=tp, per_node=per_node)
    return plan_context_parallel(
        seq_len=seq_len,
        cp=cp,
        num_k_heads=dims.num_k_heads * tp,  # under TP the layer's dims are one rank's share
        num_v_heads=dims.num_v_heads * tp,
        head_k_dim=dims.head_k_dim,
        head_v_dim=dims.head_v_dim,
        conv_kernel_size=dims.conv_kernel_size,
        hidden_size=dims.hidden_size,
        dtype=dtype,
        layout=layout,
        device=device,
        inner_size=inner_size,
        tp=tp,
        num_experts=num_experts if tp > 1 else 0,
        modes=[m for m in MODES + (TWO_LEVEL_MODES if inner_size else ()) if m not in leave_out],
        **machine,
    )


def choose_plan(
    dims: LayerDims,
    *,
    ranks: Sequence[int],
    device: str,
    seq_len: int,
    layout: str = "contiguous",
    dtype: str = "bfloat16",
    inner_size: int | None = None,
    chunk_size: int = 64,
    kernel: str = "auto",
    num_experts: int = 0,
    leave_out: Sequence[str] = (),
    **machine: float,
) -> CPPlan:
    """The :class:`~.plan.CPPlan` that ``mode="auto"`` runs: :func:`rank_for_layer`'s fastest
    mode, in ``layout`` with ``chunk_size`` and the GDN ``kernel``; its ``reason`` is the cost
    model's line (:meth:`~.ranking.Ranking.why`).

    Example (a GDN layer of 16 q/k and 48 value heads of 128, 128K tokens on 16 nodes of 8 GPUs)::

        dims = LayerDims(hidden_size=5120, num_k_heads=16, num_v_heads=48, head_k_dim=128,
                         head_v_dim=128, conv_kernel_size=4, norm_eps=1e-6)
        choose_plan(dims, ranks=range(128), device="gpu", seq_len=131072).describe()
        # 'mode=ulysses+scan layout=contiguous inner_size=8'
    """
    ranked = rank_for_layer(
        dims,
        ranks=ranks,
        device=device,
        seq_len=seq_len,
        layout=layout,
        dtype=dtype,
        inner_size=inner_size,
        num_experts=num_experts,
        leave_out=leave_out,
        **machine,
    )
    return CPPlan(
        mode=ranked.choice,
        layout=layout,
        inner_size=ranked.inner_size,
        chunk_size=chunk_size,
        kernel=kernel,
        reason=ranked.why(),
    )
