"""The batched reverse state loop (ops/gdn/recurrence_batched.py) against the readable one
(ops/gdn/recurrence.py ``backward_states``), on torch and, where installed, on MindSpore (which takes
the batched loop through ``TensorOps.prefers_batched_loops``).

Inputs are random tensors of the loop's shapes (they need not come from one forward: the backward
is linear in d_exits and do). Both loops do the same sums in the same order, so in fp64 they agree
to rounding; every result is compared (du, dw, dkd, dgl, d_entries).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from hyperpar_gdn.ops.gdn.recurrence import backward_states
from hyperpar_gdn.ops.gdn.recurrence_batched import backward_states_batched
from hyperpar_gdn.platform.torch_ops import TorchOps

TOL = 1e-12  # max |batched - readable| / max |readable|, fp64; measured 0 to 3e-16
NAMES = ("du", "dw", "dkd", "dgl", "d_entries")


@dataclass(frozen=True)
class Case:
    n: int  # chunks
    entry_chunks: tuple[int, ...] = ()
    outputs: bool = True
    flush: bool = False

    @property
    def id(self) -> str:
        parts = [f"N{self.n}", "entries" + "-".join(map(str, self.entry_chunks)) if self.entry_chunks else ""]
        parts += ["outputs" if self.outputs else "no-outputs", "flush" if self.flush else ""]
        return "-".join(p for p in parts if p)


CASES = [
    Case(5),
    Case(5, outputs=False, flush=True),  # a summary's loop
    Case(6, entry_chunks=(2, 3)),  # documents starting at chunks 2 and 3 (one chunk long)
    Case(1, entry_chunks=()),
    Case(4, entry_chunks=(1,), flush=True),
]
B, H, C, K, V = 2, 3, 4, 5, 6


def _arrays(case: Case) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(case.n + 10 * len(case.entry_chunks))
    n, e = case.n, len(case.entry_chunks) + 1
    arrays = {
        "states": rng.standard_normal((n, B, H, K, V)),
        "vn": rng.standard_normal((n, B, H, C, V)),
        "w": rng.standard_normal((n, B, H, C, K)) * 0.3,
        "kd": rng.standard_normal((n, B, H, C, K)) * 0.3,
        "gl": rng.uniform(0.5, 1.0, (n, B, H)),
        "d_exits": rng.standard_normal((e, B, H, K, V)),
    }
    if case.outputs:
        arrays["qg"] = rng.standard_normal((n, B, H, C, K))
        arrays["p"] = np.tril(rng.standard_normal((n, B, H, C, C)))
        arrays["do"] = rng.standard_normal((n, B, H, C, V))
    if case.flush:  # heads whose dvn (head 0) and ds (head 1) of batch 1 are subnormal: flushed
        arrays["kd"][:, 1, 0] *= 1e-200
        arrays["d_exits"][:, 1, 0] *= 1e-110
        arrays["kd"][:, 1, 1] = arrays["w"][:, 1, 1] = 0.0
        arrays["d_exits"][:, 1, 1] *= 1e-310
        for name in ("qg", "do") if case.outputs else ():
            arrays[name][:, 1, :2] = 0.0
    return arrays


def _run(loop: Any, xp: Any, t: dict[str, Any], case: Case) -> list[np.ndarray]:
    outputs = (t["qg"], t["p"], t["do"]) if case.outputs else None
    grads = loop(
        xp, t["states"], t["vn"], t["w"], t["kd"], t["gl"], t["d_exits"], outputs,
        entry_chunks=case.entry_chunks, flush=case.flush,
    )  # fmt: skip
    return [xp.to_numpy(g) for g in grads]


def _assert_same(actual: list[np.ndarray], expected: list[np.ndarray], *, exact_zeros: bool = True) -> None:
    """``exact_zeros``: du and d_entries (the flushed ones) must have zeros in the same places (a
    subnormal left in would pass the tolerance); checked on torch. MindSpore's float64 kernels
    flush subnormal and near-subnormal values on their own, depending on shape and on the
    process's floating-point mode (torch tests earlier in the same process change it), so on
    MindSpore only the values are compared."""
    for name, a, e in zip(NAMES, actual, expected, strict=True):
        assert a.shape == e.shape, f"{name}: shape {a.shape} != {e.shape}"
        if exact_zeros and name in ("du", "d_entries"):  # dw, dkd, dgl are not flushed by the loops
            za, ze = a == 0, e == 0
            assert np.array_equal(za, ze), f"{name}: {int(za.sum())} zeros, readable {int(ze.sum())}"
        err = float(np.abs(a - e).max()) / max(float(np.abs(e).max()), 1e-300)
        assert err <= TOL, f"{name}: batched vs readable error {err:.3g} > {TOL:g}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_batched_backward_equals_readable_torch(case: Case) -> None:
    xp = TorchOps()
    assert not xp.prefers_batched_loops  # so backward_states below is the readable loop
    t = {k: torch.tensor(v) for k, v in _arrays(case).items()}
    _assert_same(_run(backward_states_batched, xp, t, case), _run(backward_states, xp, t, case))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_batched_backward_equals_readable_mindspore(case: Case) -> None:
    ms = pytest.importorskip("mindspore")
    from hyperpar_gdn.platform.mindspore_ops import MindSporeOps

    class ReadableMindSporeOps(MindSporeOps):
        prefers_batched_loops = False

    batched_xp = MindSporeOps()
    assert batched_xp.prefers_batched_loops  # backward_states takes the batched loop on MindSpore
    arrays = _arrays(case)
    t = {k: ms.Tensor(v) for k, v in arrays.items()}
    readable = _run(backward_states, ReadableMindSporeOps(), t, case)
    _assert_same(_run(backward_states, batched_xp, t, case), readable, exact_zeros=False)
    # and both equal torch's readable loop
    torch_readable = _run(backward_states, TorchOps(), {k: torch.tensor(v) for k, v in arrays.items()}, case)
    _assert_same(readable, torch_readable, exact_zeros=False)
