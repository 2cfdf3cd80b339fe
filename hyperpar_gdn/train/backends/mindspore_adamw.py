"""MindSpore's AdamW set up as torch's, and torch's global-norm gradient clipping, for
:class:`~hyperpar_gdn.train.backends.mindspore_backend.MindSporeBackend`.

- :func:`clip_grad_norm`: torch's ``clip_grad_norm_`` on a list of MindSpore gradients;
- :func:`library_adamw_class`: the MindSpore AdamW that runs on the device target;
- :class:`AdamW`: that AdamW with the settings of :mod:`.optim` (betas (0.9, 0.95), eps 1e-8,
  decay on matrices only), its state as torch tensors in checkpoints (format
  :data:`ADAMW_FORMAT`; a torch run refuses it).

Example::

    optimizer = AdamW(params, weight_decay=0.1, names=names)
    grads, norm = clip_grad_norm(grads, 1.0)  # grads in the order of params
    optimizer.step(grads, lr=1e-3)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mindspore as ms
import numpy as np
import torch
from mindspore import ops

from hyperpar_gdn.train.checkpoints.replicated_shards import Leaf

__all__ = ["ADAMW_FORMAT", "AdamW", "clip_grad_norm", "library_adamw_class"]

# The name checkpoints record for this optimizer's state; it keeps the module the class first lived
# in, so that checkpoints written before it moved here still resume.
ADAMW_FORMAT = "hyperpar_gdn.train.backends.mindspore_backend.AdamW/1"


def clip_grad_norm(grads: Sequence[ms.Tensor], max_norm: float) -> tuple[list[ms.Tensor], float]:
    """torch's ``clip_grad_norm_``: scale every gradient by ``min(1, max_norm / (norm + 1e-6))``,
    where norm is the 2-norm of all of them together. Returns (gradients, norm before clipping)."""
    if max_norm <= 0:
        raise ValueError(f"max_norm={max_norm} must be positive")
    squares = [(g.astype(ms.float32) ** 2).sum() for g in grads]
    total = ops.sqrt(ops.stack(squares).sum())
    coef = ops.clamp(ms.Tensor(max_norm, ms.float32) / (total + 1e-6), max=1.0)
    return [g * coef.astype(g.dtype) for g in grads], float(total.asnumpy())


def library_adamw_class() -> type:
    """MindSpore's AdamW for the device target: ``mindspore.mint.optim.AdamW`` on Ascend; on CPU,
    where its ``AdamW`` kernel is missing in 2.10 (``mint.optim.AdamW`` and ``FusedAdamW`` both
    fail with "The kernel AdamW unregistered", measured), ``mindspore.experimental.optim.AdamW``,
    the same torch AdamW arithmetic in composed ops (one compiled graph per step)."""
    if ms.get_context("device_target") == "Ascend":
        from mindspore.mint.optim import AdamW as LibraryAdamW
    else:
        from mindspore.experimental.optim import AdamW as LibraryAdamW
    return LibraryAdamW


class AdamW:
    """MindSpore's library AdamW (:func:`library_adamw_class`) with torch's settings: weight decay
    on parameters with 2 or more dims only (as ``hyperpar_gdn.train.loop.trainer`` configures torch's),
    betas (0.9, 0.95), eps 1e-8, the learning rate set every step. :meth:`step` takes the
    gradients in the order of ``params``.

    Args:
        params: the parameters to update (``mindspore.Parameter``).
        weight_decay: decoupled weight decay of the matrices.
        betas, eps: Adam's moment decays and denominator epsilon.
        names: a name per parameter, for :meth:`state_dict` (default: the parameters' own).
    """

    def __init__(
        self,
        params: Sequence[ms.Parameter],
        *,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        names: Sequence[str] | None = None,
    ) -> None:
        self.params = list(params)
        self.names = [p.name for p in self.params] if names is None else list(names)
        if len(self.names) != len(self.params):
            raise ValueError(f"AdamW got {len(self.names)} names for {len(self.params)} parameters")
        decay = [i for i, p in enumerate(self.params) if len(p.shape) >= 2]
        rest = [i for i, p in enumerate(self.params) if len(p.shape) < 2]
        self._order = decay + rest  # the library's parameter order, group by group
        self._slot = {position: slot for slot, position in enumerate(self._order)}
        groups = [
            {"params": [self.params[i] for i in ids], "weight_decay": wd}
            for ids, wd in ((decay, weight_decay), (rest, 0.0))
            if ids
        ]
        self.optimizer = library_adamw_class()(groups, lr=1e-3, betas=betas, eps=eps)
        # the step counter starts at 0 (experimental.optim) or -1 (mint.optim)
        self._step_offset = -int(self.optimizer.state_step.asnumpy().reshape(-1)[0])

    @property
    def steps(self) -> int:
        return int(self.optimizer.state_step.asnumpy().reshape(-1)[0]) + self._step_offset

    @property
    def exp_avg(self) -> list[ms.Tensor]:
        """First moments, in the order of ``params``."""
        return [self.optimizer.exp_avg[self._slot[i]] for i in range(len(self.params))]

    @property
    def exp_avg_sq(self) -> list[ms.Tensor]:
        """Second moments, in the order of ``params``."""
        return [self.optimizer.exp_avg_sq[self._slot[i]] for i in range(len(self.params))]

    def step(self, grads: Sequence[ms.Tensor], lr: float) -> None:
        if len(grads) != len(self.params):
            raise ValueError(f"AdamW.step got {len(grads)} gradients for {len(self.params)} parameters")
        for i, (param, grad) in enumerate(zip(self.params, grads, strict=True)):
            if tuple(grad.shape) != tuple(param.shape):
                raise ValueError(
                    f"AdamW: gradient {i} has shape {tuple(grad.shape)}, its parameter {param.name} "
                    f"{tuple(param.shape)}"
                )
        # A float, not the group's lr Parameter set in place: in 2.10 (measured) a group of two or
        # more parameters then kept updating with a stale rate (0.003 off torch after one change).
        for group in self.optimizer.param_groups:
            group["lr"] = float(lr)
        # Each gradient marked a variable (mindspore.mutable; tensors are variables of a compiled
        # graph anyway): the library's AdamW passes a group's gradients to a jit function as a
        # tuple, and at its second compile (the second group, first step) MindSpore 2.10 otherwise
        # logs a "might cause recompiling" warning that prints every gradient of that tuple.
        self.optimizer(tuple(ms.mutable(grads[i]) for i in self._order))

    def state_dict(self) -> dict[str, Any]:
        """The moments (torch tensors, so ``torch.load(weights_only=True)`` reads them), the step
        count and the parameter names."""
        return {
            "format": ADAMW_FORMAT,
            "steps": self.steps,
            "names": list(self.names),
            "exp_avg": [torch.from_numpy(m.asnumpy().copy()) for m in self.exp_avg],
            "exp_avg_sq": [torch.from_numpy(v.asnumpy().copy()) for v in self.exp_avg_sq],
        }

    def shard_state(self, leaf: Callable[[ms.Tensor], Leaf]) -> dict[str, Any]:
        """:meth:`state_dict` with :class:`~hyperpar_gdn.train.checkpoints.replicated_shards.Leaf` moments, each made by
        ``leaf``: nothing is copied until a rank reads the moments it saves."""
        return {
            "format": ADAMW_FORMAT,
            "steps": self.steps,
            "names": list(self.names),
            "exp_avg": [leaf(m) for m in self.exp_avg],
            "exp_avg_sq": [leaf(v) for v in self.exp_avg_sq],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the parameter names and shapes must match."""
        if state.get("format") != ADAMW_FORMAT:
            raise ValueError(
                f"optimizer state has format {state.get('format')!r}, not {ADAMW_FORMAT!r} (torch's "
                "AdamW state, from a torch run?): resume it on the platform that saved it"
            )
        if list(state["names"]) != self.names:
            raise ValueError(
                f"optimizer state is for parameters {state['names'][:3]}... ({len(state['names'])}), "
                f"not {self.names[:3]}... ({len(self.names)})"
            )
        for i, (m, v, p) in enumerate(zip(state["exp_avg"], state["exp_avg_sq"], self.params, strict=True)):
            if tuple(m.shape) != tuple(p.shape) or tuple(v.shape) != tuple(p.shape):
                raise ValueError(
                    f"optimizer state of {self.names[i]} has shape {tuple(m.shape)}, not {tuple(p.shape)}"
                )
        for i, p in enumerate(self.params):
            slot = self._slot[i]
            self.optimizer.exp_avg[slot].set_data(ms.Tensor(state["exp_avg"][i].numpy()).astype(p.dtype))
            self.optimizer.exp_avg_sq[slot].set_data(
                ms.Tensor(state["exp_avg_sq"][i].numpy()).astype(p.dtype)
            )
        step = self.optimizer.state_step
        value = np.full(step.shape, int(state["steps"]) - self._step_offset)
        step.set_data(ms.Tensor(value, step.dtype))
