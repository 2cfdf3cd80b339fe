"""When context parallelism cannot pay off: a line for a run's header that says so and names the
faster choice.

CP splits each sequence over ``cp`` ranks; every layer then pays fixed costs (collectives, the
conv halo, the summaries' fold) that only a long enough shard hides. Measured on the project's
2-core CPU machine with the README-sized model (``--model-size tiny``, hidden 64):

- the prefill of a 2,048-token prompt at cp=2 (1,024 tokens per rank) took 1/0.84 of the time of
  one device;
- the README training run (128-token sequences, 64 tokens per rank at cp=2) with
  ``--cp-mode all_gather`` trained in 13.2 s with the head_tail layout against 9.4 s contiguous.

So on the CPU platform, at :data:`MIN_TOKENS_PER_RANK` tokens per rank or fewer, a run is faster
on fewer ranks (data parallelism, or one process), and the head_tail layout (two fragments per
rank, twice the state hand-offs) is slower than contiguous outside ulysses. On accelerators the
fixed costs differ and were not measured here: no advice is given there.
"""

from __future__ import annotations

MIN_TOKENS_PER_RANK = 1024  # measured slower than one device at this shard length (see above)


def cp_advice(
    *, platform: str, cp: int, tokens_per_rank: int, mode: str, layout: str, fewer: str
) -> str | None:
    """One line for a run header when CP is not expected to pay off, else None.

    Args:
        platform: the platform's name (``"cpu"``: the one these figures were measured on).
        cp: ranks in the CP group.
        tokens_per_rank: tokens of one sequence on one rank (the shard length ``T / cp``).
        mode: the GDN CP mode; layout: the token layout (``"contiguous"`` or ``"head_tail"``).
        fewer: how the script runs on fewer ranks (an option or a launcher setting), named in the line.
    """
    if platform != "cpu" or cp < 2 or tokens_per_rank > MIN_TOKENS_PER_RANK:
        return None
    line = (
        f"note: {tokens_per_rank} tokens per rank is too few for CP to pay off (on this CPU platform "
        f"{MIN_TOKENS_PER_RANK} tokens per rank still ran slower than one device); faster: {fewer}"
    )
    if layout == "head_tail" and mode != "ulysses":
        line += f", or --cp-layout contiguous (head_tail ran 1.4x slower with --cp-mode {mode} at this size)"
    return line
