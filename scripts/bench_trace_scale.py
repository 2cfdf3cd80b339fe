"""One rank at a time of a cp = 128 to 1024 step, traced on fake CUDA tensors: bytes and messages.

For Qwen3.5-27B's GDN geometry (hidden 5120, 16 q/k and 48 value heads of 128, bf16; 128 tokens
per rank) one GDN layer's forward and backward runs on one rank under torch's fake process group
(:mod:`benchkit.fake_trace`: shapes and call sequences real, no values moved) for ranks 0, cp/2
and cp - 1 in p2p, all_gather and scan (contiguous shards). Per rank: the bytes the layer sends
and its messages (sends; a collective counts once), beside the cost model's
:func:`~hyperpar_gdn.planning.cost_model.rank_bytes_sent`, and the summaries it receives
(the state it holds: all_gather's gathered tensor, scan's and p2p's largest message)::

    PYTHONPATH=. python scripts/bench_trace_scale.py --cps 128 256 1024 --out bench_trace_scale
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from benchkit.fake_trace import FakeCudaTrace
from benchkit.output import write_json
from hyperpar_gdn.cli import HelpFormatter
from hyperpar_gdn.planning.cost_model import Geometry, rank_bytes_sent
from hyperpar_gdn.planning.plan import STATE_MODES
from hyperpar_gdn.platform.device_trace import trace_without_device

HEADS = {"hidden_size": 5120, "num_k_heads": 16, "num_v_heads": 48, "head_k_dim": 128, "head_v_dim": 128}
PER_RANK = 128


def trace_rank(cp: int, rank: int, modes: tuple[str, ...]) -> list[dict]:
    """Every mode's counts on one rank of a cp-rank group (one fake process group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
    from hyperpar_gdn.models import GatedDeltaNet

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
    rows = []
    try:
        trace = FakeCudaTrace(lambda x, where: np.array(PER_RANK))  # the lengths' exchange
        with trace_without_device("cuda"), trace.active():
            mesh = init_device_mesh("cuda", (cp,), mesh_dim_names=("cp",))
            for mode in modes:
                default = torch.get_default_dtype()
                torch.set_default_dtype(torch.bfloat16)
                try:
                    with torch.device("cuda"):
                        layer = GatedDeltaNet(*HEADS.values())
                finally:
                    torch.set_default_dtype(default)
                LinearAttentionContextParallel(mode).apply(layer, mesh)
                trace.reset()
                start = time.process_time()
                x = torch.randn(1, PER_RANK, HEADS["hidden_size"], device="cuda", dtype=torch.bfloat16)
                trace.backward(layer(x.requires_grad_(True)).float().sum())
                # a layer used alone exchanges the shard lengths itself (int64, read on the host,
                # answered above): left out, as the cost model leaves it out
                step = [c for c in trace.collectives if c.dtype != torch.int64]
                summaries = [c for c in step if c.dtype == torch.float32 and c.phase == "forward"]
                largest = max((int(np.prod(c.shape)) * 4 * (c.group_size if c.op == "_allgather_base_" else 1)
                               for c in summaries), default=0)  # fmt: skip
                g = Geometry(cp * PER_RANK, cp, *(HEADS[k] for k in list(HEADS)[1:]), 4, 1, 2)
                rows.append(
                    {"cp": cp, "rank": rank, "mode": mode, "bytes": sum(c.nbytes for c in step)}
                    | {"predicted_bytes": rank_bytes_sent(mode, g, rank)}
                    | {
                        "messages": sum(1 for c in step if c.op != "recv_"),
                        "sends": sum(c.op == "send" for c in step),
                    }
                    | {"largest_summary_bytes": largest, "cpu_seconds": time.process_time() - start}
                )
    finally:
        dist.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument(
        "--cps", type=int, nargs="+", default=[128, 256, 1024], help="CP sizes to trace (ranks 0, cp/2, cp-1)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("bench_trace_scale"), help="folder for trace_scale.json"
    )
    args = parser.parse_args()
    rows: list[dict] = []
    for cp in args.cps:
        for rank in (0, cp // 2, cp - 1):
            rows += trace_rank(cp, rank, STATE_MODES)
            write_json(args.out / "trace_scale.json", rows)
    print(
        f"{'cp':>5} {'rank':>5} {'mode':<11} {'bytes':>12} {'model':>12} {'messages':>8} {'sends':>5} {'held MiB':>9}"
    )
    for r in rows:
        print(
            f"{r['cp']:>5} {r['rank']:>5} {r['mode']:<11} {r['bytes']:>12} {r['predicted_bytes']:>12.0f} "
            f"{r['messages']:>8} {r['sends']:>5} {r['largest_summary_bytes'] / 2**20:>9.1f}"
        )


if __name__ == "__main__":
    main()
