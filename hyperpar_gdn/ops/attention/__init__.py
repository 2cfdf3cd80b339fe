"""Causal softmax attention over global positions, on any framework.

- :mod:`.softmax`: the entry point :func:`attention` (picks a path), the dense reference
  :func:`dense_attention`, RoPE and the layer's projections;
- :mod:`.visibility`: which queries see which keys (:class:`Tokens`), block maps and segments;
- :mod:`.blockwise`: online softmax over key blocks with a custom backward;
- :mod:`.segments`: a platform's fused kernel per fully visible rectangle.
"""

from hyperpar_gdn.ops.attention.softmax import attention, dense_attention
from hyperpar_gdn.ops.attention.visibility import Tokens

__all__ = ["Tokens", "attention", "dense_attention"]
