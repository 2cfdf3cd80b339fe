"""The local kernel of the gated delta rule: ours (``"native"``) or fla's Triton kernels (``"fla"``).

Every mode of context parallelism runs the rule on local tokens through the functions here, with
the kernel chosen once per layer by :func:`resolve_kernel` (``kernel="auto" | "fla" | "native"``):

- :func:`gdn_rule`: outputs and final states of a whole sequence (one device, ulysses' heads, a
  prefill's per-prompt states), packed documents as ``doc_starts`` or ``cu_seqlens``;
- :func:`shard_rule`: a shard entered by a state its peers send (the state modes); ours is the
  one-pass recurrence of :mod:`.onepass`, fla's the widened call of :mod:`.fla_kernel`;
- :func:`decode_rule`: one token per row from a recurrent state.

"native" runs on every framework and device (the reference). "fla" is fla's
``chunk_gated_delta_rule`` (training, prefill) and ``fused_recurrent_gated_delta_rule`` (a decode
step), on torch tensors: CUDA, Ascend through fla's Triton-Ascend path, and for tests the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``, asked for explicitly). fla and triton are imported
only when fla is resolved or called, never by importing this package.

Legend: B batch (rows), T tokens, Hk q/k heads, H value heads, K/V head dims, N documents.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.ops.gdn import fla_kernel
from hyperpar_gdn.ops.gdn.chunk import chunk_gated_delta_rule, outputs_from, prepare_chunks
from hyperpar_gdn.ops.gdn.fla_kernel import FLA_CALLS
from hyperpar_gdn.ops.gdn.naive import recurrent_gated_delta_rule
from hyperpar_gdn.ops.gdn.onepass import StateExchange, shard_outputs
from hyperpar_gdn.ops.gdn.varlen import Documents
from hyperpar_gdn.platform import Tensor, ops_for

KERNELS = ("auto", "fla", "native")

__all__ = [
    "FLA_CALLS",
    "KERNELS",
    "GDNKernel",
    "check_kernel",
    "decode_rule",
    "fla_missing",
    "gdn_rule",
    "kernel_for_inputs",
    "platform_of",
    "resolve_kernel",
    "shard_rule",
]


@dataclass(frozen=True)
class GDNKernel:
    """The kernel a layer runs (``"native"`` or ``"fla"``) and why, in words (the run header's)."""

    name: str
    reason: str


def check_kernel(kernel: Any) -> str:
    """``kernel`` if it is one of :data:`KERNELS`, else ValueError naming it."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not a GDN kernel; choose one of {', '.join(KERNELS)}")
    return kernel


def fla_missing(platform: str) -> str | None:
    """What keeps fla's Triton kernels from running on ``platform`` (``cpu``, ``cuda``, ``npu``,
    ``mindspore``), in words, or None when they can run. Imports triton and fla when both are
    installed."""
    if platform == "mindspore":
        return "fla's kernels take torch tensors; MindSpore keeps the native kernel"
    missing = [name for name in ("triton", "fla") if importlib.util.find_spec(name) is None]
    if missing:  # first: nothing else helps without them
        return f"{' and '.join(missing)} not installed (pip install 'hyperpar-gdn[fla]')"
    if platform == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "on CPU fla's Triton kernels run only under Triton's interpreter (TRITON_INTERPRET=1)"
    if platform == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            return "torch_npu not installed"
        try:
            backends = importlib.import_module("fla.ops.gated_delta_rule.backends")
            if not backends.TritonAscendGDNBackend.is_available():
                return "fla's Triton-Ascend backend sees no Ascend NPU"
        except Exception as error:  # any import failure means: not here
            return f"fla's Triton-Ascend path does not import ({type(error).__name__}: {error})"
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as error:
        return f"fla.ops.gated_delta_rule does not import ({type(error).__name__}: {error})"
    return None


def resolve_kernel(kernel: str, *, platform: str) -> GDNKernel:
    """The kernel for ``kernel`` on ``platform``.

    ``"native"``: ours. ``"auto"``: fla on ``cuda``, and on ``npu`` where fla's Triton-Ascend path
    imports; ours everywhere else (on ``cpu`` fla would run only under Triton's interpreter). ``"fla"``:
    fla, or a ValueError naming what is missing; on ``cpu`` it is allowed under
    ``TRITON_INTERPRET=1`` (tests)."""
    check_kernel(kernel)
    if kernel == "native":
        return GDNKernel("native", "kernel='native' asked for")
    if kernel == "auto" and platform in ("cpu", "mindspore"):
        why = "fla's Triton kernels need CUDA or Ascend" if platform == "cpu" else fla_missing(platform)
        return GDNKernel("native", f"auto on {platform}: {why}")
    missing = fla_missing(platform)
    if missing is not None:
        if kernel == "fla":
            raise ValueError(f"kernel='fla' cannot run on platform {platform!r}: {missing}")
        return GDNKernel("native", f"auto on {platform}: {missing}")
    if platform == "cpu":
        return GDNKernel(
            "fla", "kernel='fla' asked for on CPU: fla's Triton kernels under Triton's interpreter"
        )
    return GDNKernel("fla", f"{kernel} on {platform}: fla's Triton kernels import")


def platform_of(x: Tensor) -> str:
    """The platform name of a tensor (``mindspore``, or torch's device type: ``cpu``, ``cuda``, ``npu``)."""
    xp = ops_for(x)
    return "mindspore" if xp.name == "mindspore" else str(x.device.type)


def fla_refusal(dtype_name: str) -> str | None:
    """Why fla's kernels cannot take inputs of this dtype (its name), or None."""
    if dtype_name.endswith("float64"):
        return "fla's kernels take fp32, bf16 or fp16 inputs, not float64"
    return None


def kernel_for_inputs(kernel: str, requested: str, x: Tensor) -> str:
    """The kernel that runs on inputs like ``x``: ``kernel`` (resolved), or ``"native"`` when fla
    cannot take them and only ``"auto"`` was asked for (ValueError for an explicit ``"fla"``)."""
    if kernel != "fla":
        return kernel
    why = fla_refusal(str(ops_for(x).dtype(x)))
    if why is None:
        return kernel
    if requested == "fla":
        raise ValueError(f"kernel='fla': {why}; use kernel='auto' or 'native'")
    return "native"


def gdn_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    kernel: str = "native",
    chunk_size: int = 64,
    doc_starts: Any = None,
    cu_seqlens: Any = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The rule on whole sequences, q and k l2-normalised inside: q, k ``[B, T, Hk, K]``, v ``[B, T,
    H, V]``, g (log decay, fp32) and beta ``[B, T, H]`` -> (o ``[B, T, H, V]`` in q's dtype, the final
    state(s) fp32 or None).

    Packed documents (B = 1): ``doc_starts`` bool ``[T]`` (or its :class:`~.varlen.Documents`,
    which keep what is built from them for the forward's later layers) or ``cu_seqlens`` int
    ``[N+1]``; then ``initial_state`` is ``[N, H, K, V]`` (or None) and the final states are one
    per document. ``kernel``: ``"native"`` or ``"fla"`` (resolved); ``chunk_size`` is the native
    kernel's."""
    docs = None if doc_starts is None else Documents.of(doc_starts, seq_len=q.shape[1])
    if kernel == "fla":
        return fla_kernel.plain_call(
            q,
            k,
            v,
            g,
            beta,
            cu_seqlens=cu_seqlens if docs is None else docs.cu_seqlens(),
            docs=docs,
            initial_state=initial_state,
            final_state=output_final_state,
        )
    rule = {"chunk_size": chunk_size, "use_qk_l2norm_in_kernel": True}
    if docs is None:
        return chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            **rule,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
        )
    if output_final_state or initial_state is not None:
        return chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            **rule,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=docs.cu_seqlens(),
        )
    o, _ = outputs_from(prepare_chunks(q, k, v, g, beta, **rule, doc_starts=docs), None)
    return o, None


def shard_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    exchange: StateExchange,
    *,
    kernel: str = "native",
    chunk_size: int = 64,
    widened: bool = True,
    doc_starts: Any = None,
) -> Tensor:
    """A shard's outputs ``[B, T, H, V]`` (q's dtype) when the state entering it comes from its
    peers: the shard's summary goes to ``exchange``, which returns the entering state (forward) and
    the gradient of the state leaving it (backward); inputs as in :func:`gdn_rule`.

    ``widened=False``: a shard that no state enters (its exchange gets M = None). ``doc_starts``:
    bool ``[B, T]`` (rows: fragments of B = 1) or ``[T]``, True where a packed document starts
    (or their :class:`~.varlen.Documents`); False at token 0 means the shard continues a document."""
    if kernel == "fla":
        return fla_kernel.shard_call(q, k, v, g, beta, exchange, widened=widened, doc_starts=doc_starts)
    prep = prepare_chunks(
        q, k, v, g, beta, chunk_size=chunk_size, use_qk_l2norm_in_kernel=True, doc_starts=doc_starts
    )
    return prep.xp.cast(shard_outputs(prep, exchange, widened=widened), prep.out_dtype)


def decode_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, *, kernel: str = "native"
) -> tuple[Tensor, Tensor]:
    """One token per row: q, k ``[B, 1, Hk, K]``, v ``[B, 1, H, V]``, g, beta ``[B, 1, H]``, the
    recurrent state ``[B, H, K, V]`` -> (o ``[B, 1, H, V]``, the new state)."""
    if kernel == "fla":
        return fla_kernel.recurrent_call(q, k, v, g, beta, state)
    return recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
