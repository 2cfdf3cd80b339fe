"""The run header of scripts/train.py: true at one rank (no CP claimed), and a note naming the
faster choice when the cost model predicts that CP does not pay at the run's sequence length."""

from __future__ import annotations

from hyperpar_gdn.planning.payoff import cp_payoff
from hyperpar_gdn.train.config import TrainConfig
from hyperpar_gdn.train.loop.header import run_header


def _header(config: TrainConfig, *, platform: str = "cpu", world: int = 2, cp: int = 2) -> list[str]:
    return run_header(
        config,
        platform=platform,
        world_size=world,
        dp=world // cp,
        cp=cp,
        parameters=1234,
        first_step=1,
        model_config=config.model.to_dict(),
    )


def test_one_rank_claims_no_context_parallelism() -> None:
    (line,) = _header(TrainConfig(), world=1, cp=1)
    assert line.startswith(
        "platform cpu, 1 rank = dp 1 x cp 1 (no context parallelism), model --model-size tiny"
    )
    assert "--cp-mode" not in line and "--cp-layout" not in line and "1,234 parameters, --dtype fp32" in line


def test_short_sequences_name_the_faster_choice() -> None:
    first, note = _header(TrainConfig(cp_mode="all_gather"))  # the README run: 128 tokens, cp=2
    assert "(--cp-mode all_gather, --cp-layout head_tail)" in first
    assert note.startswith("note: CP does not pay at 128 tokens per sequence over cp=2: the cost model (cpu:")
    assert "tokens per rank" not in note and "all_gather exchanges per GDN layer" in note
    assert "--cp-size 1 (2 data-parallel replicas" in note
    (_, ulysses) = _header(TrainConfig(batch_size=3))  # ulysses: the layout changes nothing
    assert "fewer ranks per CP group" in ulysses and "contiguous layout" not in ulysses


def test_the_note_goes_at_the_cost_models_break_even() -> None:
    config = TrainConfig()
    payoff = cp_payoff(
        model_config=config.model.to_dict(), seq_len=config.seq_len, cp=2, mode=config.cp_mode,
        layout=config.token_layout(), device="cpu",
    )  # fmt: skip
    assert payoff.break_even is not None and payoff.break_even > config.seq_len
    assert f"a gain from about {payoff.break_even:,} tokens per sequence" in _header(config)[1]
    assert len(_header(TrainConfig(seq_len=payoff.break_even))) == 1
    assert len(_header(TrainConfig(seq_len=payoff.break_even // 2))) == 2
    # every platform is priced (its device kind's figures): a cuda run of 128 tokens gets the note too
    assert "the cost model (gpu:" in _header(config, platform="cuda")[1]


def test_tensor_parallelism_is_shown_and_priced() -> None:
    """--tp: the ranks as dp x cp x tp; the note prices CP on a TP rank's heads (half the heads:
    less work split off per rank, so the break-even moves later than at tp 1)."""
    config = TrainConfig(cp_mode="p2p", tp=2, cp_size=2)
    lines = run_header(
        config,
        platform="cpu",
        world_size=8,
        dp=2,
        cp=2,
        tp=2,
        parameters=1234,
        first_step=1,
        model_config=config.model.to_dict(),
    )
    assert lines[0].startswith(
        "platform cpu, 8 ranks = dp 2 x cp 2 x tp 2 (--cp-mode p2p, --cp-layout head_tail)"
    )
    common = dict(
        model_config=config.model.to_dict(), seq_len=config.seq_len, cp=2, mode="p2p",
        layout=config.token_layout(), device="cpu",
    )  # fmt: skip
    at_tp2, at_tp1 = cp_payoff(**common, tp=2), cp_payoff(**common)
    assert at_tp2.saved_s < at_tp1.saved_s  # a TP rank runs the rule on half the heads
    assert at_tp2.break_even is not None and at_tp2.break_even >= at_tp1.break_even
    assert lines[1].startswith("note: CP does not pay at 128 tokens per sequence over cp=2")
    assert f"a gain from about {at_tp2.break_even:,} tokens" in lines[1]
    assert "--cp-size 1 (4 data-parallel replicas" in lines[1]  # 8 ranks / tp 2


def test_a_two_level_mode_shows_its_inner_size() -> None:
    config = TrainConfig(cp_size=4, cp_mode="ulysses+p2p", cp_inner_size=2)
    (first, *_) = run_header(
        config, platform="cpu", world_size=4, dp=1, cp=4, tp=1, parameters=1234, first_step=1,
        model_config=config.model.to_dict(),
    )  # fmt: skip
    assert "4 ranks = dp 1 x cp 4 (--cp-mode ulysses+p2p, --cp-inner-size 2, --cp-layout " in first, first
