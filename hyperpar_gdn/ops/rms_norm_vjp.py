"""RMSNorm with a hand-written backward, for frameworks whose autograd of broadcasting products is
slow (:attr:`hyperpar_gdn.platform.TensorOps.prefers_written_backward`: MindSpore on CPU, where
a ``[..., D] * [..., 1]`` product, and the reductions its gradient needs, run 10-100x slower than
same-shape kernels).

The same values as the autograd forms in :func:`hyperpar_gdn.ops.blocks.rms_norm` and
:func:`hyperpar_gdn.ops.gdn.layer.gated_rms_norm` (the forward is the same sequence of products;
the backward is the same derivative, summed in another order). Every broadcast goes through
:meth:`TensorOps.mul` and every reduction through :meth:`TensorOps.sum`, which such a framework
serves by tiling and by a product with ones.

With ``n = x * r``, ``r = (mean(x^2) + eps)^-1/2`` over the last dim and ``g`` the gradient
reaching ``n``: ``dx = r * (g - n * mean(g * n))``.

Legend: D the normalised (last) dim; ``[...]`` any leading dims.
"""

from __future__ import annotations

from typing import Any

from hyperpar_gdn.platform import Tensor, TensorOps

__all__ = ["written_gated_rms_norm", "written_rms_norm"]


def written_rms_norm(xp: TensorOps, x: Tensor, weight: Tensor, eps: float, *, zero_centred: bool) -> Tensor:
    """:func:`hyperpar_gdn.ops.blocks.rms_norm` (plain or zero-centred) with a written backward.
    x ``[..., D]``, weight ``[D]`` -> ``[..., D]`` in x's dtype."""
    dtype, ct = xp.dtype(x), xp.compute_dtype(x)

    def forward(x: Tensor, weight: Tensor) -> tuple[tuple[Tensor], tuple[Tensor, ...]]:
        n, r = _normed(xp, xp.cast(x, ct), eps)
        if zero_centred:
            scale = _plus_one(xp, xp.cast(weight, ct))
            return (xp.cast(xp.mul(n, scale), dtype),), (n, r, scale)
        n_x = xp.cast(n, dtype)  # the product in x's dtype, as the autograd form
        return (xp.mul(n_x, weight),), (n_x, r, weight)

    def backward(saved: tuple[Tensor, ...], dy: Tensor) -> tuple[Tensor, Tensor]:
        n, r, scale = saved  # scale: 1 + weight (zero-centred) or weight, n: normed (x's dtype if plain)
        dy = xp.cast(dy, ct)
        n_ct = xp.cast(n, ct)
        dweight = _sum_leading(xp, dy * n_ct)
        dx = _input_grad(xp, xp.mul(dy, xp.cast(scale, ct)), n_ct, r)
        return xp.cast(dx, dtype), xp.cast(dweight, xp.dtype(weight))

    (y,) = xp.custom_vjp(forward, backward, x, weight)
    return y


def written_gated_rms_norm(xp: TensorOps, o: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """:func:`hyperpar_gdn.ops.gdn.layer.gated_rms_norm` with a written backward:
    ``weight * o / rms(o) * silu(z)``; o, z ``[..., Dv]``, weight ``[Dv]`` -> o's dtype."""
    dtype, ct = xp.dtype(o), xp.compute_dtype(o)

    def forward(o: Tensor, z: Tensor, weight: Tensor) -> tuple[tuple[Tensor], tuple[Tensor, ...]]:
        n, r = _normed(xp, xp.cast(o, ct), eps)
        z_ct = xp.cast(z, ct)
        silu_z = xp.silu(z_ct)
        y = xp.mul(xp.cast(n, dtype), weight) * silu_z  # in the autograd form's order
        return (xp.cast(y, dtype),), (xp.cast(n, dtype), r, z_ct, silu_z, weight)

    def backward(saved: tuple[Tensor, ...], dy: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n, r, z_ct, silu_z, weight = saved
        dy = xp.cast(dy, ct)
        n_ct, w_ct = xp.cast(n, ct), xp.cast(weight, ct)
        dy_gate = dy * silu_z
        dweight = _sum_leading(xp, dy_gate * n_ct)
        sig = xp.sigmoid(z_ct)
        dsilu = sig * (xp.scalar(1.0, sig) + z_ct * (xp.scalar(1.0, sig) - sig))
        dz = xp.mul(dy * n_ct, w_ct) * dsilu
        do = _input_grad(xp, xp.mul(dy_gate, w_ct), n_ct, r)
        return xp.cast(do, dtype), xp.cast(dz, xp.dtype(z)), xp.cast(dweight, xp.dtype(weight))

    (y,) = xp.custom_vjp(forward, backward, o, z, weight)
    return y


def _normed(xp: TensorOps, x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x ``[..., D]`` (compute dtype) -> ``(x * r, r)``, r ``[..., 1]`` = 1 / rms(x)."""
    mean_sq = xp.sum(x * x, -1, keepdim=True) / xp.scalar(float(x.shape[-1]), x)
    r = xp.rsqrt(mean_sq + xp.scalar(eps, x))
    return xp.mul(x, r), r


def _plus_one(xp: TensorOps, w: Tensor) -> Tensor:
    return w + xp.scalar(1.0, w)


def _input_grad(xp: TensorOps, g: Tensor, n: Tensor, r: Tensor) -> Tensor:
    """``r * (g - n * mean(g * n))`` over the last dim: the gradient of x from g = dL/dn."""
    mean_gn = xp.sum(g * n, -1, keepdim=True) / xp.scalar(float(n.shape[-1]), n)
    return xp.mul(g - xp.mul(n, mean_gn), r)


def _sum_leading(xp: TensorOps, x: Tensor) -> Any:
    """``[..., D]`` -> ``[D]``: the sum over every leading dim (a weight's gradient)."""
    return xp.sum(x.reshape(-1, x.shape[-1]), 0)
