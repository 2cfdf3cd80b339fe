"""The tensor file: what :func:`write_arrays` writes, :func:`read_arrays` and safetensors' own
reader read back exactly (every dtype, a scalar, an empty array, a non-contiguous view); a dtype
it cannot hold and a truncated file are one error naming them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hyperpar_gdn.train.tensor_file import read_arrays, write_arrays


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


def test_arrays_round_trip_and_safetensors_reads_the_file(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    arrays = _arrays()
    path = tmp_path / "part.safetensors"
    size = write_arrays(path, arrays)
    assert size == path.stat().st_size
    for name, got in (("ours", read_arrays(path)), ("safetensors", load_file(path))):
        assert sorted(got) == sorted(arrays), name
        for key, array in arrays.items():
            assert got[key].dtype == array.dtype and got[key].shape == array.shape, (name, key)
            assert np.array_equal(got[key], array), (name, key)
    assert read_arrays(path)["f64"].flags.writeable  # torch.from_numpy takes it without a copy


def test_an_unsupported_dtype_and_a_truncated_file_are_named(tmp_path: Path) -> None:
    path = tmp_path / "part.safetensors"
    with pytest.raises(ValueError, match=r"array 'c' has dtype complex128; a tensor file holds float64"):
        write_arrays(path, {"c": np.zeros(2, dtype=np.complex128)})
    write_arrays(path, _arrays())
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"part\.safetensors: entry '\w+' of shape .* spans bytes"):
        read_arrays(path)


def test_mindspores_own_loader_reads_the_file(tmp_path: Path) -> None:
    """MindSpore's ``load_checkpoint(..., format="safetensors")`` reads a part as its own."""
    ms = pytest.importorskip("mindspore")
    rng = np.random.default_rng(1)
    arrays = {"layers.0.w": rng.standard_normal((4, 3)).astype(np.float32), "b": np.ones(3, np.float32)}
    path = tmp_path / "rank-0.safetensors"
    write_arrays(path, arrays)
    loaded = ms.load_checkpoint(str(path), format="safetensors")
    assert sorted(loaded) == sorted(arrays)
    assert all(np.array_equal(loaded[k].asnumpy(), a) for k, a in arrays.items())
