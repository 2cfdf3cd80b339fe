"""The transformers releases this package is tested with, and one warning line outside them.

This package leans on transformers' Qwen3.5 internals (its cache, its GDN layer's call, its hub
kernels), which change in minor releases. ``TESTED_TRANSFORMERS`` is the range the tests run on,
oldest to newest (pyproject.toml's extras declare the same; tests/test_packaging.py keeps the two
equal). :func:`warn_if_untested` prints one line, on rank 0 and once per process, when the
installed release is outside it; nothing when transformers is not installed.
"""

from __future__ import annotations

import functools
from importlib import metadata

__all__ = ["TESTED_TRANSFORMERS", "untested_transformers", "warn_if_untested"]

TESTED_TRANSFORMERS = ">=5.24.0,<5.26"


def untested_transformers(version: str | None) -> str | None:
    """The warning line for transformers ``version`` (None: not installed), or None inside the range."""
    if version is None:
        return None
    from packaging.specifiers import SpecifierSet  # transformers' own dependency

    if SpecifierSet(TESTED_TRANSFORMERS).contains(version, prereleases=True):
        return None
    return (
        f"hyperpar_gdn: warning: transformers {version} is outside the tested range "
        f"transformers{TESTED_TRANSFORMERS}; install one inside it (pip install 'hyperpar-gdn[transformers]')"
    )


@functools.cache
def warn_if_untested() -> None:
    """Print :func:`untested_transformers`' line on stderr, on rank 0 only, once per process."""
    from hyperpar_gdn.cli import launch_rank, print_line

    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        version = None
    line = untested_transformers(version)
    if line is not None and launch_rank() == 0:
        print_line(line)
