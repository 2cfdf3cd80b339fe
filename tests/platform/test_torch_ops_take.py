"""TorchOps.take: a host index of ascending runs (head and channel blocks) is taken as slices,
with no index tensor made, and equals index_select with its gradient; other indexes go through
index_select."""

from __future__ import annotations

import pytest
import torch

from hyperpar_gdn.platform.torch_ops import SLICED_RUNS, TorchOps

INDEXES = {
    "blocks": [4, 5, 6, 0, 1, 8, 9],
    "repeated": [1, 1, 0, 0],
    "one": [3],
    "identity": list(range(10)),
    "many-runs": list(range(9, -1, -1)) * 7,  # 70 runs: index_select
}


@pytest.mark.parametrize("index", INDEXES.values(), ids=INDEXES.keys())
def test_take_equals_index_select_with_its_gradient(
    index: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(3, 10, 2, dtype=torch.float64, requires_grad=True)
    made = []
    as_tensor = torch.as_tensor
    monkeypatch.setattr(torch, "as_tensor", lambda *a, **k: (made.append(a), as_tensor(*a, **k))[1])
    got = TorchOps().take(x, index, 1)
    monkeypatch.undo()
    runs = 1 + sum(b - a != 1 for a, b in zip(index[:-1], index[1:], strict=True))
    assert bool(made) == (runs >= SLICED_RUNS), (runs, made)
    want = torch.index_select(x, 1, torch.tensor(index))
    assert torch.equal(got, want)
    cot = torch.randn_like(want)
    assert torch.equal(*(torch.autograd.grad((y * cot).sum(), x)[0] for y in (got, want)))
