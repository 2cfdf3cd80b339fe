"""PEFT LoRA on transformers' Qwen3.5 models (dense and MoE) under context parallelism equals the
same PEFT model on one process: logits and every adapter gradient, with packed documents, on real
gloo groups, for ``apply_context_parallel`` given the ``PeftModel`` itself.

LoRA sits on every GDN projection (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
``out_proj``), every attention projection and the MLP's (the MoE model's shared expert), with
random ``lora_B`` (PEFT's ``init_lora_weights=False``) so that every adapter changes the output,
and PEFT's trained copies (``modules_to_save``) of the norms; at cp 2 also DoRA. The oracle is
PEFT's model on one process, each document alone (transformers' CPU layers do not separate packed
documents). transformers computes the GDN rule in float32 even in a float64 model, so the oracle
is exact to about 2e-6 here (adapters a tenth of PEFT's random update, as trained ones are small
beside the weights; with the raw random update the same float32 rounding reaches 1.4e-5). What CP
cannot serve is refused on every rank, the model left as it was; a CP prefill of a PEFT model
continues like PEFT's generate.
"""

from __future__ import annotations

import copy

import peft
import pytest
import torch
from distributed_harness import run_ranks
from tiny_models import GENERATION_VOCAB, generation_model, tiny_model

from hyperpar_gdn import (
    apply_context_parallel,
    init_device_mesh,
    prefill_context_parallel,
    shard_for_context_parallel,
    undo_context_parallel,
)
from hyperpar_gdn.distributed.parallel_style import is_parallelized
from hyperpar_gdn.integrations.transformers.trainer_checks import check_head

TARGETS = [
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
]
T = 48
DOCS = (0, 5, 20, 31, 48)  # documents across the shard boundaries at cp 2 and 4
TOL = 1e-5


def lora_model(
    *,
    moe: bool,
    targets: list[str] = TARGETS,
    rank: int = 4,
    base: torch.nn.Module | None = None,
    dora: bool = False,
    modules_to_save: list[str] | None = None,
) -> torch.nn.Module:
    """``base`` (default: the tiny float64 model of tiny_models) with LoRA (``rank``, random A and
    B; ``dora``: DoRA's magnitude too) on ``targets``, and trained copies of ``modules_to_save``."""
    base = tiny_model(moe=moe) if base is None else base
    torch.manual_seed(5)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=targets,
        init_lora_weights=False,
        use_dora=dora,
        modules_to_save=modules_to_save,
    )
    model = peft.get_peft_model(base, config).to(base.dtype)
    # a tenth of PEFT's random update B A: small beside the weights, as trained ones are
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.mul_(0.3)
        for layer in model.modules():  # DoRA: magnitudes near the norms of the scaled weights
            if dora and isinstance(layer, peft.tuners.lora.LoraLayer) and layer.lora_magnitude_vector:
                magnitude = layer.lora_magnitude_vector["default"]
                a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
                magnitude.update_layer(
                    base_layer=layer.get_base_layer(), lora_A=a, lora_B=b, scaling=layer.scaling["default"]
                )
                magnitude.weight.mul_(1 + 0.02 * torch.randn_like(magnitude.weight))
    return model


def _adapter_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _reference(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process: the logits [1, T, V] and the adapters' gradients of the mean loss over every
    labelled token, each document run alone."""
    count = sum(b - a - 1 for a, b in zip(DOCS[:-1], DOCS[1:], strict=True))
    logits = []
    for a, b in zip(DOCS[:-1], DOCS[1:], strict=True):
        out = model(input_ids=ids[:, a:b], labels=ids[:, a:b], use_cache=False)
        (out.loss * ((b - a - 1) / count)).backward()
        logits.append(out.logits.detach())
    return torch.cat(logits, 1), _adapter_grads(model)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _worker(rank: int, world: int, cases: tuple[tuple[str, int | None], ...]) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ids = torch.randint(0, 61, (1, T), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(b - a) for a, b in zip(DOCS[:-1], DOCS[1:], strict=True)])[None]
    shard = shard_for_context_parallel(mesh, ids, position_ids=positions)
    window = slice(rank * T // world, (rank + 1) * T // world)
    errors = {}
    variants = [("dense", False, False), ("moe", True, False)] + (
        [("dora", False, True)] if world == 2 else []
    )
    for variant, moe, dora in variants:
        base = lora_model(moe=moe, dora=dora, modules_to_save=["norm"])  # the GDN gated norms: copies
        ref_logits, ref_grads = _reference(copy.deepcopy(base), ids)
        assert all(g.abs().max() > 0 for g in ref_grads.values())  # every adapter reaches the loss
        for mode, inner in cases:
            model = copy.deepcopy(base)
            assert apply_context_parallel(model, mesh, mode=mode, inner_size=inner) is model
            out = model(**shard.model_inputs(), labels=shard.labels)
            out.loss.backward()
            key = f"{variant}/{mode}"
            errors[f"{key}/logits"] = _relative(out.logits.detach(), ref_logits[:, window])
            grads = _adapter_grads(model)
            assert grads.keys() == ref_grads.keys()
            for name, grad in grads.items():
                summed = mesh.platform.collectives.all_reduce_sum(grad, mesh.get_group())
                errors[f"{key}/{name}"] = _relative(summed, ref_grads[name])
    return errors


def _check(errors_per_rank: list[dict[str, float]]) -> None:
    worst: dict[str, float] = {}
    for errors in errors_per_rank:
        for key, value in errors.items():
            kind = "logits" if key.endswith("logits") else "grads"
            worst[kind] = max(worst.get(kind, 0.0), value)
            assert value <= TOL, f"{key}: relative error {value:.2e} > {TOL:.0e}"
    print(f"worst relative errors: {worst}")


@pytest.mark.parametrize(
    ("world", "cases"),
    [
        (2, (("p2p", None), ("ulysses", None), ("scan", None))),
        (4, (("p2p", None), ("ulysses", None), ("scan", None), ("ulysses+p2p", 2))),
    ],
    ids=["cp2", "cp4"],
)
def test_lora_equals_one_process(world: int, cases: tuple) -> None:
    _check(run_ranks(_worker, world, cases, timeout_s=420))


def _refusal_worker(rank: int, world: int) -> dict[str, str]:
    """The one line each unservable wrapper raises, and whether the model was left as it was."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ids = torch.randint(0, 61, (1, T), generator=torch.Generator().manual_seed(3))
    cases = {
        # the conv over the sequence is computed from its weight (rank divisible by its 64 groups)
        "conv1d": (lora_model(moe=False, targets=["conv1d"], rank=64), "p2p"),
        # ulysses_hidden slices the projection weights by head
        "ulysses_hidden": (lora_model(moe=False, targets=["in_proj_qkv"]), "ulysses_hidden"),
    }
    found = {}
    for name, (model, mode) in cases.items():
        before = model(input_ids=ids, use_cache=False).logits
        try:
            apply_context_parallel(model, mesh, mode=mode)
            found[name] = ""
        except NotImplementedError as error:
            found[name] = str(error)
        unchanged = torch.equal(model(input_ids=ids, use_cache=False).logits, before)
        found[name + "/unchanged"] = str(unchanged and not any(is_parallelized(m) for m in model.modules()))
    return found


def test_unservable_wrappers_are_refused_on_every_rank() -> None:
    for found in run_ranks(_refusal_worker, 2, timeout_s=240):
        assert found["conv1d"].startswith("layer 0: linear_attn.conv1d is wrapped by peft.tuners.lora"), found
        assert "leave conv1d out of the adapter's target modules" in found["conv1d"]
        assert found["ulysses_hidden"].startswith(
            "mode 'ulysses_hidden': layer 0: linear_attn.in_proj_qkv is peft.tuners.lora.layer.Linear"
        ), found
        assert "use mode='ulysses'" in found["ulysses_hidden"]
        assert found["conv1d/unchanged"] == found["ulysses_hidden/unchanged"] == "True"


def test_trainer_refuses_a_wrapped_lm_head() -> None:
    with pytest.raises(
        NotImplementedError, match=r"^the LM head is wrapped by peft\.tuners\.lora\.layer\.Linear"
    ):
        check_head(lora_model(moe=False, targets=["lm_head"]))
    check_head(lora_model(moe=False))  # adapters elsewhere: the head's weight is the head


def _prefill_worker(rank: int, world: int) -> list[str]:
    """A CP prefill of the PEFT model (LoRA on the head too: the prefill calls it), continued by
    PEFT's generate on one process, against PEFT's generate from the prompt (fp32, greedy)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    base = lora_model(moe=True, targets=[*TARGETS, "lm_head"], base=generation_model(moe=True))
    ids = torch.randint(1, GENERATION_VOCAB, (2, 37), generator=torch.Generator().manual_seed(37))
    with torch.no_grad():
        expected = base.generate(input_ids=ids, max_new_tokens=8, do_sample=False)[:, 37:]
    failures = []
    for mode in ("p2p", "ulysses"):
        model = apply_context_parallel(copy.deepcopy(base), mesh, mode=mode)
        logits, cache = prefill_context_parallel(model, mesh, ids)
        undo_context_parallel(model)
        first = logits.argmax(-1, keepdim=True)
        with torch.no_grad():  # the prompt and the first new token in, the cache holding the prompt
            out = model.generate(
                input_ids=torch.cat([ids, first], 1), past_key_values=cache, max_new_tokens=7, do_sample=False
            )
        got = out[:, 37:]
        if not torch.equal(got, expected):
            failures.append(f"{mode}: continuation {got.tolist()} != generate's {expected.tolist()}")
    return failures


def test_prefill_continues_like_generate() -> None:
    for failures in run_ranks(_prefill_worker, 2, timeout_s=240):
        assert not failures, "\n".join(failures)
