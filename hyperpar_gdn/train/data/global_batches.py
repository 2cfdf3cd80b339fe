"""Tokens (bytes, or a transformers tokenizer's) and deterministic global batches of them.

Batch ``i`` of a run is a pure function of ``(seed, i)``: every rank draws the same global batch
and cuts out its own part (:mod:`.rank_batches`), the no-CP reference draws the same batch whole,
and a resumed run continues from the saved position with the very batches an uninterrupted run
would have drawn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hyperpar_gdn.corpus import BUILTIN_CORPUS
from hyperpar_gdn.train.errors import VocabularyError

__all__ = [
    "TEXT_SUFFIXES",
    "VOCAB_SIZE",
    "Batch",
    "BatchSampler",
    "TokenStream",
    "VocabularyError",
    "check_vocabulary",
    "load_stream",
    "load_tokens",
    "read_documents",
]

VOCAB_SIZE = 256  # bytes


TEXT_SUFFIXES = (".txt", ".text", ".md")


def read_documents(path: str | None) -> list[str]:
    """The documents of ``--data``: a text file (one document), a JSONL file (one document per
    line, its "text" field) or a directory of such files (sorted by name); None: the built-in
    corpus. Every error names the file (and line)."""
    if path is None:
        return [BUILTIN_CORPUS]
    root = Path(path)
    if root.is_dir():
        files = sorted(f for f in root.iterdir() if not f.name.startswith("."))
        unknown = [f.name for f in files if f.suffix not in (*TEXT_SUFFIXES, ".jsonl") or not f.is_file()]
        if unknown:
            raise ValueError(
                f"--data {path}: {', '.join(unknown)} is not a text ({', '.join(TEXT_SUFFIXES)}) or .jsonl file"
            )
        if not files:
            raise ValueError(f"--data {path}: the directory holds no .txt, .md or .jsonl file")
        return [doc for f in files for doc in _file_documents(f)]
    if not root.is_file():
        raise FileNotFoundError(f"--data {path}: no such file or directory")
    return _file_documents(root)


def _file_documents(file: Path) -> list[str]:
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--data {file}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if file.suffix != ".jsonl":
        return [text]
    documents = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"--data {file}:{number}: not JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f'--data {file}:{number}: expected an object with a "text" string')
        documents.append(record["text"])
    return documents


@dataclass(frozen=True)
class TokenStream:
    """The training data as one stream: ``tokens`` int64 ``[N]`` and ``doc_starts`` bool ``[N]``
    (True at the first token of every document)."""

    tokens: torch.Tensor
    doc_starts: torch.Tensor


def load_stream(path: str | None, tokenizer: Any = None) -> TokenStream:
    """The documents of ``--data`` (see :func:`read_documents`) as one token stream.

    Without a tokenizer, bytes (the built-in model): a text file as its raw bytes (one document),
    the documents of a JSONL file or directory joined with a newline. With one (a transformers
    model directory's), each document's tokens followed by the EOS token."""
    if tokenizer is None and path is not None and Path(path).is_file() and Path(path).suffix != ".jsonl":
        documents = [list(Path(path).read_bytes())]
    elif tokenizer is None:
        texts = read_documents(path)
        documents = [
            list((text + "\n" * (i + 1 < len(texts))).encode("utf-8")) for i, text in enumerate(texts)
        ]
    else:
        eos = tokenizer.eos_token_id
        documents = [
            tokenizer(text, add_special_tokens=False)["input_ids"] + [eos] for text in read_documents(path)
        ]
    lengths = [len(d) for d in documents if d]
    starts = torch.zeros(sum(lengths), dtype=torch.bool)
    starts[torch.tensor([0, *lengths[:-1]]).cumsum(0)] = True
    return TokenStream(torch.tensor([t for d in documents for t in d], dtype=torch.int64), starts)


def load_tokens(path: str | None, tokenizer: Any = None) -> torch.Tensor:
    """The token stream ``[N]`` (int64) of ``--data``: :func:`load_stream` without the documents."""
    return load_stream(path, tokenizer).tokens


@dataclass(frozen=True)
class Batch:
    """A global batch: ``tokens`` int64 ``[B, T+1]`` (windows of the stream: inputs and, shifted
    by one, labels) and ``doc_starts`` bool ``[B, T+1]`` (where the stream's documents start)."""

    tokens: torch.Tensor
    doc_starts: torch.Tensor

    @property
    def has_documents(self) -> bool:
        """Whether a document starts inside a row (after its first input token)."""
        return bool(self.doc_starts[:, 1:].any())


class BatchSampler:
    """Draws global batches ``[batch_size, seq_len + 1]`` of windows at random offsets.

    Stateful (``state_dict``/``load_state_dict``): its state is the number of batches drawn.

    Args:
        stream: the data (:class:`TokenStream`), or a bare token stream ``[N]`` (one document).
        seq_len: tokens per training sequence (each window has one more: the last label).
        batch_size: sequences per global batch.
        seed: with the batch index, fixes the offsets.
    """

    def __init__(
        self, stream: TokenStream | torch.Tensor, *, seq_len: int, batch_size: int, seed: int
    ) -> None:
        if not isinstance(stream, TokenStream):
            starts = torch.zeros(stream.numel(), dtype=torch.bool)
            starts[:1] = True
            stream = TokenStream(stream, starts)
        tokens = stream.tokens
        if tokens.dim() != 1 or tokens.numel() < seq_len + 1:
            raise ValueError(
                f"the data has {tokens.numel()} tokens; --seq-len {seq_len} needs at least {seq_len + 1}"
            )
        self.tokens = tokens
        self.doc_starts = stream.doc_starts
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.position = 0

    def next_batch(self) -> Batch:
        """The next global batch: windows ``[batch_size, seq_len + 1]`` (on the CPU)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        offsets = torch.randint(
            0, self.tokens.numel() - self.seq_len, (self.batch_size,), generator=generator
        )
        self.position += 1
        index = offsets[:, None] + torch.arange(self.seq_len + 1)
        return Batch(self.tokens[index], self.doc_starts[index])

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "num_tokens": self.tokens.numel()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed or state["num_tokens"] != self.tokens.numel():
            raise ValueError(
                f"the checkpoint's data stream (seed={state['seed']}, {state['num_tokens']} tokens) is "
                f"not this run's (--seed {self.seed}, {self.tokens.numel()} tokens): pass the same "
                "--seed and --data to continue the same loss curve"
            )
        self.position = int(state["position"])


def check_vocabulary(
    stream: TokenStream, *, vocab_size: int, tokenizer: Any = None, model: str, data: str | None
) -> None:
    """Refuse token ids outside ``[0, vocab_size)`` before they reach the embedding (on CUDA an
    index assertion with no useful message); with a tokenizer, also one that has more tokens than
    the model's ``vocab_size`` (the tokenizer and the model directory do not match)."""
    where = f"--data {data}" if data is not None else "the built-in corpus"
    if tokenizer is not None and len(tokenizer) > vocab_size:
        raise VocabularyError(
            f"the tokenizer of {model} has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{vocab_size}: the tokenizer and the model do not match (use the tokenizer saved with it)"
        )
    bad = (stream.tokens < 0) | (stream.tokens >= vocab_size)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise VocabularyError(
            f"{where}: {int(bad.sum())} token ids fall outside the vocabulary of {model} (vocab_size "
            f"{vocab_size}: ids 0..{vocab_size - 1}), the first is {int(stream.tokens[first])} at "
            f"token {first}; use the model's own tokenizer"
        )
