"""With ``kernel="fla"`` (fla's Triton kernels under Triton's interpreter, real gloo ranks, cp 2):
a CP prefill of a tiny transformers Qwen3.5 model (GDN heads of K = V = 32) hands transformers'
``generate`` the prompt's state: the greedy continuation equals transformers' one-device
``generate`` token for token, and the cache's GDN states (recurrent and conv) equal those of
transformers' own prefill (fp32; transformers routes its GDN layers to fla's kernels here). bf16:
the layer's output error against an fp64 reference is within 1.5x of our kernel's, per mode."""

from __future__ import annotations

import copy

import torch
from distributed_harness import run_ranks
from tiny_models import GENERATION_VOCAB, _causal_lm, generation_config, move_off_init

from hyperpar_gdn import (
    LinearAttentionContextParallel,
    apply_context_parallel,
    init_device_mesh,
    prefill_context_parallel,
    undo_context_parallel,
)
from hyperpar_gdn.models import GatedDeltaNet
from hyperpar_gdn.ops.gdn.layer import LayerDims, LayerWeights, gdn_layer_forward
from hyperpar_gdn.platform import ops_for

T = 24  # shards of 12 tokens at cp 2
NEW_TOKENS = 4
MODES = ("ulysses", "p2p")
STATE_TOL = 1e-5


def _model() -> torch.nn.Module:
    config = generation_config(moe=False)
    config.linear_key_head_dim = config.linear_value_head_dim = 32
    torch.manual_seed(0)
    model = _causal_lm(config)
    move_off_init(model, 0.3, dt_bias_shift=-3.0)
    return model.eval()


def _gdn_states(cache, model) -> dict[str, torch.Tensor]:
    return {
        f"{kind}{i}": getattr(cache.layers[i], f"{kind}_states")[0]
        for i, layer in enumerate(model.model.layers)
        if getattr(layer, "linear_attn", None) is not None
        for kind in ("conv", "recurrent")
    }


def _prefill_worker(rank: int, world: int, model, ids, expected, ref_states) -> list[str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    failures = []
    for mode in MODES:
        cp_model = apply_context_parallel(copy.deepcopy(model), mesh, mode=mode, kernel="fla")
        logits, cache = prefill_context_parallel(cp_model, mesh, ids)
        undo_context_parallel(cp_model)
        for name, value in _gdn_states(cache, cp_model).items():
            err = ((value - ref_states[name]).abs().max() / ref_states[name].abs().max()).item()
            if err > STATE_TOL:
                failures.append(f"{mode} {name}: relative error {err:.1e} > {STATE_TOL:.0e}")
        if rank == 0:
            first = logits.argmax(-1, keepdim=True)
            with torch.no_grad():
                out = cp_model.generate(
                    torch.cat([ids, first], 1),
                    past_key_values=cache,
                    max_new_tokens=NEW_TOKENS - 1,
                    do_sample=False,
                )
            got = out[:, T:]
            if not torch.equal(got, expected):
                failures.append(f"{mode}: continuation {got.tolist()} != generate's {expected.tolist()}")
    return failures


def test_prefill_on_fla_continues_as_generate() -> None:
    model = _model()
    ids = torch.randint(1, GENERATION_VOCAB, (1, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[:, T:]
        ref_states = _gdn_states(model(input_ids=ids, use_cache=True).cache, model)
    for rank, failures in enumerate(
        run_ranks(_prefill_worker, 2, model, ids, expected, ref_states, timeout_s=900)
    ):
        assert not failures, f"rank {rank}: {failures}"


def _bf16_worker(rank: int, world: int, layer, x, reference) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    shard = slice(rank * T // world, (rank + 1) * T // world)
    errors = {}
    for mode in MODES:
        for kernel in ("fla", "native"):
            cp_layer = LinearAttentionContextParallel(mode, kernel=kernel).apply(copy.deepcopy(layer), mesh)
            with torch.no_grad():
                y = cp_layer(x[:, shard])
            diff = (y.double() - reference[:, shard]).norm() ** 2
            total = mesh.platform.collectives.all_reduce_sum(diff.reshape(1), mesh.get_group())
            errors[f"{mode}/{kernel}"] = (total.sqrt() / reference.norm()).item()
    return errors


def test_bf16_error_within_1_5x_of_ours() -> None:
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 4, 32, 32)
    move_off_init(layer, 0.1, dt_bias_shift=-4.0)
    x = torch.randn(1, T, 32, generator=torch.Generator().manual_seed(1))
    exact = copy.deepcopy(layer).double()
    reference = gdn_layer_forward(
        ops_for(x), LayerWeights.of(exact), LayerDims.of(exact), x.double()
    ).detach()
    errors = run_ranks(_bf16_worker, 2, layer.to(torch.bfloat16), x.bfloat16(), reference, timeout_s=900)[0]
    for mode in MODES:
        fla, ours = errors[f"{mode}/fla"], errors[f"{mode}/native"]
        print(f"bf16 {mode}: fla {fla:.3e}, ours {ours:.3e}, ratio {fla / ours:.2f}")
        assert fla <= 1.5 * ours, f"{mode}: fla's bf16 error {fla:.3e} > 1.5 x ours {ours:.3e}"
