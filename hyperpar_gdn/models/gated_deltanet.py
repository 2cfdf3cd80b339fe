"""A Qwen3.5 Gated DeltaNet layer for PyTorch, with transformers' parameter names."""

from __future__ import annotations

import torch
from torch import nn

from hyperpar_gdn.models.shells import GatedDeltaNetShell


class GatedRMSNorm(nn.Module):
    """weight * x / rms(x) * silu(gate) over the last dim (normalised in fp32)."""

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps


class GatedDeltaNet(GatedDeltaNetShell, nn.Module):
    """Qwen3.5 GDN layer for PyTorch: constructor, forward and arguments in
    :class:`~hyperpar_gdn.models.shells.GatedDeltaNetShell`.

    Example:
        >>> layer = GatedDeltaNet(64, 2, 4, 16, 16)
        >>> tuple(layer(torch.randn(2, 10, 64)).shape)
        (2, 10, 64)
    """

    def _linear(self, in_features: int, out_features: int) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=False)

    def _causal_conv(self, channels: int, width: int) -> nn.Module:
        return nn.Conv1d(
            channels, channels, kernel_size=width, groups=channels, padding=width - 1, bias=False
        )

    def _ones(self, name: str, size: int) -> nn.Parameter:
        return nn.Parameter(torch.ones(size))

    def _log_uniform(self, name: str, size: int, low: float, high: float) -> nn.Parameter:
        return nn.Parameter(torch.log(torch.empty(size).uniform_(low, high)))

    def _gated_norm(self, dim: int, eps: float) -> nn.Module:
        return GatedRMSNorm(dim, eps=eps)
