"""Sharded checkpoints on real gloo ranks: a run saved at (dp 1, cp 2) resumes at (dp 2, cp 1),
(dp 1, cp 4) and under --fsdp, and checkpoints saved there resume back at (dp 1, cp 2): the losses
after the resume are those of an uninterrupted run at the new size (fp32, relative 1e-5) and the
final weights equal its weights. Under --fsdp every rank writes its own file; a flipped byte in a
shard is one line naming the file (--resume) or a fallback to the checkpoint before (auto resume);
a rank that cannot write its shard (a file-size limit) stops every rank with one line naming it;
--async-save writes the very checkpoints of a synchronous run.

Three jobs share their process groups: 2 ranks (most runs), 4 ranks, 2 ranks (back from cp 4).
"""

from __future__ import annotations

import resource
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks

from hyperpar_gdn.train import CheckpointError, SaveError, TrainConfig, Trainer, load_checkpoint
from hyperpar_gdn.train.checkpoints.directory import read_manifest

STEPS, SAVE = 6, 3
TINY = {"seq_len": 32, "batch_size": 4, "steps": STEPS, "seed": 3, "cp_mode": "p2p", "save_every": SAVE}
REL = 1e-5  # fp32: another CP/DP size or FSDP sums the same numbers in another order
WEIGHTS_ATOL = 1e-5  # the final weights, at the same CP size (FSDP or not)
ADAM_ATOL = 5e-4  # the final weights after steps 1..3 at another CP/DP size (see the test)


def _run(root: Path, name: str, **options: Any) -> list[float] | str:
    """A run saving under ``root/name``: its losses, or the message of a CheckpointError or a
    SaveError."""
    try:
        trainer = Trainer(TrainConfig(**{**TINY, "save": str(root / name), **options}))
    except CheckpointError as err:
        return str(err)
    try:
        return trainer.train().losses
    except SaveError as err:
        return str(err)
    finally:
        trainer.close()


def _resume(rank: int, root: Path, name: str, checkpoint: Path, **options: Any) -> dict[str, Any]:
    """A run resumed from ``checkpoint``: its losses, and (rank 0) the tensors of the model and
    AdamW state it loaded, gathered whole, that differ from the checkpoint's (none: exact)."""
    trainer = Trainer(TrainConfig(**{**TINY, "save": str(root / name), "resume": str(checkpoint), **options}))
    try:
        loaded = trainer.backend.state_dict()  # collective under FSDP: gathered on rank 0
        differ = None
        if rank == 0:
            saved = load_checkpoint(checkpoint)[1]
            differ = [k for k, t in saved["model"].items() if not torch.equal(loaded["model"][k], t)]
            for key, state in saved["optimizer"]["state"].items():
                mine = loaded["optimizer"]["state"][key]
                differ += [f"{key}.{k}" for k, t in state.items() if not torch.equal(mine[k], t)]
        return {"losses": trainer.train().losses, "differ": differ}
    finally:
        trainer.close()


def _two(rank: int, world: int, root: Path) -> dict[str, Any]:
    step = f"step-{SAVE}"
    out: dict[str, Any] = {}
    # first, while the job's rendezvous file is small (every rank appends to it)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill, as scripts/train.py
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:  # rank 1 cannot write its shard (about 1.5 MB); the log stays far below this
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, limit[1]))
    try:
        out["full"] = _run(root, "full", cp_size=2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    out["a"] = _run(root, "a", cp_size=2)  # saved at (dp 1, cp 2)
    out["b"] = _run(root, "b", cp_size=1)  # uninterrupted at (dp 2, cp 1)
    out["a@dp2"] = _resume(rank, root, "a@dp2", root / "a" / step, cp_size=1)
    out["b@cp2"] = _resume(rank, root, "b@cp2", root / "b" / step, cp_size=2)  # and back
    out["f"] = _run(root, "f", cp_size=2, fsdp=True)  # uninterrupted under --fsdp
    out["a@fsdp"] = _resume(rank, root, "a@fsdp", root / "a" / step, cp_size=2, fsdp=True)
    out["f@plain"] = _resume(rank, root, "f@plain", root / "f" / step, cp_size=2)  # and back
    out["async"] = _run(root, "async", cp_size=2, async_save=True)
    if rank == 0:  # a copy of a's checkpoints with one byte of a step-6 shard flipped
        shutil.copytree(root / "a", root / "bad")
        shard = root / "bad" / f"step-{STEPS}" / "state" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    torch.distributed.barrier()
    out["bad --resume"] = _run(root, "unused", cp_size=2, steps=8, resume=str(root / "bad" / f"step-{STEPS}"))
    out["bad auto"] = _run(root, "bad", cp_size=2)  # falls back to step-3, saves step-6 anew
    return out


def _four(rank: int, world: int, root: Path) -> dict[str, Any]:
    return {
        "g": _run(root, "g", cp_size=4),  # uninterrupted at (dp 1, cp 4)
        "a@cp4": _resume(rank, root, "a@cp4", root / "a" / f"step-{SAVE}", cp_size=4),
    }


def _back(rank: int, world: int, root: Path) -> dict[str, Any]:
    return {"g@cp2": _resume(rank, root, "g@cp2", root / "g" / f"step-{SAVE}", cp_size=2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("sharded")
    two = run_ranks(_two, 2, root, timeout_s=400)
    four = run_ranks(_four, 4, root, timeout_s=200)
    back = run_ranks(_back, 2, root, timeout_s=120)
    for results in (two, four, back):  # every rank reports the same losses and errors
        for key, value in results[0].items():
            if isinstance(value, dict):  # a resumed run: rank 0 alone compared the loaded state
                assert all(r[key]["losses"] == value["losses"] for r in results), key
            else:
                assert all(r[key] == value for r in results), key
    return root, {**two[0], **four[0], **back[0]}


def _final(root: Path, name: str) -> dict[str, dict[str, Any]]:
    return load_checkpoint(root / name / f"step-{STEPS}")[1]


def _assert_close_losses(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), what
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    assert worst <= REL, f"{what}: losses differ by {worst:.3g} (relative)"


@pytest.mark.timeout(800)
@pytest.mark.parametrize(
    "resumed, uninterrupted",
    [("a@dp2", "b"), ("b@cp2", "a"), ("a@fsdp", "f"), ("f@plain", "a"), ("a@cp4", "g"), ("g@cp2", "a")],
)
def test_resume_at_another_size_continues_the_run_at_that_size(
    runs: tuple[Path, dict[str, Any]], resumed: str, uninterrupted: str
) -> None:
    root, out = runs
    assert out[resumed]["differ"] == [], f"{resumed} loaded other values than its checkpoint holds"
    _assert_close_losses(out[resumed]["losses"], out[uninterrupted][SAVE:], f"{resumed} vs {uninterrupted}")
    got, want = _final(root, resumed), _final(root, uninterrupted)
    assert got["model"].keys() == want["model"].keys()
    # the same CP size: only FSDP's summation order differs; another CP/DP size: steps 1..3 were
    # rounded differently, and AdamW's normalized step turns a rounding-level difference of a
    # near-zero gradient into up to lr (1e-3) per step (measured: 1.5e-4 at most)
    same_size = {resumed.split("@")[0], uninterrupted} in ({"a", "f"},)
    atol = WEIGHTS_ATOL if same_size else ADAM_ATOL
    for name, tensor in want["model"].items():
        torch.testing.assert_close(got["model"][name], tensor, rtol=REL, atol=atol, msg=name)
    assert got["train"]["step"] == want["train"]["step"] == STEPS


@pytest.mark.timeout(800)
def test_under_fsdp_each_rank_writes_its_own_shard(runs: tuple[Path, dict[str, Any]]) -> None:
    root, _ = runs
    directory = root / "f" / f"step-{STEPS}"
    manifest = read_manifest(directory)
    sizes = {name: entry["bytes"] for name, entry in manifest["shards"].items() if name.endswith(".distcp")}
    assert sorted(sizes) == ["state/__0_0.distcp", "state/__1_0.distcp"]
    assert max(sizes.values()) < 0.6 * sum(sizes.values()), sizes  # no file holds most of the state
    assert sorted(manifest["parts"]) == ["data", "train"]
    assert not (directory / "model.pt").exists()
    whole = load_checkpoint(directory)[1]  # one host reads it whole: every parameter, full shape
    tensors = [*whole["model"].values()]
    tensors += [t for state in whole["optimizer"]["state"].values() for t in state.values()]
    assert sum(sizes.values()) >= sum(t.numel() * t.element_size() for t in tensors)  # all of it, once


@pytest.mark.timeout(800)
def test_a_flipped_byte_in_a_shard_is_named(runs: tuple[Path, dict[str, Any]]) -> None:
    root, out = runs
    shard = root / "bad" / f"step-{STEPS}" / "state" / "__1_0.distcp"
    message = out["bad --resume"]
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith(f"checkpoint file {shard} is corrupt: its size or sha256 differs"), message
    # auto resume skips it for step-3 and retrains steps 4..6 to the same losses
    assert out["bad auto"] == out["a"][SAVE:]
    with pytest.raises(CheckpointError, match="is corrupt"):  # one host: the same check
        bad = root / "bad-copy"
        shutil.copytree(root / "a" / f"step-{STEPS}", bad / f"step-{STEPS}")
        flipped = bad / f"step-{STEPS}" / "state" / "__0_0.distcp"
        data = bytearray(flipped.read_bytes())
        data[0] ^= 0xFF
        flipped.write_bytes(bytes(data))
        load_checkpoint(bad)


@pytest.mark.timeout(800)
def test_async_save_writes_the_checkpoints_of_a_synchronous_run(runs: tuple[Path, dict[str, Any]]) -> None:
    root, out = runs
    assert out["async"] == out["a"]
    for step in (SAVE, STEPS):
        got = load_checkpoint(root / "async" / f"step-{step}")[1]
        want = load_checkpoint(root / "a" / f"step-{step}")[1]
        for name, tensor in want["model"].items():
            assert torch.equal(got["model"][name], tensor), f"step-{step}: {name}"
        for name, state in want["optimizer"]["state"].items():
            for key, value in state.items():
                assert torch.equal(got["optimizer"]["state"][name][key], value), f"step-{step}: {name}.{key}"
    assert sorted(p.name for p in (root / "async").iterdir()) == [f"step-{SAVE}", f"step-{STEPS}"]


@pytest.mark.timeout(800)
def test_a_shard_that_cannot_be_written_stops_every_rank_with_one_line(
    runs: tuple[Path, dict[str, Any]],
) -> None:
    root, out = runs
    message = out["full"]  # the same on both ranks (the fixture checks): DCP gathers the failures
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith(
        f"could not save the step-{SAVE} checkpoint under {root / 'full'}: rank 1: OSError: [Errno 27] File too large"
    ), message
    assert message.endswith("no partial directory is left (--on-save-error stop)"), message
    assert list((root / "full").iterdir()) == []  # nothing visible, nothing hidden
