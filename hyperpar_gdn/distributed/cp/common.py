"""What every context-parallel mode receives: the CP group, the layer's stage functions and
every rank's shard length."""

from __future__ import annotations

from dataclasses import dataclass

from hyperpar_gdn.ops.layer import LayerDims, LayerWeights, conv_silu
from hyperpar_gdn.platform import Collectives, Group, Tensor, TensorOps


@dataclass(frozen=True)
class CPGroup:
    """This rank's place on the CP axis: rank r holds the r-th contiguous piece of the sequence
    (usually tokens [r*T/cp, (r+1)*T/cp); pieces may differ in length)."""

    xp: TensorOps
    comm: Collectives
    group: Group
    rank: int
    size: int


@dataclass(frozen=True)
class LayerCall:
    """One forward call of a GDN layer on the local shard."""

    weights: LayerWeights
    dims: LayerDims
    chunk_size: int


def conv_with_halo(cp: CPGroup, mixed: Tensor, conv_weight: Tensor) -> Tensor:
    """Causal conv + SiLU on the local shard mixed ``[B, T/cp, C]``.

    The first W-1 outputs need the last W-1 pre-conv tokens of the previous rank: they come
    through a differentiable shift (rank 0 gets zeros, which is the sequence's own padding)."""
    width = conv_weight.shape[-1]
    if cp.size == 1 or width == 1:
        return conv_silu(cp.xp, mixed, conv_weight)
    t = mixed.shape[1]
    halo = cp.comm.shift_right(mixed[:, t - (width - 1) :], cp.group)
    return conv_silu(cp.xp, mixed, conv_weight, halo=halo)


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
