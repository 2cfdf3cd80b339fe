"""The shared MindSpore test job: one msrun start per world size for every MindSpore test.

The launcher itself (:func:`run_msrun`, and :func:`start_watchdog` / :func:`write_result` for
worker scripts) lives in :mod:`hyperpar_gdn.platform.msrun`; it is re-exported here for the test
workers that import it by this name. One msrun start costs 10-20 s here, so
:func:`cp_worker_job` runs every section of ``tests/distributed/msrun_cp_worker.py`` in one job.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from hyperpar_gdn.platform.msrun import (
    MsrunOutcome,
    msrun_available,
    run_msrun,
    start_watchdog,
    write_result,
)

# the GDN layer's parameters, in the order the MindSpore workers report their gradients
GDN_PARAMS = (
    "in_proj_qkv.weight",
    "in_proj_z.weight",
    "in_proj_b.weight",
    "in_proj_a.weight",
    "conv1d.weight",
    "A_log",
    "dt_bias",
    "norm.weight",
    "out_proj.weight",
)

__all__ = [
    "GDN_PARAMS",
    "MsrunOutcome",
    "cp_worker_job",
    "msrun_available",
    "run_msrun",
    "section_data",
    "start_watchdog",
    "write_result",
]


CP_WORKER = Path(__file__).resolve().parent / "distributed" / "msrun_cp_worker.py"
CP_WORKER_SECTIONS = {
    2: (
        "collectives",
        "cp",
        "packed",
        "attention",
        "bad_input",
        "lm_loss",
        "prefill",
        "cp_decoding",
        "cpu_share",
        "stall",
    ),
    4: (
        "collectives",
        "cp",
        "packed",
        "attention",
        "bad_input",
        "mesh2d",
        "grads",
        "scan",
        "prefill",
        "tp_layers",
        "tp_model",
        "tp_bad_input",
        "cpu_share",
    ),
    8: ("two_level_head_tail",),
}


@cache
def cp_worker_job(world_size: int) -> MsrunOutcome:
    """The one msrun job per world size that the MindSpore tests share (tests/platform and
    tests/distributed read its sections): ``tests/distributed/msrun_cp_worker.py`` with every
    section that size runs. Cached for the pytest session: each world size starts msrun once."""
    if world_size not in CP_WORKER_SECTIONS:
        raise ValueError(
            f"world_size={world_size}: the shared job runs on {sorted(CP_WORKER_SECTIONS)} workers"
        )
    timeout_s = 600 if "prefill" in CP_WORKER_SECTIONS[world_size] else 240
    return run_msrun(
        CP_WORKER, world_size, ["--sections", *CP_WORKER_SECTIONS[world_size]], timeout_s=timeout_s
    )


def section_data(outcome: MsrunOutcome, section: str) -> list[dict[str, Any]]:
    """Every rank's data for ``section`` of a :func:`cp_worker_job`; an ``AssertionError`` with the
    job's logs or the failing rank's traceback if any rank has none."""
    data = []
    for rank, result in enumerate(outcome.results):
        if result is None or section not in result["sections"]:
            raise AssertionError(f"rank {rank} has no result for section {section!r}\n{outcome.describe()}")
        entry = result["sections"][section]
        if not entry["ok"]:
            raise AssertionError(f"rank {rank} failed in section {section!r}:\n{entry['error']}")
        data.append(entry["data"])
    return data
