"""The rank launcher under the name the test modules import it by.

It lives in the library, :mod:`hyperpar_gdn.platform.launch` (forked ranks in a real gloo
process group, a deadline, tracebacks and stacks of failing ranks); the benchmarks under
``scripts/`` use the same function. See its module docstring for the example and the options.
"""

from hyperpar_gdn.platform.launch import RankOutcome, RanksFailed, launch_ranks, run_ranks

__all__ = ["RankOutcome", "RanksFailed", "launch_ranks", "run_ranks"]
