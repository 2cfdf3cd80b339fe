"""ParallelConfig on its own: every broken rule is one line naming the value; a good one has none."""

from __future__ import annotations

import pytest

from hyperpar_gdn import CPPlan, ParallelConfig


def test_good_options_have_no_errors_and_name_their_plan() -> None:
    assert ParallelConfig().errors() == []
    config = ParallelConfig(tp=2, cp_mode="ulysses+p2p", cp_inner_size=2, cp_layout="contiguous")
    assert config.errors() == []
    assert config.cp_plan() == CPPlan(mode="ulysses+p2p", inner_size=2)
    assert ParallelConfig(cp_mode="auto", seq_len=256).cp_plan() is None  # parallelize resolves it
    assert ParallelConfig(activation_checkpointing=True, fsdp=True, bf16=True).errors() == []


@pytest.mark.parametrize(
    "options, message",
    [
        ({"tp": 0}, "tp=0 must be a positive int"),
        ({"ep": True}, "ep=True must be a positive int"),
        ({"fsdp": "yes"}, "fsdp='yes' must be True or False"),
        (
            {"cp_layout": "head_tail"},
            "cp_layout='head_tail': options of context parallelism, which cp_mode=None",
        ),
        ({"seq_len": 64}, "seq_len=64: options of context parallelism"),
        ({"cp_mode": "ring"}, "cp_mode='ring': mode='ring' is not a context-parallel mode"),
        ({"cp_mode": "auto"}, "seq_len is given with cp_mode='auto' and only then; got seq_len=None"),
        (
            {"cp_mode": "p2p", "seq_len": 64},
            "seq_len is given with cp_mode='auto' and only then; got seq_len=64",
        ),
        ({"cp_mode": "auto", "seq_len": 0}, "seq_len=0 must be a positive int"),
        ({"cp_mode": "p2p", "cp_inner_size": 2}, "inner_size is given with the two-level modes"),
        ({"cp_mode": "p2p", "cp_layout": "zigzag"}, "zigzag"),
        ({"cp_mode": "auto", "seq_len": 64, "cp_chunk_size": 0}, "chunk_size must be a positive int; got 0"),
    ],
)
def test_each_broken_rule_is_one_line_naming_the_value(options: dict, message: str) -> None:
    errors = ParallelConfig(**options).errors()
    assert len(errors) == 1, errors
    assert message in str(errors[0]), errors[0]
    assert "\n" not in str(errors[0])


def test_options_are_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        ParallelConfig(2)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        ParallelConfig().tp = 2  # type: ignore[misc]
