"""The run header of scripts/train.py: true at one rank (no CP claimed), and a note naming the
faster choice when the shard is too short for CP to pay off (the measured CPU threshold)."""

from __future__ import annotations

from hyperpar_gdn.distributed.payoff import MIN_TOKENS_PER_RANK
from hyperpar_gdn.train.config import TrainConfig
from hyperpar_gdn.train.header import run_header


def _header(config: TrainConfig, *, platform: str = "cpu", world: int = 2, cp: int = 2) -> list[str]:
    return run_header(
        config, platform=platform, world_size=world, dp=world // cp, cp=cp, parameters=1234, first_step=1
    )


def test_one_rank_claims_no_context_parallelism() -> None:
    (line,) = _header(TrainConfig(), world=1, cp=1)
    assert line.startswith(
        "platform cpu, 1 rank = dp 1 x cp 1 (no context parallelism), model --model-size tiny"
    )
    assert "--cp-mode" not in line and "--cp-layout" not in line and "1,234 parameters, --dtype fp32" in line


def test_short_shards_name_the_faster_choice() -> None:
    first, note = _header(TrainConfig(cp_mode="all_gather"))  # the README run: 128 tokens, cp=2
    assert "(--cp-mode all_gather, --cp-layout head_tail)" in first
    assert note.startswith("note: 64 tokens per rank is too few for CP to pay off")
    assert "--cp-size 1 (2 data-parallel replicas" in note and "--cp-layout contiguous" in note
    (_, ulysses) = _header(TrainConfig(batch_size=3))  # ulysses: the layout is not blamed
    assert "fewer ranks per CP group" in ulysses and "--cp-layout contiguous" not in ulysses


def test_no_note_for_long_shards_or_unmeasured_platforms() -> None:
    long_enough = TrainConfig(seq_len=2 * (MIN_TOKENS_PER_RANK + 1))
    assert len(_header(long_enough)) == 1
    assert len(_header(TrainConfig(), platform="cuda")) == 1
    assert len(_header(TrainConfig(seq_len=2 * MIN_TOKENS_PER_RANK))) == 2
