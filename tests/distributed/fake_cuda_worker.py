"""One process that traces one rank of a cp = 8 run of a tiny transformers Qwen3.5 (one GDN and one
attention layer) on fake CUDA tensors with torch's fake process group, for every case asked, and
prints one JSON line per case (tests/distributed/test_fake_cuda_trace.py reads them; docs/
backends.md's trace table comes from ``--table``).

A case is a training step (forward, the loss's backward through the tracer's engine), a training
step on packed documents (``packed``: a model with two GDN layers, the second watched as ``gdn2``,
documents of DOC tokens that start inside the traced rank's shard), a prefill, or a prefill and one
decode step on the CP group, in one mode, layout and dtype. A model is built once under fake
tensors and parallelized, then restored, case after case. Run in a process of its
own: it joins a fake default process group and leaves it at exit.

    python tests/distributed/fake_cuda_worker.py --cases train:p2p:contiguous:bfloat16:3 ...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from benchkit.fake_trace import FakeCudaTrace  # noqa: E402
from hyperpar_gdn import apply_context_parallel, init_device_mesh, undo_context_parallel  # noqa: E402
from hyperpar_gdn.distributed.layout import TokenLayout  # noqa: E402
from hyperpar_gdn.platform.device_trace import trace_without_device  # noqa: E402

CP = 8
PIECE = 8  # tokens per rank: 4 per fragment in head_tail, above the conv halo of 3
VOCAB = 61
DOC = 10  # packed documents: a start inside rank 3's shard in both layouts (30; 50)
DIMS = {  # the GDN layer's: 4 q/k heads, 8 value heads (ulysses over 8 ranks), K = V = 8, conv 4
    "hidden_size": 32,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def config(layer_types: list[str]) -> Any:
    import transformers

    return transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        intermediate_size=48,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False,
        **DIMS,
    )


class SequenceValues:
    """The values of the model's once-per-forward host reads (fake tensors have none): the
    shard lengths and the sequence description the model's hooks gather (positions, padding,
    tokens, labelled positions), for a whole sequence of CP * PIECE distinct tokens (``packed``:
    positions that restart every DOC tokens)."""

    def __init__(self, layout: str, packed: bool) -> None:
        self.lengths = [PIECE] * CP
        self.tokens = TokenLayout.of(layout, self.lengths)
        self.packed = packed

    def __call__(self, x: torch.Tensor, where: str) -> np.ndarray:
        if "all_gather_int" in where:  # tolist() reads the gathered lengths one by one
            return np.array(PIECE)
        if x.dim() == 3:  # [channels, B, T]: the pieces in rank order
            positions = np.concatenate([self.tokens.positions(r) for r in range(CP)])
            rows = [
                positions % DOC if self.packed else positions,
                np.ones_like(positions),
                positions % VOCAB,
                np.ones_like(positions),
            ]
            return np.stack(rows[: x.shape[0]])[:, None, :]
        raise AssertionError(f"an unexpected host read of a {tuple(x.shape)} tensor at {where}")


def _dtype_checks(model: torch.nn.Module, failures: list[str]) -> None:
    """Every mixer returns its input's dtype (forward hooks, recorded in ``failures``)."""

    def check(module: Any, args: tuple, kwargs: dict, out: Any) -> None:
        x = args[0] if args else kwargs["hidden_states"]
        y = out[0] if isinstance(out, tuple) else out
        if y.dtype != x.dtype or y.device != x.device:
            failures.append(f"{type(module).__name__}: {x.dtype} on {x.device} -> {y.dtype} on {y.device}")

    for layer in model.model.layers:
        mixer = getattr(layer, "linear_attn", None) or layer.self_attn
        mixer.register_forward_hook(check, with_kwargs=True)


def watched_model(dtype: str, trace: FakeCudaTrace, *, packed: bool) -> Any:
    """The model of a case (packed: two GDN layers, ``gdn`` and ``gdn2``), its mixers watched."""
    import transformers

    types = ["linear_attention"] * (2 if packed else 1) + ["full_attention"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3_5ForCausalLM._from_config(config(types), dtype=getattr(torch, dtype))
    layers = model.model.layers
    for i, layer in enumerate(layers[:-1]):
        trace.watch(layer.linear_attn, "gdn" if i == 0 else f"gdn{i + 1}")
    trace.watch(layers[-1].self_attn, "attention")
    return model


def run_case(trace: FakeCudaTrace, model: Any, mesh: Any, case: dict, failures: list[str]) -> None:
    from hyperpar_gdn.inference.cp_decoding import decode_step_context_parallel, shard_cache
    from hyperpar_gdn.inference.prefill import prefill_context_parallel

    extra = {} if case["inner_size"] is None else {"inner_size": case["inner_size"]}
    trace.mark("setup")  # the ranks agree on the plan (one exchange, not per forward)
    apply_context_parallel(model, mesh, mode=case["mode"], layout=case["layout"], **extra)
    trace.mark("forward")
    applied = [True]
    try:
        if case["kind"] in ("train", "packed"):
            ids = torch.randint(0, VOCAB, (1, PIECE), device="cuda")
            out = model(input_ids=ids, labels=ids, cp_layout=case["layout"])
            if out.logits.dtype != model.dtype:
                failures.append(f"logits {out.logits.dtype} from a {model.dtype} model")
            trace.backward(out.loss)
            bad = [n for n, p in model.named_parameters() if p.grad is None or p.grad.dtype != p.dtype]
            if bad:
                failures.append(f"parameters without a gradient of their dtype: {bad}")
            model.zero_grad(set_to_none=True)
            return
        prompt = torch.randint(0, VOCAB, (1, CP * PIECE), device="cuda")
        logits, cache = prefill_context_parallel(model, mesh, prompt)
        if case["kind"] == "decode":
            undo_context_parallel(model)
            applied.clear()
            state = shard_cache(model, mesh, cache, length=CP * PIECE)
            trace.mark("decode")
            decode_step_context_parallel(model, mesh, state, logits.argmax(-1, keepdim=True))
    finally:
        if applied:
            undo_context_parallel(model)


OPS = {"alltoall_base_": "a2a", "_allgather_base_": "ag", "send": "send", "allreduce_": "ar"}


def table(lines: list[dict]) -> str:
    """docs/backends.md's table from training cases traced on several ranks (one dtype): per mode
    and layout, the GDN layer's collectives (rank 3) and the bytes each traced rank sends beside
    the cost model's for that rank and its worst rank; the attention layer's bytes; host reads."""
    from hyperpar_gdn.planning.cost_model import MACHINES, Geometry, mode_cost, rank_bytes_sent

    ranks = sorted({c["rank"] for c in lines})
    head = ["mode", "layout", "GDN collectives fwd / bwd (rank 3)"]
    head += [f"rank {r}: traced / model" for r in ranks] + [
        "model worst rank",
        "attention (each rank)",
        "host reads in layers",
    ]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    keys = sorted({(c["mode"], c["layout"], c["inner_size"]) for c in lines}, key=str)
    for mode, layout, inner in keys:
        mine = {
            c["rank"]: c for c in lines if (c["mode"], c["layout"], c["inner_size"]) == (mode, layout, inner)
        }
        e = 2 if mine[ranks[0]]["dtype"] == "bfloat16" else 4
        g = Geometry(CP * PIECE, CP, DIMS["linear_num_key_heads"], DIMS["linear_num_value_heads"],
                     DIMS["linear_key_head_dim"], DIMS["linear_value_head_dim"], DIMS["linear_conv_kernel_dim"],
                     1, e, head_tail=layout == "head_tail", hidden=DIMS["hidden_size"])  # fmt: skip

        def ops(case: dict, phase: str) -> str:
            names = [
                OPS[c[0]] for c in case["collectives"] if c[1] == "gdn" and c[2] == phase and c[0] in OPS
            ]
            return " ".join(f"{names.count(n)} {n}" for n in dict.fromkeys(names)) or "-"

        name = mode if inner is None else f"{mode} (inner {inner})"
        middle = mine.get(3, mine[ranks[0]])
        cells = [name, layout, f"{ops(middle, 'forward')} / {ops(middle, 'backward')}"]
        for r in ranks:
            sent = sum(c[3] for c in mine[r]["collectives"] if c[1] == "gdn")
            cells.append(f"{sent} / {rank_bytes_sent(mode, g, r, inner_size=inner):.0f}")
        cells.append(f"{mode_cost(mode, g, MACHINES['gpu'], inner_size=inner).bytes_sent:.0f}")
        cells.append(str(sum(c[3] for c in middle["collectives"] if c[1] == "attention")))
        cells.append(str(sum(len([r for r in c["reads"] if r[1] != "model"]) for c in mine.values())))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", required=True, help="kind:mode:layout:dtype:rank[:inner_size]")
    parser.add_argument("--table", action="store_true", help="print docs/backends.md's table, not JSON lines")
    args = parser.parse_args(argv)
    cases = []
    for text in args.cases:
        kind, mode, layout, dtype, rank, *inner = text.split(":")
        cases.append(dict(kind=kind, mode=mode, layout=layout, dtype=dtype, rank=int(rank),
                          inner_size=int(inner[0]) if inner else None))  # fmt: skip
    results: list[dict] = []
    for rank in sorted({c["rank"] for c in cases}):
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=CP)
        for dtype, packed in sorted(
            {(c["dtype"], c["kind"] == "packed") for c in cases if c["rank"] == rank}
        ):
            mine = [
                c for c in cases if (c["rank"], c["dtype"], c["kind"] == "packed") == (rank, dtype, packed)
            ]
            current: dict = {}
            values = {layout: SequenceValues(layout, packed) for layout in ("contiguous", "head_tail")}
            trace = FakeCudaTrace(lambda x, where, v=values, c=current: v[c["layout"]](x, where))
            with trace_without_device("cuda"), trace.active():
                model = watched_model(dtype, trace, packed=packed)
                mesh = init_device_mesh("cuda", (CP,), mesh_dim_names=("cp",))
                # as init_distributed sets it when it makes the group (the fake one exists already)
                mesh.platform.collectives.timeout = timedelta(seconds=60)
                failures: list[str] = []
                _dtype_checks(model, failures)
                for case in mine:
                    current.update(case)
                    failures.clear()
                    trace.reset()
                    start = time.process_time()
                    try:
                        run_case(trace, model, mesh, case, failures)
                        error = None
                    except Exception as err:  # reported, the next case runs
                        error = f"{type(err).__name__}: {err}"
                    line = case | trace.summary() | {
                        "error": error, "failures": failures, "cpu_seconds": time.process_time() - start,
                    }  # fmt: skip
                    results.append(line)
                    if not args.table:
                        print(json.dumps(line), flush=True)
        dist.destroy_process_group()
    if args.table:
        print(table(results))


if __name__ == "__main__":
    main()
