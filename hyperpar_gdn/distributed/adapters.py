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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

__all__ = ["ADAPTERS", "ModelAdapter", "register_adapter"]


class ModelAdapter:
    """How context parallelism meets one model family. Subclasses say which models and layers they
    serve (:meth:`declines`, :meth:`declines_layer`: None, or why not) and implement the rest."""

    name: ClassVar[str] = ""

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


ADAPTERS: list[type[ModelAdapter]] = []


def register_adapter(cls: type[ModelAdapter]) -> type[ModelAdapter]:
    """Class decorator: add ``cls`` to the registry (asked in registration order)."""
    if cls not in ADAPTERS:
        ADAPTERS.append(cls)
    return cls
