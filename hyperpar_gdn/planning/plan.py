"""The context-parallel plan: what a model's GDN layers run under CP, owned in one place.

This module is the one place that names the CP modes (:data:`MODES`, :data:`TWO_LEVEL_MODES`,
:data:`MODE_CHOICES`), what each mode is (:class:`ModeSpec`: head parallel, two levels, which
state exchange) and the token layouts (:data:`LAYOUTS`). A :class:`CPPlan` (mode, token layout,
inner size, chunk size, kernel) is frozen and checks itself when built; :func:`plan_errors` checks
it against a model's GDN layers and a CP group's ranks before anything changes (the ranks then
agree on it: :func:`hyperpar_gdn.distributed.agreement.agree_on_plan`).

``mode="auto"`` is not a plan: :func:`hyperpar_gdn.planning.choice.choose_plan` turns it into
one with the cost model (for a sequence length and a dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hyperpar_gdn.ops.gdn.kernels import check_kernel

__all__ = [
    "HEAD_MODES",
    "LAYOUTS",
    "MODES",
    "MODE_CHOICES",
    "STATE_MODES",
    "TWO_LEVEL_MODES",
    "CPPlan",
    "ModeSpec",
    "check_layout",
    "check_mode",
    "cp_groups",
    "head_split_error",
    "inner_size_option_error",
    "plan_errors",
]


@dataclass(frozen=True)
class ModeSpec:
    """What a GDN CP mode does.

    Attributes:
        name: the mode's name, as users spell it.
        head_parallel: the whole CP group trades the sequence split for a split of the value heads
            (every rank runs the rule on the whole sequence for its heads; no conv halo).
        state_exchange: how the shards' state summaries reach later shards (``"p2p"``,
            ``"all_gather"`` or ``"scan"``), or None (a head-parallel mode).
        two_level: ulysses inside groups of ``inner_size`` consecutive CP ranks, ``state_exchange``
            across them.
        exchanges: what goes over the links, in words (for docs and errors).
    """

    name: str
    head_parallel: bool
    state_exchange: str | None
    two_level: bool
    exchanges: str


_STATE = {
    "p2p": "the entering state, rank to rank along a chain (cp - 1 hops)",
    "all_gather": "one all-gather of every rank's fp32 state summary",
    "scan": "a prefix scan of the summaries in ceil(log2 cp) point-to-point rounds",
}
_SPECS = (
    ModeSpec("ulysses", True, None, False, "two all-to-alls of the projected heads"),
    ModeSpec("ulysses_hidden", True, None, False, "two all-to-alls of the layer's input and output"),
    *(ModeSpec(name, False, name, False, words) for name, words in _STATE.items()),
    *(
        ModeSpec(f"ulysses+{name}", False, name, True, f"ulysses inside a node; across nodes {words}")
        for name, words in _STATE.items()
    ),
)
SPECS: dict[str, ModeSpec] = {spec.name: spec for spec in _SPECS}

MODES = tuple(s.name for s in _SPECS if not s.two_level)  # one level
TWO_LEVEL_MODES = tuple(s.name for s in _SPECS if s.two_level)
HEAD_MODES = tuple(s.name for s in _SPECS if s.head_parallel)
STATE_MODES = tuple(s.name for s in _SPECS if s.state_exchange is not None and not s.two_level)
MODE_CHOICES = (*MODES, *TWO_LEVEL_MODES, "auto")  # what a user may ask for
LAYOUTS = ("contiguous", "head_tail")  # which tokens a rank holds (hyperpar_gdn.distributed.layout)


def check_layout(layout: object) -> str:
    """``layout`` if it is one of :data:`LAYOUTS`, else a ValueError naming the valid ones."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not a token layout; choose one of {', '.join(LAYOUTS)}")
    return layout  # type: ignore[return-value]


def check_mode(mode: object, *, allow_auto: bool = False) -> str:
    """``mode`` if it names a mode (or ``"auto"`` with ``allow_auto``), else a ValueError naming them."""
    choices = MODE_CHOICES if allow_auto else (*MODES, *TWO_LEVEL_MODES)
    if mode not in choices:
        raise ValueError(f"mode={mode!r} is not a context-parallel mode; choose one of {', '.join(choices)}")
    return mode  # type: ignore[return-value]


def inner_size_option_error(mode: str, inner_size: int | None) -> str | None:
    """The scripts' rule for ``--cp-mode`` and ``--cp-inner-size``, as a message, or None: a
    two-level mode requires the inner size, and no other mode takes one."""
    two_level = ", ".join(TWO_LEVEL_MODES)
    if mode in TWO_LEVEL_MODES and inner_size is None:
        return (
            f"--cp-mode {mode} requires --cp-inner-size N: the ranks of each inner (ulysses) group, "
            "e.g. one node's"
        )
    if mode not in TWO_LEVEL_MODES and inner_size is not None:
        return f"--cp-inner-size {inner_size} goes with the two-level modes ({two_level}) only; got --cp-mode {mode}"
    return None


@dataclass(frozen=True, kw_only=True)
class CPPlan:
    """How a model's GDN layers run under context parallelism (validated when built).

    Attributes:
        mode: one of :data:`MODES` or :data:`TWO_LEVEL_MODES` (``"auto"`` is resolved before a
            plan exists: :func:`~hyperpar_gdn.planning.choice.choose_plan`).
        layout: which tokens a rank holds: ``"contiguous"`` (the r-th piece of cp) or
            ``"head_tail"`` (pieces r and 2cp-1-r of 2cp).
        inner_size: ranks per inner group (a node) for the two-level modes, and only for them.
        chunk_size: tokens per chunk of the gated delta rule.
        kernel: the local kernel of the gated delta rule, ``"auto"``, ``"fla"`` or ``"native"``
            (:func:`~hyperpar_gdn.ops.gdn.kernels.resolve_kernel`; ``"auto"``: fla's Triton kernels
            on CUDA and Ascend where they import, else ours).
        reason: why this plan was chosen (the cost model's line for ``auto``), for run headers.

    Example::

        plan = CPPlan(mode="ulysses+scan", inner_size=8)
        plan.spec.two_level, plan.spec.state_exchange      # (True, 'scan')
    """

    mode: str
    layout: str = "contiguous"
    inner_size: int | None = None
    chunk_size: int = 64
    kernel: str = "auto"
    reason: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        check_mode(self.mode)
        check_layout(self.layout)
        two_level = SPECS[self.mode].two_level
        if two_level != (self.inner_size is not None):
            raise ValueError(
                f"inner_size is given with the two-level modes ({', '.join(TWO_LEVEL_MODES)}) and only "
                f"then; got mode={self.mode!r}, inner_size={self.inner_size!r}"
            )
        if self.inner_size is not None and (not _is_int(self.inner_size) or self.inner_size < 1):
            raise ValueError(f"inner_size must be a positive int; got {self.inner_size!r}")
        if not _is_int(self.chunk_size) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int; got {self.chunk_size!r}")
        check_kernel(self.kernel)

    @property
    def spec(self) -> ModeSpec:
        return SPECS[self.mode]

    def describe(self) -> str:
        """One line for a run header: ``mode=p2p layout=head_tail`` (and the inner size)."""
        inner = "" if self.inner_size is None else f" inner_size={self.inner_size}"
        return f"mode={self.mode} layout={self.layout}{inner}"

    def heads_split_over(self, cp: int) -> int | None:
        """Ranks that the value heads are split over: cp (head-parallel), inner_size (two-level), or None."""
        return cp if self.spec.head_parallel else self.inner_size


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def head_split_error(num_v_heads: int, num_k_heads: int, ranks: int, mode: str, *, tp: int = 1) -> str | None:
    """Why ``mode`` cannot split a layer's value heads over ``ranks`` ranks, or None (num_v_heads
    must be divisible by ranks; num_k_heads need not be). ``tp`` > 1: the heads given are one TP
    rank's share, which the mode splits again (the layer's heads divisible by tp x ranks)."""
    if tp > 1 and num_v_heads % ranks:
        return (
            f"mode={mode!r} splits each TP rank's value heads over the CP ranks: num_v_heads="
            f"{num_v_heads * tp} is not divisible by tp x cp = {tp} x {ranks}; use mode='p2p', 'all_gather' "
            "or 'scan', or a smaller tp or cp"
        )
    if num_v_heads % ranks:
        return (
            f"mode={mode!r} splits the value heads over the ranks: num_v_heads={num_v_heads} is not "
            f"divisible by cp={ranks} (num_k_heads={num_k_heads}); use mode='p2p', 'all_gather' or 'scan', "
            "or a cp that divides num_v_heads"
        )
    return None


def cp_groups(ranks: Sequence[int], world: int) -> list[list[int]] | None:
    """Every CP group of the world when ``ranks`` (this CP group's global ranks, in order) is the cp
    axis of a row-major mesh of ``world`` ranks, ``(dp, cp)`` or ``(dp, cp, tp)``: cp ranks ``s``
    apart (s = 1, or tp), the groups ``b*cp*s + t + k*s`` (k < cp) for every block b and offset
    t < s; None for any other CP group. Every process computes the same list (no exchange)."""
    ranks, cp = list(ranks), len(ranks)
    stride = ranks[1] - ranks[0] if cp > 1 else 1
    if stride < 1 or world % (cp * stride):
        return None
    groups = [
        [b * cp * stride + t + k * stride for k in range(cp)]
        for b in range(world // (cp * stride))
        for t in range(stride)
    ]
    return groups if ranks in groups else None


def plan_errors(plan: CPPlan, gdn_dims: Sequence[tuple[int, Any]], *, cp: int, ranks: Sequence[int],
                world: int) -> list[Exception]:  # fmt: skip
    """Every reason ``plan`` cannot run on these GDN layers over this CP mesh, as the exceptions to
    raise (empty: it can; ``NotImplementedError`` for what is not built, ``ValueError`` else).

    Args:
        gdn_dims: (layer index, :class:`~hyperpar_gdn.ops.gdn.layer.LayerDims`) of every GDN layer.
        cp: the CP group's size; ranks: its global ranks, in order; world: the number of processes.
    """
    errors = []
    over = plan.heads_split_over(cp)
    if plan.inner_size is not None and cp % plan.inner_size:
        errors.append(ValueError(f"mode={plan.mode!r}: inner_size={plan.inner_size} does not divide cp={cp}"))
    elif plan.inner_size is not None:
        if cp_groups(ranks, world) is None:
            errors.append(
                NotImplementedError(
                    f"mode={plan.mode!r} needs the CP groups to be the cp axis of a row-major mesh of the "
                    f"{world} processes ((dp, cp) or (dp, cp, tp): cp ranks evenly strided); this CP mesh has "
                    f"ranks {list(ranks)}"
                )
            )
    splitter = "ulysses" if plan.spec.two_level else plan.mode  # the mode that splits the heads
    for index, dims in gdn_dims:
        if over is None:
            break
        error = head_split_error(dims.num_v_heads, dims.num_k_heads, over, splitter, tp=dims.tp)
        if error is not None and plan.spec.two_level:
            error = f"mode={plan.mode!r} runs ulysses over inner_size={over} ranks: {error}"
        if error is not None:
            errors.append(ValueError(f"layer {index}: {error}"))
            break  # every GDN layer of a model has the same heads: one line says it
    return errors
