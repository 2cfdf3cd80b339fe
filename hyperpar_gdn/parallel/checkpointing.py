"""Activation checkpointing per decoder layer (torch): the layer's forward, collectives
included, runs again in the backward instead of keeping its activations. It goes on after
tensor and context parallelism (it wraps the layers they changed) and before FSDP."""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from hyperpar_gdn.distributed.decoder_layers import text_model_of

__all__ = ["apply_activation_checkpointing"]


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every decoder layer in the backward instead of keeping its activations."""
    layers = text_model_of(model).layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)
