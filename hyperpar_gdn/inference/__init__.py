"""Inference: prefill under context parallelism, decoding on one device or on the CP group.

- :mod:`.prefill`: :func:`~hyperpar_gdn.prefill_context_parallel` (a prompt read on the CP ranks;
  the states it leaves are recorded into one :class:`~hyperpar_gdn.ops.prefill_states.PrefillStates`
  passed explicitly to the mixers);
- :mod:`.packed`: several prompts packed in one row, a cache per prompt;
- :mod:`.cp_decoding`: decoding with each rank keeping its share of the attention K/V cache;
- :mod:`.decoding`: this package's models' decoding state, one step, greedy generation;
- ``scripts/generate.py``'s run: :mod:`.generate_options`, :mod:`.engine`, :mod:`.sampling`,
  :mod:`.generate_run`.
"""
