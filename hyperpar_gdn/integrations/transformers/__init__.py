"""transformers' Qwen3.5 models under context parallelism: everything that names a transformers
class or keyword lives in this package.

- :mod:`.adapter`: the model adapter the core asks (registered when this package is imported);
- :mod:`.discovery`: where a Qwen3.5 model keeps its decoder layers;
- :mod:`.hooks`: the per-forward pre-hooks (positions, padding, packed documents, labels);
- :mod:`.attention`: transformers' attention layer under the softmax-attention style;
- :mod:`.cache`: the ``DynamicCache`` a CP prefill fills;
- :mod:`.sharded_cache`: that cache cut to a rank's share, and a decoding step on the CP group;
- :mod:`.inference`: both as the CP prefill and decoding ask them (the adapter's ``inference()``);
- :mod:`.head_sharded`: the GDN layer's forward once tensor parallelism splits it by heads;
- :mod:`.model_dir`: load a model directory for training, export one, make a tiny one
  (:mod:`.model_config` reads its config.json without torch);
- :mod:`.lm_head`: the final hidden states and head weight of a model the trainer trains;
- :mod:`.trainer`: ``ContextParallelTrainer`` and ``ContextParallelMixin`` (transformers'
  ``Trainer`` and its subclasses, TRL's ``SFTTrainer`` among them), loaded on first use;
- :mod:`.hub_kernels`: transformers' hub kernels turned off while this package's forwards are
  installed;
- :mod:`.versions`: the tested transformers releases; importing this package prints one warning
  line (rank 0) when the installed one is outside them.
"""

from __future__ import annotations

from hyperpar_gdn._lazy import lazy_exports
from hyperpar_gdn.integrations.transformers import adapter as _adapter  # noqa: F401 (registers it)
from hyperpar_gdn.integrations.transformers.versions import warn_if_untested

_EXPORTS = {
    "ContextParallelMixin": "hyperpar_gdn.integrations.transformers.trainer",
    "ContextParallelTrainer": "hyperpar_gdn.integrations.transformers.trainer",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
warn_if_untested()
