"""Training on MindSpore under msrun (2 MCCL workers, one job for the whole module): the hybrid LM
and the MindSpore Qwen3.5 models (dense and MoE, from transformers directories) with context
parallelism equal the single-device MindSpore model (fp64, every mode), and ``scripts/train.py``
trains both with CP along the torch run's loss curve (no CP, same weights, same batches); the
Qwen3.5 run exports a directory that transformers loads."""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import threading
import time
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks

pytest.importorskip("mindspore")

from msrun_harness import MsrunOutcome, run_msrun  # noqa: E402
from tiny_models import TINY_LM  # noqa: E402
from torch_training import torch_losses, torch_resume_error  # noqa: E402

from hyperpar_gdn.corpus import BUILTIN_CORPUS  # noqa: E402
from hyperpar_gdn.integrations.transformers.model_dir import write_tiny_qwen35  # noqa: E402
from hyperpar_gdn.models.lm import HybridLM  # noqa: E402
from hyperpar_gdn.train import MODEL_SIZES, TrainConfig, load_checkpoint  # noqa: E402

WORKER = Path(__file__).resolve().parent / "msrun_train_worker.py"
MSRUN_SCRIPT = Path(__file__).resolve().parent / "msrun_train_script.py"
MODES = ("ulysses", "p2p", "all_gather")
STEPS = 10
OPTIONS = {"seq_len": 64, "batch_size": 4, "steps": STEPS, "seed": 3}
TRAIN_MODE = "all_gather"
# Per step, |loss(MindSpore, CP) - loss(torch, no CP)|: the torch CP parity tolerance. Measured
# <= 1.4e-6 over these 10 steps (p2p and all_gather): fp32 rounding of two frameworks' kernels,
# which 10 steps at lr 1e-3 do not amplify much.
LOSS_TOL = 1e-4
LM_TOL = 1e-10  # fp64: the CP maths is exact, rounding only


def _flags(options: dict[str, Any]) -> list[str]:
    return [f"--{key.replace('_', '-')}={value}" for key, value in options.items()]


_ROOT = tempfile.TemporaryDirectory(prefix="hp-ms-train-")  # removed when the session ends
QWEN_KINDS = ("dense", "moe")


@cache
def _model_dirs() -> dict[str, Path]:
    """Tiny transformers Qwen3.5 directories (random weights, a BPE tokenizer), written once."""
    root = Path(_ROOT.name)
    return {kind: write_tiny_qwen35(root / kind, moe=kind == "moe") for kind in QWEN_KINDS}


@cache
def _packed_data() -> str:
    """The built-in corpus's paragraphs, cut into JSONL documents of 15 to 500 bytes."""
    pieces = [p.replace("\n", " ") for p in BUILTIN_CORPUS.split("\n\n")]
    pieces = [piece for p in pieces for piece in (p[:15], p[15:]) if piece]
    path = Path(_ROOT.name) / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": piece}) + "\n" for piece in pieces))
    return str(path)


# The shared msrun job (up to 480 s) runs inside the first test that reads it.
pytestmark = pytest.mark.timeout(540)


@cache
def _job() -> MsrunOutcome:
    train_options = [*_flags({**OPTIONS, "cp_mode": TRAIN_MODE}), "--check-parity"]
    dirs = [str(_model_dirs()[kind]) for kind in QWEN_KINDS]
    args = [
        *("--sections", "lm_cp", "qwen_cp", "train", "train_ac", "train_packed", "train_model"),
        *("--qwen-dirs", *dirs, "--export-dir", str(Path(_ROOT.name) / "export")),
        *("--packed-data", _packed_data()),
        *("--", *train_options),
    ]
    return run_msrun(WORKER, 2, args, timeout_s=480)


def _section(name: str) -> list[dict[str, Any]]:
    outcome = _job()
    data = []
    for rank, result in enumerate(outcome.results):
        if result is None or name not in result["sections"]:
            raise AssertionError(f"rank {rank} has no result for {name!r}\n{outcome.describe()}")
        entry = result["sections"][name]
        assert entry["ok"], f"rank {rank} failed in {name!r}:\n{entry['error']}"
        data.append(entry["data"])
    assert outcome.ok, outcome.describe()
    return data


@pytest.mark.parametrize("mode", MODES)
def test_lm_cp_equals_single_device_on_mindspore(mode: str) -> None:
    num_params = len(list(HybridLM(TINY_LM).parameters()))
    for rank, results in enumerate(_section("lm_cp")):
        for key in (mode, f"{mode}/head_tail"):  # contiguous and head_tail layouts
            errors = results[key]
            assert len(errors) == 2 + num_params  # logits, undo, every parameter's gradient
            bad = {name: err for name, err in errors.items() if not err <= LM_TOL}
            assert not bad, f"rank {rank} {key}: errors above {LM_TOL}: {bad}"


@pytest.mark.parametrize("kind", QWEN_KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_qwen35_cp_equals_single_device_on_mindspore(mode: str, kind: str) -> None:
    from hyperpar_gdn.models.mindspore import Qwen3_5ForCausalLM

    num_params = len(list(Qwen3_5ForCausalLM.from_pretrained(_model_dirs()[kind]).get_parameters()))
    for rank, results in enumerate(_section("qwen_cp")):
        keys = (mode, f"{mode}/head_tail") if kind == "dense" else (mode,)  # head_tail: dense only
        for key in keys:
            errors = results[kind][key]
            assert len(errors) == 2 + num_params  # logits, undo, every parameter's gradient
            bad = {name: err for name, err in errors.items() if not err <= LM_TOL}
            assert not bad, f"rank {rank} {kind} {key}: errors above {LM_TOL}: {bad}"


def test_train_script_trains_a_transformers_directory_along_torchs_curve() -> None:
    """``HP_PLATFORM=mindspore msrun ... scripts/train.py --model DIR`` (CP over 2 workers) follows
    the torch Trainer on the same directory without CP, and exports a directory transformers loads."""
    import transformers

    rank0, rank1 = _section("train_model")
    assert rank0["exit_code"] == rank1["exit_code"] == 0
    assert (rank0["platform"], rank0["cp_size"]) == ("mindspore", 2)
    losses = rank0["losses"]
    assert max(losses[-3:]) < losses[0] - 0.2, losses
    options = {**OPTIONS, "cp_size": 1, "model_dir": str(_model_dirs()["dense"])}
    torch_curve = run_ranks(torch_losses, 1, options, timeout_s=120)[0]
    diffs = [abs(a - b) for a, b in zip(losses, torch_curve, strict=True)]
    assert max(diffs) <= LOSS_TOL, f"MindSpore {losses}\ntorch {torch_curve}\n|diff| {diffs}"
    parity = rank0["parity"]
    assert parity["ok"] and parity["max_abs_diff"] <= LOSS_TOL, parity
    export = Path(_ROOT.name) / "export"
    model = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert transformers.AutoTokenizer.from_pretrained(export).eos_token == "<|endoftext|>"
    initial = transformers.AutoModelForCausalLM.from_pretrained(_model_dirs()["dense"])
    moved = (model.model.embed_tokens.weight - initial.model.embed_tokens.weight).abs().max().item()
    assert moved > 1e-4, "the exported weights are the initial ones"


def test_train_script_follows_the_torch_loss_curve() -> None:
    rank0, rank1 = _section("train")
    assert rank0["exit_code"] == rank1["exit_code"] == 0
    assert (rank0["platform"], rank0["world_size"], rank0["dp_size"], rank0["cp_size"]) == (
        "mindspore",
        2,
        1,
        2,
    )
    assert rank0["steps"] == list(range(1, STEPS + 1))
    losses = rank0["losses"]
    assert losses[0] > 5.0  # ~ln 256 at init
    assert max(losses[-3:]) < losses[0] - 0.5
    torch_curve = run_ranks(torch_losses, 1, {**OPTIONS, "cp_size": 1}, timeout_s=120)[0]
    diffs = [abs(a - b) for a, b in zip(losses, torch_curve, strict=True)]
    assert max(diffs) <= LOSS_TOL, f"MindSpore {losses}\ntorch {torch_curve}\n|diff| {diffs}"
    # --check-parity: rank 0 also trained a MindSpore copy without CP (measured within 2.4e-7)
    parity = rank0["parity"]
    assert parity["ok"] and parity["max_abs_diff"] <= LOSS_TOL, parity
    reference = parity["reference_losses"]
    assert max(abs(a - b) for a, b in zip(reference, torch_curve, strict=True)) <= LOSS_TOL, reference


def test_activation_checkpointing_keeps_the_losses() -> None:
    """--ac (Cell.recompute per block) under CP: the backward recomputes each block, collectives
    included, and gives the same losses as the run that kept its activations."""
    for plain, recomputed in zip(_section("train"), _section("train_ac"), strict=True):
        assert recomputed["exit_code"] == 0
        if "losses" in plain:  # rank 0
            diffs = [abs(a - b) for a, b in zip(recomputed["losses"], plain["losses"], strict=True)]
            assert max(diffs) <= 1e-6, (recomputed["losses"], plain["losses"])


def test_packed_documents_follow_the_torch_run() -> None:
    """Several documents in --data: packed with boundaries under CP on MindSpore, the losses follow
    torch's run without CP on the same batches (and MindSpore's own no-CP copy)."""
    rank0 = _section("train_packed")[0]
    assert rank0["exit_code"] == 0
    options = {**OPTIONS, "cp_size": 1, "data": _packed_data()}
    torch_curve = run_ranks(torch_losses, 1, options, timeout_s=120)[0]
    diffs = [abs(a - b) for a, b in zip(rank0["losses"], torch_curve, strict=True)]
    assert max(diffs) <= LOSS_TOL, f"MindSpore {rank0['losses']}\ntorch {torch_curve}"
    assert rank0["parity"]["ok"], rank0["parity"]
    plain = _section("train")[0]["losses"]  # the built-in corpus: a different run altogether
    assert plain != rank0["losses"]


def _ms_train(config: TrainConfig) -> Any:
    from hyperpar_gdn.train.backends.mindspore_backend import MindSporeTrainer

    trainer = MindSporeTrainer(config)  # one process: a 1-rank local world, no msrun
    try:
        return trainer.train()
    finally:
        trainer.close()


@pytest.mark.parametrize("model", ["builtin", "qwen35"])
def test_save_and_resume_continue_the_same_curve(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saving at step 2 and resuming to step 4 gives bit for bit the straight run's losses; the
    model part is a torch state dict (the torch model's or transformers' names), the optimizer
    part MindSpore's own (torch refuses it). The built-in model saves sharded (the default), the
    Qwen3.5 one whole."""
    monkeypatch.setenv("HP_PLATFORM", "mindspore")
    options: dict[str, Any] = {"seq_len": 32, "batch_size": 2, "steps": 4, "seed": 5}
    if model == "qwen35":
        options["model_dir"] = str(_model_dirs()["dense"])
        options["checkpoint_format"] = "whole"
    straight = _ms_train(TrainConfig(**options, save=str(tmp_path), save_every=2))
    resumed = _ms_train(TrainConfig(**options, resume=str(tmp_path / "step-2")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4"]
    assert resumed.start_step == 2 and [r.step for r in resumed.records] == [3, 4]
    assert resumed.losses == straight.losses[2:], (resumed.losses, straight.losses)

    step, parts, _ = load_checkpoint(tmp_path)
    assert step == 4
    if model == "builtin":
        HybridLM(MODEL_SIZES["tiny"]).load_state_dict(parts["model"])  # strict: every name and shape
    else:
        import transformers

        reference = transformers.AutoModelForCausalLM.from_pretrained(options["model_dir"])
        missing, unexpected = reference.load_state_dict(parts["model"], strict=False)
        assert (missing, unexpected) == (["lm_head.weight"], []), (missing, unexpected)  # tied head
    monkeypatch.setenv("HP_PLATFORM", "cpu")
    message = run_ranks(torch_resume_error, 1, {**options, "steps": 6, "resume": str(tmp_path)})[0]
    refusal = "holds no torch AdamW state" if model == "qwen35" else "per-rank parts of a replicated state"
    assert refusal in message and "HP_PLATFORM=mindspore" in message, message


def test_checkpoint_options_match_torchs() -> None:
    """MindSpore saves sharded by default, as torch does, and takes --async-save and
    --checkpoint-format whole (tests/train/test_train_mindspore_sharded.py runs them)."""
    from hyperpar_gdn.train.backends.mindspore_backend import MindSporeBackend
    from hyperpar_gdn.train.backends.torch_backend import TorchBackend

    assert MindSporeBackend.checkpoint_formats[0] == TorchBackend.checkpoint_formats[0] == "sharded"
    for options in ({}, {"async_save": True}, {"checkpoint_format": "whole"}):
        MindSporeBackend.check(TrainConfig(save="ck", **options), "mindspore")  # accepted


def test_wrong_platform_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyperpar_gdn.train.backends.mindspore_backend import MindSporeTrainer

    monkeypatch.setenv("HP_PLATFORM", "cpu")
    with pytest.raises(
        NotImplementedError, match=r"MindSporeTrainer needs HP_PLATFORM=mindspore \(got cpu\)"
    ):
        MindSporeTrainer(TrainConfig())


def test_a_restart_resumes_from_the_newest_complete_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same command run again with --save resumes (what a rerun after msrun gave up does),
    past a truncated newest checkpoint, and ends with the first run's losses and weights."""
    monkeypatch.setenv("HP_PLATFORM", "mindspore")
    config = TrainConfig(seq_len=32, batch_size=2, seed=5, steps=4, save=str(tmp_path), save_every=2)
    straight = _ms_train(config)
    assert straight.start_step == 0 and [r.step for r in straight.records] == [1, 2, 3, 4]
    _, weights, _ = load_checkpoint(tmp_path / "step-4")
    part = tmp_path / "step-4" / "state" / "rank-0.safetensors"  # sharded, the default
    part.write_bytes(part.read_bytes()[:500])  # the newest checkpoint is damaged
    resumed = _ms_train(config)
    assert resumed.start_step == 2 and resumed.losses == straight.losses[2:]
    _, again, _ = load_checkpoint(tmp_path / "step-4")
    assert again["model"].keys() == weights["model"].keys()
    assert all(torch.equal(again["model"][k], weights["model"][k]) for k in again["model"])


def _kill_rank_when(path: Path, marker: str, rank: int, deadline_s: float, killed: list[int]) -> None:
    """SIGKILL the msrun worker of ``rank`` (its command line holds ``marker``) once ``path`` exists."""
    end = time.monotonic() + deadline_s
    while not path.is_dir():
        if time.monotonic() > end:
            return
        time.sleep(0.05)
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(marker.encode() in a for a in cmdline) and b"msrun_train_script.py" in b" ".join(cmdline):
            if f"RANK_ID={rank}".encode() in environ:
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
                return


def test_msrun_gives_up_on_a_dead_worker_and_a_rerun_resumes(tmp_path: Path) -> None:
    """msrun does not restart: a worker killed with SIGKILL ends the job with an error; the same
    command run again resumes from the newest complete checkpoint and finishes."""
    save = tmp_path / "ckpt"
    args = ["--seq-len", "32", "--batch-size", "2", "--steps", "6", "--save-every", "2"]
    args += ["--save", str(save), "--metrics-json", str(tmp_path / "metrics.json"), "--timeout-s", "60"]
    killed: list[int] = []
    killer = threading.Thread(target=_kill_rank_when, args=(save / "step-2", str(save), 1, 300, killed))
    killer.start()
    first = run_msrun(MSRUN_SCRIPT, 2, args, timeout_s=300, log_lines=400)
    killer.join()
    assert killed, f"no worker was killed:\n{first.describe()}"
    assert first.returncode not in (0, None) and not first.timed_out, first.describe()
    assert not (tmp_path / "metrics.json").exists()  # the job did not finish, and no restart
    second = run_msrun(MSRUN_SCRIPT, 2, args, timeout_s=300, log_lines=400)
    assert second.ok, second.describe()
    found = re.findall(r"resuming from \S*step-(\d+) ", second.logs["worker_0.log"])
    assert len(found) == 1 and int(found[0]) in (2, 4), second.describe()
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["start_step"] == int(found[0]) and metrics["steps"][-1] == 6


def test_bf16_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """MindSpore 2.10 has no bf16 matmul on CPU: ``--dtype bf16`` fails before any process group."""
    from hyperpar_gdn.train.backends.mindspore_backend import MindSporeTrainer

    monkeypatch.setenv("HP_PLATFORM", "mindspore")
    with pytest.raises(
        NotImplementedError, match=r"--dtype bf16 trains on torch only: MindSpore 2\.10 has no bf16"
    ):
        MindSporeTrainer(TrainConfig(dtype="bf16"))
