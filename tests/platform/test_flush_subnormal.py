"""TensorOps.flush_subnormal zeroes exactly the entries below the dtype's smallest normal value."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hyperpar_gdn.ops import apply_summary, chunk_gated_delta_rule, gdn_state_summary
from hyperpar_gdn.platform import ops_for

VALUES = [1e-39, -1e-40, 1e-30, -2e-38, 0.5, 0.0]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_torch_flush(dtype: str) -> None:
    x = torch.tensor(VALUES, dtype=getattr(torch, dtype))
    out = ops_for(x).flush_subnormal(x).numpy()
    expected = np.array(VALUES, dtype=dtype)
    if dtype == "float32":
        expected[[0, 1]] = 0.0  # 1e-39 and -1e-40 are subnormal in fp32; -2e-38 is normal
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_mindspore_flush_matches_torch(dtype: str) -> None:
    ms = pytest.importorskip("mindspore")
    values = VALUES + [1e-310, -3e-320, 3e-308]  # subnormal, subnormal, normal in fp64
    x = ms.Tensor(np.array(values, dtype=dtype))
    t = torch.tensor(values, dtype=getattr(torch, dtype))
    expected = ops_for(t).flush_subnormal(t).numpy()
    np.testing.assert_array_equal(ops_for(x).flush_subnormal(x).asnumpy(), expected)
    # zeros: 0.0 and the flushed ones (fp64: 1e-310, -3e-320; fp32: 1e-39, -1e-40, and the three
    # values below 1e-300, which are already 0 in fp32)
    assert int((expected == 0).sum()) == {"float32": 6, "float64": 3}[dtype]


def test_summary_under_strong_decay_still_exact() -> None:
    """With decays that drive M far below fp32's normal range the summary still composes."""
    torch.manual_seed(0)
    b, t, h, d = 1, 512, 2, 16
    q, k, v = (torch.randn(b, t, h, d) for _ in range(3))
    g, beta = -2.0 - torch.rand(b, t, h), torch.rand(b, t, h)
    s_in = torch.randn(b, h, d, d)
    s_ext, m = gdn_state_summary(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert m.abs().max() < 1e-30  # the decay is strong enough to matter here
    _, final = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=s_in, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(apply_summary((s_ext, m), s_in), final, rtol=1e-5, atol=1e-6)
