"""scripts/train.py under two torchrun agents acting as two nodes: ``--nnodes 1:2``, a c10d
rendezvous on 127.0.0.1 (agent A hosts its store, agent B joins it), one worker per agent, the
checkpoints in one directory both see.

- A worker killed before a chosen step (the ``HP_TRAIN_KILL_AT_STEP`` test hook, through
  tests/train/train_with_faults.py): both agents restart
  their workers, which resume from the last checkpoint and end with the loss and the weights of an
  uninterrupted 2-rank run.
- A lost node (agent B and its worker killed with SIGKILL): agent A meets alone (1 of 1..2 nodes)
  and its worker continues on 1 rank from the last checkpoint, ending with the weights of an
  uninterrupted 1-rank run from that checkpoint.

Every process of a job carries its ``TORCHELASTIC_RUN_ID``; the workers run in sessions of their
own and outlive a killed agent, so the job's processes are found by it, and a job that ended must
have left none. The references run on forked ranks (:func:`run_ranks`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import free_port, run_ranks, script_command, script_env

from hyperpar_gdn.train import TrainConfig, Trainer, load_checkpoint
from hyperpar_gdn.train.loop.fault_injection import KILL_AT_STEP_ENV, kill_step

STEPS = 16
SAVE_EVERY = 4
KILL_AT = 7  # the worker dies before step 7: step-4 is the last checkpoint, steps 5 and 6 are redone
TINY = {"seq_len": 32, "batch_size": 4, "steps": STEPS, "save_every": SAVE_EVERY, "timeout_s": 30.0}
LAST_CALL_S = 5  # a quorum of 1 agent waits this long for the second (both must meet at the start)
RDZV_CONF = f"join_timeout=60,last_call_timeout={LAST_CALL_S},keep_alive_interval=1,keep_alive_max_attempt=3"
AGENT = "--nnodes 1:2 --max-restarts 2 --monitor-interval 0.1 --local-addr 127.0.0.1"
JOB_S = 150  # a whole two-agent job, its restart included
HEADER = re.compile(r"(\d+) ranks? = dp (\d+) x cp (\d+) .*steps (\d+)\.\.(\d+)")
RESUMED = re.compile(r"resuming from \S*step-(\d+) \(the newest complete checkpoint")


def _cli(options: dict[str, Any]) -> list[str]:
    return [part for key, value in options.items() for part in (f"--{key.replace('_', '-')}", str(value))]


class _TwoNodes:
    """Agents ``a`` (hosts the rendezvous store) and ``b`` of one job, each with one worker; on exit
    every process of the job is killed."""

    def __init__(self, run: Path, env: dict[str, str] | None = None) -> None:
        self.run, self.job = run, f"nodes-{os.getpid()}-{run.name}"
        port = free_port()
        # a fresh store for every attempt: agents that count restarts differently still meet
        environ = script_env(**{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})})
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        # the fault-injecting wrapper only where a test hook is asked for: else the script itself
        program = (
            "tests/train/train_with_faults.py" if KILL_AT_STEP_ENV in (env or {}) else "scripts/train.py"
        )
        for name, host in (("a", 1), ("b", 0)):
            rdzv = f"--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} --rdzv-id {self.job}"
            rdzv += f" --rdzv-conf {RDZV_CONF},is_host={host}"
            script = [*_cli(TINY), "--save", str(run / "ckpt"), "--metrics-json", str(run / "metrics.json")]
            launcher = [*AGENT.split(), *rdzv.split()]
            with open(run / f"{name}.log", "wb") as log:
                self.agents[name] = subprocess.Popen(
                    script_command(program, *script, ranks=1, launcher=launcher),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=environ,
                    cwd=run,
                    start_new_session=True,
                )
        self.deadline = time.monotonic() + JOB_S

    def __enter__(self) -> _TwoNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        for agent in self.agents.values():
            _kill_group(agent.pid)
        for pid in self.leftovers():
            _kill_group(pid)
        for agent in self.agents.values():
            agent.wait()

    def log(self, *names: str) -> str:
        return "".join(
            (self.run / f"{name}.log").read_text(errors="replace") for name in names or self.agents
        )

    def wait(self, name: str) -> int:
        try:
            return self.agents[name].wait(timeout=max(self.deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            pytest.fail(f"agent {name} still running after {JOB_S} s:\n{self.log()}")

    def kill_node(self, name: str) -> None:
        """SIGKILL agent ``name`` and its workers (children of the agent, in sessions of their own)."""
        workers = [pid for pid in _processes() if _parent(pid) == self.agents[name].pid]
        assert workers, f"agent {name} has no worker:\n{self.log()}"
        for pid in [self.agents[name].pid, *workers]:
            _kill_group(pid)

    def leftovers(self) -> list[int]:
        """The live processes of this job (the agents' workers carry its run id)."""
        marker = f"TORCHELASTIC_RUN_ID={self.job}".encode()
        return [pid for pid in _processes() if marker in _environ(pid)]


def _processes() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None  # gone meanwhile


def _environ(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")  # empty for a zombie
    except OSError:
        return []


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # agents and workers each lead a session of their own
    except ProcessLookupError:
        pass


def _headers(text: str) -> list[tuple[int, ...]]:
    """(world size, dp, cp, first step) of each attempt's run header (rank 0 prints one)."""
    return [tuple(int(g) for g in m.groups()[:4]) for m in HEADER.finditer(text)]


def _train(rank: int, world: int, options: dict[str, Any]) -> None:
    trainer = Trainer(TrainConfig(**options))
    try:
        trainer.train()
    finally:
        trainer.close()


def _reference(run: Path, world: int, *, start: Path | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """An uninterrupted run on ``world`` forked ranks, from step 1 or from the checkpoint ``start``."""
    if start is not None:
        shutil.copytree(start, run / "ckpt" / start.name)
    options = {**TINY, "save": str(run / "ckpt"), "metrics_json": str(run / "metrics.json")}
    run_ranks(_train, world, options, timeout_s=120)
    return _final(run)


def _final(run: Path) -> tuple[float, dict[str, torch.Tensor]]:
    """The last loss, and every model and AdamW tensor of the step-STEPS checkpoint."""
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"][-1] == STEPS
    final = run / "ckpt" / f"step-{STEPS}"
    parts = load_checkpoint(final)[1]  # either format, read whole on this host
    flat = {f"model.{k}": v for k, v in parts["model"].items()}
    for index, entry in parts["optimizer"]["state"].items():
        flat.update({f"optimizer.{index}.{k}": v for k, v in entry.items() if isinstance(v, torch.Tensor)})
    return metrics["losses"][-1], flat


def _assert_same(
    got: tuple[float, dict[str, torch.Tensor]], want: tuple[float, dict[str, torch.Tensor]]
) -> None:
    assert got[0] == want[0], f"final loss {got[0]!r} != {want[0]!r}"
    assert got[1].keys() == want[1].keys()
    different = [k for k in got[1] if not torch.equal(got[1][k], want[1][k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def test_the_kill_hook_names_a_step_and_a_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KILL_AT_STEP_ENV, "7@1")
    assert (kill_step(1), kill_step(0)) == (7, None)
    monkeypatch.setenv(KILL_AT_STEP_ENV, "3")
    assert kill_step(0) == 3
    for bad in ("0", "x", "3@y", "3@-1"):
        monkeypatch.setenv(KILL_AT_STEP_ENV, bad)
        with pytest.raises(ValueError, match=re.escape(f"{KILL_AT_STEP_ENV}={bad!r} is not STEP[@RANK]")):
            kill_step(0)


@pytest.mark.timeout(JOB_S + 150)
def test_a_killed_worker_restarts_both_nodes_and_ends_as_the_uninterrupted_run(tmp_path: Path) -> None:
    run = tmp_path / "killed"
    run.mkdir()
    with _TwoNodes(run, env={KILL_AT_STEP_ENV: f"{KILL_AT}@1"}) as job:
        codes = {name: job.wait(name) for name in ("a", "b")}
        text = job.log()
        assert codes == {"a": 0, "b": 0}, text
        assert job.leftovers() == [], f"processes of the job outlived it:\n{text}"
    # both nodes in the first attempt (the rank killed itself), and both again in the restart
    assert sorted(_headers(text)) == [(2, 1, 2, 1), (2, 1, 2, SAVE_EVERY + 1)], text
    assert [int(s) for s in RESUMED.findall(text)] == [SAVE_EVERY], text
    _assert_same(_final(run), _reference(tmp_path / "straight", 2))


@pytest.mark.timeout(JOB_S + 150)
def test_a_lost_node_leaves_the_other_to_continue_alone_from_the_last_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "lost"
    run.mkdir()
    with _TwoNodes(run) as job:
        while not (run / "ckpt" / f"step-{SAVE_EVERY}").is_dir():
            assert job.agents["a"].poll() is None and time.monotonic() < job.deadline, job.log()
            time.sleep(0.01)
        job.kill_node("b")
        killed = time.monotonic()
        saved = max(int(p.name.split("-")[1]) for p in (run / "ckpt").glob("step-*"))
        assert saved < STEPS, f"the run had finished when node b was killed:\n{job.log()}"
        while not RESUMED.search(job.log("a")):
            assert job.agents["a"].poll() is None and time.monotonic() < job.deadline, job.log()
            time.sleep(0.05)
        noticed = time.monotonic() - killed
        assert job.wait("a") == 0, job.log()
        ended = time.monotonic() - killed
        assert job.leftovers() == [], f"processes of the job outlived it:\n{job.log()}"
        text = job.log("a")
    print(f"lost node: resumed {noticed:.1f} s after the kill, the job ended after {ended:.1f} s")
    resumed = [int(s) for s in RESUMED.findall(text)]
    assert len(resumed) == 1 and resumed[0] % SAVE_EVERY == 0 and saved <= resumed[0] < STEPS, text
    assert (2, 1, 2, 1) in _headers(job.log()), job.log()  # both nodes met at the start (either has rank 0)
    assert _headers(text)[-1] == (1, 1, 1, resumed[0] + 1), text  # then node a alone
    assert noticed < 60, f"node a resumed {noticed:.1f} s after the kill"  # 3 s + last call + start-up
    _assert_same(_final(run), _reference(tmp_path / "alone", 1, start=run / "ckpt" / f"step-{resumed[0]}"))
