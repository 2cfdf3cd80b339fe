"""Shared test configuration and fixtures.

pytest imports this file with ``tests/`` prepended to ``sys.path`` (its default import mode, and
``tests/`` is not a package). That is what lets test modules in subfolders import the shared
modules beside it, whether run as ``pytest`` or ``python -m pytest``: ``oracles`` (the reference
implementations and the input helpers), ``tiny_models`` (the small model configurations used in
several files), ``distributed_harness`` (forked gloo ranks; scripts under torchrun),
``msrun_harness`` and ``torch_training`` (the torch runs the MindSpore training tests compare
with). ``tests/distributed`` is put on the path as well: the shared MindSpore msrun
worker there (``msrun_cp_worker``) names the sections that tests in several folders read.

Tiers: without paths on the command line (``python -m pytest -q``) only the quick tier runs, the
tests that ``quick_tier.QUICK`` names; ``--full`` runs every test (CI: ``.ci/run``). Paths given
(``python -m pytest tests/train/test_train.py``) run every test under them, named or not.

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
from _pytest.config import Config
from quick_tier import QUICK

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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="run every test; without it and without paths, only the quick tier (tests/quick_tier.py)",
    )


def _quick_tier_applies(config: Config) -> bool:
    return not config.getoption("full") and config.args_source != Config.ArgsSource.ARGS


def pytest_report_header(config: Config) -> str:
    if _quick_tier_applies(config):
        return "tier: quick (tests/quick_tier.py); --full runs every test"
    return "tier: every test collected"


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect: every entry is checked against the whole suite
def pytest_collection_modifyitems(config: Config, items: list[pytest.Item]) -> None:
    if not _quick_tier_applies(config):
        return
    root = Path(str(config.rootpath))
    named = {f"{path}::{name}" for path, names in QUICK.items() for name in names}
    found: set[str] = set()
    keep, drop = [], []
    for item in items:
        path = Path(str(item.path)).relative_to(root).as_posix()
        entries = {f"{path}::{item.name}", f"{path}::{item.originalname}"} & named
        found |= entries
        (keep if entries else drop).append(item)
    stale = sorted(named - found)
    if stale:
        raise pytest.UsageError(
            f"tests/quick_tier.py names {len(stale)} test(s) that were not collected (renamed, moved or "
            f"removed?): {', '.join(stale[:5])}{' ...' if len(stale) > 5 else ''}"
        )
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
