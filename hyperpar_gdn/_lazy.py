"""Package names that load their module on first use (a module-level ``__getattr__``, PEP 562).

A package lists what it exports and where each name lives; importing the package then imports
none of those modules, so a framework-free part (a config, the command line, the memory plan)
loads without torch or MindSpore::

    _EXPORTS = {"Trainer": "hyperpar_gdn.train.loop.trainer", "TrainConfig": "hyperpar_gdn.train.config"}
    __all__ = sorted(_EXPORTS)
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

This module imports only the standard library.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` (its ``__name__``, already in
    ``sys.modules``) for ``exports``: exported name -> the module that defines it.

    ``__getattr__(name)`` imports the module, stores the value in the package (later lookups do not
    come back here) and returns it; a name not in ``exports`` raises ``AttributeError`` as Python
    does for a missing attribute. ``__dir__()`` lists the package's globals and every export.
    """
    module = sys.modules[package]
    exports = dict(exports)  # a later change to the caller's mapping changes nothing here

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(module, name, value)  # loaded once
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(exports))

    return __getattr__, __dir__
