"""``model(**shard.model_inputs(), labels=shard.labels).loss`` under context parallelism (real gloo
ranks, every mode): each rank's ``.loss`` is its term of the global mean, so the terms add up to
transformers' own one-process loss and the gradients, summed over the ranks, to its gradients;
with padding and with packed documents. What the loss cannot honour is refused on every rank.

Oracles: transformers' model and loss on one process (padding); each document alone through
transformers (packed documents, which transformers' CPU layers do not separate). Tolerances as in
test_transformers_models (float32 gates in a float64 model)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from distributed_harness import run_ranks
from tiny_models import tiny_model

from hyperpar_gdn import apply_context_parallel, init_device_mesh, shard_for_context_parallel

transformers = pytest.importorskip("transformers")

MODES = ("ulysses", "p2p", "all_gather")
T = 48
DOCS = (0, 5, 20, 31, 48)  # documents across the shard boundary at 24
TOL, GATE_TOL = 1e-5, 1e-4


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _reference(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, packed: bool):
    """(loss, gradients) of the mean loss over every labelled token, on one process."""
    if not packed:  # transformers' own loss: it shifts the labels itself
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        return loss.item(), _grads(model)
    count = sum(b - a - 1 for a, b in zip(DOCS[:-1], DOCS[1:], strict=True))
    total = 0.0
    for a, b in zip(DOCS[:-1], DOCS[1:], strict=True):  # every document alone, weighted by its labels
        loss = model(input_ids=ids[:, a:b], labels=ids[:, a:b], use_cache=False).loss * ((b - a - 1) / count)
        loss.backward()
        total += loss.item()
    return total, _grads(model)


def _worker(rank: int, world: int, packed: bool) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    base = tiny_model(moe=False)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 61, (1 if packed else 2, T), generator=gen)
    mask = None
    if packed:
        positions = torch.cat([torch.arange(b - a) for a, b in zip(DOCS[:-1], DOCS[1:], strict=True)])[None]
        shard = shard_for_context_parallel(mesh, ids, position_ids=positions)
    else:
        mask = torch.ones_like(ids)
        mask[0, -13:] = 0  # right padding across the shard boundary
        mask[1, -3:] = 0
        shard = shard_for_context_parallel(mesh, ids, attention_mask=mask)
    ref_loss, ref_grads = _reference(copy.deepcopy(base), ids, mask, packed)
    errors = {}
    for mode in MODES:
        model = apply_context_parallel(copy.deepcopy(base), mesh, mode=mode)
        loss = model(**shard.model_inputs(), labels=shard.labels).loss
        loss.backward()
        total = mesh.platform.collectives.all_reduce_sum(loss.detach().reshape(1), mesh.get_group())
        errors[f"{mode}/loss"] = abs(total.item() - ref_loss) / ref_loss
        for name, p in model.named_parameters():
            grad = mesh.platform.collectives.all_reduce_sum(p.grad.clone(), mesh.get_group())
            ref = ref_grads[name]
            errors[f"{mode}/{name}"] = ((grad - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    return errors


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_labels_loss_equals_one_process(packed: bool) -> None:
    for errors in run_ranks(_worker, 2, packed, timeout_s=240):
        assert len(errors) > 3 * 10
        for key, value in errors.items():
            tol = GATE_TOL if key.endswith(("A_log", "dt_bias")) else TOL
            assert value <= tol, f"{key}: relative error {value:.2e} > {tol:.0e}"


def _refusals(rank: int, world: int) -> list[str]:
    """Each bad call is made on rank 0 only: rank 1 must stop too, not wait in a collective."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = apply_context_parallel(tiny_model(moe=False), mesh, mode="p2p")
    shard = shard_for_context_parallel(mesh, torch.randint(0, 61, (2, 16)))
    good = {**shard.model_inputs(), "labels": shard.labels}
    bad_calls = (
        {"logits_to_keep": 1},
        {"num_items_in_batch": 7},
        {"shift_labels": shard.labels + 1},
        {"labels": shard.labels[:, :3]},
        {"labels": None},
    )
    messages = []
    for bad in bad_calls:
        try:
            model(**{**good, **bad}) if rank == 0 else model(**good)
            messages.append("no error")
        except (ValueError, NotImplementedError) as err:
            messages.append(str(err))
    return messages


def test_refuses_what_the_loss_cannot_honour() -> None:
    rank0, rank1 = run_ranks(_refusals, 2, timeout_s=120)
    assert "does not handle logits_to_keep=1" in rank0[0]
    assert "does not take num_items_in_batch=" in rank0[1]
    assert "sets shift_labels= from them: pass labels only" in rank0[2]
    assert "takes labels as this rank's shard [B, T/cp] = (2, 8) (shard.labels); got shape (2, 3)" in rank0[3]
    assert all("CP ranks [0] refused their input" in m for m in rank1[:4])
    # labels on rank 1 only: both ranks see it in the one gather and stop
    assert all("labels= was passed on some CP ranks but not on ranks [0]" in m for m in (rank0[4], rank1[4]))


def _whole_sequence_everywhere(rank: int, world: int) -> list[bool]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = apply_context_parallel(tiny_model(moe=False), mesh, mode="p2p")
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    warned = []
    for inputs in ({"input_ids": ids}, shard_for_context_parallel(mesh, ids).model_inputs()):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                model(**inputs)
        warned.append(any("got the same 16 tokens" in str(w.message) for w in caught))
    return warned


def test_warns_when_every_rank_gets_the_whole_sequence() -> None:
    for warned in run_ranks(_whole_sequence_everywhere, 2, timeout_s=120):
        assert warned == [True, False]
