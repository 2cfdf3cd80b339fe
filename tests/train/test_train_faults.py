"""Faults in a training run, on 2 real gloo ranks (cp 2) in one shared job: a NaN injected on rank 1
(the test-only :class:`InjectNaN` callback) is skipped on every rank, never saved, and stops the run
after ``--max-bad-steps`` in a row; a checkpoint that cannot be written (a file-size limit on rank
0, the writer) is one line on every rank, leaves the checkpoint before it loadable and nothing
partial, and stops the run or (``--on-save-error continue``) does not. Also: scripts/train.py's
one line per rank and exit code 3 under torchrun.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks, run_script, script_command, script_env, worker_pid

from hyperpar_gdn.integrations.transformers.model_dir import train_tokenizer, write_tiny_qwen35
from hyperpar_gdn.train import SaveError, TrainConfig, Trainer, TrainingStopped, load_checkpoint
from hyperpar_gdn.train.checkpoints.directory import list_checkpoints
from hyperpar_gdn.train.checkpoints.whole import nonfinite_entries
from hyperpar_gdn.train.data.global_batches import TokenStream, VocabularyError, check_vocabulary
from hyperpar_gdn.train.loop.fault_injection import INJECT_NAN_ENV, InjectNaN

TINY = {"seq_len": 32, "batch_size": 2, "warmup_steps": 1}


def _train(options: dict[str, Any], *, inject: str = "") -> Any:
    """Run a trainer; returns (steps, skipped steps) or the fault's class name and message.
    ``inject``: "STEP[,STEP...]@RANK", the steps at which rank RANK's loss scale is NaN."""
    steps, _, target = inject.partition("@")
    nan = [InjectNaN(int(s) for s in steps.split(","))] if inject and int(target) == _rank() else []
    trainer = Trainer(TrainConfig(**TINY, **options), callbacks=nan)
    try:
        result = trainer.train()
        return [r.step for r in result.records], result.skipped_steps, [r.loss for r in result.records]
    except (TrainingStopped, SaveError) as err:
        return type(err).__name__, str(err)
    finally:
        trainer.close()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _faults(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # NaN at steps 3 and 5 on rank 1 (never two in a row): both skipped on every rank, and saved
    out["nan"] = _train({"steps": 6, "save": str(tmp / "nan"), "save_every": 1}, inject="3,5@1")
    # two in a row with --max-bad-steps 2: stopped at the second
    out["stop"] = _train({"steps": 6, "max_bad_steps": 2}, inject="2,3@1")
    # a file-size limit on rank 0 once step-2 is saved: the step-4 save fails (whole checkpoints:
    # rank 0 alone writes, the others learn it from rank 0)
    save, whole = str(tmp / "full"), {"checkpoint_format": "whole"}
    out["before"] = _train({"steps": 2, "save": save, **whole})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill, as scripts/train.py
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 0:
        # under the 1 MB model.pt, over what the log (stdout, a file here) grows to
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, limit[1]))
    try:
        out["full_stop"] = _train({"steps": 4, "save": save, "save_every": 2, **whole})
        out["full_continue"] = _train(
            {"steps": 4, "save": save, "save_every": 1, "on_save_error": "continue", **whole}
        )
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    return out


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("faults")
    return tmp, run_ranks(_faults, 2, tmp, timeout_s=150)


@pytest.mark.timeout(180)
def test_a_nan_step_is_skipped_on_every_rank_and_never_saved(faults: tuple[Path, list[dict]]) -> None:
    tmp, ranks = faults
    for rank, out in enumerate(ranks):
        steps, skipped, losses = out["nan"]
        assert steps == [1, 2, 3, 4, 5, 6] and skipped == [3, 5], f"rank {rank}: {out['nan']}"
        assert all(loss == loss for loss in losses), f"rank {rank}: the reported losses {losses}"
    saved = {step: load_checkpoint(path)[1] for step, path in list_checkpoints(tmp / "nan")}
    assert sorted(saved) == [1, 2, 3, 4, 5, 6]
    for step, parts in saved.items():
        assert nonfinite_entries(parts) == [], f"step-{step} holds NaN or inf"
    for step in (3, 5):  # a skipped step changes neither the weights nor the optimizer state
        before, after = saved[step - 1], saved[step]
        for name, tensor in before["model"].items():
            assert torch.equal(tensor, after["model"][name]), f"step-{step} changed {name}"
        step_counts = [
            (s["step"], t["step"])
            for s, t in zip(
                before["optimizer"]["state"].values(), after["optimizer"]["state"].values(), strict=True
            )
        ]
        assert all(torch.equal(a, b) for a, b in step_counts), f"step-{step} counted an AdamW step"
    changed = [n for n, t in saved[4]["model"].items() if not torch.equal(t, saved[3]["model"][n])]
    assert changed, "step 4 (finite) did not update the weights"


@pytest.mark.timeout(180)
def test_bad_steps_in_a_row_stop_the_run_on_every_rank(faults: tuple[Path, list[dict]]) -> None:
    for out in faults[1]:
        kind, message = out["stop"]
        assert kind == "TrainingStopped"
        assert message.startswith("stopped at step 3: steps 2..3 (2 in a row, --max-bad-steps 2)"), message


@pytest.mark.timeout(180)
def test_a_failed_save_is_one_line_on_every_rank_and_the_previous_checkpoint_loads(
    faults: tuple[Path, list[dict]],
) -> None:
    tmp, (rank0, rank1) = faults
    root = tmp / "full"
    assert rank0["before"][0] == [1, 2]
    kind, message = rank0["full_stop"]
    assert kind == "SaveError" and message.startswith(f"could not save the step-4 checkpoint under {root}: ")
    assert "File too large" in message and "(--on-save-error stop)" in message, message
    kind, message = rank1["full_stop"]
    assert kind == "SaveError"
    assert message.startswith(f"rank 0 could not save the step-4 checkpoint under {root} (rank 0's line"), (
        message
    )
    for out in (rank0, rank1):  # continue: steps 3 and 4 trained, both saves failed
        assert out["full_continue"][0] == [3, 4], out["full_continue"]
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]  # nothing partial, hidden or not
    assert load_checkpoint(root)[0] == 2


def test_nonfinite_entries_names_the_tensors() -> None:
    state = {"model": {"w": torch.tensor([1.0, float("nan")]), "n": torch.tensor([3])}, "x": [torch.ones(1)]}
    assert nonfinite_entries(state) == ["model.w"]
    state["x"].append(torch.tensor([float("-inf")]))
    assert nonfinite_entries(state) == ["model.w", "x.1"]


@pytest.mark.timeout(150)
def test_script_stops_with_one_line_per_rank_and_exit_code_3(tmp_path: Path) -> None:
    options = ["--steps", "4", "--seq-len", "32", "--batch-size", "2", "--max-bad-steps", "2"]
    env = script_env(**{INJECT_NAN_ENV: "1,2@0"})
    result = run_script("tests/train/train_with_faults.py", *options, cwd=tmp_path, env=env, timeout=120)
    assert result.returncode != 0
    lines = sorted(line for line in result.stderr.splitlines() if "train.py: rank" in line)
    assert len(lines) == 2, result.stderr
    for rank, line in enumerate(lines):
        assert line.startswith(f"train.py: rank {rank}: stopped: stopped at step 2: steps 1..2"), line
    assert "exitcode  : 3" in result.stderr, result.stderr[-2000:]


def _torchrun(args: list[str], cwd: Path, **popen: Any) -> subprocess.Popen[str]:
    script = ["--seq-len", "32", "--batch-size", "2", *args]
    command = script_command("scripts/train.py", *script, launcher=["--monitor-interval", "0.1"])
    env = script_env(PYTHONFAULTHANDLER="1")
    return subprocess.Popen(command, cwd=cwd, env=env, text=True, **popen)


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    stream = TokenStream(torch.tensor([1, 2, 300, 7, 256]), torch.zeros(5, dtype=torch.bool))
    with pytest.raises(VocabularyError) as caught:
        check_vocabulary(stream, vocab_size=256, model="--model-size tiny", data="d.jsonl")
    assert str(caught.value) == (
        "--data d.jsonl: 2 token ids fall outside the vocabulary of --model-size tiny (vocab_size 256: "
        "ids 0..255), the first is 300 at token 2; use the model's own tokenizer"
    )
    check_vocabulary(stream, vocab_size=301, model="m", data=None)  # all below 301: accepted


@pytest.mark.timeout(150)
def test_a_tokenizer_that_does_not_match_the_model_is_one_line_on_every_rank(tmp_path: Path) -> None:
    """A model directory whose tokenizer was replaced by a larger one (913 tokens: BPE on the built-in corpus stops there; the model has 512)."""
    model = tmp_path / "model"
    write_tiny_qwen35(model)
    train_tokenizer(vocab_size=1024).save_pretrained(model)
    process = _torchrun(["--model", str(model), "--steps", "2"], tmp_path, stderr=subprocess.PIPE)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0
    lines = sorted(line for line in stderr.splitlines() if "train.py: rank" in line)
    assert len(lines) == 2, stderr
    for rank, line in enumerate(lines):
        assert line.startswith(f"train.py: rank {rank}: error: the tokenizer of {model} has 913 tokens but ")
        assert "the model's vocab_size is 512" in line, line


@pytest.mark.timeout(150)
def test_a_stopped_rank_is_named_by_the_others_within_the_timeout(tmp_path: Path) -> None:
    """SIGSTOP on rank 1's worker once step-2 is saved: rank 0 fails its next collective after
    --timeout-s, names the step and rank 1 in one line and exits, within the timeout + 10 s."""
    timeout_s = 10  # also bounds the start-up rendezvous on this loaded machine
    log = tmp_path / "log.txt"
    options = ["--steps", "100000", "--save", str(tmp_path / "ckpt"), "--save-every", "2"]
    with open(log, "w") as out:
        process = _torchrun(
            [*options, "--timeout-s", str(timeout_s)],
            tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    stuck = None
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "ckpt" / "step-2").is_dir():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        waiting, stuck = worker_pid(process.pid, 0), worker_pid(process.pid, 1)
        assert waiting is not None and stuck is not None
        os.kill(stuck, signal.SIGSTOP)
        stopped = time.monotonic()
        while _running(waiting):
            if time.monotonic() - stopped > timeout_s + 10:
                os.kill(waiting, signal.SIGABRT)  # its Python stack into the log (PYTHONFAULTHANDLER)
                time.sleep(2)
                raise AssertionError(f"rank 0 still runs:\n{log.read_text()}")
            time.sleep(0.1)
        took = time.monotonic() - stopped
    finally:
        if stuck is not None:
            os.kill(stuck, signal.SIGCONT)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    lines = [x for x in log.read_text().splitlines() if "train.py: rank 0: stopped:" in x]
    assert len(lines) == 1, log.read_text()
    assert re.search(
        rf"stopped: step \d+: a collective failed or waited more than --timeout-s {timeout_s} s on rank 0; "
        "rank 1 did not answer",
        lines[0],
    ), lines[0]
    assert timeout_s - 1 < took < timeout_s + 10, took


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
