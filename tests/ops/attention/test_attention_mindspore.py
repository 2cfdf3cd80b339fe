"""Causal softmax attention on MindSpore (CPU: the blockwise path) against torch's dense reference
with the same inputs, fp64: outputs and the gradients of q, k, v for packed documents with
padding and for query fragments over keys in rank order; and the MindSpore CausalSelfAttention
with packed documents against the torch layer (output and every parameter gradient)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

ms = pytest.importorskip("mindspore")

from hyperpar_gdn.models.attention import CausalSelfAttention as TorchAttention  # noqa: E402
from hyperpar_gdn.models.mindspore import CausalSelfAttention, load_torch_state_dict  # noqa: E402
from hyperpar_gdn.ops.attention.softmax import attention  # noqa: E402
from hyperpar_gdn.ops.attention.visibility import Tokens  # noqa: E402
from hyperpar_gdn.platform import ops_for  # noqa: E402

TOL = 1e-12  # fp64
DOCS = np.array([0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 3, 3, 3, 3, 4, 4, 4, 4])
MASK = np.ones((2, 19), np.int64)
MASK[:, :3] = 0
MASK[1, :7] = 0


pytestmark = pytest.mark.usefixtures("mindspore_pynative")


def _fragments() -> tuple[Tokens, Tokens]:
    def span(a: int, b: int) -> Tokens:
        return Tokens.span(a, b, DOCS[a:b])

    return Tokens.cat([span(0, 5), span(14, 19)]), Tokens.cat([span(0, 5), span(14, 19), span(5, 14)])


CASES = {
    "packed-padding": (Tokens.span(0, 19, DOCS), Tokens.span(0, 19, DOCS), MASK),
    "packed-fragments": (*_fragments(), None),
}


@pytest.mark.parametrize("block_size", [4, 512])
@pytest.mark.parametrize("name", sorted(CASES))
def test_blockwise_equals_torch_reference(name: str, block_size: int) -> None:
    queries, keys, mask = CASES[name]
    rng = np.random.default_rng(0)
    shapes = [(2, 4, len(queries), 8), (2, 2, len(keys), 8), (2, 2, len(keys), 8)]
    arrays = [rng.standard_normal(s) for s in shapes]
    cot = rng.standard_normal(shapes[0])

    tq = [torch.tensor(a, requires_grad=True) for a in arrays]
    xp_t = ops_for(tq[0])
    o_t = attention(xp_t, *tq, queries=queries, keys=keys, key_mask=mask, path="reference")
    expected = [o_t, *torch.autograd.grad((o_t * torch.tensor(cot)).sum(), tq)]

    inputs = [ms.Tensor(a) for a in arrays]
    xp = ops_for(inputs[0])

    def run(q: Any, k: Any, v: Any) -> Any:
        return attention(xp, q, k, v, queries=queries, keys=keys, key_mask=mask, block_size=block_size)

    o = run(*inputs)
    grads = ms.grad(lambda q, k, v: (run(q, k, v) * ms.Tensor(cot)).sum(), grad_position=(0, 1, 2))(*inputs)
    for label, a, e in zip(("o", "dq", "dk", "dv"), (o, *grads), expected, strict=True):
        e = e.detach().numpy()
        err = np.abs(a.asnumpy() - e).max() / np.abs(e).max()
        assert err <= TOL, f"{label}: {err:.2e}"


def test_layer_with_packed_documents_equals_torch() -> None:
    torch.manual_seed(0)
    layer_t = TorchAttention(32, num_heads=4, num_kv_heads=2, head_dim=8).double()
    with torch.no_grad():
        for p in layer_t.parameters():
            p.add_(0.1 * torch.randn_like(p))
    layer = CausalSelfAttention(32, num_heads=4, num_kv_heads=2, head_dim=8)
    load_torch_state_dict(layer, layer_t.state_dict())
    cu = [0, 3, 10, 11, 15, 19]
    rng = np.random.default_rng(1)
    x, cot = rng.standard_normal((1, 19, 32)), rng.standard_normal((1, 19, 32))

    xt = torch.tensor(x, requires_grad=True)
    yt = layer_t(xt, cu_seqlens=torch.tensor(cu))
    (yt * torch.tensor(cot)).sum().backward()

    params = layer.trainable_params()
    fn = lambda inp: (layer(inp, ms.Tensor(np.array(cu))) * ms.Tensor(cot)).sum()  # noqa: E731
    y = layer(ms.Tensor(x), ms.Tensor(np.array(cu)))
    dx, dparams = ms.grad(fn, grad_position=0, weights=params)(ms.Tensor(x))
    expected = {name: p.grad for name, p in layer_t.named_parameters()}
    errors = {"y": (y.asnumpy(), yt.detach().numpy()), "dx": (dx.asnumpy(), xt.grad.numpy())}
    for p, g in zip(params, dparams, strict=True):
        errors[p.name] = (g.asnumpy(), expected[p.name].numpy())
    assert len(errors) == 2 + 6
    # RoPE angles are fp32 (numpy) on both sides; the rest is fp64
    bad = {k: np.abs(a - e).max() / np.abs(e).max() for k, (a, e) in errors.items()}
    assert all(v <= 1e-10 for v in bad.values()), bad
