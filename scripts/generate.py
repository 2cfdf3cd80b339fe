"""Read a prompt under context parallelism, then continue it on one device or on the CP group.

    python scripts/make_tiny_qwen35.py tiny-qwen35
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/generate.py --model tiny-qwen35
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/generate.py --model tiny-qwen35 \\
        --prompt-file prompt.txt --cp-mode ulysses --sample --temperature 0.8 --top-k 20 --max-new-tokens 64
    HP_PLATFORM=mindspore OMP_NUM_THREADS=1 msrun --worker_num=2 --local_worker_num=2 --master_port=8118 \\
        --join=True --log_dir=msrun_log scripts/generate.py --model tiny-qwen35
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/generate.py --model tiny-qwen35 \\
        --cp-mode scan --cp-layout head_tail --min-prompt-tokens 8192 --decode-on cp-group
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 scripts/generate.py --model tiny-qwen35 --tp 2 \\
        --decode-on cp-group

Without ``--prompt-file`` the prompt is the first paragraph of the built-in English text. A
continuation that decodes to whitespace only (the tiny model's random weights often repeat one
token) prints as its ``repr`` with the token ids.

Every rank loads the model (transformers' on torch, the MindSpore Qwen3.5 under
``HP_PLATFORM=mindspore``) and the tokenized prompt; ``hyperpar_gdn.prefill_context_parallel``
reads it under CP (``--cp-mode``, ``--cp-layout``, ``--cp-inner-size``, as in
``scripts/train.py``; ``auto``: the cost model's mode) and returns the last token's logits and the decoding
state (for transformers, its ``DynamicCache``); rank 0 then decodes greedily (or samples, ``--sample``) and
prints the prompt and the continuation. Reported: the prefill time (median of ``--repeats``) and prompt tokens/s,
and the decoding tokens/s. ``--compare-one-device``: each round also times, on rank 0 alone while
the other ranks wait (so all see the same machine load), the same prefill at cp=1 (this package's
kernels on a one-rank mesh) and the framework's own one-device prefill (transformers' forward with
a cache; on MindSpore, ours without any style); ``--min-prompt-tokens`` repeats the prompt's
tokens up to a length (for long-prompt timing). Numbers go to ``--out`` (JSON; draw several with
``scripts/plot_generate.py``). ``--decode-on cp-group`` (both frameworks): every rank
decodes, keeping its share of the attention layers' K/V (:mod:`hyperpar_gdn.inference.cp_decoding`);
reported: the K/V cache bytes per rank against one device's. ``--tp N`` (torch): the world is a
mesh (cp, tp), tp innermost; the model is split by heads over tp (``apply_tensor_parallel``)
before the prefill over cp; decoding runs on the first CP rank's TP group (``one-device``) or on
every rank (``cp-group``), each rank keeping its heads' states.

The run lives in the package: :mod:`hyperpar_gdn.inference.generate_run` (options and checks in
:mod:`hyperpar_gdn.inference.generate_options`, the model in :mod:`hyperpar_gdn.inference.engine`,
greedy and sampled decoding in :mod:`hyperpar_gdn.inference.sampling`).
"""

from __future__ import annotations

import sys

from hyperpar_gdn.inference.generate_run import main

if __name__ == "__main__":
    sys.exit(main())
