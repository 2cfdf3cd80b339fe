"""Write a small random Qwen3.5 model directory (transformers format), offline.

    python scripts/make_tiny_qwen35.py tiny-qwen35            # dense
    python scripts/make_tiny_qwen35.py tiny-qwen35-moe --moe  # mixture of experts

The directory holds config.json, model.safetensors and a byte-level BPE tokenizer (512 tokens)
trained on the built-in corpus; ``scripts/train.py --model DIR`` trains it under context
parallelism and ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads it. It prints
one line (``--verbose``: the tokenizer trainer's and transformers' progress too).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("out", help="directory to write (created; existing files are overwritten)")
    parser.add_argument("--moe", action="store_true", help="Qwen3.5-MoE (4 experts, 2 per token)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    parser.add_argument(
        "--verbose", action="store_true", help="show the tokenizer trainer's and transformers' progress"
    )
    args = parser.parse_args(argv)

    from hyperpar_gdn.integrations.transformers.model_dir import write_tiny_qwen35

    out = write_tiny_qwen35(args.out, moe=args.moe, seed=args.seed, progress=args.verbose)
    print(f"wrote {'Qwen3.5-MoE' if args.moe else 'Qwen3.5'} model directory {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
