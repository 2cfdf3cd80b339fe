"""The fla environment's tests: fla's Triton kernels on this CPU under Triton's interpreter.

They run only in the environment that ``.ci/fla_env`` builds (the package with the ``fla`` extra,
``TRITON_INTERPRET=1``), never in the main test venv (``python -m pytest`` collects ``tests/``
only): with triton and fla installed, transformers' own Qwen3.5 GDN layer routes to fla's kernels.
Here a missing fla, triton or ``TRITON_INTERPRET=1`` is an error, not a skip.

Fixture ``interpreter`` (autouse, per test): :func:`triton_interpreter.interpreted_triton`, entered
before the test and undone after it; forked gloo ranks inherit it. ``tests/`` is put on the path
for its shared modules (``distributed_harness``, ``tiny_models``, ``oracles``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError(
        "tests_fla runs fla's Triton kernels under Triton's interpreter: set TRITON_INTERPRET=1 before "
        f"pytest starts (got TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}); see .ci/fla_env"
    )

import fla.ops.gated_delta_rule  # noqa: E402,F401  (fails here, not skips, when fla cannot import)
import triton  # noqa: E402,F401

_HERE = Path(__file__).resolve().parent
for folder in (_HERE, _HERE.parent / "tests"):
    if str(folder) not in sys.path:
        sys.path.append(str(folder))

from triton_interpreter import interpreted_triton, patched_names  # noqa: E402

PRISTINE = patched_names()  # triton as it was imported


@pytest.fixture(autouse=True)
def interpreter() -> Iterator[None]:
    with interpreted_triton():
        yield
    changed = [name for name, value in patched_names().items() if value is not PRISTINE[name]]
    assert not changed, f"the interpreter fixture left triton changed: {changed}"
