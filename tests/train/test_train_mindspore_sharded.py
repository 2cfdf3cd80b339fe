"""MindSpore's sharded checkpoints (the replicated layout, the default): a run saved at cp 2 under
msrun resumes at cp 1, a cp 1 save resumes at cp 2, and a whole checkpoint (format 1) of cp 1 at
cp 2: the losses after each resume are those of an uninterrupted run at the new size (fp32,
relative 1e-5). Both msrun workers write a part and neither holds most of the state; a flipped
byte in a part is one line naming the file; --async-save (the resume of the whole checkpoint)
writes the tensors of the synchronous save (the resume of the sharded one, the same state); the
converter reads the checkpoint; torch refuses it in one line, and MindSpore a torch one.

One msrun job (2 workers) runs every cp 2 run in turn; the cp 1 runs are one-process MindSpore
worlds in the test process, before the job (the checkpoints it resumes) and after it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks

pytest.importorskip("mindspore")

from msrun_harness import run_msrun  # noqa: E402
from torch_training import torch_losses, torch_resume_error  # noqa: E402

from hyperpar_gdn.train import CheckpointError, TrainConfig, load_checkpoint  # noqa: E402
from hyperpar_gdn.train.checkpoints.convert import convert  # noqa: E402
from hyperpar_gdn.train.checkpoints.directory import read_manifest
from hyperpar_gdn.train.checkpoints.replicated_shards import read_part  # noqa: E402

WORKER = Path(__file__).resolve().parent / "msrun_train_worker.py"
OPTIONS: dict[str, Any] = {"seq_len": 32, "batch_size": 2, "steps": 4, "seed": 5, "save_every": 2}
CP_MODE = "all_gather"
REL = 1e-5  # fp32: the same sums in another order at another CP size
NO_SAVES = {key: value for key, value in OPTIONS.items() if key != "save_every"}  # --save-every needs --save

pytestmark = pytest.mark.timeout(600)  # the shared msrun job runs inside the first test


def _flags(options: dict[str, Any]) -> list[str]:
    return [f"--{key.replace('_', '-')}={value}" for key, value in options.items()]


def _ms_train(**options: Any) -> list[float]:
    from hyperpar_gdn.train.backends.mindspore_backend import MindSporeTrainer

    trainer = MindSporeTrainer(TrainConfig(**{**OPTIONS, **options}))  # a 1-rank local world
    try:
        return trainer.train().losses
    finally:
        trainer.close()


_ROOT = tempfile.TemporaryDirectory(prefix="hp-ms-sharded-")  # removed when the session ends


@cache
def _runs() -> tuple[Path, dict[str, Any]]:
    """Every run, once: cp 1 here (before and after the job), cp 2 in one msrun job."""
    root = Path(_ROOT.name)
    out: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HP_PLATFORM", "mindspore")
        out["one"] = _ms_train(save=str(root / "one"))  # cp 1, sharded: the default
        out["whole"] = _ms_train(save=str(root / "whole"), steps=2, checkpoint_format="whole")
        cp2 = {**OPTIONS, "cp_mode": CP_MODE}
        runs = {
            "two": _flags({**cp2, "save": root / "two"}),  # cp 2, uninterrupted
            "from_one": _flags({**cp2, "save": root / "from_one", "resume": root / "one" / "step-2"}),
            # the same state as from_one's (the cp 1 runs are the same computation), saved in the background
            "from_whole": [
                *_flags({**cp2, "save": root / "from_whole", "resume": root / "whole" / "step-2"}),
                "--async-save",
            ],
        }
        (root / "runs.json").write_text(json.dumps(runs))
        job = run_msrun(
            WORKER, 2, ["--sections", "runs", "--runs-json", str(root / "runs.json")], timeout_s=480
        )
        out["job"] = job
        entries = [{} if r is None else r["sections"].get("runs", {}) for r in job.results]
        out["errors"] = "\n".join(entry.get("error", "") for entry in entries)
        if job.ok and all(entry.get("ok") for entry in entries):
            out["cp2"], out["cp2_rank1"] = entries[0]["data"], entries[1]["data"]
            out["from_two"] = _ms_train(save=str(root / "from_two"), resume=str(root / "two" / "step-2"))
    return root, out


def _cp2(name: str) -> dict[str, Any]:
    root, out = _runs()
    assert "cp2" in out, f"{out['errors']}\n{out['job'].describe()}"
    result = out["cp2"][name]
    assert result["exit_code"] == out["cp2_rank1"][name]["exit_code"] == 0, (name, out["job"].describe())
    return result


def _assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), (what, got, want)
    rel = [abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)]
    assert max(rel) <= REL, f"{what}: {got} vs {want} (relative {max(rel):.2e})"


def test_a_cp2_save_resumes_at_cp1_as_an_uninterrupted_cp1_run() -> None:
    root, out = _runs()
    two = _cp2("two")
    assert (two["cp_size"], two["world_size"]) == (2, 2)
    assert read_manifest(root / "two" / "step-2")["meta"]["cp"] == 2
    _assert_close(out["from_two"], out["one"][2:], "cp 2 -> cp 1")


def test_a_cp1_save_and_a_whole_checkpoint_resume_at_cp2_as_an_uninterrupted_cp2_run() -> None:
    root, out = _runs()
    two = _cp2("two")
    for name in ("from_one", "from_whole"):
        resumed = _cp2(name)
        assert resumed["steps"] == [3, 4], resumed
        _assert_close(resumed["losses"], two["losses"][2:], f"{name} at cp 2")
    assert out["whole"] == out["one"][:2]  # the format does not change training
    assert read_manifest(root / "whole" / "step-2")["format"] == 1


def test_each_rank_writes_its_part_and_the_manifest_says_the_world_size() -> None:
    root, _ = _runs()
    _cp2("two")
    step = root / "two" / "step-2"
    manifest = read_manifest(step)
    assert (manifest["format"], manifest["layout"]) == (2, "replicated")
    assert (manifest["meta"]["world_size"], manifest["meta"]["cp"]) == (2, 2)
    parts = {
        name: entry["bytes"] for name, entry in manifest["shards"].items() if name.endswith(".safetensors")
    }
    assert sorted(parts) == ["state/rank-0.safetensors", "state/rank-1.safetensors"], manifest["shards"]
    assert max(parts.values()) < 0.55 * sum(parts.values()), parts  # no file holds most of the state
    keys = [set(read_part(step / name)) for name in sorted(parts)]
    assert keys[0] and keys[1] and not keys[0] & keys[1]  # disjoint, and each rank wrote tensors
    index = json.loads((step / "state" / "index.json").read_text())
    assert index["world_size"] == 2
    _, whole, _ = load_checkpoint(step)  # every part read: the whole state, as the whole format has it
    model = whole["model"]
    optimizer = whole["optimizer"]
    assert len(keys[0] | keys[1]) == len(model) + 2 * len(optimizer["names"])
    assert optimizer["steps"] == 2 and optimizer["format"].startswith(
        "hyperpar_gdn.train.backends.mindspore_backend"
    )
    from hyperpar_gdn.models.lm import HybridLM
    from hyperpar_gdn.train import MODEL_SIZES

    HybridLM(MODEL_SIZES["tiny"]).load_state_dict(model)  # strict: the torch model's names and shapes


def test_a_flipped_byte_in_a_part_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyperpar_gdn.train.backends.mindspore_backend import MindSporeTrainer

    root, _ = _runs()
    _cp2("two")
    bad = root / "bad" / "step-2"
    shutil.copytree(root / "two" / "step-2", bad)
    part = bad / "state" / "rank-1.safetensors"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x10
    part.write_bytes(bytes(data))
    monkeypatch.setenv("HP_PLATFORM", "mindspore")
    with pytest.raises(CheckpointError) as caught:
        MindSporeTrainer(TrainConfig(**NO_SAVES, resume=str(bad)))
    assert str(caught.value) == (
        f"checkpoint file {part} is corrupt: its size or sha256 differs from {bad / 'manifest.json'}"
    )


def test_async_save_writes_the_tensors_of_the_synchronous_save() -> None:
    """from_whole (--async-save) and from_one resume the same state: the same run, saved in the
    background or not."""
    root, _ = _runs()
    assert _cp2("from_whole")["losses"] == _cp2("from_one")["losses"]
    assert sorted(p.name for p in (root / "from_whole").iterdir()) == ["step-4"]  # committed at the end
    _, sync, _ = load_checkpoint(root / "from_one" / "step-4")
    _, background, _ = load_checkpoint(root / "from_whole" / "step-4")
    assert sync["model"].keys() == background["model"].keys()
    assert all(torch.equal(sync["model"][k], background["model"][k]) for k in sync["model"])
    for moment in ("exp_avg", "exp_avg_sq"):
        pairs = zip(sync["optimizer"][moment], background["optimizer"][moment], strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)


def test_the_converter_reads_it_and_torch_refuses_it_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = _runs()
    _cp2("two")
    written = convert(root / "two", tmp_path, to="whole")
    assert written == tmp_path / "step-4" and read_manifest(written)["format"] == 1
    _, converted, meta = load_checkpoint(written)
    _, sharded, _ = load_checkpoint(root / "two" / "step-4")
    assert meta["world_size"] == 2
    assert all(torch.equal(converted["model"][k], t) for k, t in sharded["model"].items())
    assert converted["optimizer"]["names"] == sharded["optimizer"]["names"]
    monkeypatch.setenv("HP_PLATFORM", "cpu")
    options = {**NO_SAVES, "steps": 6, "resume": str(root / "two")}
    message = run_ranks(torch_resume_error, 1, options, timeout_s=120)[0]
    assert "\n" not in message and "per-rank parts of a replicated state" in message, message
    assert "HP_PLATFORM=mindspore" in message, message


def test_a_torch_sharded_checkpoint_is_refused_on_mindspore_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hyperpar_gdn.train.backends.mindspore_backend import MindSporeTrainer

    monkeypatch.setenv("HP_PLATFORM", "cpu")
    run_ranks(torch_losses, 1, {**OPTIONS, "steps": 2, "save": str(tmp_path)}, timeout_s=120)
    assert read_manifest(tmp_path / "step-2")["layout"] == "dcp"
    monkeypatch.setenv("HP_PLATFORM", "mindspore")
    with pytest.raises(ValueError) as caught:
        MindSporeTrainer(TrainConfig(**NO_SAVES, resume=str(tmp_path)))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"checkpoint {tmp_path} is sharded by torch's DCP")
    assert "HP_PLATFORM=cpu|cuda|npu" in message, message
