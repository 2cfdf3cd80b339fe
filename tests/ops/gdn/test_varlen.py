"""Packed documents (cu_seqlens / doc_starts) in the gated delta rule: every document of a packed
row must come out as if it ran alone, through the masked chunks (no per-document states), the
document-aligned layout (per-document initial and final states), the token-by-token reference and
the summaries; plus the shard-by-shard identities context parallelism will rely on, and the checks.

References per document: fla's naive recurrent and chunked functions and transformers'
``torch_chunk_gated_delta_rule`` (oracles.py; fp32 inside), and our recurrent reference in fp64.
Errors are max |actual - expected| relative to max |expected| (oracles.assert_close).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from oracles import ORACLES, Inputs, Shape, assert_close, hf_chunk, make_inputs

from hyperpar_gdn.ops import (
    apply_summary,
    chunk_gated_delta_rule,
    cu_seqlens_from_position_ids,
    gdn_state_summary,
    outputs_from,
    prepare_chunks,
    recurrent_gated_delta_rule,
    summary_from,
)

# The oracles compute in fp32 (measured ~5e-7 against ours).
FP32_TOL = {"o": 1e-5, "final_state": 1e-5}
FP32_GRAD_TOL = 1e-5
# fp64 against fp64 (measured ~1e-15).
FP64_TOL = {"o": 1e-12, "final_state": 1e-12, "s_ext": 1e-12, "m": 1e-12}
FP64_GRAD_TOL = 1e-10


@dataclass(frozen=True)
class Packed:
    name: str
    cu: tuple[int, ...]
    chunk_size: int
    H: int = 4
    Hk: int = 2

    @property
    def T(self) -> int:
        return self.cu[-1]

    @property
    def id(self) -> str:
        return f"{self.name}-T{self.T}-N{len(self.cu) - 1}-C{self.chunk_size}"

    def inputs(self, *, dtype: torch.dtype = torch.float64, requires_grad: bool = False) -> Inputs:
        x = make_inputs(
            Shape(B=1, T=self.T, H=self.H, Hk=self.Hk), dtype=dtype, seed=self.T, requires_grad=requires_grad
        )
        gen = torch.Generator().manual_seed(self.T + 1)
        s0 = torch.randn(len(self.cu) - 1, self.H, 16, 16, generator=gen, dtype=torch.float64)
        x.initial_state = s0.to(dtype).requires_grad_(requires_grad)
        return x

    def documents(self) -> list[tuple[int, int]]:
        return list(zip(self.cu[:-1], self.cu[1:], strict=True))


def _random_cu(seed: int, t: int, n: int) -> tuple[int, ...]:
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, t), n - 1, replace=False))
    return (0, *cuts.tolist(), t)


CASES = [
    Packed("one-doc", (0, 75), 16),
    Packed("shorter-than-chunk", (0, 1, 3, 7, 20, 40), 16),
    Packed("at-chunk-starts", (0, 16, 32, 50, 64), 16),
    Packed("T-not-multiple", (0, 30, 31, 75), 32),
    Packed("many-docs", _random_cu(0, 200, 13), 32),
    Packed("long-and-short", (0, 150, 152, 153, 200), 64),
]
IDS = [c.id for c in CASES]


def per_document(
    fn: Callable, x: Inputs, case: Packed, *, with_state: bool = True, **kwargs: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each document run alone (from its own initial state): outputs concatenated over T, final
    states stacked ``[N, H, K, V]``."""
    outputs, finals = [], []
    for n, (start, stop) in enumerate(case.documents()):
        doc = (t[:, start:stop] for t in x.qkvgb())
        s0 = x.initial_state[n : n + 1] if with_state else None
        o, s = fn(*doc, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs)
        outputs.append(o)
        finals.append(s)
    return torch.cat(outputs, 1), torch.cat(finals, 0)


def packed(
    fn: Callable, x: Inputs, case: Packed, *, with_state: bool = True, **kwargs: object
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return fn(
        *x.qkvgb(),
        cu_seqlens=torch.tensor(case.cu, dtype=torch.int32),
        initial_state=x.initial_state if with_state else None,
        use_qk_l2norm_in_kernel=True,
        **kwargs,
    )


# --- outputs and final states -------------------------------------------------------------------


@pytest.mark.parametrize("with_state", [True, False], ids=["states", "nostates"])
@pytest.mark.parametrize("oracle", ["fla_recurrent", "fla_chunk", "hf_chunk"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_chunk_matches_oracle_per_document(case: Packed, oracle: str, with_state: bool) -> None:
    """With per-document states: the document-aligned layout; without: the masked chunks."""
    x = case.inputs(dtype=torch.float32)
    o_ref, s_ref = per_document(ORACLES[oracle], x, case, with_state=with_state, chunk_size=case.chunk_size)
    o, s = packed(
        chunk_gated_delta_rule,
        x,
        case,
        with_state=with_state,
        chunk_size=case.chunk_size,
        output_final_state=True,
    )
    assert tuple(s.shape) == (len(case.cu) - 1, case.H, 16, 16)
    assert_close("o", o, o_ref, FP32_TOL["o"])
    assert_close("final_state", s, s_ref, FP32_TOL["final_state"])
    # Without output_final_state and states the masked path runs: the same outputs.
    if not with_state:
        o_masked, none = packed(chunk_gated_delta_rule, x, case, with_state=False, chunk_size=case.chunk_size)
        assert none is None
        assert_close("o", o_masked, o_ref, FP32_TOL["o"])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_chunk_and_recurrent_match_documents_alone_fp64(case: Packed) -> None:
    x = case.inputs()
    o_ref, s_ref = per_document(recurrent_gated_delta_rule, x, case)
    for name, kwargs in {
        "recurrent": {},
        "chunk-per-document": {"chunk_size": case.chunk_size},
    }.items():
        fn = recurrent_gated_delta_rule if name == "recurrent" else chunk_gated_delta_rule
        o, s = packed(fn, x, case, output_final_state=True, **kwargs)
        assert_close(f"{name} o", o, o_ref, FP64_TOL["o"])
        assert_close(f"{name} final_state", s, s_ref, FP64_TOL["final_state"])
    o_ref0, _ = per_document(recurrent_gated_delta_rule, x, case, with_state=False)
    o, _ = packed(chunk_gated_delta_rule, x, case, with_state=False, chunk_size=case.chunk_size)
    assert_close("masked o", o, o_ref0, FP64_TOL["o"])


def test_documents_do_not_leak() -> None:
    """Guards the comparisons above: changing document 0 changes nothing in document 1."""
    case = Packed("two", (0, 37, 75), 16)
    x = case.inputs()
    o, _ = packed(chunk_gated_delta_rule, x, case, with_state=False, chunk_size=16)
    with torch.no_grad():
        x.v[:, :37] += 1.0
        x.g[:, 30:37] -= 0.5
    o2, _ = packed(chunk_gated_delta_rule, x, case, with_state=False, chunk_size=16)
    assert (o2 - o)[:, :37].abs().max() > 1e-2
    assert (o2 - o)[:, 37:].abs().max() == 0


# --- gradients ---------------------------------------------------------------------------------


def _grads(fn: Callable, x: Inputs, *, with_state: bool) -> dict[str, torch.Tensor]:
    o, s = fn(x)
    gen = torch.Generator().manual_seed(5)  # cotangents drawn in fp64 whatever the output dtype
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum()
    if s is not None:
        loss = loss + (s * torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.dtype)).sum()
    leaves = x.leaves() if with_state else {k: v for k, v in x.leaves().items() if k != "dinitial_state"}
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))


@pytest.mark.parametrize("with_state", [True, False], ids=["states", "nostates"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_grads_match_transformers_per_document(case: Packed, with_state: bool) -> None:
    x = case.inputs(requires_grad=True)
    kwargs = {"with_state": with_state, "chunk_size": case.chunk_size}
    if not with_state:  # the masked chunks, o only

        def ours(y: Inputs) -> tuple[torch.Tensor, None]:
            return packed(chunk_gated_delta_rule, y, case, **kwargs)[0], None

        def ref(y: Inputs) -> tuple[torch.Tensor, None]:
            return per_document(hf_chunk, y, case, **kwargs)[0], None

    else:

        def ours(y: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
            return packed(chunk_gated_delta_rule, y, case, output_final_state=True, **kwargs)

        def ref(y: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
            return per_document(hf_chunk, y, case, **kwargs)

    grads, expected = _grads(ours, x, with_state=with_state), _grads(ref, x, with_state=with_state)
    for name, grad in grads.items():
        assert_close(name, grad, expected[name], FP32_GRAD_TOL)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_grads_match_recurrent_fp64(case: Packed) -> None:
    x = case.inputs(requires_grad=True)

    def ours(y: Inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        return packed(chunk_gated_delta_rule, y, case, chunk_size=case.chunk_size, output_final_state=True)

    def ref(y: Inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        return packed(recurrent_gated_delta_rule, y, case, output_final_state=True)

    grads, expected = _grads(ours, x, with_state=True), _grads(ref, x, with_state=True)
    for name, grad in grads.items():
        assert_close(name, grad, expected[name], FP64_GRAD_TOL)


@pytest.mark.parametrize("per_document_states", [False, True], ids=["masked-chunks", "document-aligned"])
def test_gradcheck(per_document_states: bool) -> None:
    """Cuts inside chunks, at a chunk start and a one-token document, with padding at the end."""
    x = make_inputs(Shape(B=1, T=11, H=2, Hk=1, K=4, V=3), dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 2, 3, 8, 11])
    s0 = torch.randn(4, 2, 4, 3, dtype=torch.float64, requires_grad=True)

    def fn(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if per_document_states:
            return chunk_gated_delta_rule(
                *args[:5], initial_state=args[5], output_final_state=True,
                chunk_size=4, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
        return chunk_gated_delta_rule(*args, chunk_size=4, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[:1]

    inputs = (*x.qkvgb(), s0) if per_document_states else x.qkvgb()
    assert torch.autograd.gradcheck(fn, inputs)


# --- summaries and shards (what context parallelism relies on) ------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_summary_with_cu_seqlens(case: Packed) -> None:
    """S_in is document 0's initial state; the result is the last document's final state; M = 0
    exactly when there is more than one document."""
    x = case.inputs()
    x.initial_state[1:] = 0  # documents after the first start from zero
    s_ext, m = gdn_state_summary(
        *x.qkvgb(), chunk_size=case.chunk_size, use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor(case.cu)
    )
    _, finals = per_document(recurrent_gated_delta_rule, x, case)
    assert_close(
        "final_state", apply_summary((s_ext, m), x.initial_state[:1]), finals[-1:], FP64_TOL["final_state"]
    )
    if len(case.cu) > 2:
        assert m.abs().max() == 0
    else:
        assert m.abs().max() > 1e-3


def _segments_reference(
    x: Inputs, doc_starts: np.ndarray, s_in: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """o and the final state of a segment whose documents start at ``doc_starts``: tokens before
    the first start continue from ``s_in``, every document after starts from zero."""
    bounds = [0, *np.flatnonzero(doc_starts).tolist(), doc_starts.shape[0]]
    bounds = sorted(set(bounds))
    outputs, s = [], None
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        s0 = s_in if start == 0 and not doc_starts[0] else None
        o, s = recurrent_gated_delta_rule(
            *(t[:, start:stop] for t in x.qkvgb()), initial_state=s0, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        outputs.append(o)
    return torch.cat(outputs, 1), s


SHARD_SPLITS = [
    ("mid-document", 45),
    ("at-document-start", 50),
    ("one-token-into-document", 51),
    ("in-short-docs", 5),
]


@pytest.mark.parametrize("split", [s for _, s in SHARD_SPLITS], ids=[n for n, _ in SHARD_SPLITS])
def test_shards_with_doc_starts_pass_state(split: int) -> None:
    """Two shards of one packed row, each described by its slice of doc_starts: the second runs
    from the first's final state, and its summary maps that state to the true final state."""
    case = Packed("shards", (0, 3, 7, 20, 50, 75), 16)
    x = case.inputs()
    doc_starts = np.zeros(case.T, dtype=bool)
    doc_starts[list(case.cu[:-1])] = True
    o_ref, s_ref = per_document(recurrent_gated_delta_rule, x, case, with_state=False)
    halves = [(0, split), (split, case.T)]
    outputs, s, summaries = [], None, []
    for start, stop in halves:
        part = Inputs(*(t[:, start:stop] for t in x.qkvgb()), None)
        prep = prepare_chunks(
            *part.qkvgb(), chunk_size=16, use_qk_l2norm_in_kernel=True, doc_starts=doc_starts[start:stop]
        )
        summaries.append(summary_from(prep))
        o, s = outputs_from(prep, s)
        outputs.append(o)
    assert_close("o", torch.cat(outputs, 1), o_ref, FP64_TOL["o"])
    assert_close("final_state", s, s_ref[-1:], FP64_TOL["final_state"])
    # The second shard's summary from the first one's state, and against the reference segments.
    first_final = apply_summary(summaries[0], torch.zeros_like(s))
    assert_close("final_state", apply_summary(summaries[1], first_final), s_ref[-1:], FP64_TOL["final_state"])
    second = Inputs(*(t[:, split:] for t in x.qkvgb()), None)
    s_in = torch.randn(1, case.H, 16, 16, dtype=torch.float64)
    o2, s2 = _segments_reference(second, doc_starts[split:], s_in)
    prep = prepare_chunks(
        *second.qkvgb(), chunk_size=16, use_qk_l2norm_in_kernel=True, doc_starts=doc_starts[split:]
    )
    o2_ours, s2_ours = outputs_from(prep, s_in)
    assert_close("o", o2_ours, o2, FP64_TOL["o"])
    assert_close("final_state", s2_ours, s2, FP64_TOL["final_state"])
    s_ext, m = summaries[1]
    assert (m.abs().max() == 0) == bool(doc_starts[split:].any())


def test_summary_gradcheck_with_doc_starts() -> None:
    x = make_inputs(Shape(B=1, T=9, H=2, Hk=1, K=4, V=3), dtype=torch.float64, requires_grad=True)
    doc_starts = np.array([0, 0, 1, 0, 0, 0, 1, 0, 0], dtype=bool)

    def fn(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gdn_state_summary(*args, chunk_size=4, use_qk_l2norm_in_kernel=True, doc_starts=doc_starts)

    assert torch.autograd.gradcheck(fn, x.qkvgb())


# --- input checks ---------------------------------------------------------------------------------


BAD_CU = {
    "not-starting-at-0": ([1, 5, 10], r"start at 0; got cu_seqlens\[0\]=1"),
    "not-increasing": ([0, 5, 5, 10], r"strictly increasing.*cu_seqlens\[1\]=5, cu_seqlens\[2\]=5"),
    "decreasing": ([0, 6, 4, 10], r"strictly increasing.*cu_seqlens\[1\]=6, cu_seqlens\[2\]=4"),
    "not-ending-at-T": ([0, 5, 9], r"end at the sequence length T=10; got cu_seqlens\[-1\]=9"),
    "float": ([0.0, 5.0, 10.0], r"cu_seqlens must hold integers; got dtype float"),
    "2-D": ([[0, 5, 10]], r"1-D \[N\+1\].*\(1, 3\)"),
    "one-entry": ([0], r"1-D \[N\+1\] with N >= 1.*\(1,\)"),
}


@pytest.mark.parametrize(
    "fn", [chunk_gated_delta_rule, recurrent_gated_delta_rule], ids=["chunk", "recurrent"]
)
@pytest.mark.parametrize("bad", list(BAD_CU))
def test_bad_cu_seqlens(bad: str, fn: Callable) -> None:
    cu, message = BAD_CU[bad]
    x = make_inputs(Shape(B=1, T=10, H=2))
    with pytest.raises(ValueError, match=message):
        fn(*x.qkvgb(), cu_seqlens=torch.tensor(cu))


@pytest.mark.parametrize(
    "fn", [chunk_gated_delta_rule, recurrent_gated_delta_rule], ids=["chunk", "recurrent"]
)
def test_cu_seqlens_needs_batch_one(fn: Callable) -> None:
    x = make_inputs(Shape(B=2, T=10, H=2))
    with pytest.raises(ValueError, match=r"batch size B=1; got B=2"):
        fn(*x.qkvgb(), cu_seqlens=torch.tensor([0, 4, 10]))


@pytest.mark.parametrize(
    "fn", [chunk_gated_delta_rule, recurrent_gated_delta_rule], ids=["chunk", "recurrent"]
)
def test_cu_seqlens_initial_state_is_per_document(fn: Callable) -> None:
    x = make_inputs(Shape(B=1, T=10, H=2), with_state=True)  # [1, H, K, V]: one state, three documents
    with pytest.raises(
        ValueError, match=r"initial_state must be \[N, H, K, V\] = \(3, 2, 16, 16\).*\(1, 2, 16, 16\)"
    ):
        fn(*x.qkvgb(), cu_seqlens=torch.tensor([0, 4, 6, 10]), initial_state=x.initial_state)


def test_prepare_chunks_checks_its_packed_keywords() -> None:
    x = make_inputs(Shape(B=1, T=10, H=2))
    with pytest.raises(ValueError, match="give cu_seqlens or doc_starts, not both"):
        prepare_chunks(*x.qkvgb(), cu_seqlens=[0, 10], doc_starts=np.ones(10, dtype=bool))
    with pytest.raises(ValueError, match=r"doc_starts must be \[T\] or \[1, T\] with T=10; got shape \(9,\)"):
        prepare_chunks(*x.qkvgb(), doc_starts=np.ones(9, dtype=bool))
    with pytest.raises(ValueError, match=r"doc_starts must be booleans"):
        prepare_chunks(*x.qkvgb(), doc_starts=np.full(10, 2))


# --- position_ids ---------------------------------------------------------------------------------


def test_cu_seqlens_from_position_ids() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])
    cu = cu_seqlens_from_position_ids(pos)
    assert cu.tolist() == [0, 3, 4, 8] and cu.dtype == pos.dtype


BAD_POSITIONS = {
    "not-starting-at-0": ([[1, 2, 3]], r"start at 0; got position_ids\[0\]=1"),
    "skips": ([[0, 1, 3, 4]], r"position_ids\[1\]=1, position_ids\[2\]=3"),
    "restarts-at-1": ([[0, 1, 2, 1]], r"position_ids\[2\]=2, position_ids\[3\]=1"),
    "batch-2": ([[0, 1], [0, 1]], r"\[1, T\].*\(2, 2\)"),
    "float": ([[0.0, 1.0]], r"position_ids must hold integers"),
}


@pytest.mark.parametrize("bad", list(BAD_POSITIONS))
def test_bad_position_ids(bad: str) -> None:
    values, message = BAD_POSITIONS[bad]
    with pytest.raises(ValueError, match=message):
        cu_seqlens_from_position_ids(torch.tensor(values))
