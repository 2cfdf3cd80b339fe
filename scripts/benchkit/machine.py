"""What a benchmark records about the machine: versions, cores, load average, host memory."""

from __future__ import annotations

import os
import platform
import resource
import sys
from typing import Any

from hyperpar_gdn.platform.host_memory import keep_freed_host_memory

__all__ = ["keep_host_memory", "load_average", "machine_info", "peak_rss_bytes", "rss_bytes"]


def machine_info() -> dict[str, Any]:
    """Python version, platform string, core count and the load average now."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": load_average(),
    }


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (the machine is shared: record them beside timings)."""
    return list(os.getloadavg())


def keep_host_memory(enabled: bool) -> bool:
    """Keep freed host memory in the heap (:func:`keep_freed_host_memory`) unless ``enabled`` is
    False (``--glibc-malloc-defaults``); returns whether it is kept. Forked ranks inherit it."""
    return keep_freed_host_memory() if enabled else False


def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
