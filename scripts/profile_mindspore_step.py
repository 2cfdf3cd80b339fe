"""Where MindSpore's whole-model training step spends its time, beside torch's same step.

The model is ``bench_cp_model_mindspore``'s (transformers' Qwen3.5 with the 27B head ratios / 4,
3 GDN + 1 attention layers, hidden 256, seed 0), loaded by MindSpore's ``Qwen3_5ForCausalLM`` and
by transformers (its GDN layers running our maths, as ``apply_context_parallel`` does on one
rank). One process, one thread per framework (``OMP_WAIT_POLICY=PASSIVE`` is set here; MindSpore's
kernel threads come from ``HP_MINDSPORE_THREADS``, 1 unless set, which the platform applies; its
CPU pool still has two threads), fp32.

Three measurements, each in alternating rounds (the frameworks take turns, so load falls on both):

- ``step``: forward, the chunked LM loss (mean), backward, on each framework; the ratio
  MindSpore / torch is the number this script is for;
- ``parts``: forward+backward of each part alone (a GDN mixer, the attention mixer, an MLP, an
  RMSNorm, the loss) on the same random input, on each framework: their ratios say which part
  makes the whole step slow; ``share`` is a part's MindSpore time x its count over the step;
- ``ops`` (MindSpore): exclusive seconds per ``TensorOps`` function during one step (launch
  blocking makes kernels synchronous, so a call's time is its kernel's); what no function
  accounts for is autograd, Tensor operators and Python.

Usage: ``OMP_NUM_THREADS=1 python scripts/profile_mindspore_step.py --seq-len 2048 --repeats 2``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchkit.machine import load_average
from benchkit.output import write_json
from benchkit.qwen35_steps import token_ids, write_model_dir
from benchkit.timing import alternating_rounds
from hyperpar_gdn.cli import HelpFormatter

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HP_MINDSPORE_THREADS", "1")  # MindSporePlatform.init_distributed applies it


def torch_side(model_dir: Path, ids_np: Any) -> tuple[Any, dict[str, Any]]:
    """transformers' model with our GDN maths in its GDN layers; the step and the parts."""
    import torch
    import transformers

    from hyperpar_gdn.ops.gdn.layer import layer_forward
    from hyperpar_gdn.ops.lm_loss import lm_loss_sum

    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).train()
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            gdn = layer.linear_attn
            gdn.forward = functools.partial(_ours_torch, layer_forward, gdn)
    ids = torch.tensor(ids_np)
    labels = torch.tensor(_shifted(ids_np))
    count = ids_np.shape[1] - 1

    def step() -> float:
        model.zero_grad(set_to_none=True)
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        loss = lm_loss_sum(hidden, model.lm_head.weight, labels) / count
        loss.backward()
        return float(loss.detach())

    x = torch.randn(1, ids_np.shape[1], model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    rope = model.model.rotary_emb(x, torch.arange(ids_np.shape[1])[None])
    blocks = model.model.layers
    parts = {
        "gdn": lambda h: blocks[0].linear_attn(h),
        "attention": lambda h: blocks[3].self_attn(h, position_embeddings=rope, attention_mask=None)[0],
        "mlp": lambda h: blocks[0].mlp(h),
        "norm": lambda h: blocks[0].input_layernorm(h),
        "loss": lambda h: lm_loss_sum(h, model.lm_head.weight, labels),
    }

    def run_part(fn: Any) -> Any:
        def call() -> None:
            model.zero_grad(set_to_none=True)
            h = x.clone().requires_grad_(True)
            out = fn(h)
            (out.sum() if out.ndim == 0 else (out * out).mean()).backward()

        return call

    return step, {name: run_part(fn) for name, fn in parts.items()}


def _ours_torch(layer_forward: Any, module: Any, hidden_states: Any, **kwargs: Any) -> Any:
    mask = kwargs.pop("attention_mask", None)
    unused = {k: v for k, v in kwargs.items() if v is not None and v is not False}
    if unused:
        raise ValueError(f"the profiled GDN layer takes no {sorted(unused)}")
    return layer_forward(module, hidden_states, mask)


def _shifted(ids_np: Any) -> Any:
    import numpy as np

    return np.append(ids_np[:, 1:], [[-100]], axis=1)


def mindspore_side(model_dir: Path, ids_np: Any) -> tuple[Any, dict[str, Any]]:
    import mindspore as ms
    import numpy as np

    from hyperpar_gdn.models.mindspore import Qwen3_5ForCausalLM
    from hyperpar_gdn.ops.lm_loss import lm_loss_sum
    from hyperpar_gdn.platform import get_platform

    get_platform("mindspore").init_distributed()  # PyNative, launch blocking, HP_MINDSPORE_THREADS
    model = Qwen3_5ForCausalLM.from_pretrained(model_dir)
    ids = ms.Tensor(ids_np)
    labels = ms.Tensor(_shifted(ids_np))
    count = ids_np.shape[1] - 1
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(
        lambda i: lm_loss_sum(model.final_hidden_states(i), model.head_weight, labels) / count, None, params
    )

    def step() -> float:
        loss, _ = grad_fn(ids)
        return float(loss.asnumpy())

    rng = np.random.default_rng(2)
    x = ms.Tensor(rng.standard_normal((1, ids_np.shape[1], model.config.hidden_size)).astype(np.float32))
    blocks = model.model.layers
    cells = {
        "gdn": blocks[0].linear_attn,
        "attention": blocks[3].self_attn,
        "mlp": blocks[0].mlp,
        "norm": blocks[0].input_layernorm,
    }

    def run_part(fn: Any, weights: list[Any]) -> Any:
        def scalar(h: Any) -> Any:
            out = fn(h)
            return out if out.ndim == 0 else (out * out).mean()

        part_grad = ms.value_and_grad(scalar, 0, weights)
        return lambda: part_grad(x)[0].asnumpy()

    parts = {name: run_part(cell, cell.trainable_params()) for name, cell in cells.items()}
    parts["loss"] = run_part(lambda h: lm_loss_sum(h, model.head_weight, labels), [model.head_weight])
    return step, parts


def op_profile(step: Any) -> dict[str, dict[str, float]]:
    """Exclusive seconds and calls per MindSporeOps function over one ``step()``."""
    from hyperpar_gdn.platform.mindspore_ops import MindSporeOps

    seconds: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    stack: list[float] = []  # time spent in children of each open call
    originals = {}
    for name, fn in vars(MindSporeOps).items():
        if callable(fn) and not name.startswith("__") and not isinstance(fn, staticmethod):
            originals[name] = fn

            def timed(*a: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
                stack.append(0.0)
                start = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    total = time.perf_counter() - start
                    children = stack.pop()
                    seconds[_name] += total - children
                    calls[_name] += 1
                    if stack:
                        stack[-1] += total

            setattr(MindSporeOps, name, timed)
    start = time.perf_counter()
    try:
        step()
    finally:
        for name, fn in originals.items():
            setattr(MindSporeOps, name, fn)
    wall = time.perf_counter() - start
    rows = {n: {"s": seconds[n], "calls": calls[n]} for n in sorted(seconds, key=seconds.get, reverse=True)}
    return {"step_s": wall, "in_functions_s": sum(seconds.values()), "functions": rows}


COUNTS = {"gdn": 3, "attention": 1, "mlp": 4, "norm": 9, "loss": 1}  # per step of the model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens T")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size of the model")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["step", "parts", "ops"], help="measurements to skip"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("results/profile_mindspore_step.json"), help="JSON to write"
    )
    args = parser.parse_args()
    import numpy as np

    ids_np = token_ids(args.seq_len, args.vocab, np)
    result: dict[str, Any] = {"seq_len": args.seq_len, "load_average_before": load_average()}
    with tempfile.TemporaryDirectory(prefix="profile_ms_") as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", args.vocab)
        t_step, t_parts = torch_side(model_dir, ids_np)
        m_step, m_parts = mindspore_side(model_dir, ids_np)
    rounds = dict(repeats=args.repeats, warmup=args.warmup)
    if "step" not in args.skip:
        losses = {"torch": t_step(), "mindspore": m_step()}
        times = alternating_rounds({"torch": t_step, "mindspore": m_step}, **rounds)
        med = {k: statistics.median(v) for k, v in times.items()}
        result["step"] = {
            "samples_s": times,
            "median_s": med,
            "mindspore_over_torch": med["mindspore"] / med["torch"],
            "loss": losses,
        }
        print(
            f"step T={args.seq_len}: torch {med['torch']:.2f}s MindSpore {med['mindspore']:.2f}s "
            f"ratio {med['mindspore'] / med['torch']:.2f}; losses {losses}"
        )
    if "parts" not in args.skip:
        calls = {}
        for name in COUNTS:
            calls[f"torch/{name}"], calls[f"mindspore/{name}"] = t_parts[name], m_parts[name]
        times = alternating_rounds(calls, **rounds)
        med = {k: statistics.median(v) for k, v in times.items()}
        result["parts"] = {"samples_s": times, "counts": COUNTS}
        total = sum(med[f"mindspore/{n}"] * c for n, c in COUNTS.items())
        print(f"{'part':<10}{'torch s':>9}{'ms s':>9}{'ratio':>7}{'ms share':>9}")
        for n, c in COUNTS.items():
            t, m = med[f"torch/{n}"], med[f"mindspore/{n}"]
            print(f"{n:<10}{t:>9.3f}{m:>9.3f}{m / t:>7.1f}{m * c / total:>9.2f}")
    if "ops" not in args.skip:
        result["ops"] = ops = op_profile(m_step)
        print(f"ops: step {ops['step_s']:.2f}s, inside TensorOps functions {ops['in_functions_s']:.2f}s")
        for name, row in list(ops["functions"].items())[:15]:
            print(f"  {name:<20}{row['s']:>8.3f}s{row['calls']:>7} calls")
    result["load_average_after"] = load_average()
    write_json(args.out, result)
    print(f"load average {result['load_average_before']} -> {result['load_average_after']}; wrote {args.out}")


if __name__ == "__main__":
    main()
