"""msrun worker for tests/train/test_train_mindspore.py (one 2-worker job, these sections) and
tests/train/test_train_mindspore_sharded.py (its `runs` section).

- ``lm_cp``: the MindSpore HybridLM under ``apply_context_parallel`` in every mode against the
  single-device MindSpore model with the same fp64 weights: logits shard and every parameter
  gradient summed over the ranks (relative errors), then ``undo_context_parallel``; in the
  contiguous and the head_tail token layouts;
- ``qwen_cp``: the same for the MindSpore Qwen3_5ForCausalLM of each ``--qwen-dirs`` directory
  (dense and MoE), loaded in fp64 and moved off its init;
- ``train``: ``scripts/train.py`` (its ``main``, as msrun would run it) with the options after
  ``--``; rank 0 returns the losses of its ``--metrics-json``; ``train_ac``: the same with ``--ac``;
  ``train_packed``: the same on ``--packed-data`` (documents packed with boundaries);
- ``train_model``: the same with ``--model`` (the first ``--qwen-dirs`` entry) and
  ``--export`` (``--export-dir``);
- ``runs``: ``scripts/train.py`` once per entry of ``--runs-json`` (a JSON object: name -> its
  command line), in order; the data is each run's, by name.

Each rank writes ``{"rank", "sections": {name: {"ok", "seconds", "data" or "error"}}}``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # msrun_harness, tiny_models

from msrun_harness import start_watchdog, write_result  # noqa: E402

MODES = ("ulysses", "p2p", "all_gather")


def _rel(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def lm_cp_section(platform: Any) -> dict[str, Any]:
    import torch
    from tiny_models import TINY_LM, move_off_init

    from hyperpar_gdn.models.lm import HybridLM as TorchHybridLM
    from hyperpar_gdn.models.mindspore import HybridLM

    torch.manual_seed(0)
    initial = TorchHybridLM(TINY_LM)
    move_off_init(initial, 0.1)  # every gradient is exercised
    initial = initial.to(torch.float64)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1)).numpy()
    return cp_errors(platform, lambda: HybridLM.from_torch(initial), ids)


def qwen_cp_section(platform: Any, model_dirs: list[str]) -> dict[str, Any]:
    import mindspore as ms

    from hyperpar_gdn.models.mindspore import Qwen3_5ForCausalLM

    def build(path: str) -> Any:
        model = Qwen3_5ForCausalLM.from_pretrained(path, dtype="float64")
        rng = np.random.default_rng(0)  # off the init (zero norms, ones): every gradient shows
        for param in model.get_parameters():
            noise = 0.1 * rng.standard_normal(tuple(param.shape))
            param.set_data(param.value() + ms.Tensor(noise, ms.float64))
        return model

    out = {}
    for path in model_dirs:
        vocab = build(path).config.vocab_size
        ids = np.random.default_rng(1).integers(0, vocab, (2, 40)).astype(np.int64)
        # head_tail on the dense model only (the MoE one adds nothing to the layout, and time)
        layouts = ("contiguous", "head_tail") if Path(path).name == "dense" else ("contiguous",)
        out[Path(path).name] = cp_errors(platform, lambda path=path: build(path), ids, layouts=layouts)
    return out


def cp_errors(
    platform: Any, build: Any, ids: np.ndarray, *, layouts: tuple[str, ...] = ("contiguous", "head_tail")
) -> dict[str, dict[str, float]]:
    """Per mode (``mode``, and ``mode/head_tail`` in the head_tail layout): relative errors of the CP
    logits shard, of every parameter gradient summed over the ranks, and of the logits after
    ``undo_context_parallel``, against ``build()`` run whole."""
    import mindspore as ms
    from mindspore import ops

    from hyperpar_gdn import init_device_mesh
    from hyperpar_gdn.distributed.layout import TokenLayout
    from hyperpar_gdn.distributed.parallelize import apply_context_parallel, undo_context_parallel

    rank, world = platform.rank(), platform.world_size()
    mesh = init_device_mesh("mindspore", (world,), mesh_dim_names=("cp",))
    t = ids.shape[1] // world

    def run(model: Any, inputs: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        names = [name for name, _ in model.parameters_and_names()]

        def loss(x: Any) -> tuple[Any, Any]:
            logits = model(x)
            return ops.logsumexp(logits, -1).sum(), logits

        grad_fn = ms.value_and_grad(loss, None, list(model.get_parameters()), has_aux=True)
        (_, logits), grads = grad_fn(ms.Tensor(inputs))
        return logits.asnumpy(), {n: g.asnumpy() for n, g in zip(names, grads, strict=True)}

    logits_ref, grads_ref = run(build(), ids)
    out: dict[str, Any] = {}
    for layout in layouts:
        shard = TokenLayout.of(layout, [t] * world).positions(rank)
        for mode in MODES:
            model = build()
            apply_context_parallel(model, mesh, mode=mode, layout=layout)
            logits, grads = run(model, ids[:, shard])
            errors = {"logits": _rel(logits, logits_ref[:, shard])}
            for name, grad in grads.items():
                summed = platform.collectives.all_reduce_sum(ms.Tensor(grad), mesh.get_group()).asnumpy()
                errors[f"d{name}"] = _rel(summed, grads_ref[name])
            undo_context_parallel(model)
            errors["undo"] = _rel(model(ms.Tensor(ids)).asnumpy(), logits_ref)
            out[mode if layout == "contiguous" else f"{mode}/{layout}"] = errors
    return out


def train_section(platform: Any, options: list[str]) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with tempfile.TemporaryDirectory() as tmp:
        metrics_path = Path(tmp) / "metrics.json"
        code = script.main([*options, "--metrics-json", str(metrics_path)])
        metrics = json.loads(metrics_path.read_text()) if platform.rank() == 0 else None
    data: dict[str, Any] = {"exit_code": code}
    if metrics is not None:
        keys = (
            "losses",
            "steps",
            "platform",
            "world_size",
            "cp_size",
            "dp_size",
            "num_parameters",
            "parity",
            "tokens_per_s",
        )
        for key in keys:
            data[key] = metrics[key]
    return data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", nargs="+", default=["lm_cp", "train"])
    parser.add_argument("--qwen-dirs", nargs="*", default=[], help="transformers Qwen3.5 directories")
    parser.add_argument("--export-dir", default=None, help="train_model's --export")
    parser.add_argument("--packed-data", default=None, help="train_packed's --data (several documents)")
    parser.add_argument("--runs-json", default=None, help="runs: a JSON file, name -> command line")
    parser.add_argument("train_options", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    train_options = [a for a in args.train_options if a != "--"]
    start_watchdog()

    from hyperpar_gdn.platform import get_platform

    platform = get_platform()
    platform.init_distributed(timeout_s=60)
    rank = platform.rank()
    result: dict[str, Any] = {"rank": rank, "sections": {}}
    for section in args.sections:
        start = time.perf_counter()
        try:
            if section == "lm_cp":
                data = lm_cp_section(platform)
            elif section == "qwen_cp":
                data = qwen_cp_section(platform, args.qwen_dirs)
            elif section == "train":
                data = train_section(platform, train_options)
            elif section == "train_ac":  # the same run with activation checkpointing
                data = train_section(platform, [*train_options, "--ac"])
            elif section == "train_packed":  # documents packed with boundaries (the default)
                data = train_section(platform, [*train_options, "--data", args.packed_data])
            elif section == "runs":
                runs = json.loads(Path(args.runs_json).read_text())
                data = {name: train_section(platform, options) for name, options in runs.items()}
            elif section == "train_model":
                model_options = ["--model", args.qwen_dirs[0], "--export", args.export_dir]
                data = train_section(platform, [*train_options, *model_options])
            else:
                raise ValueError(f"unknown section {section!r}")
            entry = {"ok": True, "data": data}
        except Exception:
            entry = {"ok": False, "error": traceback.format_exc()}
        entry["seconds"] = time.perf_counter() - start
        result["sections"][section] = entry
        write_result(rank, result)
    platform.destroy()


if __name__ == "__main__":
    main()
