"""Where the framework enters the loop: :mod:`.base` (:class:`~.base.TrainBackend`, one small
object per framework); torch's :mod:`.torch_backend` with :mod:`.tensor_parallel` (``--tp``),
:mod:`.state_dicts` (full state dicts under FSDP2) and :mod:`.optim` (AdamW and its warm-up);
MindSpore's :mod:`.mindspore_backend` with :mod:`.mindspore_adamw`."""
