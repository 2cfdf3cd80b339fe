"""Names that moved stay importable from where users found them, each with a DeprecationWarning
naming the new place, and are the very same objects."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest


@pytest.mark.parametrize(
    ("old", "new", "names"),
    [
        (
            "hyperpar_gdn.train.data",
            "hyperpar_gdn.train.global_batches",
            ["Batch", "BatchSampler", "load_tokens"],
        ),
        ("hyperpar_gdn.train.batches", "hyperpar_gdn.train.rank_batches", ["cut_batch", "replica_rows"]),
    ],
)
def test_a_renamed_module_warns_and_hands_on_its_names(old: str, new: str, names: list[str]) -> None:
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [f"{old} is now {new}"]
    renamed = importlib.import_module(new)
    assert all(getattr(module, name) is getattr(renamed, name) for name in names)


def test_the_moved_fault_hooks_warn_from_faults() -> None:
    from hyperpar_gdn.train import fault_injection, faults

    with pytest.warns(DeprecationWarning, match=r"faults\.kill_step is now .*fault_injection\.kill_step"):
        assert faults.kill_step is fault_injection.kill_step
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        faults.nothing  # noqa: B018


def test_the_checkpoint_module_still_names_the_directory_helpers() -> None:
    from hyperpar_gdn.train import checkpoint, checkpoint_dir

    assert set(checkpoint_dir.__all__) <= set(checkpoint.__all__)
    assert all(getattr(checkpoint, name) is getattr(checkpoint_dir, name) for name in checkpoint_dir.__all__)
