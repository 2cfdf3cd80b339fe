"""The parts of a replicated state: the split by bytes (disjoint, balanced, the same on every
rank), and a state written and read back whole in one process (its tensors, its small values, its
structure); a tensor holding NaN is refused before any file. Two real ranks, a cp 2 <-> cp 1 resume
and the manifest are tests/train/test_train_mindspore_sharded.py's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hyperpar_gdn.train.checkpoint import CheckpointError
from hyperpar_gdn.train.replicated_shards import Leaf, assign, load_replicated, write_replicated_shards


def _leaf(array: np.ndarray) -> Leaf:
    return Leaf(array.shape, array.dtype.name, lambda: array.copy())


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_the_split_is_balanced_by_bytes(world_size: int) -> None:
    sizes = [4096, 4096, 1024, 1024, 1024, 256, 64, 64, 16, 4] * 3
    owners = assign(sizes, world_size)
    assert owners == assign(list(sizes), world_size)  # deterministic: every rank computes it alone
    load = [sum(s for s, o in zip(sizes, owners, strict=True) if o == r) for r in range(world_size)]
    assert sum(load) == sum(sizes) and min(load) > 0
    assert max(load) - min(load) <= max(sizes), load  # greedy, largest first


def test_more_ranks_than_tensors_leave_some_ranks_empty() -> None:
    assert assign([8, 4], 4) == [0, 1]
    with pytest.raises(ValueError, match=r"world_size=0 must be >= 1"):
        assign([8], 0)


def test_a_state_round_trips_whole(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    weights = {"embed.weight": rng.standard_normal((8, 4)).astype(np.float32), "norm": np.ones(4, np.float32)}
    moments = [rng.standard_normal((8, 4)).astype(np.float32), np.zeros(4, np.float32)]
    state = {
        "model": {name: _leaf(a) for name, a in weights.items()},
        "optimizer": {
            "format": "adamw/1",
            "steps": 7,
            "names": list(weights),
            "exp_avg": [_leaf(m) for m in moments],
        },
    }
    future = write_replicated_shards(
        state, tmp_path / "state", rank=0, world_size=1, max_over_ranks=lambda v: v, background=True
    )
    assert future is not None
    future.result(timeout=60)
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["index.json", "rank-0.safetensors"]
    loaded = load_replicated(tmp_path / "state")
    assert loaded["optimizer"]["format"] == "adamw/1" and loaded["optimizer"]["steps"] == 7
    assert loaded["optimizer"]["names"] == ["embed.weight", "norm"]
    assert all(np.array_equal(loaded["model"][k], a) for k, a in weights.items())
    assert all(np.array_equal(m, a) for m, a in zip(loaded["optimizer"]["exp_avg"], moments, strict=True))


def test_a_nan_is_refused_before_any_file(tmp_path: Path) -> None:
    state = {"model": {"w": _leaf(np.array([1.0, np.nan], np.float32))}}
    with pytest.raises(CheckpointError, match=r"refusing to save into .*state: model\.w hold NaN or inf"):
        write_replicated_shards(state, tmp_path / "state", rank=0, world_size=1, max_over_ranks=lambda v: v)
    assert not (tmp_path / "state").exists()


def test_a_value_it_cannot_save_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"state entry 'model\.w' is a set"):
        write_replicated_shards(
            {"model": {"w": {1, 2}}}, tmp_path / "state", rank=0, world_size=1, max_over_ranks=lambda v: v
        )
