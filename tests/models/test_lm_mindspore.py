"""The MindSpore HybridLM against the torch one with copied weights, on one process: parameter
names, logits, the training loss and every parameter gradient (fp32 and fp64); and the MindSpore
AdamW with clipping against torch's over a few steps, and its first steps log no recompile warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

ms = pytest.importorskip("mindspore")

from tiny_models import TINY_LM, move_off_init  # noqa: E402

from hyperpar_gdn.models.lm import HybridLM as TorchHybridLM  # noqa: E402
from hyperpar_gdn.models.mindspore import HybridLM, load_torch_state_dict  # noqa: E402
from hyperpar_gdn.platform import ops_for  # noqa: E402
from hyperpar_gdn.train.backends.mindspore_adamw import AdamW, clip_grad_norm  # noqa: E402

# Relative to the tensor's largest entry (gradients: to the largest gradient). fp32: docs/maths.md's
# 1e-4; measured 3.3e-5 (each module agrees to 3e-6, the 4 blocks of perturbed weights amplify it).
# fp64: RoPE angles are fp32 (numpy) whatever the dtype, on both frameworks (RMSNorm is fp64 since it
# moved to ops.blocks), so fp32 rounding enters both; measured 2.9e-6 before that move.
TOL = {"float32": 1e-4, "float64": 2e-5}


pytestmark = pytest.mark.usefixtures("mindspore_pynative")


def _torch_model(dtype: torch.dtype) -> TorchHybridLM:
    torch.manual_seed(0)
    model = TorchHybridLM(TINY_LM)
    move_off_init(model, 0.1)  # every gradient is exercised
    return model.to(dtype)


def _rel(actual: Any, expected: torch.Tensor) -> float:
    expected_np = expected.detach().numpy()
    scale = max(float(np.abs(expected_np).max()), 1e-30)
    return float(np.abs(actual.asnumpy() - expected_np).max()) / scale


def test_parameter_names_and_shapes_equal_torchs() -> None:
    torch_model = TorchHybridLM(TINY_LM)
    ms_model = HybridLM(TINY_LM)
    ms_shapes = {name: tuple(p.shape) for name, p in ms_model.parameters_and_names()}
    assert ms_shapes == {name: tuple(p.shape) for name, p in torch_model.named_parameters()}
    assert ms_model.num_parameters() == torch_model.num_parameters()
    kinds = [type(block.mixer).__name__ for block in ms_model.layers]
    assert kinds == ["GatedDeltaNet"] * 3 + ["CausalSelfAttention"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_logits_loss_and_gradients_equal_torchs(dtype: torch.dtype) -> None:
    torch_model = _torch_model(dtype)
    ms_model = HybridLM.from_torch(torch_model)
    tokens = torch.randint(0, 256, (2, 41), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    logits_ref = torch_model(inputs)
    loss_ref = F.cross_entropy(logits_ref.reshape(-1, 256), labels.reshape(-1))
    loss_ref.backward()

    params = list(ms_model.get_parameters())
    names = [name for name, _ in ms_model.parameters_and_names()]

    def loss_fn(x: Any, y: Any) -> tuple[Any, Any]:
        logits = ms_model(x)
        return ops_for(logits).cross_entropy_sum(logits, y) / labels.numel(), logits

    grad_fn = ms.value_and_grad(loss_fn, None, params, has_aux=True)
    (loss, logits), grads = grad_fn(ms.Tensor(inputs.numpy()), ms.Tensor(labels.numpy()))

    tol = TOL[str(dtype).removeprefix("torch.")]
    assert logits.dtype == (ms.float64 if dtype == torch.float64 else ms.float32)
    errors = {"logits": _rel(logits, logits_ref), "loss": _rel(loss, loss_ref)}
    torch_params = dict(torch_model.named_parameters())
    # Gradients relative to the largest one: the decay gradients (A_log, dt_bias) are sums with
    # heavy cancellation, so their own scale is no measure of rounding (as in the torch CP test).
    grad_scale = max(float(p.grad.abs().max()) for p in torch_params.values())
    for name, grad in zip(names, grads, strict=True):
        diff = np.abs(grad.asnumpy() - torch_params[name].grad.numpy()).max()
        errors[f"d{name}"] = float(diff) / grad_scale
    assert len(errors) == 2 + len(torch_params)
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert not bad, f"errors above {tol}: {bad}"


def test_from_torch_refuses_different_parameters() -> None:
    torch_model = TorchHybridLM(TINY_LM)
    state = torch_model.state_dict()
    state.pop("layers.3.self_attn.q_norm.weight")
    with pytest.raises(ValueError, match=r"lacks \['layers\.3\.self_attn\.q_norm\.weight'\]"):
        load_torch_state_dict(HybridLM(TINY_LM), state)
    with pytest.raises(TypeError, match="needs a torch hyperpar_gdn.models.lm.HybridLM"):
        HybridLM.from_torch(torch.nn.Linear(2, 2))


def test_adamw_with_clipping_follows_torch() -> None:
    """Five steps of torch's AdamW (weight decay on matrices only) with clip_grad_norm_, fed the
    same gradients, leave the same parameters (fp32 rounding only)."""
    generator = torch.Generator().manual_seed(2)
    shapes = [(6, 5), (5,), (3, 4, 2)]
    torch_params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
    ms_params = [
        ms.Parameter(ms.Tensor(p.detach().numpy().copy()), name=f"p{i}") for i, p in enumerate(torch_params)
    ]
    decay = [p for p in torch_params if p.dim() >= 2]
    rest = [p for p in torch_params if p.dim() < 2]
    torch_opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    ms_opt = AdamW(ms_params, weight_decay=0.1)
    norms = []
    for step in range(1, 6):
        grads = [torch.randn(s, generator=generator) * step for s in shapes]
        for p, g in zip(torch_params, grads, strict=True):
            p.grad = g.clone()
        torch_norm = torch.nn.utils.clip_grad_norm_(torch_params, 1.0).item()
        lr = 1e-2 * min(1.0, step / 3)
        for group in torch_opt.param_groups:
            group["lr"] = lr
        torch_opt.step()
        clipped, ms_norm = clip_grad_norm([ms.Tensor(g.numpy()) for g in grads], 1.0)
        ms_opt.step(clipped, lr)
        norms.append((ms_norm, torch_norm))
    assert all(abs(a - b) <= 1e-5 * b for a, b in norms), norms
    assert all(b > 1.0 for _, b in norms)  # every step was clipped
    for i, (ms_p, torch_p) in enumerate(zip(ms_params, torch_params, strict=True)):
        moved = float((torch_p.detach() - torch.from_numpy(ms_p.asnumpy())).abs().max())
        assert moved <= 1e-6, f"parameter {i}: max difference {moved}"
        assert ms_opt.exp_avg[i].shape == tuple(torch_p.shape)


# A fresh interpreter: MindSpore remembers compiled functions per process, and its logger writes to
# stderr. Two groups (decay and no decay), so the library AdamW compiles its step twice.
TWO_GROUP_STEPS = r"""
import mindspore as ms
import numpy as np
from hyperpar_gdn.train.backends.mindspore_adamw import AdamW

ms.set_context(mode=ms.PYNATIVE_MODE)
shapes = [(6, 5), (5,), (3,)]
params = [ms.Parameter(ms.Tensor(np.ones(s, np.float32)), name=f"p{i}") for i, s in enumerate(shapes)]
optimizer = AdamW(params, weight_decay=0.1)
for step in range(2):
    optimizer.step([ms.Tensor(np.full(s, 0.5, np.float32)) for s in shapes], 1e-2)
print("steps", optimizer.steps)
"""


@pytest.mark.timeout(240)
def test_adamw_steps_log_no_recompile_warning() -> None:
    """The first step compiles the library AdamW's update once per group; MindSpore would then log a
    "might cause recompiling" warning printing every gradient of the group (13 KB per rank with the
    tiny preset, more with wider models) unless the gradients are marked variables, as
    :meth:`AdamW.step` does."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "GLOG_v": "2"}
    done = subprocess.run(
        [sys.executable, "-c", TWO_GROUP_STEPS], capture_output=True, text=True, env=env, timeout=200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "steps 2", done.stdout
    assert "recompil" not in done.stderr, done.stderr[:3000]
