"""Shared test configuration (no fixtures yet).

pytest imports this file with ``tests/`` prepended to ``sys.path`` (its default import mode, and
``tests/`` is not a package). That is what lets test modules in subfolders ``import oracles`` for
the reference implementations and the input helpers, whether run as ``pytest`` or
``python -m pytest``.
"""
