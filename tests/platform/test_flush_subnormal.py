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


def test_mindspore_flush_matches_torch() -> None:
    ms = pytest.importorskip("mindspore")
    x = ms.Tensor(np.array(VALUES, dtype=np.float32))
    t = torch.tensor(VALUES, dtype=torch.float32)
    np.testing.assert_array_equal(
        ops_for(x).flush_subnormal(x).asnumpy(), ops_for(t).flush_subnormal(t).numpy()
    )


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
