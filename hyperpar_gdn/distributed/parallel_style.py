"""Parallel styles: how a module is parallelized over a device mesh, applied from outside.

:class:`ParallelStyle` is the base of the GDN style (:mod:`.linear_attention_style`) and the
softmax-attention style (:mod:`.softmax_attention_style`): ``apply(module, mesh)`` replaces the
module's forward by an instance attribute, ``undo(module)`` restores it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

__all__ = ["ParallelStyle", "applied_layout", "is_parallelized", "refuse_unhandled"]

_HANDLE = "_hyperpar_cp"
_LAYOUT = "_hyperpar_cp_layout"


class ParallelStyle(ABC):
    """One job: ``apply(module, mesh)`` parallelizes ``module`` in place and returns it.

    A style replaces the module's forward (``construct`` for a MindSpore Cell) by an instance
    attribute; :meth:`undo` restores it. Nothing is patched at class level."""

    @abstractmethod
    def apply(self, module: Any, mesh: Any) -> Any: ...

    @staticmethod
    def _install(
        module: Any, make_forward: Callable[[Callable], Callable], *, layout: str | None = None
    ) -> Any:
        """Replace the module's forward by ``make_forward(original_forward)``; a mixer's style
        also records its token ``layout`` (:func:`applied_layout`)."""
        if getattr(module, _HANDLE, None) is not None:
            raise ValueError(
                f"{type(module).__name__} already has context parallelism applied; undo() it first"
            )
        attr = "construct" if hasattr(module, "construct") else "forward"
        original = getattr(module, attr)
        setattr(module, _HANDLE, (attr, attr in vars(module), original))
        setattr(module, attr, make_forward(original))
        if layout is not None:
            setattr(module, _LAYOUT, layout)
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
        if hasattr(module, _LAYOUT):
            delattr(module, _LAYOUT)
        return module


def applied_layout(module: Any) -> str | None:
    """The token layout a mixer was parallelized with (None: no context parallelism applied)."""
    return getattr(module, _LAYOUT, None)


def is_parallelized(module: Any) -> bool:
    """Whether a style's forward is installed on ``module``."""
    return getattr(module, _HANDLE, None) is not None


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
