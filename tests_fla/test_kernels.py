"""The local-kernel interface (:mod:`hyperpar_gdn.ops.gdn.kernels`) with fla installed: which kernel
``auto``, ``fla`` and ``native`` resolve to and the errors; importing the package imports no
triton; a layer's one-token decode steps on fla's fused recurrent kernel equal ours."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
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


class _Exchange:
    """One shard alone: no state enters it (S_in = 0) and none leaves it (dS_out = 0)."""

    def forward(self, s_ext: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        return torch.zeros_like(s_ext)

    def backward(self, ds_in: torch.Tensor | None) -> torch.Tensor:
        raise AssertionError("forward only")


def test_state_mode_calls_run_flas_triton_kernel_past_its_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend registered with fla (as FlashQLA is on Hopper) is asked about every dispatched call:
    a whole sequence's call reaches it, a state mode's plain and widened shard calls do not (they
    run fla's Triton kernel on every rank of a chain)."""
    from fla.backends import BaseBackend, register

    from hyperpar_gdn.ops.gdn import fla_kernel

    widths: list[int] = []

    class Recording(BaseBackend):  # declines every call after noting its value width
        backend_type = "hp_recording"
        env_var = "HP_RECORDING_BACKEND"
        default_enable = False  # off outside this test
        priority = 0

        def chunk_gated_delta_rule_verifier(self, q, k, v, *args, **kwargs):
            widths.append(v.shape[-1])
            return False, "recording only"

    register("gated_delta_rule")(Recording)
    monkeypatch.setenv("HP_RECORDING_BACKEND", "1")
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 64, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(1, 64, 4, 16, generator=gen)
    g = -torch.rand(1, 64, 4, generator=gen)
    beta = torch.rand(1, 64, 4, generator=gen)
    with torch.no_grad():
        fla_kernel.plain_call(q, k, v, g, beta)
        assert widths == [16]
        for widened in (False, True):
            fla_kernel.shard_call(q, k, v, g, beta, _Exchange(), widened=widened)
            fla_kernel.shard_call(
                q, k, v, g, beta, _Exchange(), widened=widened, doc_starts=np.arange(64) % 40 == 0
            )
    assert widths == [16], widths
