"""The Qwen3.5 GDN layer as stages of tensor maths, shared by the single-device layer and the
context-parallel modes (which insert communication between stages), on any framework.

Legend: B batch, T tokens, Hk key heads, H value heads, Dk/Dv head dims, C conv channels
(2*Hk*Dk + H*Dv), W conv kernel width.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperpar_gdn.platform import Tensor, TensorOps, ops_for

from .chunk import chunk_gated_delta_rule

REQUIRED_ATTRIBUTES = (
    "hidden_size",
    "num_k_heads",
    "num_v_heads",
    "head_k_dim",
    "head_v_dim",
    "conv_kernel_size",
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "conv1d",
    "A_log",
    "dt_bias",
    "norm",
    "out_proj",
)


@dataclass(frozen=True)
class LayerDims:
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel_size: int
    norm_eps: float

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def of(cls, module: object) -> LayerDims:
        """Read the dimensions of a GDN layer (ours, transformers' or the MindSpore one)."""
        missing = [name for name in REQUIRED_ATTRIBUTES if not hasattr(module, name)]
        if missing:
            raise ValueError(
                f"{type(module).__name__} is not a Qwen3.5 GDN layer: it lacks {', '.join(missing)}"
            )
        norm = module.norm
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if eps is None:
            raise ValueError(f"{type(module).__name__}.norm has neither variance_epsilon nor eps")
        return cls(
            hidden_size=int(module.hidden_size),
            num_k_heads=int(module.num_k_heads),
            num_v_heads=int(module.num_v_heads),
            head_k_dim=int(module.head_k_dim),
            head_v_dim=int(module.head_v_dim),
            conv_kernel_size=int(module.conv_kernel_size),
            norm_eps=float(eps),
        )


@dataclass(frozen=True)
class LayerWeights:
    """The layer's parameters (the framework's own parameter objects, so gradients reach them)."""

    qkv: Tensor  # [C, hidden]
    z: Tensor  # [H*Dv, hidden]
    b: Tensor  # [H, hidden]
    a: Tensor  # [H, hidden]
    conv: Tensor  # [C, 1, W]
    a_log: Tensor  # [H]
    dt_bias: Tensor  # [H]
    norm: Tensor  # [Dv]
    out: Tensor  # [hidden, H*Dv]

    @classmethod
    def of(cls, module: object) -> LayerWeights:
        return cls(
            qkv=module.in_proj_qkv.weight,
            z=module.in_proj_z.weight,
            b=module.in_proj_b.weight,
            a=module.in_proj_a.weight,
            conv=module.conv1d.weight,
            a_log=module.A_log,
            dt_bias=module.dt_bias,
            norm=module.norm.weight,
            out=module.out_proj.weight,
        )


def init_layer_dims(
    module: object,
    *,
    hidden_size: int,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_kernel_size: int,
    norm_eps: float,
) -> None:
    """Check a GDN layer's constructor arguments and set the dimension attributes that
    :meth:`LayerDims.of` reads (and transformers' layer has), on a module of any framework."""
    if num_v_heads % num_k_heads:
        raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_k_heads={num_k_heads}")
    module.hidden_size = hidden_size
    module.num_k_heads = num_k_heads
    module.num_v_heads = num_v_heads
    module.head_k_dim = head_k_dim
    module.head_v_dim = head_v_dim
    module.key_dim = num_k_heads * head_k_dim
    module.value_dim = num_v_heads * head_v_dim
    module.conv_dim = 2 * module.key_dim + module.value_dim
    module.conv_kernel_size = conv_kernel_size
    module.layer_norm_epsilon = norm_eps


def layer_forward(module: object, hidden_states: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """The single-device forward of a GDN layer module (ours on either framework)."""
    dims = LayerDims.of(module)
    shape = tuple(hidden_states.shape)
    if len(shape) != 3 or shape[-1] != dims.hidden_size:
        raise ValueError(f"hidden_states must be [B, T, hidden_size={dims.hidden_size}]; got {shape}")
    return gdn_layer_forward(
        ops_for(hidden_states), LayerWeights.of(module), dims, hidden_states, attention_mask
    )


def mask_padding(xp: TensorOps, x: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Zero the rows of x ``[B, T, hidden]`` where attention_mask ``[B, T]`` is 0."""
    if attention_mask is None:
        return x
    b, t = attention_mask.shape
    return x * xp.cast(attention_mask, xp.dtype(x)).reshape(b, t, 1)


def project(xp: TensorOps, w: LayerWeights, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x ``[B, T, hidden]`` -> (mixed ``[B, T, C]`` before the conv, z ``[B, T, H*Dv]``,
    beta logits ``[B, T, H]``, decay logits ``[B, T, H]``)."""
    return xp.linear(x, w.qkv), xp.linear(x, w.z), xp.linear(x, w.b), xp.linear(x, w.a)


def conv_silu(xp: TensorOps, mixed: Tensor, conv_weight: Tensor, *, halo: Tensor | None = None) -> Tensor:
    """Causal depthwise conv over T, then SiLU: mixed ``[B, T, C]`` -> ``[B, T, C]``.

    ``halo`` ``[B, W-1, C]`` holds the pre-conv tokens just before this segment (another rank's);
    None means the segment starts the sequence (zeros)."""
    c, _, width = conv_weight.shape
    weight = conv_weight.reshape(c, width)
    x = xp.swapaxes(mixed, 1, 2)
    if halo is None:
        y = xp.depthwise_conv1d(x, weight, left_pad=width - 1)
    else:
        y = xp.depthwise_conv1d(xp.cat([xp.swapaxes(halo, 1, 2), x], 2), weight, left_pad=0)
    return xp.swapaxes(xp.silu(y), 1, 2)


def split_heads(
    mixed: Tensor, *, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """mixed ``[B, T, 2*Hk*Dk + H*Dv]`` -> q, k ``[B, T, Hk, Dk]``, v ``[B, T, H, Dv]``."""
    b, t, _ = mixed.shape
    kd = num_k_heads * head_k_dim
    q = mixed[..., :kd].reshape(b, t, num_k_heads, head_k_dim)
    k = mixed[..., kd : 2 * kd].reshape(b, t, num_k_heads, head_k_dim)
    v = mixed[..., 2 * kd :].reshape(b, t, num_v_heads, head_v_dim)
    return q, k, v


def gates(
    xp: TensorOps, beta_logits: Tensor, decay_logits: Tensor, a_log: Tensor, dt_bias: Tensor
) -> tuple[Tensor, Tensor]:
    """beta = sigmoid(b) in the input dtype; g = -exp(A_log) * softplus(a + dt_bias) in the
    compute dtype (fp32, or fp64 for fp64 input)."""
    dtype = xp.compute_dtype(decay_logits)
    a = xp.cast(decay_logits, dtype) + xp.cast(dt_bias, dtype)
    g = -xp.exp(xp.cast(a_log, dtype)) * xp.softplus(a)
    return g, xp.sigmoid(beta_logits)


def gated_rms_norm(xp: TensorOps, o: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Per head: weight * o / rms(o) * silu(z), normalised in the compute dtype.
    o, z ``[..., Dv]``; the result has o's dtype."""
    dtype = xp.dtype(o)
    ct = xp.compute_dtype(o)
    x = xp.cast(o, ct)
    var = xp.sum(x * x, -1, keepdim=True) / xp.scalar(float(x.shape[-1]), x)
    x = xp.cast(x * xp.rsqrt(var + xp.scalar(eps, x)), dtype)
    return xp.cast(weight * x * xp.silu(xp.cast(z, ct)), dtype)


def finish(xp: TensorOps, w: LayerWeights, dims: LayerDims, o: Tensor, z: Tensor) -> Tensor:
    """o ``[B, T, H, Dv]``, z ``[B, T, H*Dv]`` -> out_proj(norm(o, z)) ``[B, T, hidden]``."""
    b, t = o.shape[0], o.shape[1]
    z = z.reshape(b, t, dims.num_v_heads, dims.head_v_dim)
    return xp.linear(gated_rms_norm(xp, o, z, w.norm, dims.norm_eps).reshape(b, t, dims.value_dim), w.out)


def head_dims(dims: LayerDims) -> dict[str, int]:
    return {
        "num_k_heads": dims.num_k_heads,
        "num_v_heads": dims.num_v_heads,
        "head_k_dim": dims.head_k_dim,
        "head_v_dim": dims.head_v_dim,
    }


def gdn_layer_forward(
    xp: TensorOps,
    w: LayerWeights,
    dims: LayerDims,
    x: Tensor,
    attention_mask: Tensor | None = None,
    *,
    chunk_size: int = 64,
) -> Tensor:
    """The whole layer on one device: x ``[B, T, hidden]`` -> ``[B, T, hidden]``."""
    x = mask_padding(xp, x, attention_mask)
    mixed, z, b, a = project(xp, w, x)
    q, k, v = split_heads(conv_silu(xp, mixed, w.conv), **head_dims(dims))
    g, beta = gates(xp, b, a, w.a_log, w.dt_bias)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, use_qk_l2norm_in_kernel=True)
    return finish(xp, w, dims, o, z)
