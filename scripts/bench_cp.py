"""Benchmark the context-parallel modes against one device: time, memory and traffic per rank.

For each mode and cp in --cp-sizes, ranks are forked processes in a real gloo group (on this
machine; the same code runs on cuda/npu through HP_PLATFORM with torchrun-style launching left
to the user). Two sweeps:

- fixed total T (``--seq-len``): each rank holds T/cp tokens; speed-up over cp=1 is the point.
- fixed local T (``--local-seq-len``): each rank holds the same tokens whatever cp; the cost of CP.

And parallel efficiency with one core per rank (``--efficiency-cp``, 2 by
default; ``--efficiency-cp 0`` skips it): the layer on the whole sequence (``--seq-len``) in one
process with 1 thread against ``cp`` ranks of 1 thread each holding T/cp tokens, timed
alternately in one run: the same ``cp`` processes take turns, rank 0 timing the whole sequence
while the others wait at a barrier, then all ranks timing a CP step of each mode in turn. Per mode it reports the
speedup (median single time / median over rounds of the slowest rank's CP time) and the parallel
efficiency (speedup / cp), printed and saved under ``efficiency`` in the JSON.

Threads: ``--total-threads`` is split evenly over the ranks (cp=1 gets all of them), so every
run uses the same machine. Per rank and configuration it records the median forward+backward
time over ``--repeats`` (after a warm-up), the activation memory (bytes of the distinct storages saved
for backward, parameters excluded, counted by a saved-tensor hook), the peak RSS growth of the process during the step,
and the bytes the platform's collectives sent, next to the formulas of docs/modes.md
(:func:`expected_bytes`). Results: JSON (``--out``) and a PNG plot beside it.

``--backend mindspore`` (or ``--backend torch mindspore``) times the MindSpore layer too: its ranks
are MCCL workers started by ``msrun`` (cp=1: one plain process), each running this script in
worker mode; the same rows get ``backend="mindspore"``. MindSpore has no saved-tensor hook, so
its activation memory is not measured (``None``); time, RSS growth and bytes sent are.

Every process keeps freed host memory in its heap
(:func:`hyperpar_gdn.platform.host_memory.keep_freed_host_memory`), the single-device runs included,
unless ``--glibc-malloc-defaults``; ``freed_host_memory_kept`` in the JSON records which.

Usage: ``python scripts/bench_cp.py [--seq-len 8192 --local-seq-len 2048 --cp-sizes 1 2 4]
[--backend torch mindspore]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hyperpar_gdn.cli import HelpFormatter
from hyperpar_gdn.platform.host_memory import keep_freed_host_memory

MODES = ("ulysses", "p2p", "all_gather")
LOCAL = "local"  # the efficiency run's plain layer on each shard, ranks side by side
EFFICIENCY_TARGETS = {"ulysses": 0.9, "p2p": 0.85, "all_gather": 0.85}  # cp=2, one core per rank
BACKENDS = ("torch", "mindspore")


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
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim


def expected_bytes(mode: str, shape: LayerShape, *, seq_len: int, cp: int, rank: int, itemsize: int) -> int:
    """Bytes this rank sends in one forward+backward, from the formulas of docs/modes.md.

    Every mode: the shard lengths, one int64 to each other rank per forward.
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


def _rank_main(rank: int, cp: int, port: int, threads: int, job: dict[str, Any], queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(cp),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(threads),
        HP_PLATFORM=os.environ.get("HP_PLATFORM", "cpu"),
    )
    try:
        import torch

        torch.set_num_threads(threads)
        queue.put((rank, "ok", _measure(rank, cp, job)))
    except BaseException:  # report to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))


def _measure(rank: int, cp: int, job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
    from hyperpar_gdn.models import GatedDeltaNet
    from hyperpar_gdn.platform import get_platform

    platform = get_platform()
    platform.init_distributed(timeout_s=300)
    shape = LayerShape(**job["shape"])
    torch.manual_seed(0)
    layer = GatedDeltaNet(
        shape.hidden,
        shape.num_k_heads,
        shape.num_v_heads,
        shape.head_k_dim,
        shape.head_v_dim,
        shape.conv_kernel_size,
    )
    if cp > 1:
        mesh = init_device_mesh(platform.name, (cp,), mesh_dim_names=("cp",))
        LinearAttentionContextParallel(mode=job["mode"]).apply(layer, mesh)
    t_local = job["seq_len"] // cp
    x = torch.randn(shape.batch, t_local, shape.hidden, requires_grad=True)
    comm = platform.collectives

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        layer(x).sum().backward()

    for _ in range(job["warmup"]):
        step()
    comm.reset_bytes()
    times = []
    for _ in range(job["repeats"]):
        if cp > 1:
            platform.collectives.barrier(None)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    bytes_sent = comm.reset_bytes() // job["repeats"]

    # activations: distinct storages saved for backward, parameters excluded
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    out.sum().backward()
    rss_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024
    platform.destroy()
    return {
        "rank": rank,
        "time_s": statistics.median(times),
        "times_s": times,
        "activation_bytes": sum(storages.values()),
        "peak_rss_growth_bytes": rss_growth,
        "bytes_sent": bytes_sent,
        "expected_bytes": expected_bytes(
            job["mode"], shape, seq_len=job["seq_len"], cp=cp, rank=rank, itemsize=4
        ),
    }


def _efficiency_main(rank: int, cp: int, port: int, job: dict[str, Any], queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(cp),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        HP_PLATFORM=os.environ.get("HP_PLATFORM", "cpu"),
    )
    try:
        import torch

        torch.set_num_threads(1)
        queue.put((rank, "ok", _measure_efficiency(rank, cp, job)))
    except BaseException:  # report to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))


def _measure_efficiency(rank: int, cp: int, job: dict[str, Any]) -> dict[str, Any]:
    """Per round: rank 0's time for the whole sequence on one thread (single), then for each mode
    every rank's time for its CP step (1 thread each), separated by barriers."""
    import torch

    from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
    from hyperpar_gdn.models import GatedDeltaNet
    from hyperpar_gdn.platform import get_platform

    platform = get_platform()
    platform.init_distributed(timeout_s=600)
    comm = platform.collectives
    shape = LayerShape(**job["shape"])
    mesh = init_device_mesh(platform.name, (cp,), mesh_dim_names=("cp",))

    def make_layer() -> torch.nn.Module:
        torch.manual_seed(0)
        return GatedDeltaNet(
            shape.hidden,
            shape.num_k_heads,
            shape.num_v_heads,
            shape.head_k_dim,
            shape.head_v_dim,
            shape.conv_kernel_size,
        )

    def step(layer: torch.nn.Module, x: torch.Tensor) -> None:
        layer.zero_grad(set_to_none=True)
        layer(x).sum().backward()

    seq_len = job["seq_len"]
    x_whole = torch.randn(shape.batch, seq_len, shape.hidden, requires_grad=True)
    x_local = (
        x_whole.detach()[:, rank * seq_len // cp : (rank + 1) * seq_len // cp].clone().requires_grad_(True)
    )
    single = make_layer() if rank == 0 else None
    # LOCAL: the plain layer on this rank's shard, all ranks at once and no communication: what
    # cp processes side by side cost on this machine, the floor under any mode's CP step.
    layers = {LOCAL: make_layer()}
    layers.update(
        (mode, LinearAttentionContextParallel(mode=mode).apply(make_layer(), mesh)) for mode in job["modes"]
    )
    # Every round times the single run, the local step and every mode's CP step, so that load from
    # other processes on a shared machine falls on all of them alike.
    single_times, single_cpu = [], []
    cp_times: dict[str, list[float]] = {mode: [] for mode in layers}
    cp_cpu: dict[str, list[float]] = {mode: [] for mode in layers}
    for _ in range(job["warmup"] + job["repeats"]):
        comm.barrier(None)
        if single is not None:
            start, start_cpu = time.perf_counter(), time.process_time()
            step(single, x_whole)
            single_times.append(time.perf_counter() - start)
            single_cpu.append(time.process_time() - start_cpu)
        for mode, layer in layers.items():
            comm.barrier(None)
            start, start_cpu = time.perf_counter(), time.process_time()
            step(layer, x_local)
            cp_times[mode].append(time.perf_counter() - start)
            cp_cpu[mode].append(time.process_time() - start_cpu)
    skip = job["warmup"]
    out: dict[str, Any] = {"rank": rank}
    for mode in layers:
        out[mode] = {
            "single_s": single_times[skip:],
            "cp_s": cp_times[mode][skip:],
            "single_cpu_s": single_cpu[skip:],
            "cp_cpu_s": cp_cpu[mode][skip:],
        }
    platform.destroy()
    return out


def run_efficiency(cp: int, job: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
    """Parallel efficiency at ``cp`` ranks of one thread each against one thread, per mode."""
    results = _fork_ranks(_efficiency_main, cp, (job,), timeout_s=timeout_s)
    rounds = len(results[0][LOCAL]["single_s"])
    local = [max(results[r][LOCAL]["cp_s"][i] for r in range(cp)) for i in range(rounds)]
    rows = {}
    for mode in job["modes"]:
        single = results[0][mode]["single_s"]
        per_round = [max(results[r][mode]["cp_s"][i] for r in range(cp)) for i in range(rounds)]
        speedup = statistics.median(single) / statistics.median(per_round)
        rows[mode] = {
            "cp": cp,
            "seq_len": job["seq_len"],
            "threads_per_rank": 1,
            "single_s": statistics.median(single),
            "cp_slowest_rank_s": statistics.median(per_round),
            "speedup": speedup,
            "parallel_efficiency": speedup / cp,
            # the fastest round of each: less sensitive to other processes' load on a shared machine
            "speedup_best_rounds": min(single) / min(per_round),
            "parallel_efficiency_best_rounds": min(single) / min(per_round) / cp,
            # process CPU time instead of wall time: blind to other processes' load, and to time a
            # rank spends blocked waiting for a peer (communication latency), so an upper bound
            "parallel_efficiency_cpu_time": statistics.median(results[0][mode]["single_cpu_s"])
            / statistics.median(
                [max(results[r][mode]["cp_cpu_s"][i] for r in range(cp)) for i in range(len(single))]
            )
            / cp,
            "target_efficiency": EFFICIENCY_TARGETS[mode],
            # cp plain layers on their shards side by side, no communication (slowest rank): the
            # efficiency this machine allows (single / (cp x local)), and the CP step over it
            "local_side_by_side_s": statistics.median(local),
            "machine_bound_efficiency": statistics.median(single) / statistics.median(local) / cp,
            "cp_over_local": statistics.median([c / lo for c, lo in zip(per_round, local, strict=True)]),
            "single_samples_s": single,
            "cp_slowest_rank_samples_s": per_round,
            "cp_samples_s_per_rank": [results[r][mode]["cp_s"] for r in range(cp)],
            "single_cpu_samples_s": results[0][mode]["single_cpu_s"],
            "cp_cpu_samples_s_per_rank": [results[r][mode]["cp_cpu_s"] for r in range(cp)],
            "local_side_by_side_samples_s": local,
        }
    return rows


def print_efficiency(rows: dict[str, Any]) -> None:
    print(
        f"{'mode':<11}{'cp':>3}{'T':>7}{'1 thread s':>12}{'cp ranks s':>12}{'speed-up':>10}"
        f"{'efficiency':>12}{'target':>8}{'best rounds':>13}{'CPU time':>10}{'local s':>9}{'bound':>7}"
        f"{'cp/local':>10}"
    )
    for mode, r in rows.items():
        print(
            f"{mode:<11}{r['cp']:>3}{r['seq_len']:>7}{r['single_s']:>12.3f}{r['cp_slowest_rank_s']:>12.3f}"
            f"{r['speedup']:>10.2f}{r['parallel_efficiency']:>12.3f}{r['target_efficiency']:>8.2f}"
            f"{r['parallel_efficiency_best_rounds']:>13.3f}{r['parallel_efficiency_cpu_time']:>10.3f}"
            f"{r['local_side_by_side_s']:>9.3f}{r['machine_bound_efficiency']:>7.3f}{r['cp_over_local']:>10.3f}"
        )
    print(
        "efficiency = speed-up / cp; speed-up = median single time / median over rounds of the slowest "
        "rank's time (best rounds: fastest round of each; CPU time: process CPU time instead of wall "
        "time, an upper bound blind to load and to waits); local: the plain layer on each shard, all "
        "ranks at once, no communication (bound = single / (cp x local), what the machine allows; "
        f"cp/local: the CP step over it, per round); load average now {os.getloadavg()[0]:.2f}"
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_job(cp: int, total_threads: int, job: dict[str, Any], *, timeout_s: float) -> list[dict[str, Any]]:
    """Run one configuration on ``cp`` forked ranks; per-rank results in rank order."""
    return _fork_ranks(_rank_main, cp, (max(1, total_threads // cp), job), timeout_s=timeout_s)


def _fork_ranks(target: Any, cp: int, args: tuple, *, timeout_s: float) -> list[dict[str, Any]]:
    """Fork ``cp`` ranks running ``target(rank, cp, port, *args, queue)``; their results in rank
    order (a failing rank raises with its traceback; a stuck one is killed after ``timeout_s``)."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, cp, port, *args, queue)) for r in range(cp)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(results) < cp:
            rank, status, payload = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(cp)]


# --- MindSpore: msrun workers (MCCL on CPU) ------------------------------------------------------


def _measure_mindspore(job: dict[str, Any], threads: int) -> dict[str, Any]:
    """One rank's measurement of the MindSpore layer (the worker mode of this script)."""
    import mindspore as ms
    import numpy as np

    from hyperpar_gdn import LinearAttentionContextParallel, init_device_mesh
    from hyperpar_gdn.models.mindspore import GatedDeltaNet
    from hyperpar_gdn.platform import get_platform

    platform = get_platform("mindspore")
    platform.init_distributed(timeout_s=300)  # msrun's scheduler process stays in here
    ms.set_context(runtime_num_threads=threads)
    rank, cp = platform.rank(), platform.world_size()
    shape = LayerShape(**job["shape"])
    platform.manual_seed(0)
    layer = GatedDeltaNet(
        shape.hidden,
        shape.num_k_heads,
        shape.num_v_heads,
        shape.head_k_dim,
        shape.head_v_dim,
        shape.conv_kernel_size,
    )
    if cp > 1:
        mesh = init_device_mesh("mindspore", (cp,), mesh_dim_names=("cp",))
        LinearAttentionContextParallel(mode=job["mode"]).apply(layer, mesh)
    t_local = job["seq_len"] // cp
    x = platform.from_numpy(np.random.default_rng(rank).standard_normal((shape.batch, t_local, shape.hidden)))
    grad_fn = ms.value_and_grad(
        lambda inp: layer(inp).sum(), grad_position=0, weights=layer.trainable_params()
    )
    comm = platform.collectives

    for _ in range(job["warmup"]):
        grad_fn(x)
    comm.reset_bytes()
    times = []
    for _ in range(job["repeats"]):
        if cp > 1:
            comm.barrier(None)
        start = time.perf_counter()
        grad_fn(x)
        times.append(time.perf_counter() - start)
    bytes_sent = comm.reset_bytes() // job["repeats"]
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grad_fn(x)
    rss_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024
    platform.destroy()
    return {
        "rank": rank,
        "time_s": statistics.median(times),
        "times_s": times,
        "activation_bytes": None,
        "peak_rss_growth_bytes": rss_growth,
        "bytes_sent": bytes_sent,
        "expected_bytes": expected_bytes(
            job["mode"], shape, seq_len=job["seq_len"], cp=cp, rank=rank, itemsize=4
        ),
    }


def _mindspore_worker(job_path: Path, out_dir: Path, threads: int) -> None:
    job = json.loads(job_path.read_text())
    if job["keep_host_memory"]:
        keep_freed_host_memory()
    result = _measure_mindspore(job, threads)
    (out_dir / f"rank{result['rank']}.json").write_text(json.dumps(result))


def run_job_mindspore(
    cp: int, total_threads: int, job: dict[str, Any], *, timeout_s: float
) -> list[dict[str, Any]]:
    """Run one configuration on ``cp`` msrun workers (cp=1: one process without a launcher);
    per-rank results in rank order."""
    threads = max(1, total_threads // cp)
    work = Path(tempfile.mkdtemp(prefix="bench-cp-ms-"))
    try:
        job_path, out_dir = work / "job.json", work / "out"
        out_dir.mkdir()
        job_path.write_text(json.dumps(job))
        worker = [
            str(Path(__file__).resolve()),
            "--worker-job",
            str(job_path),
            "--worker-out",
            str(out_dir),
            "--total-threads",
            str(threads),
        ]
        if cp == 1:
            command = [sys.executable, *worker]
        else:
            command = [
                sys.executable,
                "-m",
                "mindspore.parallel.cluster.run",
                f"--worker_num={cp}",
                f"--local_worker_num={cp}",
                "--master_addr=127.0.0.1",
                f"--master_port={_free_port()}",
                "--join=True",
                f"--log_dir={work / 'logs'}",
                *worker,
            ]
        env = {
            **os.environ,
            "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
            "HP_PLATFORM": "mindspore",
            "OMP_NUM_THREADS": str(threads),
            "GLOG_v": os.environ.get("GLOG_v", "3"),
        }
        with open(work / "launcher.log", "w") as log:
            proc = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)  # msrun kills its workers on SIGINT
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        results = [out_dir / f"rank{r}.json" for r in range(cp)]
        if proc.returncode != 0 or not all(path.exists() for path in results):
            logs = [(work / "launcher.log").read_text()[-4000:]]
            for path in sorted((work / "logs").glob("*.log")) if (work / "logs").exists() else []:
                logs.append(f"--- {path.name}\n" + path.read_text()[-4000:])
            raise RuntimeError(f"MindSpore cp={cp} failed (exit code {proc.returncode}):\n" + "\n".join(logs))
        return [json.loads(path.read_text()) for path in results]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def summarize(rows: list[dict[str, Any]]) -> None:
    base = {(r["backend"], r["sweep"], r["mode"]): r for r in rows if r["cp"] == 1}
    print(
        f"{'backend':<11}{'sweep':<12}{'mode':<11}{'cp':>3}{'T/cp':>7}{'time/rank s':>13}{'speed-up':>10}"
        f"{'act MiB':>10}{'act ratio':>11}{'sent KiB':>11}{'expected':>11}"
    )
    for r in rows:
        b = base.get((r["backend"], r["sweep"], r["mode"]))
        r["speedup_vs_cp1"] = b["time_s"] / r["time_s"] if b else None
        measured = b is not None and r["activation_bytes"] is not None and b["activation_bytes"]
        r["activation_ratio_vs_cp1"] = r["activation_bytes"] / b["activation_bytes"] if measured else None
        activation = "-" if r["activation_bytes"] is None else f"{r['activation_bytes'] / 2**20:.1f}"
        print(
            f"{r['backend']:<11}{r['sweep']:<12}{r['mode']:<11}{r['cp']:>3}{r['local_seq_len']:>7}"
            f"{r['time_s']:>13.3f}{(r['speedup_vs_cp1'] or 0):>10.2f}{activation:>10}"
            f"{(r['activation_ratio_vs_cp1'] or 0):>11.3f}{r['bytes_sent'] / 1024:>11.1f}"
            f"{r['expected_bytes'] / 1024:>11.1f}"
        )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    backends = sorted({r["backend"] for r in rows})
    for sweep, ax in zip(("fixed_total", "fixed_local"), axes[:2], strict=True):
        for backend in backends:
            for mode in MODES:
                pts = sorted(
                    (r["cp"], r["time_s"])
                    for r in rows
                    if r["backend"] == backend and r["sweep"] == sweep and r["mode"] == mode
                )
                if pts:
                    label = mode if len(backends) == 1 else f"{backend} {mode}"
                    ax.plot(*zip(*pts, strict=True), marker="o", label=label)
        ax.set(
            xlabel="cp",
            ylabel="forward+backward s (slowest rank)",
            title=f"time, {sweep.replace('_', ' ')} T",
        )
        ax.legend()
    for mode in MODES:
        pts = sorted(
            (r["cp"], r["activation_bytes"] / 2**20)
            for r in rows
            if r["sweep"] == "fixed_total" and r["mode"] == mode and r["activation_bytes"] is not None
        )
        if pts:
            axes[2].plot(*zip(*pts, strict=True), marker="o", label=mode)
    axes[2].set(xlabel="cp", ylabel="MiB per rank", title="activation memory, fixed total T")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--seq-len", type=int, default=8192, help="total T of the fixed-total sweep")
    parser.add_argument(
        "--local-seq-len", type=int, default=2048, help="T/cp of the fixed-local sweep (0: skip)"
    )
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2, 4], help="CP sizes of both sweeps")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="CP modes to time")
    parser.add_argument(
        "--total-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="threads split over the ranks (default: the machine's cores)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--batch", type=int, default=1, help="sequences B per step")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    parser.add_argument(
        "--out", type=Path, default=Path("results/bench_cp.json"), help="JSON file of the results"
    )
    parser.add_argument(
        "--backend", nargs="+", default=["torch"], choices=BACKENDS, help="frameworks to time, in turn"
    )
    parser.add_argument(
        "--efficiency-cp", type=int, default=2, help="ranks of the one-core-per-rank efficiency run (0: skip)"
    )
    parser.add_argument(
        "--efficiency-repeats", type=int, default=5, help="timed rounds of the efficiency run"
    )
    parser.add_argument("--skip-sweeps", action="store_true", help="only the efficiency run")
    parser.add_argument("--worker-job", type=Path, help=argparse.SUPPRESS)  # MindSpore worker mode
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--glibc-malloc-defaults",
        action="store_true",
        help="leave glibc's malloc settings alone (default: keep_freed_host_memory() in every process)",
    )
    args = parser.parse_args()
    if args.worker_job is not None:
        _mindspore_worker(args.worker_job, args.worker_out, args.total_threads)
        return
    kept = False if args.glibc_malloc_defaults else keep_freed_host_memory()  # forked ranks inherit it

    shape = LayerShape(batch=args.batch)
    sweeps = [("fixed_total", args.seq_len, None)]
    if args.local_seq_len:
        sweeps.append(("fixed_local", None, args.local_seq_len))
    efficiency = None
    if args.efficiency_cp > 1 and "torch" in args.backend:
        job = {
            "modes": args.modes,
            "seq_len": args.seq_len,
            "shape": asdict(shape),
            "repeats": args.efficiency_repeats,
            "warmup": args.warmup,
        }
        efficiency = run_efficiency(args.efficiency_cp, job, timeout_s=args.timeout)
        print_efficiency(efficiency)
    if args.skip_sweeps:
        sweeps = []
    rows = []
    for backend, (sweep, total, local) in ((b, sweep) for b in args.backend for sweep in sweeps):
        run = run_job if backend == "torch" else run_job_mindspore
        for mode in args.modes:
            for cp in args.cp_sizes:
                seq_len = total if total is not None else local * cp
                if seq_len % cp:
                    raise SystemExit(f"--seq-len {seq_len} is not divisible by cp={cp}")
                job = {
                    "mode": mode,
                    "seq_len": seq_len,
                    "shape": asdict(shape),
                    "repeats": args.repeats,
                    "warmup": args.warmup,
                    "keep_host_memory": kept,  # for MindSpore's msrun workers
                }
                ranks = run(cp, args.total_threads, job, timeout_s=args.timeout)
                slowest = max(ranks, key=lambda r: r["time_s"])
                rows.append(
                    {
                        "backend": backend,
                        "sweep": sweep,
                        "mode": mode,
                        "cp": cp,
                        "seq_len": seq_len,
                        "local_seq_len": seq_len // cp,
                        "threads_per_rank": max(1, args.total_threads // cp),
                        "time_s": slowest["time_s"],
                        "activation_bytes": None
                        if ranks[0]["activation_bytes"] is None
                        else max(r["activation_bytes"] for r in ranks),
                        "peak_rss_growth_bytes": max(r["peak_rss_growth_bytes"] for r in ranks),
                        "bytes_sent": max(r["bytes_sent"] for r in ranks),
                        "expected_bytes": max(r["expected_bytes"] for r in ranks),
                        "ranks": ranks,
                    }
                )
                print(f"done {backend} {sweep} {mode} cp={cp}: {slowest['time_s']:.3f}s", flush=True)
    summarize(rows)
    if efficiency is not None:
        print_efficiency(efficiency)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "shape": asdict(shape),
        "total_threads": args.total_threads,
        "freed_host_memory_kept": kept,
        "rows": rows,
        "efficiency": efficiency,
        "load_average_at_end": os.getloadavg(),
    }
    args.out.write_text(json.dumps(payload, indent=2))
    if rows:
        png = args.out.with_suffix(".png")
        plot(rows, png)
        print(f"wrote {args.out} and {png}")
    else:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
