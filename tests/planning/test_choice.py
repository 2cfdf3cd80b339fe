"""``mode="auto"`` made a plan from figures the caller passes: the ranking's first mode, the
two-level modes ranked by the devices per node given (never the launcher's environment)."""

from __future__ import annotations

import pytest

from hyperpar_gdn.ops.gdn.layer import LayerDims
from hyperpar_gdn.planning.choice import choose_plan, rank_for_layer, two_level_inner_size
from hyperpar_gdn.planning.ranking import plan_context_parallel

# Qwen3.5-27B's GDN layer
QWEN27B = LayerDims(
    hidden_size=5120, num_k_heads=16, num_v_heads=48, head_k_dim=128, head_v_dim=128, conv_kernel_size=4,
    norm_eps=1e-6,
)  # fmt: skip
T = 1 << 17


def test_the_plan_is_the_rankings_first_with_the_callers_options() -> None:
    plan = choose_plan(QWEN27B, ranks=range(128), device="gpu", seq_len=T, chunk_size=32, kernel="native")
    ranked = plan_context_parallel(
        seq_len=T, cp=128, num_k_heads=16, num_v_heads=48, head_k_dim=128, head_v_dim=128, hidden_size=5120,
        device="gpu", inner_size=8,
    )  # fmt: skip
    assert (plan.mode, plan.inner_size) == (ranked.choice, ranked.inner_size) == ("ulysses+scan", 8)
    assert (plan.chunk_size, plan.kernel, plan.layout) == (32, "native", "contiguous")
    assert plan.reason == ranked.why()


def test_devices_per_node_is_passed_in_not_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 devices per node ranks the two-level modes with 16 ranks inside; the launcher's
    LOCAL_WORLD_SIZE changes nothing."""
    common = {"ranks": range(128), "device": "gpu", "seq_len": T}
    default = rank_for_layer(QWEN27B, **common)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert rank_for_layer(QWEN27B, **common) == default
    assert {c.inner_size for c in default.ranking if "+" in c.mode} == {8}
    wider = rank_for_layer(QWEN27B, devices_per_node=16, **common)
    assert {c.inner_size for c in wider.ranking if "+" in c.mode} == {16}
    one_node = rank_for_layer(QWEN27B, devices_per_node=128, **common)
    assert not [c for c in one_node.ranking if "+" in c.mode]


def test_two_levels_need_a_block_of_consecutive_ranks() -> None:
    assert two_level_inner_size(range(16), tp=1, per_node=8) == 8
    assert two_level_inner_size(range(1, 33, 2), tp=2, per_node=8) == 4  # CP ranks tp apart: 8 / 2 per node
    assert two_level_inner_size([0, 3, 1, 2], tp=1, per_node=2) is None  # not consecutive
    assert two_level_inner_size(range(8), tp=1, per_node=8) is None  # one node
    assert two_level_inner_size(range(12), tp=1, per_node=8) is None  # 8 does not divide 12


def test_a_tp_rank_is_priced_at_the_layers_heads() -> None:
    """Under TP the dims are one rank's share: the ranking prices the whole layer at that tp."""
    share = LayerDims(
        hidden_size=5120, num_k_heads=4, num_v_heads=12, head_k_dim=128, head_v_dim=128, conv_kernel_size=4,
        norm_eps=1e-6, tp=4,
    )  # fmt: skip
    ranked = rank_for_layer(share, ranks=range(0, 64, 4), device="gpu", seq_len=T, num_experts=8)
    assert ranked.inputs["tp"] == 4 and ranked.inputs["H"] == 48
    direct = plan_context_parallel(
        seq_len=T, cp=16, num_k_heads=16, num_v_heads=48, head_k_dim=128, head_v_dim=128, hidden_size=5120,
        device="gpu", tp=4, inner_size=2, num_experts=8,
    )  # fmt: skip
    assert ranked == direct
    with pytest.raises(ValueError, match="device='tpu'; choose one of"):
        rank_for_layer(QWEN27B, ranks=range(4), device="tpu", seq_len=T)


def test_a_mode_left_out_is_not_ranked() -> None:
    """A caller that cannot run a mode on its layer leaves it out: the next fastest is chosen."""
    narrow = LayerDims(
        hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32, conv_kernel_size=4,
        norm_eps=1e-6,
    )  # fmt: skip
    common = {"ranks": [0, 1], "device": "cpu", "seq_len": 4096}
    assert choose_plan(narrow, **common).mode == "ulysses_hidden"
    ranked = rank_for_layer(narrow, **common, leave_out=("ulysses_hidden",))
    assert "ulysses_hidden" not in [c.mode for c in ranked.ranking]
    assert choose_plan(narrow, **common, leave_out=("ulysses_hidden",)).mode == ranked.choice == "ulysses"
