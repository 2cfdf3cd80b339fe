"""The torch side of ``bench_cp_model_mindspore.py``: the benchmark model written as a
transformers directory, and one rank timing transformers' model against ours on the whole
sequence (alternating rounds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench_cp_model import model_config

from benchkit.timing import alternating_rounds


def write_model_dir(path: Path, vocab: int) -> Path:
    """The benchmark model as a transformers directory (seed 0)."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.Qwen3_5ForCausalLM(model_config(vocab)).save_pretrained(path)
    return path


def measure_torch(rank: int, cp: int, job: dict[str, Any]) -> dict[str, Any]:
    """One rank: transformers' model and ours on the whole sequence (rounds alternate); the
    seconds and the mean loss of each."""
    import numpy as np
    import torch
    import transformers

    from hyperpar_gdn import apply_context_parallel, init_device_mesh

    ids = torch.tensor(token_ids(job["seq_len"], job["vocab"], np))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    models = {
        "transformers": transformers.AutoModelForCausalLM.from_pretrained(job["model_dir"]).train(),
        "ours": apply_context_parallel(
            transformers.AutoModelForCausalLM.from_pretrained(job["model_dir"]).train(), mesh, mode="p2p"
        ),
    }
    losses: dict[str, float] = {}

    def step(name: str) -> None:
        model = models[name]
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        loss.backward()
        losses[name] = float(loss.detach())

    times = alternating_rounds(
        {name: (lambda name=name: step(name)) for name in models},
        repeats=job["repeats"],
        warmup=job["warmup"],
    )
    return {"times_s": times, "loss": losses}


def token_ids(seq_len: int, vocab: int, np: Any) -> Any:
    """The benchmark's token ids ``[1, seq_len]`` (seed 1), made with the caller's numpy."""
    return np.random.default_rng(1).integers(0, vocab, (1, seq_len)).astype(np.int64)
