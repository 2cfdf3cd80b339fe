"""TokenLayout: which tokens each rank holds, the fragments' global order, and the reorders
between rank order and global order (no processes)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from hyperpar_gdn.distributed.layout import TokenLayout, layout_error
from hyperpar_gdn.planning.plan import check_layout
from hyperpar_gdn.platform import ops_for

XP = ops_for(torch.empty(0))


def test_head_tail_gives_rank_r_pieces_r_and_2cp_minus_1_minus_r() -> None:
    layout = TokenLayout.of("head_tail", [6, 6, 6])  # T = 18, pieces of 3
    assert [f.start // 3 for f in layout.mine(0)] == [0, 5]
    assert [f.start // 3 for f in layout.mine(1)] == [1, 4]
    assert [f.start // 3 for f in layout.mine(2)] == [2, 3]
    assert layout.positions(1).tolist() == [3, 4, 5, 12, 13, 14]
    # the chain: heads of ranks 0, 1, 2, then tails of ranks 2, 1, 0
    assert [(f.rank, f.slot) for f in layout.fragments] == [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1)]
    tail_2 = layout.mine(2)[1]
    assert layout.previous(tail_2) == layout.mine(2)[0] and layout.next(tail_2) == layout.mine(1)[1]
    assert layout.previous(layout.mine(0)[0]) is None and layout.next(layout.mine(0)[1]) is None
    assert not layout.is_contiguous


def test_contiguous_is_one_fragment_per_rank_of_any_length() -> None:
    layout = TokenLayout.of("contiguous", [3, 7, 2])
    assert layout.is_contiguous
    assert [(f.start, f.length) for f in layout.fragments] == [(0, 3), (3, 7), (10, 2)]
    assert layout.positions(1).tolist() == list(range(3, 10))


@pytest.mark.parametrize("kind", ["contiguous", "head_tail"])
def test_reorders_are_inverse_and_match_positions(kind: str) -> None:
    layout = TokenLayout.of(kind, [8, 8, 8, 8])
    whole = torch.arange(32).reshape(1, 32, 1) * 10
    rank_order = torch.cat([layout.local(XP, whole, r, 1) for r in range(4)], 1)
    expected = np.concatenate([layout.positions(r) for r in range(4)]) * 10
    assert rank_order.flatten().tolist() == expected.tolist()
    assert torch.equal(layout.to_global(XP, rank_order, 1), whole)
    assert torch.equal(layout.to_rank_order(XP, whole, 1), rank_order)


def test_bad_layouts_name_the_rule() -> None:
    with pytest.raises(ValueError, match=re.escape("layout='zigzag' is not a token layout")):
        check_layout("zigzag")
    with pytest.raises(ValueError, match=re.escape("the ranks hold [6, 8] tokens")):
        TokenLayout.of("head_tail", [6, 8])
    with pytest.raises(ValueError, match=re.escape("the ranks hold [5, 5] tokens")):
        TokenLayout.of("head_tail", [5, 5])
    assert layout_error("head_tail", 20, 4) == (
        "layout='head_tail' cuts the sequence into 8 equal pieces: T=20 is not divisible by 8 (2*cp, cp=4)"
    )
    assert layout_error("head_tail", 24, 4) is None and layout_error("contiguous", 20, 4) is None
