"""``bench_cp``'s measurements: one GDN layer under context parallelism, on each rank.

- :class:`LayerShape` and :func:`expected_bytes` (the traffic formulas of docs/modes.md).
- :func:`measure_step` (torch, a rank of :func:`benchkit.ranks.on_ranks`) and
  :func:`measure_step_mindspore` (a MindSpore msrun worker): median forward+backward time,
  activation memory (torch only: the distinct storages saved for backward, parameters
  excluded), peak RSS growth and the bytes the platform's collectives sent.
- :func:`measure_efficiency` (torch): per round, rank 0 times the whole sequence while the others
  wait at a barrier, then every rank times the plain layer on its shard side by side (``local``,
  no communication: the machine bound) and each mode's CP step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from benchkit.machine import peak_rss_bytes
from benchkit.timing import alternating_rounds

__all__ = [
    "LOCAL",
    "LayerShape",
    "expected_bytes",
    "measure_efficiency",
    "measure_step",
    "measure_step_mindspore",
]

LOCAL = "local"  # the efficiency run's plain layer on each shard, ranks side by side


@dataclass(frozen=True)
class LayerShape:
    batch: int = 1
    hidden: int = 512
    num_k_heads: int = 4
    num_v_heads: int = 4
    head_k_dim: int = 128
    head_v_dim: int = 128
    conv_kernel_size: int = 4

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def args(self) -> tuple[int, ...]:
        """The positional arguments of both frameworks' ``GatedDeltaNet``."""
        return (
            self.hidden,
            self.num_k_heads,
            self.num_v_heads,
            self.head_k_dim,
            self.head_v_dim,
            self.conv_kernel_size,
        )


def expected_bytes(mode: str, shape: LayerShape, *, seq_len: int, cp: int, rank: int, itemsize: int) -> int:
    """Bytes this rank sends in one forward+backward, from the formulas of docs/modes.md.

    Every mode: the shard lengths, one int64 to each other rank per forward.
    ulysses_hidden: forward, this rank's input shard to the cp-1 others and the partial sums of
    their tokens to them; backward the same bytes.
    ulysses: two all-to-alls each way; rank j receives the conv channels of its value heads and
    of the q/k heads they use (docs/modes.md).
    p2p: one fp32 state [B, H, K, V] forward (not from the last rank) and one backward (not from
    rank 0), plus the conv halo (W-1 tokens of C channels) each way.
    all_gather: the packed fp32 summary [B, H, K, V+K] to cp-1 peers forward, and its gradient
    to cp-1 peers backward (a reduce-scatter), plus the halo.
    """
    if cp == 1:
        return 0
    s = shape
    t_local = seq_len // cp
    lengths = 8 * (cp - 1)
    if mode == "ulysses_hidden":  # the shard to every other rank, the others' partial sums back
        per_direction = ((cp - 1) * t_local + seq_len - t_local) * s.hidden
        return 2 * s.batch * per_direction * itemsize + lengths
    if mode == "ulysses":
        hv, groups = s.num_v_heads // cp, s.num_v_heads // s.num_k_heads
        widths = [  # per rank j: its q/k heads' channels, its value heads' channels, beta and decay
            2 * s.head_k_dim * (((j + 1) * hv - 1) // groups - (j * hv) // groups + 1)
            + hv * (s.head_v_dim + 2)
            for j in range(cp)
        ]
        first = t_local * (sum(widths) - widths[rank]) + (seq_len - t_local) * widths[rank]
        second = (seq_len - t_local + (cp - 1) * t_local) * hv * s.head_v_dim
        return s.batch * (first + second) * itemsize + lengths
    halo = s.batch * (s.conv_kernel_size - 1) * s.conv_dim * itemsize
    halo_bytes = halo * ((rank < cp - 1) + (rank > 0))  # forward to rank+1, gradient to rank-1
    state = s.batch * s.num_v_heads * s.head_k_dim * s.head_v_dim * 4
    if mode == "p2p":
        return halo_bytes + state * ((rank < cp - 1) + (rank > 0)) + lengths
    packed = s.batch * s.num_v_heads * s.head_k_dim * (s.head_v_dim + s.head_k_dim) * 4
    return halo_bytes + 2 * packed * (cp - 1) + lengths


def config_row(
    backend: str, sweep: str, cp: int, threads: int, job: dict[str, Any], ranks: list[Any]
) -> dict[str, Any]:
    """One configuration's row: the slowest rank's time, the largest memory and traffic, the ranks."""
    slowest = max(ranks, key=lambda r: r["time_s"])
    activations = [r["activation_bytes"] for r in ranks]
    return {
        "backend": backend,
        "sweep": sweep,
        "mode": job["mode"],
        "cp": cp,
        "seq_len": job["seq_len"],
        "local_seq_len": job["seq_len"] // cp,
        "threads_per_rank": threads,
        "time_s": slowest["time_s"],
        "activation_bytes": None if activations[0] is None else max(activations),
        "peak_rss_growth_bytes": max(r["peak_rss_growth_bytes"] for r in ranks),
        "bytes_sent": max(r["bytes_sent"] for r in ranks),
        "expected_bytes": max(r["expected_bytes"] for r in ranks),
        "ranks": ranks,
    }


def _timed_steps(step: Any, job: dict[str, Any], comm: Any, cp: int) -> tuple[list[float], int]:
    """``job["repeats"]`` timed steps after the warm-up (ranks start each together); the times and
    the bytes sent per step."""
    for _ in range(job["warmup"]):
        step()
    comm.reset_bytes()
    barrier = (lambda: comm.barrier(None)) if cp > 1 else None
    times = alternating_rounds({"step": step}, repeats=job["repeats"], warmup=0, barrier=barrier)["step"]
    return times, comm.reset_bytes() // job["repeats"]


def _row(
    rank: int, cp: int, job: dict[str, Any], times: list[float], sent: int, **memory: Any
) -> dict[str, Any]:
    shape = LayerShape(**job["shape"])
    return {
        "rank": rank,
        "time_s": statistics.median(times),
        "times_s": times,
        **memory,
        "bytes_sent": sent,
        "expected_bytes": expected_bytes(
            job["mode"], shape, seq_len=job["seq_len"], cp=cp, rank=rank, itemsize=4
        ),
    }


def measure_step(rank: int, cp: int, job: dict[str, Any]) -> dict[str, Any]:
    """One rank of the torch layer in ``job["mode"]`` on ``job["seq_len"] / cp`` tokens."""
    import torch

    from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
    from hyperpar_gdn.models import GatedDeltaNet
    from hyperpar_gdn.platform import get_platform

    platform = get_platform()
    shape = LayerShape(**job["shape"])
    torch.manual_seed(0)
    layer = GatedDeltaNet(*shape.args)
    if cp > 1:
        mesh = init_device_mesh(platform.name, (cp,), mesh_dim_names=("cp",))
        LinearAttentionContextParallel(mode=job["mode"]).apply(layer, mesh)
    x = torch.randn(shape.batch, job["seq_len"] // cp, shape.hidden, requires_grad=True)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        layer(x).sum().backward()

    times, sent = _timed_steps(step, job, platform.collectives, cp)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    rss_before = peak_rss_bytes()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    out.sum().backward()
    growth = peak_rss_bytes() - rss_before
    return _row(
        rank, cp, job, times, sent, activation_bytes=sum(storages.values()), peak_rss_growth_bytes=growth
    )


def measure_step_mindspore(job: dict[str, Any]) -> dict[str, Any]:
    """One msrun worker's measurement of the MindSpore layer (no activation count: MindSpore has
    no saved-tensor hook)."""
    import mindspore as ms
    import numpy as np

    from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
    from hyperpar_gdn.models.mindspore import GatedDeltaNet
    from hyperpar_gdn.platform import get_platform

    platform = get_platform("mindspore")
    platform.init_distributed(timeout_s=job["timeout_s"])  # msrun's scheduler process stays in here
    rank, cp = platform.rank(), platform.world_size()
    shape = LayerShape(**job["shape"])
    platform.manual_seed(0)
    layer = GatedDeltaNet(*shape.args)
    if cp > 1:
        mesh = init_device_mesh("mindspore", (cp,), mesh_dim_names=("cp",))
        LinearAttentionContextParallel(mode=job["mode"]).apply(layer, mesh)
    rng = np.random.default_rng(rank)
    x = platform.from_numpy(rng.standard_normal((shape.batch, job["seq_len"] // cp, shape.hidden)))
    grad_fn = ms.value_and_grad(
        lambda inp: layer(inp).sum(), grad_position=0, weights=layer.trainable_params()
    )
    times, sent = _timed_steps(lambda: grad_fn(x), job, platform.collectives, cp)
    rss_before = peak_rss_bytes()
    grad_fn(x)
    growth = peak_rss_bytes() - rss_before
    platform.destroy()
    return _row(rank, cp, job, times, sent, activation_bytes=None, peak_rss_growth_bytes=growth)


def measure_efficiency(rank: int, cp: int, job: dict[str, Any]) -> dict[str, Any]:
    """Per round: rank 0's whole-sequence step on one thread (``single``), then every rank's
    ``local`` step and each mode's CP step, one thread each, separated by barriers. Returns the
    wall and CPU seconds of each after the warm-up: ``{name: [...], name/cpu: [...]}``."""
    import torch

    from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
    from hyperpar_gdn.models import GatedDeltaNet
    from hyperpar_gdn.platform import get_platform

    platform = get_platform()
    shape = LayerShape(**job["shape"])
    mesh = init_device_mesh(platform.name, (cp,), mesh_dim_names=("cp",))

    def make_layer() -> torch.nn.Module:
        torch.manual_seed(0)
        return GatedDeltaNet(*shape.args)

    def step(layer: torch.nn.Module, x: torch.Tensor) -> None:
        layer.zero_grad(set_to_none=True)
        layer(x).sum().backward()

    seq_len = job["seq_len"]
    x_whole = torch.randn(shape.batch, seq_len, shape.hidden, requires_grad=True)
    x_local = (
        x_whole.detach()[:, rank * seq_len // cp : (rank + 1) * seq_len // cp].clone().requires_grad_(True)
    )
    single = make_layer() if rank == 0 else None
    layers = {LOCAL: make_layer()}
    layers.update(
        (mode, LinearAttentionContextParallel(mode=mode).apply(make_layer(), mesh)) for mode in job["modes"]
    )
    calls: dict[str, Any] = {"single": (lambda: step(single, x_whole)) if single is not None else None}
    calls.update({name: (lambda layer=layer: step(layer, x_local)) for name, layer in layers.items()})
    barrier = platform.collectives.barrier
    return alternating_rounds(
        calls, repeats=job["repeats"], warmup=job["warmup"], barrier=lambda: barrier(None), cpu_time=True
    )
