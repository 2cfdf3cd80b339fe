"""Activation checkpointing per decoder layer: the layer's forward, collectives included, runs
again in the backward instead of keeping its activations. It goes on after tensor and context
parallelism (it wraps the layers they changed) and before FSDP. torch wraps each layer
(``checkpoint_wrapper``); MindSpore marks each block's cell for recomputation."""

from __future__ import annotations

from typing import Any

from hyperpar_gdn.distributed.decoder_layers import text_model_of

__all__ = ["apply_activation_checkpointing", "is_checkpointed", "remove_activation_checkpointing"]


def apply_activation_checkpointing(model: Any, *, framework: str = "torch") -> None:
    """Recompute every decoder layer of ``model`` (``framework``: ``"torch"`` or ``"mindspore"``)
    in the backward instead of keeping its activations."""
    layers = text_model_of(model).layers
    if framework == "mindspore":
        for block in layers:
            block.recompute()
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)


def remove_activation_checkpointing(model: Any) -> None:
    """Undo :func:`apply_activation_checkpointing` on a torch model: its decoder layers unwrapped."""
    layers = text_model_of(model).layers
    for i, layer in enumerate(layers):
        if is_checkpointed(layer):
            layers[i] = layer._checkpoint_wrapped_module


def is_checkpointed(layer: Any) -> bool:
    """Whether the torch ``layer`` is wrapped for activation checkpointing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return isinstance(layer, CheckpointWrapper)
