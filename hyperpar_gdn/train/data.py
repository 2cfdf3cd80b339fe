"""Tokens (bytes, or a transformers tokenizer's), deterministic batches, and each rank's (dp, cp) shard of them.

Batch ``i`` of a run is a pure function of ``(seed, i)``: every rank draws the same global batch
and cuts out its own part, the no-CP reference draws the same batch whole, and a resumed run
continues from the saved position with the very batches an uninterrupted run would have drawn.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .corpus import BUILTIN_CORPUS

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


def load_tokens(path: str | None, tokenizer: Any = None) -> torch.Tensor:
    """The token stream ``[N]`` (int64) of ``--data`` (see :func:`read_documents`).

    Without a tokenizer, bytes (the built-in model): a text file as its raw bytes, documents of
    a JSONL file or directory joined with a newline. With one (a transformers model directory's),
    each document's tokens followed by the EOS token."""
    if tokenizer is None:
        if path is not None and Path(path).is_file() and Path(path).suffix != ".jsonl":
            data = Path(path).read_bytes()
        else:
            data = "\n".join(read_documents(path)).encode("utf-8")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for document in read_documents(path):
        ids.extend(tokenizer(document, add_special_tokens=False)["input_ids"])
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


class BatchSampler:
    """Draws global batches ``[batch_size, seq_len + 1]`` of windows at random offsets.

    Stateful (``state_dict``/``load_state_dict``): its state is the number of batches drawn.

    Args:
        tokens: the token stream ``[N]``.
        seq_len: tokens per training sequence (each window has one more: the last label).
        batch_size: sequences per global batch.
        seed: with the batch index, fixes the offsets.
    """

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, batch_size: int, seed: int) -> None:
        if tokens.dim() != 1 or tokens.numel() < seq_len + 1:
            raise ValueError(
                f"the data has {tokens.numel()} tokens; --seq-len {seq_len} needs at least {seq_len + 1}"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.position = 0

    def next_batch(self) -> torch.Tensor:
        """The next global batch ``[batch_size, seq_len + 1]`` (int64, on the CPU)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len, (self.batch_size,), generator=generator)
        self.position += 1
        return self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)]

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


def shard_batch(
    batch: torch.Tensor, *, dp_rank: int, dp_size: int, cp_rank: int, cp_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, labels), each ``[batch/dp, seq_len/cp]``, from a global batch
    ``[batch, seq_len + 1]``: rows of DP replica ``dp_rank``, tokens
    ``[cp_rank*T/cp, (cp_rank+1)*T/cp)`` of the inputs and the next token of each as its label."""
    rows, width = batch.shape
    seq_len = width - 1
    if rows % dp_size or seq_len % cp_size:
        raise ValueError(
            f"a batch of {rows} sequences of {seq_len} tokens does not split over dp={dp_size}, cp={cp_size}"
        )
    b, t = rows // dp_size, seq_len // cp_size
    part = batch[dp_rank * b : (dp_rank + 1) * b]
    start = cp_rank * t
    return part[:, start : start + t], part[:, start + 1 : start + t + 1]
