"""The GDN style's binding of a layer's call: the packed documents come by the keywords the layer's
model family names (its adapter's), one of them at a time."""

from __future__ import annotations

import pytest
import torch

from hyperpar_gdn.distributed.decoder_layers import module_adapter_for
from hyperpar_gdn.distributed.gdn_call import signature_binder


def forward(
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
) -> None:
    """A layer's forward that takes both names (as a family's may)."""


def test_the_families_keywords_bind_the_documents_and_two_at_once_are_refused() -> None:
    x, cu = torch.zeros(1, 8, 4), torch.tensor([0, 3, 8])
    both = signature_binder(forward, cu_seqlens_keywords=("cu_seqlens", "cu_seq_lens_q"))
    assert both(x, cu_seq_lens_q=cu).cu_seqlens is cu
    assert both(x, cu_seqlens=cu).cu_seqlens is cu
    with pytest.raises(ValueError, match="pass one of cu_seqlens or cu_seq_lens_q, not several"):
        both(x, cu_seqlens=cu, cu_seq_lens_q=cu)
    ours = signature_binder(forward, cu_seqlens_keywords=("cu_seqlens",))
    with pytest.raises(Exception, match="cu_seq_lens_q"):  # a keyword this family does not take
        ours(x, cu_seq_lens_q=cu)


def test_each_family_names_its_keywords() -> None:
    pytest.importorskip("transformers")
    from tiny_models import tiny_model

    from hyperpar_gdn.models.lm import HybridLM, HybridLMConfig

    hybrid = HybridLM(HybridLMConfig(vocab_size=61, hidden_size=32, num_layers=1))
    qwen = tiny_model(moe=False)
    gdn = next(m for m in qwen.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    ours = next(m for m in hybrid.modules() if type(m).__name__ == "GatedDeltaNet")
    assert module_adapter_for(ours).cu_seqlens_keywords == ("cu_seqlens",)
    assert module_adapter_for(gdn).cu_seqlens_keywords == ("cu_seqlens", "cu_seq_lens_q")
