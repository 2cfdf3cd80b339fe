"""The first thing to run on a CUDA device: one prepared check, under five minutes on one GPU,
written to one JSON file.

    python scripts/device_check.py --out device_check.json          # a CUDA GPU
    python scripts/device_check.py --smoke --out smoke.json         # this CPU: tiny shapes, native
    python scripts/device_check.py --multi --out multi.json         # every GPU: NCCL, one process each
    python scripts/device_check.py --multi --smoke --out m.json     # gloo ranks on this CPU

Parts (each skipped, with the reason in the JSON, when its time budget is spent):

1. ``parity``: fla's kernel against ours (``native``) on the same inputs, fp32 and bf16, T = 4K
   and 32K, packed documents (three per sequence): outputs and final states, relative error
   (max |a - b| / max |b|). Only when fla's kernel imports (otherwise the reason).
2. ``layer``: one GDN layer's forward+backward time on one device per kernel at T = 8K, 32K, 128K
   (bf16; hidden 2048, 16 q/k and 32 value heads of 128).
3. ``widened``: a state mode's one widened pass (outputs, Q_eff and the summary at once,
   docs/maths.md) against the plain call, forward+backward, per kernel, at T = 8K.
4. ``modes``: every CP mode's local work per rank at cp = 2, 4, 8 (T = 16K): each rank's shard run in turn
   on the one device (torch's fake process group stands in for the others: the collectives are
   called but move nothing), forward+backward, the slowest rank's time beside the communication
   the cost model prices for a GPU node (:func:`hyperpar_gdn.plan_context_parallel`'s ``gpu``).

``--multi`` instead: every CP mode (both layouts; two levels with inner 2) on real process groups
at cp = the visible GPUs, one process each (NCCL), forward and backward against the one-device
layer (output, input and parameter gradients), and the CP layer's time (:mod:`benchkit.multi_device`).

Each mode at cp = 8 runs 8 shards of T/8 in turn: the section costs about cp x modes layer steps. The
kernel is one argument everywhere (``native``, and ``fla`` where it imports): through
``hyperpar_gdn.ops.gdn.kernels`` when the package has it, else ours directly.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchkit.device_figures import relative, timed
from hyperpar_gdn.cli import HelpFormatter
from hyperpar_gdn.ops.gdn.kernels import fla_missing, gdn_rule, shard_rule

SECTIONS = ("parity", "layer", "widened", "modes")
FULL = {"parity_t": (4096, 32768), "layer_t": (8192, 32768, 131072), "widened_t": 8192, "modes_t": 16384,
        "hidden": 2048, "k_heads": 16, "v_heads": 32, "head_dim": 128, "cps": (2, 4, 8), "repeats": 3,
        "modes_repeats": 1}  # fmt: skip
SMOKE = {"parity_t": (256,), "layer_t": (64, 128), "widened_t": 128, "modes_t": 64,
         "hidden": 32, "k_heads": 2, "v_heads": 8, "head_dim": 8, "cps": (2, 4, 8), "repeats": 1,
         "modes_repeats": 1}  # fmt: skip


# --- the kernel, one argument -----------------------------------------------------------------
def kernels_available(device: torch.device) -> dict[str, str | None]:
    """Every kernel's name -> None when it runs here, else why not."""
    return {"native": None, "fla": fla_missing(device.type)}


def rule(kernel: str, q, k, v, g, beta, *, cu_seqlens=None, final_state: bool = True):
    """The rule on whole sequences with ``kernel`` -> (o, final states); ``"reference"``: the
    token-by-token recurrence (the smoke run's other side of the parity check)."""
    if kernel == "reference":
        from hyperpar_gdn.ops.gdn.naive import recurrent_gated_delta_rule

        return recurrent_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            output_final_state=final_state,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_seqlens,
        )
    return gdn_rule(q, k, v, g, beta, kernel=kernel, cu_seqlens=cu_seqlens, output_final_state=final_state)


class ZeroExchange:
    """A state exchange with no peers: a zero entering state, no gradient from later shards."""

    def forward(self, s_ext, m):
        self.like = s_ext
        return torch.zeros_like(s_ext)

    def backward(self, ds_in):
        return torch.zeros_like(self.like)


def shard(kernel: str, q, k, v, g, beta, *, widened: bool):
    """A state mode's shard call (the widened one pass, or plain with ``widened=False``)."""
    return shard_rule(q, k, v, g, beta, ZeroExchange(), kernel=kernel, widened=widened)


# --- inputs and timing -------------------------------------------------------------------------
def rule_inputs(t: int, cfg: dict, device: torch.device, dtype: torch.dtype, seed: int = 0) -> tuple:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hk, h, d = cfg["k_heads"], cfg["v_heads"], cfg["head_dim"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    g = torch.nn.functional.logsigmoid(torch.randn(1, t, h, generator=gen) + 3).to(device)  # log decay, fp32
    beta = torch.rand(1, t, h, generator=gen).to(device=device, dtype=dtype)
    return rand(1, t, hk, d), rand(1, t, hk, d), rand(1, t, h, d), g, beta


# --- the sections ------------------------------------------------------------------------------
def parity(cfg: dict, device: torch.device, kernels: dict, other: str = "fla") -> dict:
    """``other`` (fla, or the reference recurrence in a smoke run) against native."""
    if other != "reference" and kernels.get(other, "not asked for") is not None:
        return {"skipped": f"{other}: {kernels.get(other, 'not asked for')}"}
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for t in cfg["parity_t"]:
            inputs = rule_inputs(t, cfg, device, dtype)
            cu = torch.tensor([0, t // 3, t // 2 + 7, t], device=device)
            o_n, s_n = rule("native", *inputs, cu_seqlens=cu)
            o_f, s_f = rule(other, *inputs, cu_seqlens=cu)
            out[f"{str(dtype).removeprefix('torch.')}/T={t}"] = {
                "outputs": relative(o_f, o_n),
                "states": relative(s_f, s_n),
            }
    return out


def layer_module(cfg: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from hyperpar_gdn.models import GatedDeltaNet

    torch.manual_seed(0)
    return GatedDeltaNet(cfg["hidden"], cfg["k_heads"], cfg["v_heads"], cfg["head_dim"], cfg["head_dim"]).to(
        device=device, dtype=dtype
    )


def layer_step(module: torch.nn.Module, kernel: str, x: torch.Tensor) -> Callable[[], None]:
    from hyperpar_gdn.ops.gdn.layer import LayerDims, LayerWeights, gdn_layer_forward
    from hyperpar_gdn.platform import ops_for

    def step() -> None:
        xi = x.detach().requires_grad_(True)
        y = gdn_layer_forward(ops_for(xi), LayerWeights.of(module), LayerDims.of(module), xi, kernel=kernel)
        y.float().sum().backward()

    return step


def layer_times(cfg: dict, device: torch.device, kernels: dict, deadline: float) -> dict:
    out: dict[str, Any] = {}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    module = layer_module(cfg, device, dtype)
    for kernel, why in kernels.items():
        last: tuple[int, float] | None = None  # (T, seconds) of the last measurement
        for t in cfg["layer_t"]:
            key = f"{kernel}/T={t}"
            # the next T's runs, guessed linear in T from the last one, must fit in the budget
            guess = 0.0 if last is None else last[1] * t / last[0] * (cfg["repeats"] + 1)
            if why is not None:
                out[key] = {"skipped": why}
            elif time.monotonic() + guess > deadline:
                out[key] = {"skipped": f"time budget: about {guess:.0f} s expected"}
            else:
                x = torch.randn(1, t, cfg["hidden"], device=device, dtype=dtype)
                out[key] = timed(layer_step(module, kernel, x), device, cfg["repeats"])
                last = (t, out[key]["median_s"])
    return out


def widened_times(cfg: dict, device: torch.device, kernels: dict) -> dict:
    out: dict[str, Any] = {}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for kernel, why in kernels.items():
        if why is not None:
            out[kernel] = {"skipped": why}
            continue
        inputs = [x.requires_grad_(True) for x in rule_inputs(cfg["widened_t"], cfg, device, dtype)]

        def run(widened: bool, kernel: str = kernel, inputs: list = inputs) -> Callable[[], None]:
            return lambda: shard(kernel, *inputs, widened=widened).float().sum().backward()

        plain, wide = timed(run(False), device, cfg["repeats"]), timed(run(True), device, cfg["repeats"])
        out[kernel] = {"plain": plain, "widened": wide, "ratio": wide["median_s"] / plain["median_s"]}
    return out


def mode_list(cfg: dict, cp: int) -> list[tuple[str, int | None]]:
    from hyperpar_gdn.planning.plan import HEAD_MODES, MODES, TWO_LEVEL_MODES

    modes: list[tuple[str, int | None]] = [
        (m, None) for m in MODES if m not in HEAD_MODES or cfg["v_heads"] % cp == 0
    ]
    if cp >= 4:
        modes += [(m, 2) for m in TWO_LEVEL_MODES]
    return modes


def rank_step(cfg: dict, device: torch.device, kernel: str, mode: str, inner: int | None, cp: int, rank: int,
              module: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:  # fmt: skip
    """Rank ``rank``'s forward+backward of the layer under ``mode`` on the fake group (joined)."""
    from hyperpar_gdn.distributed.linear_attention_style import LinearAttentionContextParallel
    from hyperpar_gdn.distributed.mesh import DeviceMesh
    from hyperpar_gdn.distributed.sequence import GlobalSequence
    from hyperpar_gdn.platform import get_platform

    platform = get_platform(device.type)
    mesh = DeviceMesh.from_group(
        platform, dist.group.WORLD, list(range(cp)), mesh_dim_name="cp", device_type=device.type
    )
    layer = copy.deepcopy(module)
    style = LinearAttentionContextParallel(mode=mode, inner_size=inner, kernel=kernel)
    style.apply(layer, mesh)
    # the lengths known: no exchange on the fake group
    seq = GlobalSequence.build([x.shape[1]] * cp, rank=rank)

    def step() -> None:
        xi = x.detach().requires_grad_(True)
        layer(xi, cp_context=seq).float().sum().backward()

    return step


def mode_times(cfg: dict, device: torch.device, kernels: dict, deadline: float) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hyperpar_gdn import plan_context_parallel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    module = layer_module(cfg, device, dtype)
    t = cfg["modes_t"]
    out: dict[str, Any] = {}
    for kernel, why in kernels.items():
        for cp in cfg["cps"]:
            x = torch.randn(1, t // cp, cfg["hidden"], device=device, dtype=dtype)
            plans = {}
            for inner in (None, 2):
                if inner is None or cp >= 4:
                    plan = plan_context_parallel(seq_len=t, cp=cp, num_k_heads=cfg["k_heads"], num_v_heads=cfg["v_heads"],
                                                 head_k_dim=cfg["head_dim"], head_v_dim=cfg["head_dim"], hidden_size=cfg["hidden"],
                                                 dtype=str(dtype).removeprefix("torch."), device="gpu", inner_size=inner)  # fmt: skip
                    plans.update({(c.mode, c.inner_size): c for c in plan.ranking})
            for mode, inner in mode_list(cfg, cp):
                key = f"{kernel}/cp={cp}/{mode}" + ("" if inner is None else f"/inner={inner}")
                if why is not None or time.monotonic() > deadline:
                    out[key] = {"skipped": why or "time budget spent"}
                    continue
                per_rank = []
                for rank in range(cp):
                    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
                    try:
                        per_rank.append(
                            timed(
                                rank_step(cfg, device, kernel, mode, inner, cp, rank, module, x),
                                device,
                                cfg["modes_repeats"],
                            )["median_s"]
                        )
                    finally:
                        dist.destroy_process_group()
                cost = plans[(mode, inner)]
                out[key] = {"local_s_per_rank": per_rank, "slowest_rank_s": max(per_rank),
                            "model_comm_bytes_worst_rank": cost.bytes_sent, "model_seconds": cost.seconds}  # fmt: skip
    return out


def multi(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--multi``: :mod:`benchkit.multi_device` on one process per device, rank 0's figures to
    ``--out``."""
    from benchkit.multi_device import MULTI_FULL, MULTI_SMOKE, multi_worker
    from hyperpar_gdn.platform.launch import run_ranks

    if args.smoke:
        platform, world = "cpu", args.ranks
    elif torch.cuda.device_count() >= 2:
        platform, world = "cuda", torch.cuda.device_count()
    else:
        parser.error(
            f"--multi needs at least 2 visible GPUs (found {torch.cuda.device_count()}); "
            "with --smoke it runs gloo ranks on this CPU"
        )
    if world < 2:
        parser.error(f"--ranks={world}: --multi needs at least 2 ranks")
    cfg = MULTI_SMOKE if args.smoke else MULTI_FULL
    results = run_ranks(multi_worker, world, cfg, timeout_s=args.budget_s, env={"HP_PLATFORM": platform})
    result = {
        "platform": platform,
        "cp": world,
        "torch": torch.__version__,
        "config": cfg,
        "cases": results[0],
    }
    if platform == "cuda":
        result["device"] = torch.cuda.get_device_name(0)
    args.out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print(json.dumps({k: result[k] for k in ("platform", "cp")} | {"cases": len(results[0])}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write (required)")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes, native kernel, CPU (checks the script runs)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=270.0, help="stop starting new measurements after this"
    )
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="the parts to run"
    )
    parser.add_argument(
        "--multi",
        action="store_true",
        help="every CP mode at cp = the visible GPUs under NCCL, one process each, against one device "
        "(with --smoke: --ranks gloo ranks on this CPU)",
    )
    parser.add_argument("--ranks", type=int, default=4, help="with --multi --smoke: how many CPU ranks")
    args = parser.parse_args(argv)
    if args.multi:
        return multi(args, parser)
    cfg = SMOKE if args.smoke else FULL
    if args.smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
    else:
        parser.error("no CUDA device here: run with --smoke (tiny shapes on the CPU) or on a GPU")
    kernels = kernels_available(device)
    if args.smoke:
        kernels = {"native": None}
    deadline = time.monotonic() + args.budget_s
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "smoke": args.smoke, "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
        "kernels": kernels,
    }  # fmt: skip
    runs = {"parity": lambda: parity(cfg, device, kernels, "reference" if args.smoke else "fla"), "layer": lambda: layer_times(cfg, device, kernels, deadline),
            "widened": lambda: widened_times(cfg, device, kernels), "modes": lambda: mode_times(cfg, device, kernels, deadline)}  # fmt: skip
    for name in args.sections:
        start = time.monotonic()
        result[name] = runs[name]() if time.monotonic() < deadline else {"skipped": "time budget spent"}
        result[f"{name}_seconds"] = time.monotonic() - start
        args.out.write_text(json.dumps(result, indent=1, default=float) + "\n")  # after every part
    print(
        json.dumps({k: v for k, v in result.items() if k.endswith("_seconds") or k in ("device", "kernels")})
    )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
