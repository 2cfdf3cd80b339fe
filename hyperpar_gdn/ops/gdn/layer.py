"""The Qwen3.5 GDN layer as stages of tensor maths, shared by the single-device layer and the
context-parallel modes (which insert communication between stages), on any framework.

Legend: B batch, T tokens, Hk key heads, H value heads, Dk/Dv head dims, C conv channels
(2*Hk*Dk + H*Dv), W conv kernel width.

Packed documents (B = 1) reach the stages as ``doc_starts``: bool ``[T]``, True at the first token
of a document (see :mod:`hyperpar_gdn.ops.gdn.varlen`). It is per token, so a context-parallel shard
takes its slice like any other per-token tensor; False at the shard's token 0 means the shard
continues a document from the previous rank. Two stages use it:

- :func:`conv_silu` (``doc_starts``, and ``halo_doc_starts`` for the W-1 halo tokens): no output
  reads a token of another document, the halo included.
- the rule, through :func:`hyperpar_gdn.ops.prepare_chunks` (``doc_starts``): the state restarts
  from zero at every True; the entering state (another rank's) reaches only the tokens before the
  first True, and the summary has M = 0 when the shard holds any True.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hyperpar_gdn.ops.gdn.kernels import gdn_rule
from hyperpar_gdn.ops.gdn.varlen import Documents, check_doc_starts, packed_doc_starts
from hyperpar_gdn.ops.head_shard import head_shard_of
from hyperpar_gdn.ops.prefill_states import PrefillStates, conv_state_of
from hyperpar_gdn.ops.projections import Projection, projection, wrapper_of
from hyperpar_gdn.ops.rms_norm_vjp import written_gated_rms_norm
from hyperpar_gdn.platform import Tensor, TensorOps, ops_for

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
    tp: int = 1  # tensor parallelism: the heads above are one of tp ranks' share of the layer's

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
        norm, shard = module.norm, head_shard_of(module)
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
            tp=1 if shard is None else shard.size,
        )

    def tp_rank(self, tp: int) -> LayerDims:
        """These sizes as one of ``tp`` ranks will hold them once tensor parallelism splits the
        layer by heads (itself when it is split already, or ``tp`` is 1)."""
        if tp == 1 or self.tp > 1:
            return self
        return replace(self, num_k_heads=self.num_k_heads // tp, num_v_heads=self.num_v_heads // tp, tp=tp)


@dataclass(frozen=True)
class LayerWeights:
    """What the stages use of a layer: its projections as callables (the modules the model holds,
    called as they are, so that a wrapper such as PEFT's LoRA applies; :mod:`hyperpar_gdn.ops.projections`)
    and the parameters of the conv, the gates and the gated norm (the framework's own parameter
    objects, so gradients reach them)."""

    qkv: Projection  # [..., hidden] -> [..., C]
    z: Projection  # [..., hidden] -> [..., H*Dv]
    b: Projection  # [..., hidden] -> [..., H]
    a: Projection  # [..., hidden] -> [..., H]
    conv: Tensor  # [C, 1, W]
    a_log: Tensor  # [H]
    dt_bias: Tensor  # [H]
    norm: Tensor  # [Dv]
    out: Projection  # [..., H*Dv] -> [..., hidden]

    @classmethod
    def of(cls, module: object) -> LayerWeights:
        """The layer's parts; under tensor parallelism this rank's local shards
        (:attr:`~hyperpar_gdn.ops.head_shard.HeadShard.weights`). Raises
        ``NotImplementedError`` when its conv or gated norm is wrapped (:func:`wrapped_weights_error`)."""
        shard = head_shard_of(module)
        if shard is not None and shard.weights is not None:
            return shard.weights()
        error = wrapped_weights_error(module, type(module).__name__)
        if error is not None:
            raise NotImplementedError(error)
        return cls(
            qkv=projection(module.in_proj_qkv),
            z=projection(module.in_proj_z),
            b=projection(module.in_proj_b),
            a=projection(module.in_proj_a),
            conv=module.conv1d.weight,
            a_log=module.A_log,
            dt_bias=module.dt_bias,
            norm=module.norm.weight,
            out=projection(module.out_proj),
        )


PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def wrapped_weights_error(module: object, where: str) -> str | None:
    """Why the stages cannot read the weights of a GDN layer's conv or gated norm (``where``: how
    the error names the layer), or None: they compute both from the weights, which would bypass a
    wrapper around either module."""
    for name in ("conv1d", "norm"):
        wrapper = wrapper_of(getattr(module, name))
        if wrapper is not None:
            return (
                f"{where}.{name} is wrapped by {wrapper}: the GDN layer's conv over the sequence and "
                f"its gated norm are computed from their weights, so a wrapper there would be bypassed; "
                f"leave {name} out of the adapter's target modules"
            )
    return None


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


def layer_forward(
    module: object,
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    *,
    cu_seqlens: Any = None,
    position_ids: Any = None,
    prefill_states: PrefillStates | None = None,
) -> Tensor:
    """The single-device forward of a GDN layer module (ours on either framework).

    ``prefill_states``: an inference prefill's record; the layer hands it its decoding state
    (conv ``[B, C, W]``, S ``[B, H, K, V]``) after the last token (not with packed documents).

    Packed documents (B = 1): ``cu_seqlens`` int ``[N+1]`` (fla's) or ``position_ids`` ``[1, T]``
    restarting at 0 per document (transformers'); both may be given if they agree. The conv and
    the state restart at every document."""
    dims = LayerDims.of(module)
    shape = tuple(hidden_states.shape)
    if len(shape) != 3 or shape[-1] != dims.hidden_size:
        raise ValueError(f"hidden_states must be [B, T, hidden_size={dims.hidden_size}]; got {shape}")
    doc_starts = packed_doc_starts(
        batch_size=shape[0], seq_len=shape[1], cu_seqlens=cu_seqlens, position_ids=position_ids
    )
    xp = ops_for(hidden_states)
    states = prefill_states
    if states is None:
        return gdn_layer_forward(
            xp, LayerWeights.of(module), dims, hidden_states, attention_mask, doc_starts=doc_starts
        )
    y, (conv, s) = gdn_layer_forward(
        xp,
        LayerWeights.of(module),
        dims,
        hidden_states,
        attention_mask,
        doc_starts=doc_starts,
        output_final_state=True,
    )
    states.keep_gdn(module, conv, s)
    return y


def mask_padding(xp: TensorOps, x: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Zero the rows of x ``[B, T, hidden]`` where attention_mask ``[B, T]`` is 0."""
    if attention_mask is None:
        return x
    b, t = attention_mask.shape
    return x * xp.cast(attention_mask, xp.dtype(x)).reshape(b, t, 1)


def project(xp: TensorOps, w: LayerWeights, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x ``[B, T, hidden]`` -> (mixed ``[B, T, C]`` before the conv, z ``[B, T, H*Dv]``,
    beta logits ``[B, T, H]``, decay logits ``[B, T, H]``)."""
    return w.qkv(x), w.z(x), w.b(x), w.a(x)


def conv_silu(
    xp: TensorOps,
    mixed: Tensor,
    conv_weight: Tensor,
    *,
    halo: Tensor | None = None,
    doc_starts: Any = None,
    halo_doc_starts: Any = None,
) -> Tensor:
    """Causal depthwise conv over T, then SiLU: mixed ``[B, T, C]`` -> ``[B, T, C]``.

    ``halo`` ``[B, W-1, C]`` holds the pre-conv tokens just before this segment (another rank's);
    None means the segment starts the sequence (zeros).

    ``doc_starts`` (bool ``[T]``, B = 1, or a :class:`~.varlen.Documents` that carries the halo's
    too): the conv restarts at every True, reading no token before it. With a halo,
    ``halo_doc_starts`` (bool ``[W-1]``) says the same of the halo tokens, and the halo is read
    only as far back as the document of the segment's first token goes. A
    :func:`conv_silu_reference` beside this one loops over tokens."""
    c, _, width = conv_weight.shape
    weight = conv_weight.reshape(c, width)
    x = xp.swapaxes(mixed, 1, 2)
    if doc_starts is not None:
        return _conv_silu_packed(xp, x, weight, halo, doc_starts, halo_doc_starts)
    if halo_doc_starts is not None:
        raise ValueError("halo_doc_starts needs doc_starts (the segment's own document starts)")
    if halo is None:
        y = xp.depthwise_conv1d(x, weight, left_pad=width - 1)
    else:
        y = xp.depthwise_conv1d(xp.cat([xp.swapaxes(halo, 1, 2), x], 2), weight, left_pad=0)
    return xp.swapaxes(xp.silu(y), 1, 2)


def _conv_silu_packed(
    xp: TensorOps, x: Tensor, weight: Tensor, halo: Tensor | None, doc_starts: Any, halo_doc_starts: Any
) -> Tensor:
    """The conv of :func:`conv_silu` over x ``[B=1, C, T]`` as W shifted products, each tap s
    masked where a document starts in (t - s, t] (the masks of ``doc_starts``, a
    :class:`~.varlen.Documents` that keeps them for the forward's later layers, or an array)."""
    b, _, t = x.shape
    width = weight.shape[1]
    if b != 1:
        raise ValueError(f"packed documents (doc_starts) need batch size B=1; got B={b}")
    if halo is None and halo_doc_starts is not None:
        raise ValueError("halo_doc_starts was given without a halo")
    docs = Documents.of(doc_starts, seq_len=t, halo=halo_doc_starts, width=width)
    keep = docs.conv_keep(xp, width=width, with_halo=halo is not None, like=x)  # [W-1, 1, 1, T]
    x_full = xp.pad_dim(x, 2, width - 1, 0) if halo is None else xp.cat([xp.swapaxes(halo, 1, 2), x], 2)
    y = x * weight[:, width - 1 :]
    for s in range(1, width):
        y = (
            y
            + x_full[:, :, width - 1 - s : width - 1 - s + t]
            * weight[:, width - 1 - s : width - s]
            * keep[s - 1]
        )
    return xp.swapaxes(xp.silu(y), 1, 2)


def conv_silu_reference(xp: TensorOps, mixed: Tensor, conv_weight: Tensor, doc_starts: Any) -> Tensor:
    """Readable reference of :func:`conv_silu` with ``doc_starts`` (no halo): each token's conv
    reads its own document's tokens only, one token at a time."""
    c, _, width = conv_weight.shape
    t = mixed.shape[1]
    starts = check_doc_starts(doc_starts, seq_len=t)
    doc_start = 0
    rows = []
    for i in range(t):
        if starts[i]:
            doc_start = i
        acc = mixed[:, i] * conv_weight[:, 0, width - 1]
        for s in range(1, min(width, i - doc_start + 1)):
            acc = acc + mixed[:, i - s] * conv_weight[:, 0, width - 1 - s]
        rows.append(xp.silu(acc))
    return xp.stack(rows, 1)


def split_heads(
    xp: TensorOps, mixed: Tensor, *, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """mixed ``[B, T, 2*Hk*Dk + H*Dv]`` -> q, k ``[B, T, Hk, Dk]``, v ``[B, T, H, Dv]``."""
    b, t, _ = mixed.shape
    kd = num_k_heads * head_k_dim
    q, k, v = xp.split(mixed, [kd, kd, num_v_heads * head_v_dim], 2)
    return (
        q.reshape(b, t, num_k_heads, head_k_dim),
        k.reshape(b, t, num_k_heads, head_k_dim),
        v.reshape(b, t, num_v_heads, head_v_dim),
    )


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
    if xp.prefers_written_backward:
        return written_gated_rms_norm(xp, o, z, weight, eps)
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
    return w.out(gated_rms_norm(xp, o, z, w.norm, dims.norm_eps).reshape(b, t, dims.value_dim))


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
    doc_starts: Any = None,
    output_final_state: bool = False,
    kernel: str = "native",
) -> Any:
    """The whole layer on one device: x ``[B, T, hidden]`` -> ``[B, T, hidden]``; ``kernel``: the
    local kernel of the rule, ``"native"`` or ``"fla"`` (:mod:`hyperpar_gdn.ops.gdn.kernels`).

    ``doc_starts`` (bool ``[T]``, B = 1, or a :class:`~.varlen.Documents`): packed documents;
    the conv and the state restart at every True (token 0 starts the first document whatever it
    says).

    ``output_final_state``: return ``(y, (conv_state [B, C, W], S [B, H, K, V]))``, the decoding
    state after the last token (see :mod:`hyperpar_gdn.ops.prefill_states`); not with packed
    documents."""
    if output_final_state and doc_starts is not None:
        raise NotImplementedError("output_final_state with packed documents (doc_starts) is not supported")
    if doc_starts is not None:  # checked once, for the conv and the rule
        doc_starts = Documents.of(doc_starts, seq_len=x.shape[1])
    x = mask_padding(xp, x, attention_mask)
    mixed, z, b, a = project(xp, w, x)
    q, k, v = split_heads(xp, conv_silu(xp, mixed, w.conv, doc_starts=doc_starts), **head_dims(dims))
    g, beta = gates(xp, b, a, w.a_log, w.dt_bias)
    o, s = gdn_rule(
        q,
        k,
        v,
        g,
        beta,
        kernel=kernel,
        chunk_size=chunk_size,
        doc_starts=doc_starts,
        output_final_state=output_final_state,
    )
    y = finish(xp, w, dims, o, z)
    if output_final_state:
        return y, (conv_state_of(xp, mixed, dims.conv_kernel_size), s)
    return y
