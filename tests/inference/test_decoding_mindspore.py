"""Greedy generation of the MindSpore Qwen3.5 model (dense and MoE, fp32) from a transformers
directory equals transformers' ``generate(do_sample=False)`` token for token; its steps' logits
equal transformers' cached steps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

ms = pytest.importorskip("mindspore")
transformers = pytest.importorskip("transformers")

from tiny_models import GENERATION_VOCAB, generation_model  # noqa: E402

from hyperpar_gdn.inference.decoding import decode_step, greedy_generate, prefill  # noqa: E402
from hyperpar_gdn.models.mindspore import Qwen3_5ForCausalLM  # noqa: E402

NEW_TOKENS = 16
LOGIT_TOL = 1e-4  # two frameworks' fp32 kernels (as the model's own logit test)


pytestmark = pytest.mark.usefixtures("mindspore_pynative")


def write_tiny_model(moe: bool, out: Path) -> Path:
    """The decoding tests' model (its weights peaked: no near ties between the frameworks' argmax;
    transformers' default decay), saved to ``out``."""
    generation_model(moe=moe, dt_bias_shift=None).save_pretrained(out)
    return out


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_greedy_generate_equals_transformers(moe: bool, tmp_path: Path) -> None:
    path = write_tiny_model(moe, tmp_path / "model")
    ids = np.random.default_rng(1).integers(1, GENERATION_VOCAB, (2, 21)).astype(np.int64)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = reference.generate(torch.from_numpy(ids), max_new_tokens=NEW_TOKENS, do_sample=False).numpy()
    model = Qwen3_5ForCausalLM.from_pretrained(path)
    got = greedy_generate(model, ms.Tensor(ids), max_new_tokens=NEW_TOKENS).asnumpy()
    assert got.shape == expected.shape == (2, 21 + NEW_TOKENS)
    np.testing.assert_array_equal(got, expected)
    assert len(set(got[0, 21:].tolist())) > 1, "a constant continuation would not test the steps"

    # the logits of the prompt's last token and of two steps, against transformers' cached forward
    logits, state = prefill(model, ms.Tensor(ids))
    with torch.no_grad():
        out = reference(input_ids=torch.from_numpy(ids), use_cache=True)
        ref_logits, cache = [out.logits[:, -1].numpy()], out.cache
        for t in range(2):
            step = torch.from_numpy(expected[:, 21 + t : 22 + t])
            out = reference(input_ids=step, cache=cache, use_cache=True)
            ref_logits.append(out.logits[:, -1].numpy())
            cache = out.cache
    ours = [logits.asnumpy()]
    for t in range(2):
        logits, state = decode_step(model, state, ms.Tensor(expected[:, 21 + t : 22 + t]))
        ours.append(logits.asnumpy())
    for i, (a, b) in enumerate(zip(ours, ref_logits, strict=True)):
        err = float(np.abs(a - b).max() / np.abs(b).max())
        assert err <= LOGIT_TOL, f"step {i}: relative logit error {err:.2e}"
