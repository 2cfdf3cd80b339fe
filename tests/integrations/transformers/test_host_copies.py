"""Copies from the device to the host in one forward of a whole model under context parallelism
(real gloo ranks, cp=2, packed documents): the document boundaries, the padding and the shard
lengths are read once per forward and carried to every layer, so the count of host copies
(``TorchOps.to_numpy``) and of length exchanges (``all_gather_int``, whose result is read on the
host) does not grow with the number of layers. On a GPU or NPU each is a synchronisation."""

from __future__ import annotations

import copy

import torch
from distributed_harness import run_ranks
from tiny_models import tiny_config

from hyperpar_gdn import apply_context_parallel, init_device_mesh
from hyperpar_gdn.models.lm import HybridLM, HybridLMConfig
from hyperpar_gdn.platform.torch_collectives import TorchCollectives
from hyperpar_gdn.platform.torch_ops import TorchOps

T = 32
CU = (0, 5, 20, 32)  # a document across the shard boundary at 16
MODES = ("ulysses", "p2p", "all_gather")


class _Counting:
    """Counts the calls of the host-copy functions while active (class-level wrappers, undone on
    exit)."""

    def __init__(self) -> None:
        self.calls = {"to_numpy": 0, "all_gather_int": 0}
        self._saved = {}

    def __enter__(self) -> _Counting:
        for owner, name in ((TorchOps, "to_numpy"), (TorchCollectives, "all_gather_int")):
            original = getattr(owner, name)
            self._saved[(owner, name)] = original

            def counted(*args: object, _original=original, _name=name, **kwargs: object) -> object:
                self.calls[_name] += 1
                return _original(*args, **kwargs)

            setattr(owner, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)


def _transformers(num_layers: int) -> torch.nn.Module:
    import transformers

    config = tiny_config(moe=False)
    config.num_hidden_layers = num_layers
    config.layer_types = (["linear_attention"] * 3 + ["full_attention"]) * (num_layers // 4)
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(config)


def _hybrid(num_layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return HybridLM(HybridLMConfig(vocab_size=61, hidden_size=32, num_layers=num_layers))


def _worker(rank: int, world: int) -> dict[str, dict[str, int]]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    t = T // world
    ids = torch.randint(0, 61, (1, T), generator=torch.Generator().manual_seed(1))[
        :, rank * t : (rank + 1) * t
    ]
    positions = torch.cat([torch.arange(b - a) for a, b in zip(CU[:-1], CU[1:], strict=True)])[None]
    counts: dict[str, dict[str, int]] = {}
    for num_layers in (4, 8):
        for kind, build in (("transformers", _transformers), ("hybrid", _hybrid)):
            base = build(num_layers)
            for mode in MODES:
                model = apply_context_parallel(copy.deepcopy(base), mesh, mode=mode)
                with torch.no_grad(), _Counting() as counting:
                    if kind == "transformers":  # packing from the shard's position_ids
                        model(input_ids=ids, position_ids=positions[:, rank * t : (rank + 1) * t])
                    else:
                        model(ids, cu_seqlens=torch.tensor(CU))
                counts[f"{kind}/{mode}/{num_layers}"] = dict(counting.calls)
    return counts


def test_host_copies_per_forward_do_not_grow_with_layers() -> None:
    for rank, counts in enumerate(run_ranks(_worker, 2, timeout_s=240)):
        assert len(counts) == 2 * 2 * len(MODES), counts
        for kind in ("transformers", "hybrid"):
            for mode in MODES:
                four, eight = counts[f"{kind}/{mode}/4"], counts[f"{kind}/{mode}/8"]
                assert four == eight, f"rank {rank} {kind} {mode}: 4 layers {four}, 8 layers {eight}"
                # one length exchange per forward; transformers' hook reads its gathered
                # positions/padding/tokens once, HybridLM copies cu_seqlens once
                assert four == {"to_numpy": 1, "all_gather_int": 1}, f"rank {rank} {kind} {mode}: {four}"
