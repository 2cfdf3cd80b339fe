"""hyperpar-gdn: context parallelism for Gated DeltaNet layers on PyTorch and MindSpore.

Split a GDN layer's (or a whole hybrid model's) sequence over a group of ranks and get the
single-device result::

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))     # under torchrun, 2 ranks
    LinearAttentionContextParallel(mode="ulysses").apply(layer, mesh)  # a GDN layer
    apply_context_parallel(model, mesh, mode="p2p")                    # or a whole model
    shard = shard_for_context_parallel(mesh, input_ids)                # this rank's piece
    loss = context_parallel_loss(model(shard.input_ids), shard.labels, mesh)
    loss.backward()
    sync_context_parallel_grads(model, mesh)                           # sum the gradient shares

Public API (loaded on first use, so ``import hyperpar_gdn.ops`` stays light):

- ``init_device_mesh``, ``DeviceMesh``: the mesh of ranks (torch's API, any platform).
- ``LinearAttentionContextParallel``: CP for one GDN layer (modes ``ulysses`` and
  ``ulysses_hidden`` (head parallel), ``p2p``, ``all_gather`` and ``scan`` (state passing), and
  the two-level ``ulysses+p2p``, ``ulysses+all_gather``, ``ulysses+scan``);
  ``CPPlan``: what a model's GDN layers run under CP (mode, token layout, inner size, chunk size,
  kernel; ``apply_context_parallel(model, mesh, plan=...)``); ``plan_context_parallel``: the modes
  ranked by a cost model (``apply_context_parallel(..., mode="auto", seq_len=T)`` takes its choice); ``SoftmaxAttentionContextParallel``: CP for a
  softmax-attention layer; ``ParallelStyle``: their base (``apply`` / ``undo``).
- ``apply_context_parallel``, ``undo_context_parallel``: every layer of ``HybridLM`` or of
  transformers' Qwen3.5 models. ``apply_tensor_parallel``: their blocks split by heads and
  columns over a TP axis (torch DTensor), before context parallelism (docs/tensor_parallel.md).
  ``parallelize``: expert, tensor and context parallelism, activation checkpointing and FSDP2 in
  one call, in that order, every part checked first; ``ParallelConfig``: what it applies.
- ``shard_for_context_parallel``, ``ContextParallelBatch``: a whole batch cut into this rank's
  shard with labels shifted on the whole sequence; ``context_parallel_loss``: this rank's term of
  the global mean loss; ``sync_context_parallel_grads``: the gradient shares summed over the CP
  group (averaged over a DP axis); ``context_parallel_lm_loss``: the same loss term from the
  hidden states and the LM head's weight, in token chunks, without ever holding the logits.
- ``prefill_context_parallel``: read a prompt under CP; the last token's logits and the decoding
  state (transformers' ``DynamicCache``) for one device to continue from (docs/inference.md).
- ``DTensor``, ``Shard``, ``Replicate``, ``distribute_tensor``: a small DTensor (a whole tensor
  cut into this rank's shard: ``distribute_tensor(x, mesh, [Shard(1)])``); ``get_platform``: the framework layer
  (``HP_PLATFORM`` = cpu, cuda, npu or mindspore).

Models: ``hyperpar_gdn.models`` (``GatedDeltaNet``, ``HybridLM``; MindSpore twins in
``hyperpar_gdn.models.mindspore``). Training: ``scripts/train.py`` and ``hyperpar_gdn.train``.
Guides: README.md and docs/ in the repository.
"""

from __future__ import annotations

from hyperpar_gdn._lazy import lazy_exports

_EXPORTS = {
    "CPPlan": "hyperpar_gdn.planning.plan",
    "DTensor": "hyperpar_gdn.distributed.dtensor",
    "Replicate": "hyperpar_gdn.distributed.dtensor",
    "Shard": "hyperpar_gdn.distributed.dtensor",
    "distribute_tensor": "hyperpar_gdn.distributed.dtensor",
    "DeviceMesh": "hyperpar_gdn.distributed.mesh",
    "init_device_mesh": "hyperpar_gdn.distributed.mesh",
    "LinearAttentionContextParallel": "hyperpar_gdn.distributed.linear_attention_style",
    "ParallelStyle": "hyperpar_gdn.distributed.parallel_style",
    "SoftmaxAttentionContextParallel": "hyperpar_gdn.distributed.softmax_attention_style",
    "apply_context_parallel": "hyperpar_gdn.distributed.parallelize",
    "apply_tensor_parallel": "hyperpar_gdn.tensor_parallel.apply",
    "ParallelConfig": "hyperpar_gdn.parallel.config",
    "parallelize": "hyperpar_gdn.parallel.compose",
    "plan_context_parallel": "hyperpar_gdn.planning.ranking",
    "undo_context_parallel": "hyperpar_gdn.distributed.parallelize",
    "prefill_context_parallel": "hyperpar_gdn.inference.prefill",
    "sync_context_parallel_grads": "hyperpar_gdn.distributed.grads",
    "ContextParallelBatch": "hyperpar_gdn.distributed.batch",
    "context_parallel_lm_loss": "hyperpar_gdn.distributed.batch",
    "context_parallel_loss": "hyperpar_gdn.distributed.batch",
    "shard_for_context_parallel": "hyperpar_gdn.distributed.batch",
    "get_platform": "hyperpar_gdn.platform",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

# Model adapters register themselves (hyperpar_gdn.distributed.adapters); transformers' is imported
# here, without transformers, so that every entry point finds transformers' Qwen3.5 models.
import hyperpar_gdn.integrations.transformers  # noqa: E402, F401
