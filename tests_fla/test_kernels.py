"""The local-kernel interface (:mod:`hyperpar_gdn.ops.gdn.kernels`) with fla installed: which kernel
``auto``, ``fla`` and ``native`` resolve to and the errors; importing the package imports no
triton; a layer's one-token decode steps on fla's fused recurrent kernel equal ours."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from oracles import rel_err
from tiny_models import move_off_init

from hyperpar_gdn.models import GatedDeltaNet
from hyperpar_gdn.ops.gdn.decode import gdn_decode_step
from hyperpar_gdn.ops.gdn.kernels import FLA_CALLS, kernel_for_inputs, resolve_kernel
from hyperpar_gdn.ops.gdn.layer import LayerDims, LayerWeights
from hyperpar_gdn.platform import ops_for


def test_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_kernel("native", platform="cuda").name == "native"
    auto_cpu = resolve_kernel("auto", platform="cpu")
    assert auto_cpu.name == "native" and "need CUDA or Ascend" in auto_cpu.reason
    assert resolve_kernel("auto", platform="cuda").name == "fla"  # fla and triton import here
    forced = resolve_kernel("fla", platform="cpu")
    assert forced.name == "fla" and "interpreter" in forced.reason
    auto_ms = resolve_kernel("auto", platform="mindspore")
    assert auto_ms.name == "native" and "MindSpore keeps the native kernel" in auto_ms.reason
    with pytest.raises(ValueError, match="kernel='fla' cannot run on platform 'mindspore'"):
        resolve_kernel("fla", platform="mindspore")
    with pytest.raises(
        ValueError, match="kernel='triton' is not a GDN kernel; choose one of auto, fla, native"
    ):
        resolve_kernel("triton", platform="cuda")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"cannot run on platform 'cpu': .*TRITON_INTERPRET=1"):
        resolve_kernel("fla", platform="cpu")


def test_float64_refused_by_fla_falls_back_under_auto_only() -> None:
    x = torch.zeros(1, 2, 3, dtype=torch.float64)
    assert kernel_for_inputs("fla", "auto", x) == "native"
    with pytest.raises(
        ValueError, match="kernel='fla': fla's kernels take fp32, bf16 or fp16 inputs, not float64"
    ):
        kernel_for_inputs("fla", "fla", x)
    assert kernel_for_inputs("fla", "fla", x.float()) == "fla"


def test_importing_the_package_imports_no_triton() -> None:
    code = (
        "import sys, hyperpar_gdn, hyperpar_gdn.ops.gdn.kernels, hyperpar_gdn.distributed.linear_attention_style\n"
        "assert 'triton' not in sys.modules and 'fla' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_decode_steps_on_fla_equal_ours() -> None:
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 4, 32, 32)
    move_off_init(layer, 0.1, dt_bias_shift=-4.0)
    xp = ops_for(layer.A_log)
    w, dims = LayerWeights.of(layer), LayerDims.of(layer)
    conv = torch.randn(2, dims.conv_dim, dims.conv_kernel_size)
    states = {
        kernel: (conv, torch.randn(2, 4, 32, 32, generator=torch.Generator().manual_seed(1)))
        for kernel in ("fla", "native")
    }
    FLA_CALLS.clear()
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(2, 1, 32)
            out = {}
            for kernel, (c, s) in states.items():
                y, c, s = gdn_decode_step(xp, w, dims, x, c, s, kernel=kernel)
                out[kernel], states[kernel] = y, (c, s)
            assert rel_err(out["fla"], out["native"]) < 1e-5, (step, rel_err(out["fla"], out["native"]))
            assert rel_err(states["fla"][1], states["native"][1]) < 1e-5
    assert FLA_CALLS == {"recurrent": 3}


def test_model_decode_steps_on_fla_equal_ours() -> None:
    """Our HybridLM (GDN heads of K = V = 32) after a prompt: decode steps with gdn_kernel="fla"
    give ours' logits (1e-5) and greedy tokens, one fla recurrent call per GDN layer and step."""
    from hyperpar_gdn.inference.decoding import decode_step, prefill
    from hyperpar_gdn.models import HybridLM, HybridLMConfig

    torch.manual_seed(0)
    config = HybridLMConfig(
        num_layers=4, vocab_size=61, initializer_range=0.3, linear_key_head_dim=32, linear_value_head_dim=32
    )
    model = HybridLM(config).eval()
    ids = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(1))
    logits, state = prefill(model, ids)
    states = {"fla": state, "native": state}
    token = logits.argmax(-1, keepdim=True)
    FLA_CALLS.clear()
    for step in range(3):
        out = {}
        for kernel in states:
            out[kernel], states[kernel] = decode_step(model, states[kernel], token, gdn_kernel=kernel)
        assert rel_err(out["fla"], out["native"]) < 1e-5, (step, rel_err(out["fla"], out["native"]))
        assert torch.equal(out["fla"].argmax(-1), out["native"].argmax(-1))
        token = out["native"].argmax(-1, keepdim=True)
    gdn_layers = sum(block.layer_type == "linear_attention" for block in model.layers)
    assert FLA_CALLS == {"recurrent": 3 * gdn_layers}
