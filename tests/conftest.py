"""Shared test configuration and fixtures.

pytest imports this file with ``tests/`` prepended to ``sys.path`` (its default import mode, and
``tests/`` is not a package). That is what lets test modules in subfolders import the shared
modules beside it, whether run as ``pytest`` or ``python -m pytest``: ``oracles`` (the reference
implementations and the input helpers), ``tiny_models`` (the small model configurations used in
several files), ``distributed_harness`` (forked gloo ranks; scripts under torchrun),
``msrun_harness`` and ``torch_training`` (the torch runs the MindSpore training tests compare
with). ``tests/distributed`` is put on the path as well: the shared MindSpore msrun
worker there (``msrun_cp_worker``) names the sections that tests in several folders read.

Fixtures:

- ``mindspore_pynative`` (module scope): MindSpore in PyNative mode with launch blocking for the
  module's tests (the GDN maths is Python around MindSpore ops; launch blocking is one-way and
  only makes small-op workloads faster), the previous mode restored after. A MindSpore test module
  uses it with ``pytestmark = pytest.mark.usefixtures("mindspore_pynative")``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_DISTRIBUTED = str(Path(__file__).resolve().parent / "distributed")
if _DISTRIBUTED not in sys.path:
    sys.path.append(_DISTRIBUTED)


@pytest.fixture(scope="module")
def mindspore_pynative() -> Iterator[None]:
    import mindspore as ms

    from hyperpar_gdn.platform.mindspore_ops import enable_launch_blocking

    previous = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    enable_launch_blocking()
    yield
    ms.set_context(mode=previous)
