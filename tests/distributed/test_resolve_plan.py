"""``mode="auto"`` on a model (:func:`~hyperpar_gdn.distributed.parallelize.resolve_plan`): a mode the
model's GDN layers would refuse is not chosen. ulysses_hidden projects a rank's heads from the
projections' weights, so a wrapped projection (LoRA, a quantized layer) rules it out; auto then
takes the fastest mode that remains."""

from __future__ import annotations

from torch import nn

from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.distributed.parallelize import resolve_plan
from hyperpar_gdn.models import HybridLM
from hyperpar_gdn.models.lm import HybridLMConfig
from hyperpar_gdn.platform import get_platform


class Wrapped(nn.Module):
    """A wrapper of a projection that is not a plain linear layer (as PEFT's LoRA layers are)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_auto_leaves_out_a_mode_the_layers_refuse() -> None:
    # heads wide against the hidden size: ulysses_hidden moves the fewest bytes
    model = HybridLM(
        HybridLMConfig(hidden_size=32, linear_key_head_dim=32, linear_value_head_dim=32, num_layers=2)
    )
    mesh = DeviceMesh.from_group(get_platform("cpu"), None, [0, 1], mesh_dim_name="cp")
    assert resolve_plan(model, mesh, mode="auto", seq_len=4096).mode == "ulysses_hidden"
    gdn = model.layers[0].linear_attn
    gdn.in_proj_z = Wrapped(gdn.in_proj_z)
    plan = resolve_plan(model, mesh, mode="auto", seq_len=4096)
    assert plan.mode == "ulysses", plan.reason
    assert "ulysses_hidden" not in plan.reason, plan.reason
