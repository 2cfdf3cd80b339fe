"""Check every context-parallel mode against the single-device layer on this machine's devices.

Launch with one process per device, on any platform:

    torchrun --nproc-per-node 4 scripts/selfcheck.py              # HP_PLATFORM picks cpu/cuda/npu
    HP_PLATFORM=mindspore msrun --worker_num=4 --local_worker_num=4 scripts/selfcheck.py

Every rank builds the same layer and input, runs the whole sequence on its own device (the
reference), then each mode on its shard, and compares the output shard, the input-gradient shard
and the parameter gradients (summed over ranks), as errors relative to each tensor's scale. The
modes are the library's own list (:data:`hyperpar_gdn.distributed.plan.MODE_CHOICES`): every
one-level mode; the two-level modes with ``--inner-size`` ranks per inner group (default: the
ranks per node when the world spans nodes, else the smallest group that leaves two or more
groups); and ``auto``, reported as the mode the cost model picks for this layer and length.
Rank 0 prints a table, one row per mode (a skipped mode says why) and, last,
``selfcheck: <ok>/<total> ok, <n> skipped``; the exit code is 0 only if every mode that
applies passed (the head-parallel modes need the value heads divisible by the ranks they split
them over; the two-level modes need at least 4 ranks).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
from hyperpar_gdn.distributed.plan import MODE_CHOICES, SPECS, CPPlan, head_split_error
from hyperpar_gdn.distributed.verify import compare_with_reference
from hyperpar_gdn.ops.gdn.kernels import KERNELS, resolve_kernel
from hyperpar_gdn.platform import Platform, get_platform


def build_layer(platform: Platform, args: argparse.Namespace) -> Any:
    """The GDN layer of the platform's framework, with weights fixed by the seed."""
    if platform.name == "mindspore":
        from hyperpar_gdn.models.mindspore import GatedDeltaNet
    else:
        from hyperpar_gdn.models import GatedDeltaNet
    platform.manual_seed(args.seed)
    layer = GatedDeltaNet(args.hidden, args.k_heads, args.v_heads, args.head_dim, args.head_dim)
    return layer.to(platform.device) if hasattr(layer, "to") else layer


def inner_size_for(world: int, v_heads: int, asked: int | None) -> tuple[int | None, str]:
    """(ranks per inner group of the two-level modes, or None, and why none): ``asked``, else the
    ranks per node (torchrun's ``LOCAL_WORLD_SIZE``) when the world spans nodes, else the smallest
    group of 2 or more ranks that leaves 2 or more groups; it divides the world and the value heads."""
    if world < 4:
        return None, f"two levels need 4 or more ranks (2 or more groups of 2 or more); {world} launched"
    if asked is not None:
        candidates = [asked]
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        candidates = ([local] if 1 < local < world else []) + list(range(2, world // 2 + 1))
    for inner in candidates:
        if world % inner == 0 and world // inner > 1 and inner > 1 and v_heads % inner == 0:
            return inner, ""
    what = f"--inner-size {asked}" if asked is not None else "no inner group size"
    return None, f"{what} divides the {world} ranks into 2 or more groups and the {v_heads} value heads"


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
    add(
        "--inner-size",
        type=int,
        default=None,
        help="ranks per inner group of the two-level modes (default: the ranks per node across nodes, "
        "else the smallest group that leaves 2 or more groups)",
    )
    add("--seed", type=int, default=0, help="weights and input")
    add("--tolerance", type=float, default=1e-4, help="max error relative to each tensor's scale")
    add("--timeout-s", type=float, default=300.0, help="process-group timeout (seconds)")
    add(
        "--gdn-kernel",
        default="auto",
        choices=KERNELS,
        help="the CP layers' local GDN kernel: auto (fla's Triton kernels on CUDA and Ascend where they "
        "import, else ours), fla or native; the reference is always ours on one device",
    )
    args = parser.parse_args()

    platform = get_platform()
    resolve_kernel(args.gdn_kernel, platform=platform.name)  # an error on every rank alike, before the group
    platform.init_distributed(timeout_s=args.timeout_s)
    rank, world = platform.rank(), platform.world_size()
    if args.seq_len % world:  # every rank alike, before any collective
        platform.destroy()
        raise ValueError(f"--seq-len {args.seq_len} must be divisible by the {world} ranks")
    mesh = init_device_mesh(platform.name, (world,), mesh_dim_names=("cp",))
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.batch_size, args.seq_len, args.hidden))
    cotangent = rng.standard_normal(x.shape)
    inner, no_inner = inner_size_for(world, args.v_heads, args.inner_size)

    rows, passed = [], {}
    try:
        for mode in MODE_CHOICES:
            if mode == "auto":
                rows.append(_auto_row(args, platform.name, world, passed))
                continue
            spec = SPECS[mode]
            if spec.two_level and inner is None:
                rows.append((mode, f"skipped: {no_inner}", "", ""))
                continue
            split = world if spec.head_parallel else inner if spec.two_level else None
            why = None if split is None else head_split_error(args.v_heads, args.k_heads, split, mode)
            if why is not None:
                rows.append((mode, f"skipped: {args.v_heads} value heads not divisible by {split}", "", ""))
                continue
            plan = CPPlan(mode=mode, inner_size=inner if spec.two_level else None, kernel=args.gdn_kernel)
            layer = LinearAttentionContextParallel(plan=plan).apply(build_layer(platform, args), mesh)
            start = time.perf_counter()
            errors = compare_with_reference(platform, mesh, layer, build_layer(platform, args), x, cotangent)
            elapsed = time.perf_counter() - start
            worst_name, worst = max(errors.items(), key=lambda item: item[1])
            passed[mode] = worst <= args.tolerance
            name = mode if plan.inner_size is None else f"{mode} (inner {plan.inner_size})"
            result = "ok" if passed[mode] else "FAIL"
            rows.append((name, f"{worst:.2e} ({worst_name})", f"{elapsed:.2f}s", result))
    finally:
        if rank == 0:
            _print_table(platform.name, world, args, rows)
        platform.destroy()
    ok, total = sum(passed.values()), len(passed)
    return 0 if ok == total else 1


def _auto_row(
    args: argparse.Namespace, platform: str, world: int, passed: dict[str, bool]
) -> tuple[str, str, str, str]:
    """The row of ``auto``: the cost model's pick for this layer at T on the platform's device kind
    (one-level modes, as on one node), and the result of that mode's row."""
    from hyperpar_gdn.distributed.planner import DEVICE_KINDS, plan_context_parallel

    if world < 2:
        return ("auto", "skipped: one rank, nothing to choose", "", "")
    choice = plan_context_parallel(
        seq_len=args.seq_len, cp=world, num_k_heads=args.k_heads, num_v_heads=args.v_heads,
        head_k_dim=args.head_dim, head_v_dim=args.head_dim, hidden_size=args.hidden,
        batch=args.batch_size, dtype="float32", device=DEVICE_KINDS.get(platform, "cpu"),
    ).choice  # fmt: skip
    if choice not in passed:
        return ("auto", f"skipped: picks {choice}, which was not checked", "", "")
    return ("auto", f"picks {choice} (its row above)", "", "ok" if passed[choice] else "FAIL")


def _print_table(platform: str, world: int, args: argparse.Namespace, rows: list[tuple]) -> None:
    print(f"platform={platform} ranks={world} T={args.seq_len} B={args.batch_size} hidden={args.hidden}")
    kernel = resolve_kernel(args.gdn_kernel, platform=platform)
    print(f"GDN kernel: {kernel.name} ({kernel.reason})")
    print(f"{'mode':<30}{'max rel error':<44}{'time':<10}result")
    for mode, err, elapsed, result in rows:
        print(f"{mode:<30}{err:<44}{elapsed:<10}{result}")
    checked = [row for row in rows if row[3] in ("ok", "FAIL") and row[0] != "auto"]
    ok = sum(row[3] == "ok" for row in checked)
    skipped = sum(row[1].startswith("skipped") for row in rows)
    print(f"selfcheck: {ok}/{len(checked)} ok, {skipped} skipped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
