"""transformers' Qwen3.5 models (dense and MoE) under context parallelism equal the one-process
model: logits shard, loss and every parameter gradient (summed over ranks), on real gloo groups.

The oracle is transformers' own model code run whole in each process. transformers rounds the
GDN decay inputs (A_log and the decay logits) to float32 even in a float64 model (docs/maths.md,
what the tests hold the code to), while the CP layers compute them in float64, so the float64 comparison is at the
level of float32 rounding (measured: 1e-7 to 2e-6 relative): 1e-5 for logits and most
gradients, 1e-4 for A_log and dt_bias, whose gradients are sums with heavy cancellation.
"""

from __future__ import annotations

import copy

import pytest
import torch
from distributed_harness import run_ranks
from tiny_models import tiny_config, tiny_model

from hyperpar_gdn import (
    apply_context_parallel,
    context_parallel_loss,
    init_device_mesh,
    shard_for_context_parallel,
    undo_context_parallel,
)

transformers = pytest.importorskip("transformers")

TOL = 1e-5
GATE_TOL = 1e-4  # A_log, dt_bias (see the module docstring)
SEQ_LEN = 48


def _batch(padded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 61, (2, SEQ_LEN), generator=g)
    if not padded:
        return ids, None
    mask = torch.ones(2, SEQ_LEN, dtype=torch.int64)
    mask[0, -13:] = 0  # right padding crossing a shard boundary at cp 4
    mask[1, :5] = 0  # left padding
    return ids, mask


def _reference(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None):
    """One process, whole sequence: logits, mean loss over the labelled tokens, gradients."""
    labels = ids[:, 1:].clone()
    if mask is not None:
        labels[mask[:, 1:] == 0] = -100
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int, moe: bool, modes: tuple[str, ...], padded: bool, num_k_heads: int):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    base = tiny_model(moe=moe, num_k_heads=num_k_heads)
    ids, mask = _batch(padded)
    ref_logits, ref_loss, ref_grads = _reference(copy.deepcopy(base), ids, mask)
    t = SEQ_LEN // world
    window = slice(rank * t, (rank + 1) * t)
    real = torch.ones(2, SEQ_LEN, dtype=torch.bool) if mask is None else mask.bool()
    errors = {}
    for mode in modes:
        model = copy.deepcopy(base)
        apply_context_parallel(model, mesh, mode=mode)
        shard = shard_for_context_parallel(mesh, ids, attention_mask=mask)
        logits = model(**shard.model_inputs()).logits
        loss = context_parallel_loss(logits, shard.labels, mesh)
        loss.backward()
        total = mesh.platform.collectives.all_reduce_sum(loss.detach().reshape(1).clone(), mesh.get_group())
        keep = real[:, window]  # padded positions' logits are not defined by either model
        scale = ref_logits.abs().max()
        err = {
            "logits": ((logits.detach() - ref_logits[:, window])[keep].abs().max() / scale).item(),
            "loss": abs(total.item() - ref_loss.item()) / ref_loss.item(),
        }
        for name, p in model.named_parameters():
            grad = mesh.platform.collectives.all_reduce_sum(p.grad.clone(), mesh.get_group())
            ref = ref_grads[name]
            err["grad:" + name] = ((grad - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        undo_context_parallel(model)
        errors[mode] = err
    return errors


def _check(errors_per_rank: list[dict]) -> None:
    for errors in errors_per_rank:
        for mode, err in errors.items():
            for key, value in err.items():
                tol = GATE_TOL if key.endswith(("A_log", "dt_bias")) else TOL
                assert value <= tol, f"{mode} {key}: relative error {value:.2e} > {tol:.0e}"


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "cp4"])
def test_causal_lm_equals_one_process(world: int, moe: bool) -> None:
    modes = ("ulysses", "p2p", "all_gather")
    _check(run_ranks(_worker, world, moe, modes, False, 2, timeout_s=240))  # ulysses at cp 4: grouped heads


@pytest.mark.parametrize("mode", ["ulysses", "p2p", "all_gather"])
def test_padding_mask(mode: str) -> None:
    _check(run_ranks(_worker, 2, False, (mode,), True, 2, timeout_s=180))


def _multimodal_worker(rank: int, world: int) -> tuple[float, str]:
    """The language model inside Qwen3_5ForConditionalGeneration, text only; labels= (given on
    rank 0 only) refused on both ranks."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    config = transformers.Qwen3_5Config(text_config=tiny_config(moe=False).to_dict())
    model = transformers.Qwen3_5ForConditionalGeneration(config).to(torch.float64).eval()
    ids, _ = _batch(False)
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        apply_context_parallel(model, mesh, mode="p2p")
        shard = shard_for_context_parallel(mesh, ids)
        local = model(input_ids=shard.input_ids).logits  # positions default to the global ones
        try:
            model(input_ids=shard.input_ids, **({"labels": shard.labels} if rank == 0 else {}))
            refusal = "no error"
        except ValueError as err:
            refusal = str(err)
    t = SEQ_LEN // world
    return ((local - ref[:, rank * t : (rank + 1) * t]).abs().max() / ref.abs().max()).item(), refusal


def test_multimodal_language_model() -> None:
    (err0, refusal0), (err1, refusal1) = run_ranks(_multimodal_worker, 2, timeout_s=120)
    assert err0 <= TOL and err1 <= TOL
    assert "does not handle labels=; compute the loss with context_parallel_loss" in refusal0
    assert "CP ranks [0] refused their input" in refusal1


def test_refuses_what_it_does_not_handle() -> None:
    def worker(rank: int, world: int) -> list[str]:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        model = apply_context_parallel(tiny_model(moe=False), mesh, mode="p2p")
        ids = torch.randint(0, 61, (1, 8))
        messages = []
        for kwargs in (
            {"use_cache": True},
            {"attention_mask": torch.ones(1, 1, 8, 8)},
            {"seq_idx": ids},
        ):
            try:
                model(input_ids=ids, **kwargs)
                messages.append("no error")
            except (ValueError, NotImplementedError) as err:
                messages.append(str(err))
        return messages

    for messages in run_ranks(worker, 2, timeout_s=60):
        assert "use_cache=True" in messages[0]
        assert "attention_mask as this rank's shard [B, T/cp] = (1, 8); got shape (1, 1, 8, 8)" in messages[1]
        assert "does not handle seq_idx=" in messages[2]


def _exchange_count_worker(rank: int, world: int, mode: str, padded: bool) -> tuple[int, float]:
    """Length exchanges (``all_gather_int`` calls on the real gloo group) in one forward+backward
    of the model, and its logits' error against one process."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    collectives = mesh.platform.collectives
    base = tiny_model(moe=False)
    ids, mask = _batch(padded)
    ref_logits, _, _ = _reference(copy.deepcopy(base), ids, mask)
    model = apply_context_parallel(base, mesh, mode=mode)
    shard = shard_for_context_parallel(mesh, ids, attention_mask=mask)
    calls = []
    exchange = collectives.all_gather_int

    def counted(value: int, group: object) -> list[int]:
        calls.append(value)
        return exchange(value, group)

    collectives.all_gather_int = counted
    try:
        logits = model(**shard.model_inputs()).logits
        logits.sum().backward()
    finally:
        collectives.all_gather_int = exchange
    t = SEQ_LEN // world
    keep = (torch.ones(2, SEQ_LEN, dtype=torch.bool) if mask is None else mask.bool())[
        :, rank * t : (rank + 1) * t
    ]
    err = (logits.detach() - ref_logits[:, rank * t : (rank + 1) * t])[
        keep
    ].abs().max() / ref_logits.abs().max()
    return len(calls), err.item()


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("mode", ["ulysses", "p2p"])
def test_shard_lengths_exchanged_once_per_forward(mode: str, padded: bool) -> None:
    """The model's forward exchanges the shard lengths once for all of its layers (three GDN
    layers and one softmax layer here): each exchange is a host synchronisation on a GPU or NPU."""
    for count, err in run_ranks(_exchange_count_worker, 2, mode, padded, timeout_s=120):
        assert count == 1, f"{count} length exchanges in one forward+backward"
        assert err <= TOL
