"""keep_freed_host_memory: a freed block below its mmap threshold stays in the process (glibc), and
the default returns it; a block above the threshold is returned either way.

Each case runs in a fresh interpreter, since the settings are process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hyperpar_gdn.platform.host_memory import MMAP_THRESHOLD

# Allocates and touches N MiB, frees it, and prints the resident set growth that remains (MiB).
SCRIPT = """
import sys
from hyperpar_gdn.platform.host_memory import keep_freed_host_memory

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

kept = keep_freed_host_memory() if sys.argv[1] == "keep" else None
before = rss_mib()
block = bytearray(int(sys.argv[2]) * 2**20)
block[:: 4096] = b"x" * len(block[:: 4096])
del block
print(kept, rss_mib() - before)
"""


def _run(mode: str, mib: int) -> tuple[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, str(mib)], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    return out[0], float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc and /proc are Linux's")
def test_freed_block_stays_in_the_heap_only_when_asked() -> None:
    kept, kept_growth = _run("keep", 96)
    _, default_growth = _run("default", 96)
    assert kept == "True"
    assert kept_growth > 80, f"a freed 96 MiB block left only {kept_growth:.0f} MiB resident"
    assert default_growth < 30, f"glibc's defaults kept {default_growth:.0f} MiB of a freed 96 MiB block"
    # at the threshold and above (a large vocabulary's logits chunks) the block is returned at once
    _, big_growth = _run("keep", MMAP_THRESHOLD // 2**20 + 16)
    assert big_growth < 30, f"a freed block above the mmap threshold left {big_growth:.0f} MiB resident"
