"""The parts of a replicated state: the split by bytes (disjoint, balanced, the same on every
rank), and a state written and read back whole in one process (its tensors, its small values, its
structure); a tensor holding NaN is refused before any file. A part file: what :func:`write_part`
writes, :func:`read_part`, safetensors' and MindSpore's own readers read back exactly (every dtype,
a scalar, an empty array, a non-contiguous view), and a part written by the hand-written writer of
before still reads; a dtype it cannot hold and a truncated file are one error naming them. Two
real ranks, a cp 2 <-> cp 1 resume and the manifest are tests/train/test_train_mindspore_sharded.py's."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from hyperpar_gdn.train.errors import CheckpointError
from hyperpar_gdn.train.checkpoints.replicated_shards import (
    Leaf,
    assign,
    load_replicated,
    read_part,
    write_part,
    write_replicated_shards,
)


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


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    grid = rng.standard_normal((6, 5)).astype(np.float32)
    return {
        "layers.0.weight": grid,
        "transposed": grid.T,  # not C-contiguous: written in C order
        "f64": rng.standard_normal((3, 2, 2)),
        "f16": rng.standard_normal(7).astype(np.float16),
        "i64": np.arange(-4, 5, dtype=np.int64),
        "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
        "u8": np.arange(250, 256, dtype=np.uint8),
        "mask": np.array([True, False, True]),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def test_a_part_round_trips_and_safetensors_reads_it(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    arrays = _arrays()
    path = tmp_path / "part.safetensors"
    write_part(path, arrays)
    for name, got in (("ours", read_part(path)), ("safetensors", load_file(path))):
        assert sorted(got) == sorted(arrays), name
        for key, array in arrays.items():
            assert got[key].dtype == array.dtype and got[key].shape == array.shape, (name, key)
            assert np.array_equal(got[key], array), (name, key)
    assert read_part(path)["f64"].flags.writeable  # torch.from_numpy takes it without a copy


# rank-0.safetensors as the hand-written writer of before wrote it (w: float32 [2, 3] = 0..5,
# step: int64 3, mask: [True, False]): checkpoints saved then still load
_OLD_PART = (
    "sAAAAAAAAAB7InN0ZXAiOnsiZHR5cGUiOiJJNjQiLCJzaGFwZSI6W10sImRhdGFfb2Zmc2V0cyI6WzAsOF19LCJ3Ijp7ImR0eXBl"
    "IjoiRjMyIiwic2hhcGUiOlsyLDNdLCJkYXRhX29mZnNldHMiOls4LDMyXX0sIm1hc2siOnsiZHR5cGUiOiJCT09MIiwic2hhcGUi"
    "OlsyXSwiZGF0YV9vZmZzZXRzIjpbMzIsMzRdfX0gICAgIAMAAAAAAAAAAAAAAAAAgD8AAABAAABAQAAAgEAAAKBAAQA="
)


def test_a_part_written_before_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.safetensors"
    path.write_bytes(base64.b64decode(_OLD_PART))
    got = read_part(path)
    assert np.array_equal(got["w"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert got["step"].dtype == np.int64 and got["step"].shape == () and int(got["step"]) == 3
    assert got["mask"].tolist() == [True, False]


def test_an_unsupported_dtype_and_a_truncated_part_are_named(tmp_path: Path) -> None:
    path = tmp_path / "part.safetensors"
    with pytest.raises(ValueError, match=r"array 'c' has dtype complex128; a checkpoint part holds float64"):
        write_part(path, {"c": np.zeros(2, dtype=np.complex128)})
    write_part(path, _arrays())
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match=r"checkpoint file .*part\.safetensors could not be read"):
        read_part(path)


def test_a_refused_write_is_the_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as caught:
        write_part(tmp_path / "missing" / "part.safetensors", {"w": np.zeros(2, np.float32)})
    assert caught.value.filename == str(tmp_path / "missing" / "part.safetensors")


def test_mindspores_own_loader_reads_a_part(tmp_path: Path) -> None:
    """MindSpore's ``load_checkpoint(..., format="safetensors")`` reads a part as its own."""
    ms = pytest.importorskip("mindspore")
    rng = np.random.default_rng(1)
    arrays = {"layers.0.w": rng.standard_normal((4, 3)).astype(np.float32), "b": np.ones(3, np.float32)}
    path = tmp_path / "rank-0.safetensors"
    write_part(path, arrays)
    loaded = ms.load_checkpoint(str(path), format="safetensors")
    assert sorted(loaded) == sorted(arrays)
    assert all(np.array_equal(loaded[k].asnumpy(), a) for k, a in arrays.items())
