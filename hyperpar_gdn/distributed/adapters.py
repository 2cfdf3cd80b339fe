"""Model adapters: what context parallelism needs to know of a model family, one adapter per family.

The core asks the registry
(:func:`~hyperpar_gdn.distributed.decoder_layers.adapter_for` for a whole model,
:func:`~hyperpar_gdn.distributed.decoder_layers.layer_adapter_for` for an attention layer),
never a type name. An adapter finds the model's decoder layers,
installs the per-forward step that describes the whole sequence once
(:class:`~hyperpar_gdn.distributed.sequence.GlobalSequence`, passed to the mixers as
``cp_context=``), and adapts the family's softmax-attention layers to
:func:`~hyperpar_gdn.distributed.softmax_attention.attention_forward`.

Adapters register themselves with :func:`register_adapter` when their module is imported; the
first registered adapter that does not decline a model serves it, and a model none serves is
refused with each adapter's reason. This library's own decoder models (``HybridLM``, torch and
MindSpore) are served by :class:`~hyperpar_gdn.distributed.decoder_layers.DecoderAdapter`;
transformers' Qwen3.5 models by :mod:`hyperpar_gdn.integrations.transformers.adapter`, which
``import hyperpar_gdn`` registers.

Tensor parallelism asks the adapter of the family a module belongs to
(:func:`~hyperpar_gdn.distributed.decoder_layers.module_adapter_for`: the first whose :meth:`owns`
claims it, else ``DecoderAdapter``) how that family's layers meet a split by heads: their head
counts, the forward of a GDN layer on its local heads, and how to keep installed forwards.
A CP prefill and decoding on the CP group run this library's own LMs themselves and ask another
family's adapter for its :class:`FamilyInference` (:meth:`ModelAdapter.inference`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

__all__ = ["ADAPTERS", "FamilyInference", "ModelAdapter", "register_adapter"]


class ModelAdapter:
    """How context parallelism meets one model family. Subclasses say which models and layers they
    serve (:meth:`declines`, :meth:`declines_layer`: None, or why not) and implement the rest."""

    name: ClassVar[str] = ""
    models: ClassVar[str] = ""  # the whole models it serves, in words (errors list them)
    attention_layers: ClassVar[str] = ""  # the attention layers it serves, in words
    silu_activations: ClassVar[tuple[str, ...]] = ("SiLU",)  # this family's SiLU module classes
    # the keywords a GDN layer of this family takes the whole sequence's cu_seqlens [N+1] by
    cu_seqlens_keywords: ClassVar[tuple[str, ...]] = ("cu_seqlens",)

    @classmethod
    def declines(cls, model: Any) -> str | None:
        """None when this adapter serves ``model`` (a whole model), else why not, in a few words."""
        raise NotImplementedError

    @classmethod
    def declines_layer(cls, module: Any) -> str | None:
        """None when this adapter serves the softmax-attention layer ``module``, else why not."""
        raise NotImplementedError

    def decoder(self, model: Any) -> tuple[Any, Any]:
        """(the multimodal model around the text model or None, the module holding ``layers``)."""
        raise NotImplementedError

    def install_forward(self, model: Any, outer: Any, text_model: Any, mesh: Any, layout: str) -> None:
        """Make every forward of ``model`` build its :class:`GlobalSequence` (one exchange of the
        shard lengths) and pass it to every mixer as ``cp_context=``."""
        raise NotImplementedError

    def remove_forward(self, model: Any, text_model: Any) -> None:
        """Undo :meth:`install_forward` (nothing when it was not installed)."""
        raise NotImplementedError

    def attention_forward(self, module: Any, mesh: Any, layout: str) -> Callable:
        """The context-parallel forward of this family's attention layer ``module``."""
        raise NotImplementedError

    @classmethod
    def owns(cls, obj: Any) -> bool:
        """Whether ``obj`` (a model or any module of one) is of this family's classes. The library's
        own adapter claims nothing: it serves every module no other family claims."""
        return False

    def attention_heads(self, module: Any) -> tuple[int, int] | None:
        """(query heads, K/V heads) of this family's attention layer ``module``; None when it
        has no such counts."""
        raise NotImplementedError

    def set_local_attention_heads(self, module: Any, heads: int, kv_heads: int) -> None:
        """Make the attention layer ``module`` compute on ``heads`` query and ``kv_heads`` K/V
        heads (a tensor-parallel rank's share)."""
        raise NotImplementedError

    def head_sharded_gdn_forward(self, module: Any) -> Callable | None:
        """The forward of this family's GDN layer ``module`` once it is split by heads (its weights
        read through :meth:`~hyperpar_gdn.ops.gdn.layer.LayerWeights.of`); None when the layer's
        own forward reads them so already."""
        raise NotImplementedError

    def keep_installed_forwards(self, model: Any) -> None:
        """Make sure forwards installed on ``model``'s modules stay for good (tensor parallelism has
        no undo): a family that re-selects its modules' forwards by itself is told not to."""
        raise NotImplementedError

    def inference(self) -> FamilyInference | None:
        """How a CP prefill and decoding on the CP group run this family's LMs; None for this
        library's own (:mod:`hyperpar_gdn.inference` runs them itself)."""
        return None


class FamilyInference:
    """A model family's LMs as :func:`~hyperpar_gdn.prefill_context_parallel` and decoding on the
    CP group (:mod:`hyperpar_gdn.inference.cp_decoding`) use them: its own forward and cache.

    Legend: B batch, T prompt tokens, T_r this rank's tokens, C hidden, V vocabulary."""

    def check_prefill(self, model: Any) -> None:
        """Raise ``NotImplementedError`` when ``model`` is not an LM of the family a prefill serves."""
        raise NotImplementedError

    def prefill_hidden(
        self,
        text_model: Any,
        input_ids: Any,
        mask_np: Any,
        index: Any,
        states: Any,
        positions: Any = None,
    ) -> Any:
        """The final hidden states ``[B, T_r, C]`` of the prompt ``input_ids`` ``[B, T]``'s tokens
        at the global positions ``index`` (int ``[T_r]``), every mixer handed ``states`` (a
        :class:`~hyperpar_gdn.ops.prefill_states.PrefillStates`); ``mask_np`` bool ``[B, T]``
        (left padding) or None; ``positions`` ``[1, T]`` (packed prompts) or None."""
        raise NotImplementedError

    def head(self, model: Any) -> Any:
        """The LM head as a callable ``[..., C] -> [..., V]`` (the module the model holds)."""
        raise NotImplementedError

    def cache(self, model: Any, text_model: Any, states: Any, *, tokens: int) -> Any:
        """The family's decoding cache after a ``tokens``-token prompt, from the recorded ``states``."""
        raise NotImplementedError

    def caches(self, model: Any, text_model: Any, states: Any, cu: Any) -> list[Any]:
        """One cache per packed prompt (bounds ``cu`` int ``[N+1]``)."""
        raise NotImplementedError

    def decodes(self, model: Any) -> bool:
        """Whether ``model`` decodes on the CP group (an LM of the family with a head)."""
        raise NotImplementedError

    def cut_cache(
        self, model: Any, cache: Any, *, length: int, start: int, stop: int
    ) -> tuple[Any, dict, dict]:
        """From the cache of a ``length``-token prefill: (the GDN layers' states, and by attention
        layer index the K and V of tokens ``[start, stop)`` ``[B, Hkv, stop - start, D]``, copied)."""
        raise NotImplementedError

    def step(self, model: Any, gdn: Any, ids_B1: Any, *, position: int, attend: Callable) -> Any:
        """One token per row ``[B, 1]`` at ``position``: the GDN layers step on ``gdn`` (in place),
        the attention layers call ``attend(i, q, k, v, *, scale)`` -> logits ``[B, V]`` (fp32 at least)."""
        raise NotImplementedError


ADAPTERS: list[type[ModelAdapter]] = []


def register_adapter(cls: type[ModelAdapter]) -> type[ModelAdapter]:
    """Class decorator: add ``cls`` to the registry (asked in registration order)."""
    if cls not in ADAPTERS:
        ADAPTERS.append(cls)
    return cls
