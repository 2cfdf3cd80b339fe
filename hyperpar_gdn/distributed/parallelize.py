"""Apply context parallelism to every token mixer of a :class:`~hyperpar_gdn.models.HybridLM`.

Everything else in the model (embedding, norms, MLPs, LM head) works token by token, so once the
mixers take a sequence shard the whole model does: ``model(input_ids_local)`` returns this
rank's logits ``[B, T/cp, V]``.
"""

from __future__ import annotations

from typing import Any

from .attention_style import SoftmaxAttentionContextParallel
from .mesh import as_cp_mesh
from .style import MODES, LinearAttentionContextParallel

__all__ = ["apply_context_parallel", "undo_context_parallel"]


def apply_context_parallel(model: Any, mesh: Any, *, mode: str, chunk_size: int = 64) -> Any:
    """Make every block of ``model`` take and return a sequence shard along the 1-D ``mesh``.

    GDN mixers (``linear_attn``) get :class:`LinearAttentionContextParallel` in ``mode``;
    softmax mixers (``self_attn``) get :class:`SoftmaxAttentionContextParallel` (all-gathered K
    and V, whatever ``mode``). Checks every block before changing any.

    Args:
        model: a model with ``layers``, each holding ``linear_attn`` or ``self_attn``.
        mesh: the CP axis (e.g. ``mesh["cp"]``).
        mode: ``"ulysses"``, ``"p2p"`` or ``"all_gather"`` for the GDN layers.
        chunk_size: chunk of the gated delta rule.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not a context-parallel mode; choose one of {', '.join(MODES)}")
    cp_mesh = as_cp_mesh(mesh)
    layers = list(getattr(model, "layers", []))
    mixers = [_mixer(i, block) for i, block in enumerate(layers)]
    if not mixers:
        raise ValueError(f"{type(model).__name__} has no layers to parallelize")
    cp = cp_mesh.size()
    for i, (kind, module) in enumerate(mixers):
        if (
            mode == "ulysses"
            and kind == "linear_attn"
            and (module.num_k_heads % cp or module.num_v_heads % cp)
        ):
            raise ValueError(
                f"mode='ulysses' splits GDN heads over cp={cp}, but block {i} has num_k_heads="
                f"{module.num_k_heads} and num_v_heads={module.num_v_heads}; use mode='p2p' or 'all_gather'"
            )
    linear_style = LinearAttentionContextParallel(mode, chunk_size=chunk_size)
    softmax_style = SoftmaxAttentionContextParallel()
    for kind, module in mixers:
        (linear_style if kind == "linear_attn" else softmax_style).apply(module, cp_mesh)
    return model


def undo_context_parallel(model: Any) -> Any:
    """Restore the single-device forward of every mixer of ``model``."""
    for i, block in enumerate(getattr(model, "layers", [])):
        kind, module = _mixer(i, block)
        style = LinearAttentionContextParallel if kind == "linear_attn" else SoftmaxAttentionContextParallel
        style.undo(module)
    return model


def _mixer(index: int, block: Any) -> tuple[str, Any]:
    for kind in ("linear_attn", "self_attn"):
        module = getattr(block, kind, None)
        if module is not None:
            return kind, module
    raise ValueError(f"block {index} ({type(block).__name__}) has neither linear_attn nor self_attn")
