"""A model directory written whole or not at all, and the weights read with every file closed."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import numpy as np
import pytest

from hyperpar_gdn.models.directories import written_whole
from hyperpar_gdn.models.safetensors_files import read_weights, write_weights


def test_a_failed_write_leaves_the_directory_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "model"
    with written_whole(out) as temp:
        (temp / "config.json").write_text("old")
    with pytest.raises(RuntimeError, match="stopped"), written_whole(out) as temp:
        (temp / "config.json").write_text("new")
        raise RuntimeError("stopped")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert (out / "config.json").read_text() == "old"
    with written_whole(out) as temp:
        (temp / "weights").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert sorted(p.name for p in out.iterdir()) == ["weights"]  # replaced, not merged


def test_reading_weights_leaves_no_file_open(tmp_path: Path) -> None:
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    write_weights(tmp_path, arrays)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        read = read_weights(tmp_path)
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [
        str(w.message) for w in caught
    ]
    np.testing.assert_array_equal(read["w"], arrays["w"])
