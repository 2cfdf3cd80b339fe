"""Check every context-parallel mode against the single-device layer on this machine's devices.

Launch with one process per device, on any platform:

    torchrun --nproc-per-node 4 scripts/selfcheck.py              # HP_PLATFORM picks cpu/cuda/npu
    torchrun --nproc-per-node 4 scripts/selfcheck.py --tp 2       # cp 2 x tp 2
    torchrun --nproc-per-node 4 scripts/selfcheck.py --ep 4       # and a MoE block over ep 4
    HP_PLATFORM=mindspore msrun --worker_num=4 --local_worker_num=4 scripts/selfcheck.py

Every rank builds the same layer and input, runs the whole sequence on its own device (the
reference), then each mode on its shard, and compares the output shard, the input-gradient shard
and the parameter gradients (summed over ranks), as errors relative to each tensor's scale. The
modes are the library's own list (:data:`hyperpar_gdn.planning.plan.MODE_CHOICES`): every
one-level mode; the two-level modes with ``--inner-size`` ranks per inner group (default: the
ranks per node when the world spans nodes, else the smallest group that leaves two or more
groups); and ``auto``, reported as the mode the cost model picks for this layer and length.
Rank 0 prints a table, one row per mode (a skipped mode says why) and, last,
``selfcheck: <ok>/<total> ok, <n> skipped``; the exit code is 0 only if every mode that
applies passed (the head-parallel modes need the value heads divisible by the ranks they split
them over; the two-level modes need at least 4 ranks).

``--tp N``: the world is a mesh (cp, tp), tp innermost; the layer is split by heads over
the TP ranks (:mod:`hyperpar_gdn.tensor_parallel`) before each mode runs over the cp = W / N ranks
on its TP rank's heads, and its gradients are made whole over tp before the comparison. The
head-parallel modes then need the value heads divisible by tp x cp; the two-level ones cp >= 4.

On torch one more row: a whole fp64 model (three GDN blocks of that layer's sizes and a
softmax-attention block) made parallel by ``parallelize`` (split over the TP ranks, then p2p over
the CP ranks), its logits and every parameter gradient against the same model on one device.

``--ep N`` (torch, with transformers): one more row, a Qwen3.5 sparse MoE block (8 experts or
``N``, top-2, hidden ``--hidden``) with its routed experts split over N consecutive ranks
(:mod:`hyperpar_gdn.expert_parallel`), each rank bringing its own tokens of the batch: its output
and input-gradient shards and every parameter gradient against the whole block on one device.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
from hyperpar_gdn.distributed.verify import compare_with_reference
from hyperpar_gdn.ops.gdn.kernels import KERNELS, resolve_kernel
from hyperpar_gdn.planning.plan import MODE_CHOICES, SPECS, CPPlan, head_split_error
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


def inner_size_for(world: int, v_heads: int, asked: int | None, *, tp: int = 1) -> tuple[int | None, str]:
    """(ranks per inner group of the two-level modes, or None, and why none): ``asked``, else the
    ranks per node (torchrun's ``LOCAL_WORLD_SIZE``, over ``tp``) when the world spans nodes, else
    the smallest group of 2 or more ranks that leaves 2 or more groups; it divides the world (the CP
    ranks) and the value heads (a TP rank's)."""
    if world < 4:
        launched = f"{world} launched" if tp == 1 else f"cp={world} (tp={tp})"
        return None, f"two levels need 4 or more ranks (2 or more groups of 2 or more); {launched}"
    if asked is not None:
        candidates = [asked]
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) // tp
        candidates = ([local] if 1 < local < world else []) + list(range(2, world // 2 + 1))
    for inner in candidates:
        if world % inner == 0 and world // inner > 1 and inner > 1 and v_heads % inner == 0:
            return inner, ""
    what = f"--inner-size {asked}" if asked is not None else "no inner group size"
    return None, f"{what} divides the {world} ranks into 2 or more groups and the {v_heads} value heads"


def check_tp(args: argparse.Namespace) -> int:
    """``--tp``, checked from the options alone (every rank alike, before the process group)."""
    tp = args.tp
    if tp < 1:
        raise ValueError(f"--tp {tp} must be at least 1")
    if tp > 1 and (args.k_heads % tp or args.v_heads % args.k_heads):
        raise ValueError(
            f"--tp {tp} gives every TP rank whole q/k heads with their value heads: --k-heads {args.k_heads} "
            f"must be divisible by tp (and --v-heads {args.v_heads} by --k-heads)"
        )
    return tp


def world_error(args: argparse.Namespace, world: int, tp: int) -> str | None:
    """Why the launched ``world`` does not fit ``--tp`` and ``--seq-len``, or None."""
    if world % tp:
        return f"--tp {tp} must divide the {world} launched ranks (the mesh is cp x tp)"
    cp = world // tp
    if args.seq_len % cp:
        ranks = f"the {world} ranks" if tp == 1 else f"the cp={cp} ranks (world {world} / tp {tp})"
        return f"--seq-len {args.seq_len} must be divisible by {ranks}"
    return None


def split_heads(platform: Platform, layer: Any, tp_mesh: Any) -> None:
    """Split the GDN layer by heads over the TP axis: the library's GDN style (torch: through
    ``parallelize_module``)."""
    if platform.name == "mindspore":
        from hyperpar_gdn.tensor_parallel.mindspore_styles import GatedDeltaNetTensorParallel as MSStyle

        MSStyle().apply(layer, tp_mesh)
        return
    from torch.distributed.tensor.parallel import parallelize_module

    from hyperpar_gdn.tensor_parallel.apply import as_tp_mesh
    from hyperpar_gdn.tensor_parallel.styles import GatedDeltaNetTensorParallel

    parallelize_module(layer, as_tp_mesh(tp_mesh), GatedDeltaNetTensorParallel())


def whole_grads_over(platform: Platform, layer: Any, tp_mesh: Any) -> Any:
    """What makes the gradients of ``layer``, split by heads over ``tp_mesh``, whole and in the
    one-device layout (collective): ``compare_with_reference``'s ``whole_grads``."""
    if platform.name == "mindspore":
        from hyperpar_gdn.tensor_parallel.mindspore_apply import whole_parameters

        def whole(grads: dict[str, Any]) -> dict[str, Any]:
            arrays = whole_parameters(layer, grads, tp_mesh)
            return {name: platform.from_numpy(value, dtype="float32") for name, value in arrays.items()}

        return whole
    from hyperpar_gdn.tensor_parallel import canonical_grads

    return lambda grads: canonical_grads(layer, grads)


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
    add(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks: the world is cp x tp, the layer split by heads over tp",
    )
    add(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks: also check a MoE block with its experts split over ep ranks (torch)",
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
    tp = check_tp(args)
    check_ep(args, platform.name)
    platform.init_distributed(timeout_s=args.timeout_s)
    rank, world = platform.rank(), platform.world_size()
    error = world_error(args, world, tp)
    if error is None and world % args.ep:
        error = f"--ep {args.ep} must divide the {world} launched ranks (the experts' ranks hold different tokens)"
    if error is not None:  # every rank alike, before any collective
        platform.destroy()
        raise ValueError(error)
    cp = world // tp
    if tp == 1:
        mesh = full = init_device_mesh(platform.name, (world,), mesh_dim_names=("cp",))
    else:
        full = init_device_mesh(platform.name, (cp, tp), mesh_dim_names=("cp", "tp"))
        mesh, tp_mesh = full["cp"], full["tp"]
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.batch_size, args.seq_len, args.hidden))
    cotangent = rng.standard_normal(x.shape)
    heads = (args.v_heads // tp, args.k_heads // tp)  # a TP rank's value and key heads
    inner, no_inner = inner_size_for(cp, heads[0], args.inner_size, tp=tp)

    rows, passed = [], {}
    try:
        for mode in MODE_CHOICES:
            if mode == "auto":
                rows.append(_auto_row(args, platform.name, cp, tp, passed))
                continue
            spec = SPECS[mode]
            if spec.two_level and inner is None:
                rows.append((mode, f"skipped: {no_inner}", "", ""))
                continue
            split = cp if spec.head_parallel else inner if spec.two_level else None
            why = None if split is None else head_split_error(*heads, split, mode, tp=tp)
            if why is not None:
                over = f"{split}" if tp == 1 else f"tp x {split} = {tp * split}"
                rows.append((mode, f"skipped: {args.v_heads} value heads not divisible by {over}", "", ""))
                continue
            plan = CPPlan(mode=mode, inner_size=inner if spec.two_level else None, kernel=args.gdn_kernel)
            layer = build_layer(platform, args)
            if tp > 1:
                split_heads(platform, layer, tp_mesh)
            layer = LinearAttentionContextParallel(plan=plan).apply(layer, mesh)
            start = time.perf_counter()
            reference = build_layer(platform, args)
            split = {} if tp == 1 else {"whole_grads": whole_grads_over(platform, layer, tp_mesh)}
            errors = compare_with_reference(platform, mesh, layer, reference, x, cotangent, **split)
            elapsed = time.perf_counter() - start
            worst_name, worst = max(errors.items(), key=lambda item: item[1])
            passed[mode] = worst <= args.tolerance
            name = mode if plan.inner_size is None else f"{mode} (inner {plan.inner_size})"
            result = "ok" if passed[mode] else "FAIL"
            rows.append((name, f"{worst:.2e} ({worst_name})", f"{elapsed:.2f}s", result))
        if platform.name == "npu":  # float64 is slow or missing on Ascend's vector units
            rows.append(("model: parallelize", "skipped: an fp64 model on the CPU and CUDA only", "", ""))
        elif platform.name != "mindspore":
            start = time.perf_counter()
            worst_name, worst = check_model(args, platform, full, tp)
            passed["model"] = worst <= args.tolerance
            elapsed = f"{time.perf_counter() - start:.2f}s"
            result = "ok" if passed["model"] else "FAIL"
            name = "model: parallelize" + (f" (tp {tp})" if tp > 1 else "")
            rows.append((name, f"{worst:.2e} ({worst_name})", elapsed, result))
        if args.ep > 1:
            start = time.perf_counter()
            worst_name, worst = check_moe_block(args, platform)
            passed["moe"] = worst <= args.tolerance
            result = "ok" if passed["moe"] else "FAIL"
            elapsed = f"{time.perf_counter() - start:.2f}s"
            rows.append((f"MoE block, ep {args.ep}", f"{worst:.2e} ({worst_name})", elapsed, result))
    finally:
        if rank == 0:
            _print_table(platform.name, world, tp, args, rows)
        platform.destroy()
    ok, total = sum(passed.values()), len(passed)
    return 0 if ok == total else 1


def check_model(args: argparse.Namespace, platform: Platform, mesh: Any, tp: int) -> tuple[str, float]:
    """(worst tensor, its error relative to its scale) of a whole fp64 model (``HybridLM``: three GDN
    blocks of the checked layer's sizes and a softmax-attention block) made parallel by
    ``parallelize`` (tensor parallelism over ``tp``, then p2p over the CP ranks) against the same model on one device: this rank's logits and every parameter gradient
    (made whole over tp, summed over the CP ranks)."""
    import copy

    import torch

    from hyperpar_gdn import ParallelConfig, parallelize, shard_for_context_parallel
    from hyperpar_gdn.models.lm import HybridLM, HybridLMConfig
    from hyperpar_gdn.tensor_parallel import canonical_grads

    sizes = {"linear_key_head_dim": args.head_dim, "linear_value_head_dim": args.head_dim}
    config = HybridLMConfig(
        vocab_size=64, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_attention_heads=2 * tp,
        num_key_value_heads=tp, head_dim=args.head_dim, linear_num_key_heads=args.k_heads,
        linear_num_value_heads=args.v_heads, **sizes,
    )  # fmt: skip
    platform.manual_seed(args.seed)
    model = HybridLM(config).to(platform.device, torch.float64)  # fp64: the gates' sums are exact
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), generator=gen)
    weight = torch.randn(args.batch_size, args.seq_len, config.vocab_size, generator=gen, dtype=torch.float64)
    ids, weight = ids.to(platform.device), weight.to(platform.device)
    logits_ref = reference(ids)
    (logits_ref * weight).sum().backward()

    parallelize(model, mesh, ParallelConfig(tp=tp, cp_mode="p2p"))
    cp = mesh["cp"]
    shard = shard_for_context_parallel(cp, ids)
    t = args.seq_len // cp.size()
    mine = slice(cp.get_local_rank() * t, (cp.get_local_rank() + 1) * t)
    logits = model(shard.input_ids)
    (logits * weight[:, mine]).sum().backward()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    errors = {"logits": rel(logits.detach(), logits_ref.detach()[:, mine])}
    grads = canonical_grads(model)  # whole over tp, in the one-device layout
    for name, p in reference.named_parameters():
        grad = platform.collectives.all_reduce_sum(grads[name].contiguous(), cp.get_group())
        errors[name] = rel(grad, p.grad)
    return max(errors.items(), key=lambda item: item[1])


def check_ep(args: argparse.Namespace, platform: str) -> None:
    """``--ep``, checked from the options alone (every rank alike, before the process group)."""
    if args.ep < 1:
        raise ValueError(f"--ep {args.ep} must be at least 1")
    if args.ep > 1 and platform == "mindspore":
        raise ValueError(f"--ep {args.ep}: expert parallelism runs on torch (HP_PLATFORM=cpu / cuda / npu)")
    if args.ep > 1 and args.seq_len % args.ep:
        raise ValueError(
            f"--ep {args.ep} splits the {args.seq_len} tokens (--seq-len) over its ranks: divide it"
        )


def check_moe_block(args: argparse.Namespace, platform: Platform) -> tuple[str, float]:
    """(worst tensor, its error relative to its scale) of a Qwen3.5 MoE block with its experts over
    ``--ep`` consecutive ranks, each on its slice of the tokens, against the whole block (fp64)."""
    import copy

    import torch
    from torch.distributed.tensor import DTensor
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    from hyperpar_gdn.expert_parallel import ExpertParallel

    experts = max(8, args.ep)
    config = Qwen3_5MoeTextConfig(
        hidden_size=args.hidden, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    )  # fmt: skip
    config._experts_implementation = "eager"  # transformers' reference loop over experts
    platform.manual_seed(args.seed)
    block = Qwen3_5MoeSparseMoeBlock(config).to(torch.float64)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.batch_size, args.seq_len, args.hidden, generator=gen, dtype=torch.float64)
    cotangent = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    x_ref = x.clone().requires_grad_()
    reference = copy.deepcopy(block)
    (reference(x_ref) * cotangent).sum().backward()

    world = platform.world_size()
    mesh = init_device_mesh(platform.name, (world // args.ep, args.ep), mesh_dim_names=("replica", "ep"))
    ExpertParallel().apply(block, mesh["ep"])
    ep_rank, t = mesh["ep"].get_local_rank(), args.seq_len // args.ep
    mine = slice(ep_rank * t, (ep_rank + 1) * t)
    x_mine = x[:, mine].clone().requires_grad_()
    out = block(x_mine)
    (out * cotangent[:, mine]).sum().backward()
    group = mesh["ep"].get_group()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()

    errors = {
        "output": rel(out.detach(), reference(x)[:, mine].detach()),
        "input grad": rel(x_mine.grad, x_ref.grad[:, mine]),
    }
    for name, p in block.named_parameters():
        grad = p.grad
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        else:
            grad = platform.collectives.all_reduce_sum(grad.clone(), group)
        errors[name] = rel(grad, dict(reference.named_parameters())[name].grad)
    return max(errors.items(), key=lambda item: item[1])


def _auto_row(
    args: argparse.Namespace, platform: str, cp: int, tp: int, passed: dict[str, bool]
) -> tuple[str, str, str, str]:
    """The row of ``auto``: the cost model's pick for this layer (a TP rank's heads) at T on the
    platform's device kind (one-level modes, as on one node), and the result of that mode's row."""
    from hyperpar_gdn.planning.ranking import machine_kind, plan_context_parallel

    if cp < 2:
        return ("auto", "skipped: one CP rank, nothing to choose", "", "")
    choice = plan_context_parallel(
        seq_len=args.seq_len, cp=cp, num_k_heads=args.k_heads // tp, num_v_heads=args.v_heads // tp,
        head_k_dim=args.head_dim, head_v_dim=args.head_dim, hidden_size=args.hidden,
        batch=args.batch_size, dtype="float32", device=machine_kind(platform),
    ).choice  # fmt: skip
    if choice not in passed:
        return ("auto", f"skipped: picks {choice}, which was not checked", "", "")
    return ("auto", f"picks {choice} (its row above)", "", "ok" if passed[choice] else "FAIL")


def _print_table(platform: str, world: int, tp: int, args: argparse.Namespace, rows: list[tuple]) -> None:
    ranks = f"ranks={world}" if tp == 1 else f"ranks={world} (cp={world // tp} x tp={tp})"
    print(f"platform={platform} {ranks} T={args.seq_len} B={args.batch_size} hidden={args.hidden}")
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
