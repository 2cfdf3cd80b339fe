"""What one training step holds per rank, estimated before anything is allocated.

Framework-free arithmetic over the model's sizes (:class:`~.model_shape.ModelShape`; under tensor
parallelism one TP rank's, :func:`~.rank_shape.tp_shape`) and the step's options
(:class:`StepOptions`); :func:`estimate` returns the terms in bytes for one rank
(:class:`Estimate`), :func:`longest_seq_len` the longest sequence within a budget and
:func:`cheaper_options` the options that lower it. The peak is

    runtime + parameters + gradients + optimizer + max(step phase, gradient-sync phase)

- runtime: the framework itself (:data:`RUNTIME_BYTES`, measured: the resident memory of a process
  that imported torch and built a tiny model, its libraries' code mapped as a fresh install maps it
  (:data:`FRESH_INSTALL_CODE_BYTES`); 0 on an accelerator, whose allocator counts tensors);
- parameters, gradients: fp32 (master weights under bf16 too); optimizer: AdamW's two fp32
  moments; under FSDP all three divided over the dp x cp ranks, plus the gathered weights of the
  root and two decoder layers (the one computing and the one prefetched); at tp > 1 each rank
  holds its share of the layers' matrices and whole embedding, norms, LM head (and the whole K/V
  projections when tp exceeds the K/V heads); at ep > 1 its ``E / ep`` routed experts (their
  MoE blocks whole over tp), which FSDP divides over the dp x cp / ep ranks holding the same
  experts (so the experts' share per rank is E / (dp cp) of them with or without EP; EP shrinks
  the gathered layers and, without FSDP, the experts held);
- step phase: the tensors autograd saves in the forward (:func:`saved_per_token`, counted from
  the code of each stage: the norms, the SwiGLU MLP or the routed MoE, the GDN layer's
  projections, conv and the chunk rule's hand-written forward, the attention projections, RoPE,
  the kernel's inputs and outputs and the gathered K/V), plus whichever is larger of the loss's
  transient (two ``[n, V]`` fp32 chunks of the chunked loss, or one beside two ``[V, C]``
  temporaries in its backward; or the whole ``[N, V]`` logits, their log-softmax and gradient)
  and one layer's backward (its gradients, as large as what it saved); at tp > 1 the mixers'
  and MLPs' tensors are the local heads' and columns' (the norms' and the block inputs stay
  whole), and in fp32 the backward keeps the reordered local weights a TP forward builds
  (:meth:`~.rank_shape.RankShape.weight_copies`);
  under activation checkpointing only each layer's input is kept and one layer at a time is
  recomputed; bf16 adds the autocast copies of the weights and of the head;
- heap holes (:func:`heap_holes`): on the CPU, where freed memory stays in the heap, the blocks
  of the loss's forward that its backward cannot reuse;
- communication: per GDN layer the mode's buffers (p2p's states, all_gather's cp maps, scan's
  rounds, ulysses' all-to-all of activations, for the local heads at tp > 1), TP's
  all-reduce copy of a block's output ``[N, C]``, and at ep > 1 the dispatch's send and receive
  buffers of one MoE block (``[N k, C]`` each, a balanced router); after the backward, the flat
  all-reduce buffer of the gradients (one per dtype, the size of the gradients) when there is more than one rank and
  no FSDP, or the optimizer's temporaries (two of the largest parameter's size).

Ranks differ where the work does: with contiguous shards the last CP rank's attention reads every
key (global rank ``(cp - 1) x tp``: tp is the innermost axis); under ``--check-parity`` rank 0
also holds a whole copy of the model with its optimizer and runs the whole batch with full
logits. :func:`estimate` takes the rank.

Legend: T tokens of a sequence, N tokens of this rank (rows x T / cp), C hidden size, V
vocabulary, H / Hk value / key heads of the GDN layers (dims K, V_d), c the rule's chunk (64),
tp the ranks of a TP group.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hyperpar_gdn.ops.lm_loss import default_chunk_tokens
from hyperpar_gdn.planning.model_shape import FULL, LINEAR, ModelShape
from hyperpar_gdn.planning.rank_shape import tp_shape
from hyperpar_gdn.platform.host_memory import MMAP_THRESHOLD

__all__ = [
    "FRESH_INSTALL_CODE_BYTES",
    "GIB",
    "LINEAR",
    "RUNTIME_BYTES",
    "Estimate",
    "ModelShape",
    "StepOptions",
    "cheaper_options",
    "estimate",
    "heap_holes",
    "longest_seq_len",
    "mlp_saved_per_token",
    "saved_per_token",
    "tp_shape",
]

GIB = 2**30
GDN_CHUNK = 64  # the chunk rule's C (hyperpar_gdn.ops.gdn.layer's default)
# The framework's code pages as a fresh install leaves them in the page cache: the kernel maps a
# whole page-cache folio on a fault, and a library file written in large writes (as pip 26 installs
# it) is cached in large folios, where one read in a page maps up to megabytes around it. Measured
# on the CPU machine of docs/benchmarks.md (the tiny preset's step): the process mapped 201 MiB of
# files with torch's libraries written so, 110 MiB once they were cached by reading them back
# (small folios; libtorch_cpu.so alone 98 against 48 MiB), with the same 300 MiB anonymous.
FRESH_INSTALL_CODE_BYTES = 91 * 2**20
# The resident memory of a process that imported the framework and built a tiny model (measured
# on the CPU machine of docs/benchmarks.md: 306 MiB after importing hyperpar_gdn.train and one step of
# the tiny preset with the libraries in small folios; 324 MiB with transformers imported too, as for
# --model directories), plus the fresh install's larger mapped code: the plan holds for both states.
RUNTIME_BYTES = {
    "torch": 306 * 2**20 + FRESH_INSTALL_CODE_BYTES,
    "torch+transformers": 324 * 2**20 + FRESH_INSTALL_CODE_BYTES,
}
TERMS = (
    "runtime",
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "loss",
    "backward",
    "communication",
    "heap holes",
    "gradient sync",
)


@dataclass(frozen=True, kw_only=True)
class StepOptions:
    """One training step's options, as one rank sees them.

    Attributes:
        seq_len: T of a sequence; rows: sequences per DP replica (packed into one row with
            document boundaries: the same tokens).
        cp: ranks of a CP group; tp: ranks of a TP group (tensor parallelism, the innermost axis);
            world_size: all ranks, dp x cp x tp (FSDP shards over the dp x cp of them);
            ep: ranks of an EP group, taken from the dp x cp ranks (ep divides dp x cp and the
            model's ``num_experts``).
        cp_mode: the GDN layers' mode; layout: "contiguous" or "head_tail".
        ac, dtype ("fp32" / "bf16"), fsdp, check_parity: as ``scripts/train.py``'s options.
        packed: documents restart inside a row (the conv keeps its padded input too).
        loss: "chunked" (the trainer's) or "logits" (the whole ``[N, V]`` logits).
        attention: "reference" holds each rank's ``[H, N, keys]`` scores; any other path (the
            fused kernel, blockwise) holds no score matrix.
        runtime_bytes: the framework's own memory (:data:`RUNTIME_BYTES`).
        kept_heap: freed host memory stays in the process heap (the CPU trainer's
            ``keep_freed_host_memory``), where the loss's blocks leave holes (:func:`heap_holes`).
    """

    seq_len: int
    rows: int = 1
    cp: int = 1
    tp: int = 1
    world_size: int = 1
    ep: int = 1
    cp_mode: str = "p2p"
    layout: str = "contiguous"
    ac: bool = False
    dtype: str = "fp32"
    fsdp: bool = False
    check_parity: bool = False
    packed: bool = False
    loss: str = "chunked"
    attention: str = "auto"
    runtime_bytes: int = 0
    kept_heap: bool = False

    def __post_init__(self) -> None:
        for name in ("seq_len", "rows", "cp", "tp", "world_size", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"StepOptions.{name} must be >= 1; got {getattr(self, name)}")
        if self.dtype not in ("fp32", "bf16") or self.loss not in ("chunked", "logits"):
            raise ValueError(
                f"StepOptions: dtype {self.dtype!r} (fp32, bf16), loss {self.loss!r} (chunked, logits)"
            )
        if self.world_size % (self.cp * self.tp):
            raise ValueError(
                f"StepOptions: cp x tp = {self.cp} x {self.tp} must divide world_size={self.world_size}"
            )
        if (self.world_size // self.tp) % self.ep:
            raise ValueError(
                f"StepOptions: ep={self.ep} must divide the dp x cp ranks, world_size / tp = "
                f"{self.world_size // self.tp}"
            )


@dataclass(frozen=True)
class Estimate:
    """Bytes per term (:data:`TERMS`) for one rank; :attr:`total` is the peak."""

    rank: int
    terms: dict[str, int]

    @property
    def total(self) -> int:
        t = self.terms
        fixed = t["runtime"] + t["parameters"] + t["gradients"] + t["optimizer"]
        step = t["activations"] + t["communication"] + max(t["loss"], t["backward"]) + t["heap holes"]
        return fixed + max(step, t["gradient sync"])


def saved_per_token(shape: ModelShape, kind: str, *, bf16: bool, cp: int, packed: bool) -> tuple[int, int]:
    """(elements in the compute dtype, fp32 elements) that autograd keeps per token for one decoder
    layer of ``kind``, not counting the gathered K/V of attention (per rank, see :func:`estimate`).

    Counted from the stages: RMSNorm keeps its fp32 input and normalised value and gives the
    projections their input (2C fp32 + C, twice a layer); the MLP (:func:`mlp_saved_per_token`);
    the GDN layer keeps its projections (conv_dim + value_dim + 2H), the conv's output and silu
    (2 conv_dim; packed documents add the padded input), the gates (3H fp32), the
    chunk rule's saved set (per value head: q, k, v, three per-token gates, two l2 norms, seven
    c x c matrices per chunk, then q exp(G), w, k decay, the state per chunk, v_new; q_eff under CP)
    and the gated norm (4 value_dim fp32 + the output projection's input); the attention layer keeps
    q with its gate, k, their normed copies, the kernel's q and output, the output transposed and
    gated (7 H D + 2 Hkv D), the norms' and the kernel's per-head scalars and RoPE's cos and sin
    (2 H + Hkv + 2 D fp32)."""
    c = shape.hidden_size
    lin, f32 = mlp_saved_per_token(shape)
    lin, f32 = lin + 2 * c, f32 + 4 * c  # the two norms
    if kind == LINEAR:
        h, dk, dv = shape.linear_num_value_heads, shape.linear_key_head_dim, shape.linear_value_head_dim
        conv, value = shape.conv_dim, shape.value_dim
        lin += conv * (3 if packed else 2) + conv + value + 2 * h + value
        rule = h * (2 * dk + dv + 5 + 7 * GDN_CHUNK + 3 * dk + dv + (dk * dv) // GDN_CHUNK)
        f32 += 3 * h + rule + (h * dk if cp > 1 else 0) + 4 * value
    else:
        q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
        lin += 7 * q + 2 * kv
        f32 += 2 * shape.num_attention_heads + shape.num_key_value_heads + 2 * shape.head_dim
    if not bf16:
        return 0, lin + f32
    # under autocast every projection casts the fp32 normed input itself and keeps its own copy
    # (the mixer's projections - 1) + (the MLP's two - 1) more copies than in fp32
    lin += c * (4 if kind == LINEAR else 3)
    return lin, f32


def mlp_saved_per_token(shape: ModelShape) -> tuple[int, int]:
    """(elements in the compute dtype, fp32 elements) that the MLP keeps per token: SwiGLU's gate,
    silu, up and product (4I); a MoE block the same per routed expert (k of them) with the
    expert's gathered input, output and weighted output (3C: the index_add that scatters the
    last keeps it), the shared expert (4 I_shared) and its gated output (C), and the router's fp32
    logits, probabilities and choice (3E)."""
    if not shape.num_experts:
        return 4 * shape.intermediate_size, 0
    c, k, im = shape.hidden_size, shape.num_experts_per_tok, shape.moe_intermediate_size
    return k * (3 * c + 4 * im) + 4 * shape.shared_expert_intermediate_size + c, 3 * shape.num_experts


def _layer_bytes(shape: ModelShape, kind: str, opts: StepOptions, tokens: int, keys: int) -> int:
    """What one layer of ``kind`` keeps for ``tokens`` queries over ``keys`` keys (attention)."""
    bf16 = opts.dtype == "bf16"
    lin, f32 = saved_per_token(shape, kind, bf16=bf16, cp=opts.cp, packed=opts.packed)
    size = tokens * (2 * lin + 4 * f32)
    if kind == FULL:
        width = 2 if bf16 else 4
        size += 2 * keys * shape.num_key_value_heads * shape.head_dim * width  # gathered K and V
        if opts.attention == "reference":  # scores, probabilities and the mask, [H, N, keys]
            size += tokens * keys * shape.num_attention_heads * (2 * width + 1)
    return size


def _keys(opts: StepOptions, rank: int) -> int:
    """Keys the attention of ``rank`` reads (contiguous shards: those before its shard's end)."""
    if opts.cp == 1 or opts.layout == "head_tail":
        return opts.rows * opts.seq_len
    cp_rank = (rank // opts.tp) % opts.cp
    return opts.rows * opts.seq_len * (cp_rank + 1) // opts.cp


def _loss_bytes(shape: ModelShape, opts: StepOptions, tokens: int) -> int:
    """The loss's transient beyond its inputs, and the fp32 log-sum-exps it keeps."""
    v = shape.vocab_size
    if opts.loss == "logits":  # logits, log-softmax, their gradient
        return 3 * tokens * v * 4
    n = min(tokens, default_chunk_tokens(v))
    chunk, head = n * v * 4, v * shape.hidden_size * 4
    # two [n, V] chunks at a time (each step rebinds one name); in the backward, beside one chunk of
    # probabilities, the [V, C] product P^T h and the new sum dW + P^T h beside the accumulator
    # (which becomes the head's gradient, counted there)
    size = max(2 * chunk, chunk + 2 * head) + tokens * 4
    if opts.dtype == "bf16":  # bf16 logits and probabilities, the head cast once
        size += 2 * n * v * 2 + v * shape.hidden_size * 2
    return size


def heap_holes(shape: ModelShape, opts: StepOptions, tokens: int) -> int:
    """Resident heap that no tensor holds during the loss's backward, when freed memory stays in
    the heap (``opts.kept_heap``): torch asks for 64-byte aligned blocks, which glibc serves from a
    free block at least 96 bytes larger than the request, so a freed block is never reused for a
    tensor of its own size and the two ``[n, V]`` fp32 blocks of the chunked loss's forward stay
    holes beside the backward's own. Blocks of at least ``MMAP_THRESHOLD`` (128 MiB) get mappings
    of their own, returned when freed, and leave none (a large vocabulary's chunks and ``[V, C]``
    blocks: see :mod:`hyperpar_gdn.platform.host_memory`)."""
    if not opts.kept_heap or opts.loss != "chunked":
        return 0
    chunk = min(tokens, default_chunk_tokens(shape.vocab_size)) * shape.vocab_size * 4
    return 2 * chunk if chunk < MMAP_THRESHOLD else 0


def _comm_bytes(shape: ModelShape, opts: StepOptions, tokens: int) -> int:
    """The largest per-layer buffer of the GDN mode (one layer's exchange at a time), TP's copy of
    a block's output and EP's dispatch buffers (``shape`` is one TP rank's)."""
    width = 2 if opts.dtype == "bf16" else 4
    buffers = tokens * shape.hidden_size * width if opts.tp > 1 else 0
    if opts.ep > 1:  # the dispatch's rows sent and received, [N k, C] each
        buffers += 2 * tokens * shape.num_experts_per_tok * shape.hidden_size * width
    if opts.cp == 1 or LINEAR not in shape.layer_types:
        return buffers
    return buffers + _cp_bytes(shape, opts, tokens)


def _cp_bytes(shape: ModelShape, opts: StepOptions, tokens: int) -> int:
    """The largest per-layer buffer of the GDN mode."""
    h, dk, dv = shape.linear_num_value_heads, shape.linear_key_head_dim, shape.linear_value_head_dim
    state = opts.rows * h * dk * (dk + dv) * 4
    moved = 0
    width = 2 if opts.dtype == "bf16" else 4
    if opts.cp_mode == "ulysses_hidden":  # the gathered input, its send buffer, the partial sums
        return 4 * opts.cp * tokens * shape.hidden_size * width
    if opts.cp_mode.startswith("ulysses"):  # the all-to-all's send and receive buffers
        moved = 2 * tokens * (shape.conv_dim + 2 * h + shape.value_dim) * width
        if opts.cp_mode == "ulysses":
            return moved
    mode = opts.cp_mode.split("+")[-1]
    if mode == "all_gather":
        return moved + opts.cp * state
    if mode == "scan":
        return moved + 2 * state * max(1, math.ceil(math.log2(opts.cp)))
    return moved + 2 * state  # p2p (auto is priced as p2p)


def _step_terms(shape: ModelShape, opts: StepOptions, rank: int) -> dict[str, int]:
    """The step phase of one model on ``rank``: activations, loss, backward, communication
    (``shape`` is one TP rank's)."""
    tokens = opts.rows * opts.seq_len // opts.cp
    keys = _keys(opts, rank)
    layers = [_layer_bytes(shape, kind, opts, tokens, keys) for kind in shape.layer_types]
    c = shape.hidden_size
    final = tokens * (2 * c * 4 + c * (2 if opts.dtype == "bf16" else 4))  # final norm, head input
    largest = max(layers, default=0)
    if opts.ac:  # each layer's input, then one layer recomputed
        activations = len(layers) * tokens * c * 4 + final + largest
    else:
        activations = sum(layers) + final
    if opts.dtype == "bf16":  # autocast's copies of the layers' weights live until the backward
        activations += 2 * sum(shape.layer_parameters(kind) for kind in shape.layer_types)
    elif opts.tp > 1:  # the reordered local weights the fp32 backward keeps
        copies = [4 * shape.weight_copies(kind) for kind in shape.layer_types]
        activations += max(copies, default=0) if opts.ac else sum(copies)
    return {
        "activations": activations,
        "loss": _loss_bytes(shape, opts, tokens),
        "backward": largest,
        "communication": _comm_bytes(shape, opts, tokens),
        "heap holes": heap_holes(shape, opts, tokens),
    }


def estimate(shape: ModelShape, opts: StepOptions, *, rank: int = 0) -> Estimate:
    """The memory of ``rank`` during a training step with ``opts`` (see the module docstring);
    ``shape`` is the whole model's (``ValueError`` when ``opts.tp`` or ``opts.ep`` does not split it)."""
    whole, shape = shape, tp_shape(shape, opts.tp, opts.ep)
    params = shape.num_parameters()
    shards = opts.world_size // opts.tp if opts.fsdp else 1
    experts = shape.expert_parameters()  # FSDP shards a rank's experts over their dp cp / ep replicas
    held = (params - experts) * 4 // shards + experts * 4 // max(1, shards // opts.ep)
    terms = dict.fromkeys(TERMS, 0)
    terms["runtime"] = opts.runtime_bytes
    terms["parameters"] = held
    terms["gradients"] = held
    terms["optimizer"] = 2 * held
    if opts.fsdp:  # gathered: the root (embedding, norm) and two decoder layers
        width = 2 if opts.dtype == "bf16" else 4
        layer = max((shape.layer_parameters(k) for k in shape.layer_types), default=0)
        root = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
        terms["parameters"] += (root + 2 * layer) * width
        terms["gradients"] += (root + 2 * layer) * 4
    terms.update(_step_terms(shape, opts, rank))
    # AdamW on the CPU (one tensor at a time): sqrt(v) and its quotient by the bias correction, two
    # temporaries of the largest parameter at once
    optimizer_temporaries = 2 * shape.largest_parameter() * 4 // shards
    flat = params * 4 if opts.world_size > opts.tp and not opts.fsdp else 0  # over dp x cp
    terms["gradient sync"] = max(flat, optimizer_temporaries)
    if opts.check_parity and rank == 0:  # a whole copy trained on the whole batch, full logits
        dp = opts.world_size // (opts.cp * opts.tp)
        one = dataclasses.replace(opts, cp=1, tp=1, ep=1, world_size=1, rows=opts.rows * dp, loss="logits")
        ref = _step_terms(whole, one, 0)
        terms["parameters"] += whole.num_parameters() * 4
        terms["gradients"] += whole.num_parameters() * 4
        terms["optimizer"] += 2 * whole.num_parameters() * 4
        for name in ("activations", "loss", "backward", "communication"):
            terms[name] = max(terms[name], ref[name])
    return Estimate(rank, terms)


def largest_rank(shape: ModelShape, opts: StepOptions) -> Estimate:
    """The rank with the largest estimate (the last CP rank, or rank 0 under check_parity)."""
    candidates = {0, (opts.cp - 1) * opts.tp}
    return max((estimate(shape, opts, rank=r) for r in sorted(candidates)), key=lambda e: e.total)


def seq_unit(opts: StepOptions) -> int:
    """The sequence lengths the layout accepts are multiples of this (cp, 2cp for head_tail)."""
    return 2 * opts.cp if opts.cp > 1 and opts.layout == "head_tail" else opts.cp


def longest_seq_len(shape: ModelShape, opts: StepOptions, budget: int, *, limit: int = 1 << 24) -> int:
    """The longest T (a multiple of :func:`seq_unit`, at most ``limit``) whose largest rank fits
    ``budget`` bytes; 0 when none does. The estimate grows with T, so a bisection finds it."""
    unit = seq_unit(opts)

    def fits(t: int) -> bool:
        return largest_rank(shape, dataclasses.replace(opts, seq_len=t)).total <= budget

    if not fits(unit):
        return 0
    lo, hi = 1, max(1, limit // unit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * unit) else (lo, mid - 1)
    return lo * unit


def cheaper_options(shape: ModelShape, opts: StepOptions, budget: int) -> list[tuple[StepOptions, int]]:
    """Options that lower the estimate, each with its largest rank's total: more CP ranks (the
    fewest that fit ``budget``, up to 64x), activation checkpointing, bf16, and both."""
    out: list[tuple[StepOptions, int]] = []
    factor, wider_total = 2, None
    while factor <= 64:
        candidate = dataclasses.replace(opts, cp=opts.cp * factor, world_size=opts.world_size * factor)
        if opts.seq_len % seq_unit(candidate) == 0:
            wider, wider_total = candidate, largest_rank(shape, candidate).total
            if wider_total <= budget:
                break
        factor *= 2
    if wider_total is not None:
        out.append((wider, wider_total))
    changes = [{"ac": True}, {"dtype": "bf16"}]
    if not opts.ac and opts.dtype != "bf16":
        changes.append({"ac": True, "dtype": "bf16"})
    for change in changes:
        if any(getattr(opts, k) != v for k, v in change.items()):
            other = dataclasses.replace(opts, **change)
            out.append((other, largest_rank(shape, other).total))
    return out
