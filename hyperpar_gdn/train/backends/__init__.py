"""Where the framework enters the loop: :mod:`.base` (:class:`~.base.TrainBackend`, one small
object per framework); torch's :mod:`.torch_backend` with :mod:`.tensor_parallel` (``--tp``),
:mod:`.sharding` (FSDP2, activation checkpointing) and :mod:`.optim` (AdamW and its warm-up);
MindSpore's :mod:`.mindspore_backend` with :mod:`.mindspore_adamw`."""
