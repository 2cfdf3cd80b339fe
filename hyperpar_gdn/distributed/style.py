"""Parallel styles: how a module is parallelized over a device mesh, applied from outside."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from hyperpar_gdn.ops.layer import LayerDims, LayerWeights, gdn_layer_forward
from hyperpar_gdn.platform import Tensor

from .cp.common import CPGroup, LayerCall, shard_lengths
from .cp.state_passing import state_passing_forward
from .cp.ulysses import ulysses_forward, ulysses_head_error
from .dtensor import DTensor
from .mesh import as_cp_mesh

MODES = ("ulysses", "p2p", "all_gather")
_HANDLE = "_hyperpar_cp"


class ParallelStyle(ABC):
    """One job: ``apply(module, mesh)`` parallelizes ``module`` in place and returns it.

    A style replaces the module's forward (``construct`` for a MindSpore Cell) by an instance
    attribute; :meth:`undo` restores it. Nothing is patched at class level."""

    @abstractmethod
    def apply(self, module: Any, mesh: Any) -> Any: ...

    @staticmethod
    def _install(module: Any, make_forward: Callable[[Callable], Callable]) -> Any:
        """Replace the module's forward by ``make_forward(original_forward)``."""
        if getattr(module, _HANDLE, None) is not None:
            raise ValueError(
                f"{type(module).__name__} already has context parallelism applied; undo() it first"
            )
        attr = "construct" if hasattr(module, "construct") else "forward"
        original = getattr(module, attr)
        setattr(module, _HANDLE, (attr, attr in vars(module), original))
        setattr(module, attr, make_forward(original))
        return module

    @staticmethod
    def undo(module: Any) -> Any:
        """Restore the module's own forward."""
        handle = getattr(module, _HANDLE, None)
        if handle is None:
            raise ValueError(f"{type(module).__name__} has no context parallelism applied")
        attr, was_instance_attr, original = handle
        if was_instance_attr:
            setattr(module, attr, original)
        else:
            delattr(module, attr)
        delattr(module, _HANDLE)
        return module


class LinearAttentionContextParallel(ParallelStyle):
    """Context parallelism for a Qwen3.5 Gated DeltaNet layer.

    After ``apply(module, mesh)`` the module's forward takes and returns this rank's shard of the
    sequence, ``[B, T_r, hidden]`` (rank r of the mesh holds the r-th contiguous piece of the
    sequence, usually T/cp tokens; the pieces may differ in length), and gives exactly the
    single-device result. Parameters are untouched (state dict and optimizer
    as before); their gradients are this rank's share (sum them over the CP ranks, as data
    parallelism does). ``undo(module)`` restores the original forward.

    Works on ``hyperpar_gdn.models.GatedDeltaNet``, on transformers' ``Qwen3_5GatedDeltaNet``
    (without a cache) and on the MindSpore layer.

    Args:
        mode: ``"ulysses"`` (head parallel, two all-to-alls; num_v_heads divisible by cp),
            ``"p2p"`` (state passing along a chain) or ``"all_gather"`` (one all-gather of
            fp32 state summaries). See docs/modes.md.
        chunk_size: tokens per chunk of the gated delta rule.

    Example::

        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
        LinearAttentionContextParallel(mode="p2p").apply(layer, mesh)
        y_local = layer(x_local)        # x_local: [B, T/4, hidden]
    """

    def __init__(self, mode: str = "ulysses", *, chunk_size: int = 64) -> None:
        if mode not in MODES:
            raise ValueError(
                f"mode={mode!r} is not a context-parallel mode; choose one of {', '.join(MODES)}"
            )
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
        self.mode = mode
        self.chunk_size = chunk_size

    def apply(self, module: Any, mesh: Any) -> Any:
        cp_mesh = as_cp_mesh(mesh)
        dims = LayerDims.of(module)
        cp = cp_mesh.size()
        head_error = ulysses_head_error(dims, cp) if self.mode == "ulysses" else None
        if head_error is not None:
            raise ValueError(head_error)
        platform = cp_mesh.platform
        group = CPGroup(
            xp=platform.ops,
            comm=platform.collectives,
            group=cp_mesh.get_group(),
            rank=cp_mesh.get_local_rank(),
            size=cp,
        )

        def make_forward(original: Callable) -> Callable:
            bind = _signature_binder(original)

            def forward(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
                return self._forward(module, group, hidden_states, bind(hidden_states, *args, **kwargs))

            return forward

        return self._install(module, make_forward)

    def _forward(self, module: Any, cp: CPGroup, x: Any, attention_mask: Any) -> Any:
        placements = None
        if isinstance(x, DTensor):
            placements, mesh, x = x.placements, x.device_mesh, x.to_local()
        if isinstance(attention_mask, DTensor):
            attention_mask = attention_mask.to_local()
        dims = LayerDims.of(module)
        error = _shard_error(dims, x, attention_mask)
        call = LayerCall(weights=LayerWeights.of(module), dims=dims, chunk_size=self.chunk_size)
        if cp.size == 1:
            if error is not None:
                raise ValueError(error)
            y = gdn_layer_forward(cp.xp, call.weights, dims, x, attention_mask, chunk_size=self.chunk_size)
        else:
            lengths = shard_lengths(cp, 0 if error else x.shape[1], error)  # raises on every rank
            _check_lengths(self.mode, dims, lengths)
            if self.mode == "ulysses":
                y = ulysses_forward(cp, call, x, attention_mask, lengths)
            else:
                y = state_passing_forward(self.mode, cp, call, x, attention_mask)
        return y if placements is None else DTensor.from_local(y, mesh, placements)


def refuse_unhandled(owner: str, arguments: dict[str, Any], *, allowed: tuple[str, ...] = ()) -> None:
    """Raise for every argument in ``arguments`` that a context-parallel forward does not handle
    (anything set, i.e. not None or False, outside ``allowed``): a dropped ``cache`` or
    ``cu_seq_lens_q`` would give results that look fine and are wrong."""
    unhandled = sorted(
        k for k, v in arguments.items() if k not in allowed and v is not None and v is not False
    )
    if unhandled:
        raise NotImplementedError(
            f"{owner} under context parallelism does not handle {', '.join(f'{k}=' for k in unhandled)}; "
            "supported: a full-sequence forward/backward without a cache"
            + (f" (with {', '.join(allowed)})" if allowed else "")
        )


def _signature_binder(forward: Callable) -> Callable[..., Tensor | None]:
    """Bind a call as the original forward would and return its attention mask; refuse every
    other argument that is set (a cache, packed-sequence keywords: none is handled here)."""
    signature = inspect.signature(forward)
    owner = getattr(forward, "__self__", forward).__class__.__name__

    def bind(hidden_states: Any, *args: Any, **kwargs: Any) -> Tensor | None:
        bound = dict(signature.bind(hidden_states, *args, **kwargs).arguments)
        for name, parameter in signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                bound.update(bound.pop(name, {}))
        bound.pop("hidden_states", None)
        mask = bound.pop("attention_mask", None)
        refuse_unhandled(owner, bound)
        return mask

    return bind


def _shard_error(dims: LayerDims, x: Tensor, attention_mask: Tensor | None) -> str | None:
    """What is wrong with this rank's own input, or None (checked before any communication)."""
    shape = tuple(x.shape)
    if len(shape) != 3 or shape[-1] != dims.hidden_size:
        return f"the local shard must be [B, T/cp, hidden_size={dims.hidden_size}]; got {shape}"
    if attention_mask is not None and tuple(attention_mask.shape) != shape[:2]:
        return f"attention_mask must be this rank's shard [B, T/cp] = {shape[:2]}; got {tuple(attention_mask.shape)}"
    return None


def _check_lengths(mode: str, dims: LayerDims, lengths: list[int]) -> None:
    """Rules on every rank's token count; the same ValueError on every rank (all know the counts)."""
    halo = dims.conv_kernel_size - 1
    need = 1 if mode == "ulysses" else max(halo, 1)
    for rank, t in enumerate(lengths):
        if t >= need:
            continue
        if mode == "ulysses":
            raise ValueError(
                f"mode='ulysses': the shard of CP rank {rank} is empty; every shard needs a token"
            )
        raise ValueError(
            f"mode={mode!r}: the shard of CP rank {rank} has T/cp={t} tokens, fewer than the conv halo "
            f"W-1={halo} (conv_kernel_size={dims.conv_kernel_size}); every shard needs at least {need}: "
            "use fewer ranks or a longer sequence"
        )
