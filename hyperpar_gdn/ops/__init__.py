"""The operators, each in its own package, written once against the platform's tensor functions.

- :mod:`.gdn`: the gated delta rule (reference, chunked fast path, summaries, packed documents,
  the whole GDN layer as stages, its one-token step);
- :mod:`.attention`: causal softmax attention (the dense reference, the blockwise path, fused
  kernels per rectangle, the block plan);
- :mod:`.lm_loss`: the LM loss in token chunks, without the logits;
- :mod:`.blocks`: norms, MLPs and the LM head (the non-mixer parts of a decoder).

The gated delta rule's public functions are re-exported here.
"""

from hyperpar_gdn.ops.gdn import *  # noqa: F403 (the gated delta rule's public names)
from hyperpar_gdn.ops.gdn import __all__ as __all__
