"""Check every context-parallel mode against the single-device layer on this machine's devices.

Launch with one process per device, on any platform:

    torchrun --nproc-per-node 4 scripts/selfcheck.py              # HP_PLATFORM picks cpu/cuda/npu
    HP_PLATFORM=mindspore msrun --worker_num=4 --local_worker_num=4 scripts/selfcheck.py

Every rank builds the same layer and input, runs the whole sequence on its own device (the
reference), then each mode on its shard, and compares the output shard, the input-gradient shard
and the parameter gradients (summed over ranks), as errors relative to each tensor's scale.
Rank 0 prints a table and, last, ``selfcheck: <ok>/<total> ok``; the exit code is 0 only if
every mode that applies passed (ulysses needs the value-head count divisible by the ranks).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
from hyperpar_gdn.distributed.plan import HEAD_MODES
from hyperpar_gdn.distributed.verify import compare_with_reference
from hyperpar_gdn.platform import Platform, get_platform

MODES = ("ulysses", "ulysses_hidden", "p2p", "all_gather")


def build_layer(platform: Platform, args: argparse.Namespace) -> Any:
    """The GDN layer of the platform's framework, with weights fixed by the seed."""
    if platform.name == "mindspore":
        from hyperpar_gdn.models.mindspore import GatedDeltaNet
    else:
        from hyperpar_gdn.models import GatedDeltaNet
    platform.manual_seed(args.seed)
    layer = GatedDeltaNet(args.hidden, args.k_heads, args.v_heads, args.head_dim, args.head_dim)
    return layer.to(platform.device) if hasattr(layer, "to") else layer


def main() -> int:
    """Exit code: 0, 1 when a mode fails, 2 after a user error (one line on rank 0)."""
    from hyperpar_gdn.cli import run_script
    from hyperpar_gdn.platform import PlatformUnavailableError

    return run_script("selfcheck.py", _main, user_errors=(ValueError, PlatformUnavailableError))


def _main() -> int:
    from hyperpar_gdn.cli import Parser

    parser = Parser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--seq-len", type=int, default=512, help="total tokens T, split over the ranks")
    add("--batch-size", type=int, default=2, help="sequences B of the test input")
    add("--hidden", type=int, default=128, help="hidden size of the GDN layer")
    add("--k-heads", type=int, default=4, help="query/key heads of the GDN layer")
    add("--v-heads", type=int, default=8, help="value heads (ulysses needs them divisible by the ranks)")
    add("--head-dim", type=int, default=32, help="key and value head dimension")
    add("--seed", type=int, default=0, help="weights and input")
    add("--tolerance", type=float, default=1e-4, help="max error relative to each tensor's scale")
    add("--timeout-s", type=float, default=300.0, help="process-group timeout (seconds)")
    args = parser.parse_args()

    platform = get_platform()
    platform.init_distributed(timeout_s=args.timeout_s)
    rank, world = platform.rank(), platform.world_size()
    if args.seq_len % world:  # every rank alike, before any collective
        platform.destroy()
        raise ValueError(f"--seq-len {args.seq_len} must be divisible by the {world} ranks")
    mesh = init_device_mesh(platform.name, (world,), mesh_dim_names=("cp",))
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.batch_size, args.seq_len, args.hidden))
    cotangent = rng.standard_normal(x.shape)

    rows, ok, total = [], 0, 0
    try:
        for mode in MODES:
            if mode in HEAD_MODES and args.v_heads % world:
                rows.append((mode, f"skipped: {args.v_heads} value heads not divisible by {world}", "", ""))
                continue
            total += 1
            layer = LinearAttentionContextParallel(mode=mode).apply(build_layer(platform, args), mesh)
            start = time.perf_counter()
            errors = compare_with_reference(platform, mesh, layer, build_layer(platform, args), x, cotangent)
            elapsed = time.perf_counter() - start
            worst_name, worst = max(errors.items(), key=lambda item: item[1])
            passed = worst <= args.tolerance
            ok += passed
            rows.append((mode, f"{worst:.2e} ({worst_name})", f"{elapsed:.2f}s", "ok" if passed else "FAIL"))
    finally:
        if rank == 0:
            print(
                f"platform={platform.name} ranks={world} T={args.seq_len} B={args.batch_size} hidden={args.hidden}"
            )
            print(f"{'mode':<16}{'max rel error':<44}{'time':<10}result")
            for mode, err, elapsed, result in rows:
                print(f"{mode:<16}{err:<44}{elapsed:<10}{result}")
            print(f"selfcheck: {ok}/{total} ok", flush=True)
        platform.destroy()
    return 0 if ok == total else 1


if __name__ == "__main__":
    sys.exit(main())
