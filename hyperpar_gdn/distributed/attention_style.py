"""Context parallelism for causal softmax attention: all-gather K and V, keep Q local.

Rank r of the CP axis holds tokens ``[r*T/cp, (r+1)*T/cp)``. It projects its queries, keys and
values with RoPE at those global positions, all-gathers the keys and values of the whole
sequence (differentiable: the gradient is reduce-scattered back to each shard's owner) and runs
causal attention of its queries over keys ``0 .. (r+1)*T/cp - 1`` (later shards are invisible to
it, so they are dropped before the matmuls). The result equals the single-device layer's rows.

Traffic per rank and forward: ``2 * B * Hkv * T/cp * D * (cp-1)`` elements (as much again in the
backward). Work is unbalanced (the last rank attends over the whole sequence); fine for the
1-in-4 softmax layers of a hybrid model.
"""

from __future__ import annotations

from typing import Any

from .mesh import DeviceMesh, as_cp_mesh
from .style import ParallelStyle


class SoftmaxAttentionContextParallel(ParallelStyle):
    """Context parallelism for :class:`~hyperpar_gdn.models.attention.CausalSelfAttention` (torch)
    and :class:`~hyperpar_gdn.models.mindspore.CausalSelfAttention` (MindSpore): one
    implementation over the mesh's platform (its TensorOps and differentiable all-gather).

    After ``apply(module, mesh)`` the module's forward takes and returns this rank's shard
    ``[B, T/cp, hidden]`` (every rank the same T/cp) and gives exactly the single-device rows.
    Parameters are untouched; their gradients are this rank's share (sum them over the CP ranks).
    ``undo(module)`` restores the original forward.

    Example::

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        SoftmaxAttentionContextParallel().apply(attn, mesh)
        y_local = attn(x_local)        # x_local: [B, T/2, hidden]
    """

    def apply(self, module: Any, mesh: Any) -> Any:
        for name in ("project", "attend", "finish"):
            if not callable(getattr(module, name, None)):
                raise TypeError(
                    f"{type(module).__name__} has no {name}(): SoftmaxAttentionContextParallel supports "
                    "hyperpar_gdn.models.attention.CausalSelfAttention"
                )
        cp_mesh = as_cp_mesh(mesh)
        return self._install(
            module, lambda original: lambda hidden_states: _forward(module, cp_mesh, hidden_states)
        )


def _forward(module: Any, mesh: DeviceMesh, x_BTC: Any) -> Any:
    """x ``[B, T/cp, hidden]`` (this rank's shard) -> ``[B, T/cp, hidden]``."""
    shape = tuple(x_BTC.shape)
    if len(shape) != 3 or shape[-1] != module.hidden_size:
        raise ValueError(f"the local shard must be [B, T/cp, hidden_size={module.hidden_size}]; got {shape}")
    cp, rank = mesh.size(), mesh.get_local_rank()
    b, t_local, _ = shape
    offset = rank * t_local
    xp = mesh.platform.ops
    q_BHTD, k_BHTD, v_BHTD, gate = module.project(x_BTC, position_offset=offset)
    if cp > 1:
        hkv, d = k_BHTD.shape[1], k_BHTD.shape[3]
        kv_BHTD = xp.cat([k_BHTD, v_BHTD], 1)  # [B, 2Hkv, T/cp, D]
        gathered = mesh.platform.collectives.all_gather(kv_BHTD, mesh.get_group())  # [cp, B, 2Hkv, T/cp, D]
        visible = xp.permute(gathered[: rank + 1], (1, 2, 0, 3, 4)).reshape(b, 2 * hkv, -1, d)
        k_BHTD, v_BHTD = visible[:, :hkv], visible[:, hkv:]
    return module.finish(module.attend(q_BHTD, k_BHTD, v_BHTD, q_offset=offset), gate)
