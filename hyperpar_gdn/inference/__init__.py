"""Inference: prefill under context parallelism, the decoder state, one-token steps, generation.

- :mod:`.states`: the decoding state a prompt leaves behind, recorded from the mixers while it runs;
- :mod:`.prefill`: :func:`prefill_context_parallel` (a prompt read on the CP ranks);
- :mod:`.decoding`: this package's models' decoding state, one step, greedy generation.
"""
