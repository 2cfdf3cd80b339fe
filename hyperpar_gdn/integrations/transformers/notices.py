"""What a transformers run under this package shows on the console besides its own lines.

- :func:`hide_expected_notices`: transformers says once per process that a layer function "is
  falling back to its reference PyTorch implementation" when fla or causal-conv1d is not installed.
  Their kernels are Triton and CUDA only, so on a CPU the notice names nothing a user can install:
  there it is dropped. On a device it stays (installing the kernel is the fix).
- :func:`one_line_if_uncaught`: a set-up error that no caller catches is printed as one line
  (``[rank R] <name>: error: <message>``) instead of a traceback; a caller that catches it gets
  the exception unchanged.
"""

from __future__ import annotations

import logging
import os
import sys
from types import TracebackType

__all__ = ["hide_expected_notices", "one_line_if_uncaught"]

_KERNEL_LOGGER = "transformers.integrations.hub_kernels"
_FALLBACK = "is falling back to its reference PyTorch implementation"


class _DropFallbackNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _FALLBACK not in record.getMessage()


def hide_expected_notices(device_type: str) -> None:
    """Drop transformers' reference-kernel notices when ``device_type`` is ``"cpu"`` (idempotent)."""
    if device_type != "cpu":
        return
    logger = logging.getLogger(_KERNEL_LOGGER)
    if not any(isinstance(f, _DropFallbackNotices) for f in logger.filters):
        logger.addFilter(_DropFallbackNotices())


def one_line_if_uncaught(error: BaseException, *, name: str) -> None:
    """Arrange that ``error``, if it ends the process uncaught, prints one line on this rank
    (``[rank R] name: error: message``, the rank when the launch has several) and no traceback;
    under torchrun its failure summary names the same line. Any other uncaught exception keeps
    the interpreter's report. Call it just before raising ``error``."""
    previous = sys.excepthook
    rank, world = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1") or 1)
    line = f"{f'[rank {rank}] ' if world > 1 else ''}{name}: error: {error}"

    def hook(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
        if value is not error:
            previous(kind, value, traceback)
            return
        from hyperpar_gdn.cli import _write_torchelastic_error, print_line

        print_line(line)
        _write_torchelastic_error(line)

    sys.excepthook = hook
