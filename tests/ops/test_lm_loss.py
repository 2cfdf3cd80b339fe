"""The chunked LM loss equals cross-entropy over the logits (torch's F.cross_entropy): value and
gradients of the hidden states and the head weight, tied and untied heads, ignored and padded
labels, chunk sizes that do not divide the tokens; MindSpore's equals torch's (float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hyperpar_gdn.ops.lm_loss import default_chunk_tokens, lm_loss_sum, lm_loss_sum_reference

B, T, C, V = 2, 13, 8, 37
TOL_FP64 = 1e-12


def _labels(seed: int = 0) -> torch.Tensor:
    labels = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))
    labels[0, 4] = -100  # an ignored token
    labels[1, 9:] = -100  # right padding
    return labels


def _logits_path(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """No code of ours: the logits and torch's cross-entropy."""
    logits = hidden @ weight.T
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="sum", ignore_index=-100)


@pytest.mark.parametrize("chunk_tokens", [1, 5, 26, 100, None], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_equals_cross_entropy_over_logits(tied: bool, chunk_tokens: int | None) -> None:
    """float64; the hidden states come from an embedding so that a tied head gets gradients from
    both the input side and the head."""
    gen = torch.Generator().manual_seed(1)
    embed = torch.randn(V, C, dtype=torch.float64, generator=gen, requires_grad=True)
    proj = torch.randn(C, C, dtype=torch.float64, generator=gen, requires_grad=True)
    head = embed if tied else torch.randn(V, C, dtype=torch.float64, generator=gen, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=gen)
    labels = _labels()
    leaves = (embed, proj) if tied else (embed, proj, head)

    def run(loss_fn):  # noqa: ANN001, ANN202
        hidden = torch.tanh(embed[ids] @ proj)
        hidden.retain_grad()
        loss = loss_fn(hidden, head, labels)
        (loss * 0.37).backward()
        grads = [hidden.grad.clone()] + [p.grad.clone() for p in leaves]
        for p in leaves:
            p.grad = None
        return loss.detach(), grads

    want, want_grads = run(_logits_path)
    got, got_grads = run(lambda h, w, lab: lm_loss_sum(h, w, lab, chunk_tokens=chunk_tokens))
    ref, ref_grads = run(lm_loss_sum_reference)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=TOL_FP64, atol=0)
    torch.testing.assert_close(ref, want, rtol=TOL_FP64, atol=0)
    names = ["hidden", "embed", "proj"] + ([] if tied else ["head"])
    for name, g, r, w in zip(names, got_grads, ref_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=TOL_FP64, atol=TOL_FP64, msg=f"d{name}")
        torch.testing.assert_close(r, w, rtol=TOL_FP64, atol=TOL_FP64, msg=f"d{name} (reference)")
    assert got_grads[0][1, 9:].abs().max() == 0  # padded tokens get no gradient


def test_bf16_hidden_states() -> None:
    """bf16 hidden states and an fp32 head (mixed precision): loss fp32 near the fp32 loss,
    gradients in each input's dtype."""
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(B, T, C, generator=gen)
    head = torch.randn(V, C, generator=gen, requires_grad=True)
    h16 = hidden.to(torch.bfloat16).requires_grad_()
    loss = lm_loss_sum(h16, head, _labels(), chunk_tokens=4)
    loss.backward()
    assert (
        loss.dtype == torch.float32 and h16.grad.dtype == torch.bfloat16 and head.grad.dtype == torch.float32
    )
    want = _logits_path(hidden, head.detach(), _labels())
    assert abs(loss.item() - want.item()) <= 0.02 * want.item()


def test_default_chunk() -> None:
    assert default_chunk_tokens(248_320) == 270  # 270 x 248,320 fp32 logits = 256 MiB
    assert default_chunk_tokens(10**9) == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"weight": torch.zeros(V, C + 1)}, r"the head weight must be \[V, C\] with C = hidden's 8"),
        ({"labels": torch.zeros(B, T - 1, dtype=torch.int64)}, r"labels must have hidden's leading shape"),
        ({"labels": torch.full((B, T), V)}, r"labels must be in \[0, V=37\) or ignore_index=-100; got \[37"),
        ({"chunk_tokens": 0}, r"chunk_tokens must be a positive int or None; got 0"),
    ],
)
def test_bad_input(kwargs: dict, message: str) -> None:
    args = {"hidden": torch.zeros(B, T, C), "weight": torch.zeros(V, C), "labels": _labels(), **kwargs}
    with pytest.raises(ValueError, match=message):
        lm_loss_sum(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)


def test_mindspore_equals_torch() -> None:
    """The same function on MindSpore tensors (float64), against torch's cross-entropy."""
    ms = pytest.importorskip("mindspore")
    rng = np.random.default_rng(3)
    hidden, head = rng.standard_normal((B, T, C)), rng.standard_normal((V, C))
    labels = _labels()
    th, tw = torch.tensor(hidden, requires_grad=True), torch.tensor(head, requires_grad=True)
    want = _logits_path(th, tw, labels)
    want.backward()

    def loss_fn(h, w):  # noqa: ANN001, ANN202
        return lm_loss_sum(h, w, ms.Tensor(labels.numpy()), chunk_tokens=5)

    got, (dh, dw) = ms.value_and_grad(loss_fn, (0, 1))(ms.Tensor(hidden), ms.Tensor(head))
    np.testing.assert_allclose(got.asnumpy(), want.item(), rtol=TOL_FP64)
    np.testing.assert_allclose(dh.asnumpy(), th.grad.numpy(), rtol=0, atol=TOL_FP64)
    np.testing.assert_allclose(dw.asnumpy(), tw.grad.numpy(), rtol=0, atol=TOL_FP64)


@pytest.mark.parametrize("case", ["all_labelled", "none_labelled"])
def test_every_or_no_token_labelled(case: str) -> None:
    """float64: with no ignored label (the tokens are not compacted) the loss and gradients equal
    cross-entropy over the logits; with every label ignored the loss and both gradients are 0."""
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(B, T, C, dtype=torch.float64, generator=gen, requires_grad=True)
    head = torch.randn(V, C, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, V, (B, T), generator=gen)
    if case == "none_labelled":
        labels[:] = -100
    want = _logits_path(hidden, head, labels)
    want_grads = torch.autograd.grad(want * 0.37, (hidden, head))
    got = lm_loss_sum(hidden, head, labels, chunk_tokens=7)
    got_grads = torch.autograd.grad(got * 0.37, (hidden, head))
    torch.testing.assert_close(got, want, rtol=TOL_FP64, atol=0)
    for name, g, w in zip(["hidden", "head"], got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=TOL_FP64, atol=TOL_FP64, msg=f"d{name}")
    if case == "none_labelled":
        assert got.item() == 0 and all(g.abs().max() == 0 for g in got_grads)


def test_add_rows_adds_repeated_rows() -> None:
    """The platform's row update behind the loss's one-hot gradient: repeated rows add up, on
    torch and (where installed) MindSpore, against numpy."""
    from hyperpar_gdn.platform import ops_for

    base, rows = np.arange(15.0).reshape(5, 3), np.ones((4, 3)) * [[1.0], [2.0], [3.0], [4.0]]
    index = np.array([1, 1, 4, 0])
    want = base.copy()
    np.add.at(want, index, rows)
    x = torch.tensor(base)
    got = ops_for(x).add_rows(x, index, torch.tensor(rows))
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(x.numpy(), base)  # a new tensor, the input unchanged
    try:
        import mindspore as ms
    except ImportError:
        return
    xm = ms.Tensor(base)
    np.testing.assert_array_equal(ops_for(xm).add_rows(xm, index, ms.Tensor(rows)).asnumpy(), want)
