"""transformers' hub kernels (a model's ``use_kernels``) beside the forwards this package installs.

A transformers model with ``use_kernels`` on (the default of ``from_pretrained`` from transformers
5.25, where the ``kernels`` package comes with it) re-selects the forward of every layer class
that hub kernels may replace, Qwen3.5's GDN layer and its norms among them, each time the model
switches between ``train()`` and ``eval()``: a forward installed on the layer (the
context-parallel style's, tensor parallelism's) is dropped, and the layer silently computes on its
own shard again. The Trainer calls ``train()`` at every step, the prefill ``eval()``. So while
such forwards are installed, the model's kernelization is off: the layers run their PyTorch
forwards, or ours where this package installed one.

- :func:`pause_hub_kernels`: turn it off on every transformers model inside ``model`` that has
  it on; returns those models;
- :func:`resume_hub_kernels`: turn it on again on them (kernelized for the current mode).
"""

from __future__ import annotations

from typing import Any

__all__ = ["pause_hub_kernels", "resume_hub_kernels"]


def pause_hub_kernels(model: Any) -> list[Any]:
    """Turn transformers' kernelization off on every module of ``model`` whose ``use_kernels`` is
    on (before this package installs a forward: turning it off restores the classes' forwards);
    returns those modules, for :func:`resume_hub_kernels`."""
    paused = [module for module in model.modules() if getattr(module, "use_kernels", False) is True]
    for module in paused:
        module.use_kernels = False
    return paused


def resume_hub_kernels(modules: list[Any]) -> None:
    """Turn kernelization on again on ``modules`` (:func:`pause_hub_kernels`' list), after the
    forwards this package installed are gone."""
    for module in modules:
        module.use_kernels = True
