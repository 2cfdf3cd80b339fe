"""Fine-tune a Qwen3.5 model with TRL's SFTTrainer under context parallelism.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/sft_qwen35.py
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/sft_qwen35.py --cp-mode auto
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 examples/sft_qwen35.py --cp-size 4 \\
        --cp-mode ulysses+p2p --cp-inner-size 2

Each sequence is split over the 2 ranks (cp_size=2): the Gated DeltaNet layers pass their state
from rank to rank (cp_mode="p2p"; every mode of the library is offered, two-level ones with
--cp-inner-size, and auto, the cost model's choice for a packed row's length), the
softmax-attention layers gather keys and values. Without --model it writes a tiny random Qwen3.5
directory (no download) and trains it on the built-in English text. With a real model:
--model /path/to/Qwen3.5-dir, and on GPUs HP_PLATFORM=cuda. Rank 0 prints one line saying what
runs (cp and dp sizes, mode, layout, kernel), then the Trainer's logs; --output-dir also keeps
the model and trainer_state.json (every logged loss).

Compared with a plain SFTTrainer script, three things are new: the mixin class, cp_size (and
optionally cp_mode / cp_layout / cp_inner_size / cp_seq_len) in its constructor, and
pad_to_multiple_of so every packed row splits evenly over the ranks. (The process group is
closed at the end, as every torch.distributed script should.)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import datasets
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging
from trl import SFTConfig, SFTTrainer

from hyperpar_gdn.corpus import BUILTIN_CORPUS
from hyperpar_gdn.integrations.transformers import ContextParallelMixin
from hyperpar_gdn.integrations.transformers.model_dir import write_tiny_qwen35
from hyperpar_gdn.planning.plan import MODE_CHOICES

BATCH = 8  # texts per packed row (per device)


class CPSFTTrainer(ContextParallelMixin, SFTTrainer):
    """TRL's SFTTrainer with context parallelism."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a Qwen3.5 model directory (default: a tiny random one)"
    )
    parser.add_argument("--cp-size", type=int, default=2, help="ranks per CP group (default: 2)")
    parser.add_argument("--cp-mode", default="p2p", choices=MODE_CHOICES, help="the GDN layers' CP mode")
    parser.add_argument(
        "--cp-inner-size", type=int, default=None, help="ranks per inner group of a two-level mode"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument("--output-dir", default=None)
    options = parser.parse_args()
    # the tiny model loads and its data maps in an instant: no progress bars
    transformers_logging.disable_progress_bar()
    datasets.disable_progress_bars()

    with tempfile.TemporaryDirectory() as scratch:
        path = options.model or str(write_tiny_qwen35(f"{scratch}/tiny-qwen35"))
        model = AutoModelForCausalLM.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        lines = [line for line in BUILTIN_CORPUS.splitlines() if line.strip()]
        dataset = datasets.Dataset.from_dict({"text": lines})
        # auto prices a sequence length: a packed row holds BATCH texts (and their EOS tokens)
        row_tokens = BATCH * round(statistics.mean(len(tokenizer(line)["input_ids"]) + 1 for line in lines))

        config = SFTConfig(
            output_dir=options.output_dir or f"{scratch}/out",
            per_device_train_batch_size=BATCH,
            learning_rate=3e-3,
            max_steps=options.steps,
            logging_steps=options.logging_steps,
            padding_free=True,  # packed rows, position_ids restarting per document
            max_length=None,  # padding-free rows are not truncated: keep the texts short (or pack)
            pad_to_multiple_of=2 * options.cp_size,  # head_tail cuts each row into 2 * cp_size pieces
            save_strategy="no",
            report_to=[],
            use_cpu=options.model is None,
            bf16=options.model is not None,  # TRL's default autocast: bf16 on devices, fp32 on the CPU
            disable_tqdm=True,
            activation_checkpointing=True,  # TRL's default, by its current name
            log_level_replica="error",  # transformers' warnings once, from rank 0
        )
        trainer = CPSFTTrainer(
            model=model,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            cp_size=options.cp_size,
            cp_mode=options.cp_mode,
            cp_inner_size=options.cp_inner_size,
            cp_seq_len=row_tokens if options.cp_mode == "auto" else None,
        )
        trainer.train()
        if options.output_dir:
            trainer.save_model()  # a normal model directory, written by rank 0
            trainer.save_state()  # trainer_state.json: the logged losses
    if dist.is_initialized():
        # the Trainer started the process group and leaves it open: close it while Python is
        # whole, or gloo's worker threads can abort the process on its way out
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
