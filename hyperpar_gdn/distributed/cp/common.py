"""What every context-parallel mode receives: the CP group, the layer's stage functions and
every rank's shard length."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.ops.gdn.layer import LayerDims, LayerWeights, conv_silu
from hyperpar_gdn.ops.gdn.varlen import Documents
from hyperpar_gdn.platform import Collectives, Group, Tensor, TensorOps


@dataclass(frozen=True)
class CPGroup:
    """This rank's place on the CP axis: ``rank`` of ``size``. Which tokens rank r holds is the
    token layout's (:mod:`hyperpar_gdn.distributed.layout`): the r-th contiguous piece (usually
    tokens [r*T/cp, (r+1)*T/cp); pieces may differ in length), or under ``head_tail`` pieces r
    and 2cp-1-r of 2*cp."""

    xp: TensorOps
    comm: Collectives
    group: Group
    rank: int
    size: int

    @classmethod
    def of(cls, mesh: Any) -> CPGroup:
        """This rank's place on a 1-D :class:`~hyperpar_gdn.distributed.mesh.DeviceMesh`."""
        platform = mesh.platform
        return cls(
            xp=platform.ops,
            comm=platform.collectives,
            group=mesh.get_group(),
            rank=mesh.get_local_rank(),
            size=mesh.size(),
        )


@dataclass(frozen=True)
class LayerCall:
    """One forward call of a GDN layer on the local shard; ``kernel``: the local kernel of the
    rule, ``"native"`` or ``"fla"`` (:mod:`hyperpar_gdn.ops.gdn.kernels`)."""

    weights: LayerWeights
    dims: LayerDims
    chunk_size: int
    kernel: str = "native"


def conv_with_halo(cp: CPGroup, mixed: Tensor, conv_weight: Tensor, docs: Documents | None = None) -> Tensor:
    """Causal conv + SiLU on the local shard mixed ``[B, T/cp, C]``.

    The first W-1 outputs need the last W-1 pre-conv tokens of the previous rank: they come
    through a differentiable shift (rank 0 gets zeros, which is the sequence's own padding).
    With packed documents (``docs``: the shard's, one row with its halo) the conv reads no token
    of another document, the halo's included."""
    width = conv_weight.shape[-1]
    if cp.size == 1 or width == 1:
        return conv_silu(cp.xp, mixed, conv_weight, doc_starts=docs)
    t = mixed.shape[1]
    halo = cp.comm.shift_right(mixed[:, t - (width - 1) :], cp.group)
    return conv_silu(cp.xp, mixed, conv_weight, halo=halo, doc_starts=docs)


def conv_fragments(
    cp: CPGroup,
    layout: TokenLayout,
    pieces: Sequence[Tensor],
    conv_weight: Tensor,
    docs: Documents | None = None,
) -> list[Tensor]:
    """Causal conv + SiLU on each of this rank's fragments ``pieces[slot]`` ``[B, P, C]``.

    A fragment's halo is the last W-1 pre-conv tokens of the fragment before it in global order,
    wherever that one lives: every rank all-gathers the halos of its fragments ``[n, B, W-1, C]``
    (one small differentiable collective) and takes those of its predecessors. The sequence's
    first fragment gets zeros. ``docs``: packed documents, one row (and halo) per fragment."""
    width = conv_weight.shape[-1]
    xp = cp.xp
    mine = layout.mine(cp.rank)
    halos: list[Tensor | None] = [None] * len(mine)
    if width > 1:
        tails = xp.stack([y[:, y.shape[1] - (width - 1) :] for y in pieces], 0)
        gathered = cp.comm.all_gather(tails, cp.group)  # [cp, n, B, W-1, C]
        for fragment in mine:
            prev = layout.previous(fragment)
            if prev is not None:
                halos[fragment.slot] = gathered[prev.rank][prev.slot]
    return [
        conv_silu(xp, piece, conv_weight, halo=halo, doc_starts=None if docs is None else docs.row(slot))
        for slot, (piece, halo) in enumerate(zip(pieces, halos, strict=True))
    ]


def shard_lengths(cp: CPGroup, t_local: int, error: str | None) -> list[int]:
    """Every rank's token count, exchanged (one int per rank) before any other communication.

    Bad input stops every rank, not only the one that has it: a rank whose own checks failed
    passes its ``error``, sends -1 and raises ``ValueError(error)``; the others raise a
    ``ValueError`` naming it. Every rank must call this, whatever its input."""
    lengths = cp.comm.all_gather_int(-1 if error is not None else t_local, cp.group)
    if error is not None:
        raise ValueError(error)
    refused = [rank for rank, t in enumerate(lengths) if t < 0]
    if refused:
        raise ValueError(
            f"CP ranks {refused} refused their input (their own errors say why); rank {cp.rank} stops "
            "too, so that no rank waits in a collective"
        )
    return lengths
