"""What one GDN layer's forward with ``kernel="fla"`` keeps for its backward, at 16K tokens per
rank: the widened call (a rank that receives a state) against the plain call (rank 0), counted
with saved-tensor hooks as the storages the saved tensors hold (a saved view holds all of its
base). fla's Triton kernel cannot run here (no triton in this environment), so its autograd
function is stood in for by one that saves what fla 0.6's ``ChunkGatedDeltaRuleFunction`` saves
(q and k after their l2 norm with their rstd, v, g, beta, the chunk-local A ``[B, T, H, 64]``
fp32, the initial state) and returns outputs of fla's shapes; everything around the call is the
library's own code, run on the CPU with torch's fake process group for the exchange. Asserted:
the widened layer keeps at most 1.3x the plain layer's bytes, and beyond the zero columns of
its values (which fla saves) only small states."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hyperpar_gdn.distributed.cp.common import CPGroup, LayerCall
from hyperpar_gdn.distributed.cp.state_passing import state_passing_forward
from hyperpar_gdn.models.gated_deltanet import GatedDeltaNet
from hyperpar_gdn.ops.gdn import fla_kernel
from hyperpar_gdn.ops.gdn.layer import LayerDims, LayerWeights
from hyperpar_gdn.platform.torch_collectives import TorchCollectives
from hyperpar_gdn.platform.torch_ops import TorchOps

T, HIDDEN, HK, HV, D, CHUNK = 16384, 256, 2, 4, 64, 64


class _FlaSaves(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state):
        b, t, h, dv = v.shape
        q_n, k_n = q * 1, k * 1  # the l2-normed copies fla saves
        rstd = [torch.empty(b, t, q.shape[2], dtype=torch.float32) for _ in range(2)]
        a = torch.empty(b, t, h, CHUNK, dtype=torch.float32)
        ctx.save_for_backward(q_n, rstd[0], k_n, rstd[1], v, g, beta, a, initial_state)
        final = torch.zeros(b, h, q.shape[-1], dv, dtype=torch.float32)
        return torch.zeros_like(v), final

    @staticmethod
    def backward(ctx, do, dfinal):
        raise AssertionError("not run")


def _chunk(q, k, v, g, beta, *, initial_state=None, output_final_state=False, **_):
    return _FlaSaves.apply(q, k, v, g, beta, initial_state)


def _saved_bytes(rank: int, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(fla_kernel, "_fla", lambda **_: (_chunk, None))
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.manual_seed(0)
    module = GatedDeltaNet(HIDDEN, HK, HV, D, D).to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    call = LayerCall(
        weights=LayerWeights.of(module), dims=LayerDims.of(module), chunk_size=CHUNK, kernel="fla"
    )
    x = torch.randn(1, T, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() != x.untyped_storage().data_ptr():
            storages[s.data_ptr()] = s.nbytes()
        return t

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    try:
        cp = CPGroup(xp=TorchOps(), comm=TorchCollectives(), group=None, rank=rank, size=2)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = state_passing_forward("p2p", cp, call, x, None)
        assert y.shape == x.shape
    finally:
        dist.destroy_process_group()
    return sum(storages.values())


@pytest.mark.timeout(300)
def test_widened_fla_layer_keeps_at_most_1_3x_the_plain_layers_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    plain, widened = _saved_bytes(0, monkeypatch), _saved_bytes(1, monkeypatch)
    print(f"saved for backward at T={T}: plain {plain} bytes, widened {widened} ({widened / plain:.3f}x)")
    assert plain > 0 and fla_kernel.FLA_CALLS["widened"] > 0
    assert widened <= 1.3 * plain, (plain, widened, widened / plain)
    # beyond the K zero columns of the values fla saves, only states (1% of the layer's bytes):
    # a saved view of the widened output [T, H, V + K] would add T H (V + K) bf16 more
    assert widened - plain <= T * HV * D * 2 + plain // 100, (plain, widened)
