"""Compare a context-parallel layer with the same layer on one device (any platform).

Used by ``scripts/selfcheck.py``, the tests and the benchmarks: every rank runs the whole
sequence through ``reference`` (an identical copy of the layer), then its shard through the
CP-applied ``layer``, and measures the output shard, the input-gradient shard and the parameter
gradients summed over the CP ranks against the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.platform import Platform


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max(|expected|, tiny), in float64."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {actual.shape} vs {expected.shape}")
    scale = max(float(np.abs(expected).max(initial=0.0)), 1e-30)
    return float(np.abs(actual - expected).max(initial=0.0)) / scale


def compare_with_reference(
    platform: Platform,
    mesh: Any,
    layer: Any,
    reference: Any,
    x: np.ndarray,
    cotangent: np.ndarray,
    *,
    attention_mask: np.ndarray | None = None,
    dtype: str = "float32",
    reference_dtype: str | None = None,
    shard_lengths: Sequence[int] | None = None,
    layout: str = "contiguous",
    whole_grads: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, float]:
    """Relative errors of the CP ``layer`` against ``reference`` (same weights, no CP).

    ``x`` ``[B, T, hidden]`` and ``cotangent`` (the output gradient, same shape) are the whole
    sequence, identical on every rank; ``attention_mask`` ``[B, T]``. ``layer`` must already have
    context parallelism applied on ``mesh`` (its CP axis; with one rank, ``mesh`` only needs
    ``get_local_rank()`` and ``size()``); ``whole_grads``: for a layer split by heads as well
    (tensor parallelism), what makes its parameter gradients whole, in the one-device layout and
    on the platform (a collective over the TP axis), before they are compared. ``reference_dtype`` (default ``dtype``)
    runs the reference in another precision, e.g. float64 as the truth for a float32 layer.
    ``shard_lengths`` (one per rank, summing to T) gives rank r the r-th contiguous piece of that
    length; default T/cp each. ``layout``: which tokens rank r holds (``"head_tail"``: pieces r and
    2cp-1-r of 2*cp; the layer must be parallelized with the same layout). Returns ``{"output": e, "grad_input": e, "grad_<param>": e, ...}``.
    """
    rank, size = mesh.get_local_rank(), mesh.size()
    t = x.shape[1]
    if shard_lengths is None:
        if t % size:
            raise ValueError(f"T={t} is not divisible by cp={size}")
        shard_lengths = [t // size] * size
    if len(shard_lengths) != size or sum(shard_lengths) != t or min(shard_lengths) < 0:
        raise ValueError(f"shard_lengths={list(shard_lengths)} must be {size} counts >= 0 summing to T={t}")
    local = TokenLayout.of(layout, shard_lengths).positions(rank)

    def run(module: Any, x_np: np.ndarray, cot_np: np.ndarray, mask_np: np.ndarray | None, dtype: str):
        mask = None if mask_np is None else platform.from_numpy(mask_np, dtype=dtype)
        out, (dx,), dparams = platform.value_and_grads(
            lambda inp: module(inp, attention_mask=mask),
            [platform.from_numpy(x_np, dtype=dtype)],
            platform.from_numpy(cot_np, dtype=dtype),
            module,
        )
        return out, dx, dparams

    ref_out, ref_dx, ref_dparams = run(reference, x, cotangent, attention_mask, reference_dtype or dtype)
    mask_local = None if attention_mask is None else attention_mask[:, local]
    out, dx, dparams = run(layer, x[:, local], cotangent[:, local], mask_local, dtype)

    if whole_grads is not None:
        dparams = whole_grads(dparams)
    errors = {
        "output": relative_error(platform.to_numpy(out), platform.to_numpy(ref_out)[:, local]),
        "grad_input": relative_error(platform.to_numpy(dx), platform.to_numpy(ref_dx)[:, local]),
    }
    for name, grad in dparams.items():
        total = grad if size == 1 else platform.collectives.all_reduce_sum(grad, mesh.get_group())
        errors[f"grad_{name}"] = relative_error(
            platform.to_numpy(total), platform.to_numpy(ref_dparams[name])
        )
    return errors
