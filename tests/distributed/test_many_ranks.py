"""Many ranks on one machine: one GDN layer (fp64, 8 value heads) on 16 forked gloo ranks (one
thread each, 8 tokens per rank, chunks of 4) in p2p, all_gather, scan and two levels (4 x 4),
head_tail and contiguous, packed documents crossing ranks and nodes: output shard, input
gradient and every parameter gradient (summed over the ranks) equal one device to 1e-10. Counted
per rank: scan's messages (rank 0 sends in ceil(log2 cp) forward rounds, the last rank in as
many backward rounds) and the summaries each state mode holds (all_gather's gathered tensor
grows with cp, scan's messages do not); printed with ``-s``.

The same worker runs at 32 (8 x 4) and 64 (8 x 8) ranks when ``HYPERPAR_MANY_RANKS=32,64`` is
set (once, on a quiet machine: docs/benchmarks.md records the run); CI runs 16."""

from __future__ import annotations

import copy
import math
import os
import time

import pytest
import torch
from distributed_harness import run_ranks

from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.models import GatedDeltaNet

TOL, PER_RANK = 1e-10, 8
INNER = {16: 4, 32: 4, 64: 8}  # two levels: 4 x 4, 8 x 4, 8 x 8
WORLDS = [16] + [int(w) for w in os.environ.get("HYPERPAR_MANY_RANKS", "").split(",") if w]


def _cases(world: int) -> list[tuple[str, int | None, str, tuple[int, ...] | None]]:
    t = world * PER_RANK
    docs = (0, 5, t // 3, t // 3 + 1, t - 7, t)  # short documents, one across many ranks
    inner = INNER[world]
    return [
        ("p2p", None, "contiguous", docs),
        ("all_gather", None, "head_tail", docs),
        ("all_gather", None, "contiguous", None),
        ("scan", None, "contiguous", docs),
        ("scan", None, "head_tail", None),
        ("ulysses+scan", inner, "head_tail", docs),
        ("ulysses+p2p", inner, "contiguous", None),
    ]


def _record(comm: object, log: list[tuple[str, int]]) -> None:
    """Log every send and all-gather of ``comm`` (kind, bytes) until the instance attributes go."""
    send, gather = comm.send, comm.all_gather

    def counted_send(x: torch.Tensor, dst: int, group: object) -> object:
        log.append(("send", x.numel() * x.element_size()))
        return send(x, dst, group)

    def counted_gather(x: torch.Tensor, group: object) -> object:
        log.append(("gather", x.numel() * x.element_size()))
        return gather(x, group)

    comm.send, comm.all_gather = counted_send, counted_gather


def _worker(rank: int, world: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    comm = mesh.platform.collectives
    torch.manual_seed(0)
    ours = GatedDeltaNet(32, 2, 8, 16, 8).double()
    t = world * PER_RANK
    errors, sends, held = {}, {}, {}
    for case, (mode, inner, layout, cu) in enumerate(_cases(world)):
        gen = torch.Generator().manual_seed(case)
        x, cot = (torch.randn(1, t, 32, generator=gen, dtype=torch.float64) for _ in range(2))
        x_ref = x.clone().requires_grad_(True)
        ref_layer = copy.deepcopy(ours)
        y = ref_layer(x_ref, cu_seqlens=None if cu is None else torch.tensor(cu))
        (y * cot).sum().backward()
        ref = {"output": y.detach(), "dx": x_ref.grad} | {n: p.grad for n, p in ref_layer.named_parameters()}
        index = torch.as_tensor(TokenLayout.of(layout, [PER_RANK] * world).positions(rank))
        style = LinearAttentionContextParallel(mode, chunk_size=4, inner_size=inner, layout=layout)
        layer = style.apply(copy.deepcopy(ours), mesh)
        log: list[tuple[str, int]] = []
        _record(comm, log)
        try:
            x_local = x[:, index].clone().requires_grad_(True)
            out = layer(x_local, cu_seqlens=None if cu is None else torch.tensor(cu))
            forward = list(log)
            (out * cot[:, index]).sum().backward()
        finally:
            del comm.send, comm.all_gather  # the instance attributes: the class's methods again
        got = {"output": out.detach(), "dx": x_local.grad}
        for n, p in layer.named_parameters():
            got[n] = comm.all_reduce_sum(p.grad.clone(), mesh.get_group())
        worst = 0.0
        for key, value in got.items():
            expected = ref[key][:, index] if key in ("output", "dx") else ref[key]
            worst = max(worst, ((value - expected).abs().max() / ref[key].abs().max()).item())
        name = f"{mode}/{layout}" + ("" if inner is None else f"/inner{inner}") + ("/docs" if cu else "")
        errors[name] = worst
        sends[name] = (
            sum(k == "send" for k, _ in forward),
            sum(k == "send" for k, _ in log) - sum(k == "send" for k, _ in forward),
        )
        # the summaries held at once: the largest all-gather of the forward (the summaries; the
        # conv halo's is smaller) times cp, or scan's largest message (three maps held)
        gathered = [b for k, b in forward if k == "gather"]
        sent = [b for k, b in forward if k == "send"]
        held[name] = max(gathered) * world if mode == "all_gather" and gathered else 3 * max(sent, default=0)
    return {"errors": errors, "sends": sends, "held": held}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"cp{w}")
def test_many_ranks_match_one_device(world: int) -> None:
    start = time.perf_counter()
    results = run_ranks(_worker, world, timeout_s=560)
    rounds = math.ceil(math.log2(world))
    for rank, result in enumerate(results):
        assert len(result["errors"]) == len(_cases(world)), sorted(result["errors"])
        for key, err in result["errors"].items():
            assert err <= TOL, f"cp={world} rank {rank} {key}: relative error {err:.2e} > {TOL:.0e}"
    scan = "scan/contiguous/docs"
    assert results[0]["sends"][scan][0] == rounds, results[0]["sends"][scan]  # rank 0: one send per round
    assert results[-1]["sends"][scan][1] == rounds, results[-1]["sends"][scan]  # the last rank, backward
    assert max(r["sends"][scan][0] for r in results) == rounds  # no rank sends in more rounds
    gathered = results[0]["held"]["all_gather/contiguous"]
    scanned = max(r["held"]["scan/contiguous/docs"] for r in results)
    summary = 8 * 16 * (8 + 16) * 8  # one packed map [S_ext | M]: 8 heads, K 16, V 8, fp64
    assert gathered == world * summary and scanned <= 3 * summary, (gathered, scanned)
    print(
        f"cp={world}: every case equals one device (worst {max(max(r['errors'].values()) for r in results):.1e}); "
        f"scan rounds {rounds}; summaries held per rank: all_gather {gathered} bytes, scan {scanned} bytes; "
        f"{time.perf_counter() - start:.0f} s"
    )
