"""A layer's per-token modules as the stages call them, and when the library may read a weight.

The stages take a layer's projections as callables ``[..., in] -> [..., out]``: the modules the
model holds, called as they are, so that a wrapper a user put there (PEFT's LoRA or DoRA layers, a
quantized or float8 Linear) applies. Context parallelism changes only the mixing over the
sequence. A few paths need a weight itself (ulysses_hidden's rows of one rank's heads, tensor
parallelism's shards, the conv over the sequence, the gated norm): they read it only from a module
that computes exactly what its weight says, and refuse any other in one line naming the module and
its class.

Framework-free: the classes are told apart by name, no framework is imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperpar_gdn.platform import Tensor, ops_for

__all__ = ["Projection", "WeightLinear", "linear_weight", "projection", "wrapper_of"]

Projection = Callable[[Tensor], Tensor]

# Classes of these packages hold their weight as they compute with it; any other class (peft,
# bitsandbytes, torchao, ...) wraps it.
_PLAIN_PACKAGES = ("torch", "mindspore", "transformers", "hyperpar_gdn")
_PLAIN_WEIGHTS = ("Parameter", "Tensor", "DTensor")


class WeightLinear:
    """``x -> linear(x, weight)``: a projection given by its weight ``[out, in]`` (a tensor-parallel
    shard, a MindSpore ``nn.Dense``)."""

    def __init__(self, weight: Tensor) -> None:
        self.weight = weight

    def __call__(self, x: Tensor) -> Tensor:
        return ops_for(x).linear(x, self.weight)


def _class_name(module: Any) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _is(module: Any, package: str, name: str) -> bool:
    cls = type(module)
    return cls.__name__ == name and cls.__module__.split(".", 1)[0] == package


def projection(module: Any) -> Projection:
    """How the stages call ``module``: the module itself; MindSpore's ``nn.Dense`` without bias
    (the library's MindSpore layers) through the platform's linear of its weight."""
    if _is(module, "mindspore", "Dense") and getattr(module, "bias", None) is None:
        return WeightLinear(module.weight)
    return module


def _runs(module: Any) -> Any:
    """The module that ``module`` runs: PEFT's ``ModulesToSaveWrapper`` (a trained copy of a module,
    ``modules_to_save=``) runs its one active copy, and hands out that copy's ``weight``."""
    if _is(module, "peft", "ModulesToSaveWrapper") and not module.disable_adapters:
        active = list(module.active_adapters)
        if len(active) == 1 and active[0] in module.modules_to_save:
            return module.modules_to_save[active[0]]
    return module


def wrapper_of(module: Any, *, copies: bool = True) -> str | None:
    """What wraps ``module``'s weight (its class, or its weight's class), or None when the module is
    a plain class of torch, MindSpore, transformers or this library holding a plain tensor, or
    (``copies``) PEFT's ``modules_to_save`` copy of one, whose ``weight`` is the copy's."""
    module = _runs(module) if copies else module
    if type(module).__module__.split(".", 1)[0] not in _PLAIN_PACKAGES:
        return _class_name(module)
    weight = getattr(module, "weight", None)
    if weight is not None and type(weight).__name__ not in _PLAIN_WEIGHTS:
        return f"{_class_name(module)} with a {type(weight).__name__} weight"
    return None


def linear_weight(module: Any) -> Tensor | None:
    """The weight ``[out, in]`` when calling ``module`` computes exactly ``linear(x, weight)`` (a
    :class:`WeightLinear`, torch's ``nn.Linear`` or MindSpore's ``nn.Dense`` without bias, hooks or
    wrapper), else None."""
    if isinstance(module, WeightLinear):
        return module.weight
    module = _runs(module)
    if wrapper_of(module) is not None or getattr(module, "bias", None) is not None:
        return None
    if _is(module, "torch", "Linear"):
        if module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module):
            return None
        return module.weight
    if _is(module, "mindspore", "Dense"):
        return module.weight
    return None
