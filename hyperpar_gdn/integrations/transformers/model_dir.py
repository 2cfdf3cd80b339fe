"""transformers model directories: load one for training, export the trained model, make a tiny one.

A model directory is what ``save_pretrained`` writes: ``config.json``, safetensors weights and
the tokenizer files. The model is built with transformers' own classes (``Qwen3_5ForCausalLM`` or
``Qwen3_5MoeForCausalLM``; a multimodal Qwen3.5 directory loads its language model), so what is
trained and exported is exactly what transformers loads.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from hyperpar_gdn.corpus import BUILTIN_CORPUS
from hyperpar_gdn.integrations.transformers.model_config import (
    gdn_dims,
    has_softmax_attention,
    position_range,
    text_config,
)
from hyperpar_gdn.models.directories import written_whole

EOS = "<|endoftext|>"

__all__ = [
    "export_model_dir",
    "gdn_dims",
    "has_softmax_attention",
    "load_model_dir",
    "load_tokenizer",
    "position_range",
    "text_config",
    "write_tiny_qwen35",
]


def _require_transformers(path: str | Path) -> None:
    if importlib.util.find_spec("transformers") is None:
        raise ModuleNotFoundError(
            f"--model {path} needs transformers, which is not installed: pip install -e '.[torch,transformers]'"
        )


def load_model_dir(path: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) from a transformers model directory, the model in ``dtype``."""
    _require_transformers(path)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model, tokenizer


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a model directory (transformers' ``AutoTokenizer``); it must have an EOS token."""
    _require_transformers(path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"--model {path}: the tokenizer has no EOS token (documents are joined with it)")
    return tokenizer


def export_model_dir(
    model: Any, tokenizer: Any, out: str | Path, *, state_dict: dict[str, Any] | None = None
) -> Path:
    """Write ``model`` (transformers' torch model, or the MindSpore ``Qwen3_5ForCausalLM``) and
    ``tokenizer`` as a transformers directory that ``from_pretrained`` loads.

    ``state_dict``: the weights to write instead of the model's own (a sharded model's gathered
    full state dict). The directory appears whole or not at all: it is written into a temporary
    directory beside ``out`` and renamed to ``out`` at the end (an existing ``out`` is replaced
    only then); a failure removes the temporary directory and leaves ``out`` as it was.
    """
    with written_whole(out) as temp:
        model.save_pretrained(temp, **({} if state_dict is None else {"state_dict": state_dict}))
        tokenizer.save_pretrained(temp)
    return Path(out)


@contextmanager
def progress_bars(shown: bool) -> Iterator[None]:
    """transformers' progress bars shown or hidden inside the block, as they were after it."""
    from transformers.utils import logging as transformers_logging

    before = transformers_logging.is_progress_bar_enabled()
    (transformers_logging.enable_progress_bar if shown else transformers_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (transformers_logging.enable_progress_bar if before else transformers_logging.disable_progress_bar)()


def train_tokenizer(vocab_size: int = 512, *, progress: bool = False) -> Any:
    """A byte-level BPE tokenizer trained on the built-in corpus (offline), with an EOS token;
    ``progress``: show the trainer's progress lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    bpe.train_from_iterator(BUILTIN_CORPUS.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS)


def write_tiny_qwen35(
    out: str | Path,
    *,
    moe: bool = False,
    seed: int = 0,
    sizes: dict[str, Any] | None = None,
    progress: bool = False,
) -> Path:
    """A small random Qwen3.5 model directory (3 GDN layers and 1 attention layer per 4) with a
    tokenizer trained on the built-in corpus; no downloads.

    ``sizes``: config fields that replace the tiny ones (``vocab_size``, ``hidden_size``, ...; a
    ``vocab_size`` larger than the tokenizer's leaves ids it never produces, as real checkpoints
    do); a field the config class does not have is refused. ``progress``: show the tokenizer
    trainer's and transformers' progress output (silent by default)."""
    import transformers

    tokenizer = train_tokenizer(progress=progress)
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if moe:
        common.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
        common.update(shared_expert_intermediate_size=64)
        config_class, model_class = transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM
    else:
        common.update(intermediate_size=192)
        config_class, model_class = transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM
    unknown = sorted(set(sizes or {}) - set(common) - set(config_class().to_dict()))
    if unknown:
        raise ValueError(f"write_tiny_qwen35: {config_class.__name__} has no field {', '.join(unknown)}")
    common.update(sizes or {})
    if common["vocab_size"] < len(tokenizer):
        raise ValueError(
            f"write_tiny_qwen35: vocab_size={common['vocab_size']} is below the tokenizer's {len(tokenizer)} tokens"
        )
    torch.manual_seed(seed)
    model = model_class(config_class(**common))
    with progress_bars(progress):
        return export_model_dir(model, tokenizer, out)
