"""scripts/train.py under ``torchrun --max-restarts 1`` with a worker killed by SIGKILL mid-run: the
restarted workers resume from the newest complete checkpoint under ``--save`` and end with the
loss and the weights of an uninterrupted run, bit for bit. A first start with an empty ``--save``
trains from step 1; a damaged newest checkpoint is skipped for the one before it.

The kill comes from outside (no hook in the trainer): the test waits until a checkpoint directory
appears, then sends SIGKILL to the worker process of one rank, found among torchrun's children by
the ``RANK`` in its environment.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import free_port, run_ranks, script_command, script_env, worker_pid

from hyperpar_gdn.train import CheckpointError, TrainConfig, Trainer, load_checkpoint

STEPS = 16
SAVE_EVERY = 4
TINY = ["--seq-len", "32", "--batch-size", "4", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
TIMEOUT_S = 240  # a whole torchrun job, restart included; the process groups time out after 60 s


def _command(run: Path, nproc: int, options: list[str], *, static: bool) -> list[str]:
    launcher = ["--max-restarts", "1", "--monitor-interval", "0.1"]
    if static:  # torchrun's static rendezvous (what --master-port selects); else its c10d default
        launcher += ["--master-port", str(free_port())]
    script = [*TINY, *options, "--timeout-s", "60", "--save", str(run / "ckpt")]
    script += ["--metrics-json", str(run / "metrics.json")]
    return script_command("scripts/train.py", *script, ranks=nproc, launcher=launcher)


def _run(command: list[str], log: Path, *, kill_rank: int | None = None, kill_after_step: int = 0) -> str:
    """Run ``command`` to the end (within TIMEOUT_S); with ``kill_rank``, SIGKILL that rank's worker
    once ``step-<kill_after_step>`` exists under ``--save``. Returns the output."""
    save = Path(command[command.index("--save") + 1])
    deadline = time.monotonic() + TIMEOUT_S
    with open(log, "w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=script_env(), cwd=log.parent
        )
        try:
            if kill_rank is not None:
                while not (save / f"step-{kill_after_step}").is_dir():
                    assert process.poll() is None, (
                        f"torchrun ended before step-{kill_after_step}:\n{log.read_text()}"
                    )
                    assert time.monotonic() < deadline, f"no step-{kill_after_step}:\n{log.read_text()}"
                    time.sleep(0.02)
                pid = worker_pid(process.pid, kill_rank)
                assert pid is not None, f"no worker of rank {kill_rank} under torchrun {process.pid}"
                os.kill(pid, signal.SIGKILL)
                killed_with = sorted(int(p.name.split("-")[1]) for p in save.glob("step-*"))
                assert killed_with[-1] < STEPS, (
                    f"the run had finished when the worker was killed: {killed_with}"
                )
            process.wait(timeout=max(deadline - time.monotonic(), 1))
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    text = log.read_text()
    assert process.returncode == 0, f"torchrun exited with {process.returncode}:\n{text}"
    return text


def _final_state(run: Path) -> tuple[float, dict[str, torch.Tensor]]:
    metrics = json.loads((run / "metrics.json").read_text())
    parts = load_checkpoint(run / "ckpt" / f"step-{STEPS}")[1]  # sharded: read whole on this host
    state, optimizer = parts["model"], parts["optimizer"]
    flat = {f"model.{k}": v for k, v in state.items()}
    for index, entry in optimizer["state"].items():
        flat.update({f"optimizer.{index}.{k}": v for k, v in entry.items() if isinstance(v, torch.Tensor)})
    assert metrics["steps"][-1] == STEPS
    return metrics["losses"][-1], flat


def _assert_same(a: tuple[float, dict[str, torch.Tensor]], b: tuple[float, dict[str, torch.Tensor]]) -> None:
    assert a[0] == b[0], f"final loss {a[0]!r} != {b[0]!r}"
    assert a[1].keys() == b[1].keys()
    different = [k for k in a[1] if not torch.equal(a[1][k], b[1][k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def _resumed_step(text: str) -> int:
    found = re.findall(r"resuming from \S*step-(\d+) \(the newest complete checkpoint", text)
    assert len(found) == 1, f"expected one resume, found {found}:\n{text}"
    return int(found[0])


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The uninterrupted dp 2 x cp 2 run, with an empty --save directory."""
    run = tmp_path_factory.mktemp("straight")
    text = _run(_command(run, 4, ["--cp-size", "2"], static=False), run / "log.txt")
    return run, text


def test_first_start_with_an_empty_directory_trains_from_step_1(straight: tuple[Path, str]) -> None:
    run, text = straight
    assert "no checkpoint under --save" in text and "training from step 1" in text
    assert "resuming from" not in text
    assert json.loads((run / "metrics.json").read_text())["steps"] == list(range(1, STEPS + 1))


@pytest.mark.timeout(2 * TIMEOUT_S + 60)  # two torchrun jobs
def test_killed_worker_resumes_and_ends_as_the_uninterrupted_run(
    straight: tuple[Path, str], tmp_path: Path
) -> None:
    text = _run(
        _command(tmp_path, 4, ["--cp-size", "2"], static=False),
        tmp_path / "log.txt",
        kill_rank=1,
        kill_after_step=SAVE_EVERY,
    )
    resumed = _resumed_step(text)
    assert SAVE_EVERY <= resumed < STEPS and resumed % SAVE_EVERY == 0
    assert "training from step 1" in text  # the first attempt, on an empty directory
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["start_step"] == resumed and metrics["steps"] == list(range(resumed + 1, STEPS + 1))
    _assert_same(_final_state(tmp_path), _final_state(straight[0]))


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(
    straight: tuple[Path, str], tmp_path: Path
) -> None:
    """A copy of the finished run with its newest checkpoint truncated, run again with more steps:
    it warns naming the file, resumes from the one before, and retrains to the same weights."""
    subprocess.run(["cp", "-r", str(straight[0] / "ckpt"), str(tmp_path / "ckpt")], check=True, timeout=60)
    shard = tmp_path / "ckpt" / f"step-{STEPS}" / "state" / "__0_0.distcp"  # rank 0's shard
    shard.write_bytes(shard.read_bytes()[:1000])
    text = _run(
        _command(tmp_path, 4, ["--cp-size", "2", "--keep-last", "2"], static=False), tmp_path / "log.txt"
    )
    assert f"skipping checkpoint {shard.parents[1]}: checkpoint file {shard} is corrupt" in text
    assert _resumed_step(text) == STEPS - SAVE_EVERY
    _assert_same(_final_state(tmp_path), _final_state(straight[0]))
    # --keep-last 2: the two newest remain
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        f"step-{STEPS - SAVE_EVERY}",
        f"step-{STEPS}",
    ]


@pytest.mark.timeout(2 * TIMEOUT_S + 60)  # two torchrun jobs
def test_killed_rank_0_under_fsdp_resumes_exactly(tmp_path: Path) -> None:
    """--fsdp on 2 ranks (cp 2), torchrun's static rendezvous, rank 0 killed."""
    options = ["--fsdp"]
    straight_run = tmp_path / "straight"
    killed_run = tmp_path / "killed"
    straight_run.mkdir()
    killed_run.mkdir()
    _run(_command(straight_run, 2, options, static=True), straight_run / "log.txt")
    text = _run(
        _command(killed_run, 2, options, static=True),
        killed_run / "log.txt",
        kill_rank=0,
        kill_after_step=SAVE_EVERY,
    )
    assert SAVE_EVERY <= _resumed_step(text) < STEPS
    _assert_same(_final_state(killed_run), _final_state(straight_run))


def _auto(rank: int, world: int, options: dict[str, Any]) -> list[int] | str:
    try:
        trainer = Trainer(TrainConfig(**options))
    except (ValueError, CheckpointError) as err:
        return str(err)
    try:
        return [r.step for r in trainer.train().records]
    finally:
        trainer.close()


def test_a_second_start_continues_and_conflicting_options_are_refused(tmp_path: Path) -> None:
    """In-process, 1 rank: --save resumes where the last run stopped; options that change the
    batches are refused naming them; --no-auto-resume starts over."""
    options = {"seq_len": 32, "batch_size": 2, "cp_size": 1, "save": str(tmp_path), "save_every": 2}
    assert run_ranks(_auto, 1, {**options, "steps": 4}, timeout_s=60)[0] == [1, 2, 3, 4]
    assert run_ranks(_auto, 1, {**options, "steps": 6}, timeout_s=60)[0] == [5, 6]
    refused = run_ranks(_auto, 1, {**options, "steps": 8, "seq_len": 64}, timeout_s=60)[0]
    assert refused == (
        f"checkpoint {tmp_path / 'step-6'} was written by a run with different data or shapes: "
        "--seq-len 32 (now 64)"
    )
    done = run_ranks(_auto, 1, {**options, "steps": 6}, timeout_s=60)[0]
    assert done.startswith(
        f"the newest checkpoint under --save, {tmp_path / 'step-6'} is at step 6; --steps 6"
    )
    assert run_ranks(_auto, 1, {**options, "steps": 2, "auto_resume": False}, timeout_s=60)[0] == [1, 2]
    for step in (2, 4, 6):
        (tmp_path / f"step-{step}" / "train.pt").write_bytes(b"damaged")
    refused = run_ranks(_auto, 1, {**options, "steps": 8}, timeout_s=60)[0]
    assert refused.startswith(f"every checkpoint under --save {tmp_path} (step-2, step-4, step-6) failed")


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_rank_0_killed_while_saving_falls_back_to_the_checkpoint_before(tmp_path: Path) -> None:
    """Rank 0 (the writer) killed with SIGKILL while step-8 is being written (a model large enough
    that the write takes a while): no step-8 appears, the restart resumes from step-4 and removes
    the unfinished save."""
    save = tmp_path / "ckpt"
    command = _command(tmp_path, 2, ["--model-size", "small"], static=False)
    command[command.index("--steps") + 1] = "8"  # step-8 is the last save
    deadline = time.monotonic() + TIMEOUT_S
    with open(tmp_path / "log.txt", "w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=script_env(), cwd=tmp_path
        )
        try:
            while not (temps := list(save.glob(".step-8.tmp-*"))):
                assert process.poll() is None and time.monotonic() < deadline, (
                    tmp_path / "log.txt"
                ).read_text()
                time.sleep(0.005)
            pid = worker_pid(process.pid, 0)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            caught = temps[0].exists() and not (save / "step-8").exists()
            process.wait(timeout=max(deadline - time.monotonic(), 1))
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    text = (tmp_path / "log.txt").read_text()
    assert process.returncode == 0, text
    assert caught, "rank 0 finished the save before it was killed; the test saw no save in progress"
    assert _resumed_step(text) == 4
    assert f"removed {temps[0]}: a save that did not finish" in text
    assert sorted(p.name for p in save.iterdir()) == ["step-4", "step-8"]
