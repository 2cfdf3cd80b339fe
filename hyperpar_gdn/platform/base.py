"""The platform contract: the small interfaces that code above the platform layer may use.

No file here imports a framework, and neither does the core above the platform: the maths
(``hyperpar_gdn.ops``), the layer, the context-parallel algorithms (``hyperpar_gdn.distributed``)
and prefill (``hyperpar_gdn.inference``) receive a :class:`TensorOps` (tensor functions) and,
when they communicate, a :class:`Collectives` (differentiable collectives over a process group).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from hyperpar_gdn.platform.attention_kernel import AttentionKernel

# The label of a token that has no loss (torch's and transformers' convention); the one definition.
IGNORE_INDEX = -100

Tensor = Any  # a torch.Tensor or a mindspore.Tensor, depending on the platform
Group = Any  # a framework process-group handle


class TensorOps(ABC):
    """Tensor functions the GDN maths needs, beyond Python operators (+, -, *, /, slicing).

    Every method must be differentiable under the framework's autograd unless it says otherwise.
    """

    name: str
    # True where each call costs far more than its arithmetic at the loops' sizes (MindSpore
    # PyNative on CPU): hand-written loops then take the work that does not depend on the carried
    # state out of the loop, batched over chunks (see hyperpar_gdn/ops/gdn/recurrence_batched.py).
    prefers_batched_loops: bool = False
    # True where broadcasting products, reductions and strided copies are far slower than
    # same-shape kernels, in autograd's backward too (MindSpore on CPU): RMSNorm then runs with its
    # hand-written backward (hyperpar_gdn/ops/rms_norm_vjp.py), whose broadcasts and sums go
    # through mul and sum, and ulysses builds its send buffer by gathers (distributed/cp/ulysses.py).
    prefers_written_backward: bool = False

    @abstractmethod
    def is_tensor(self, x: object) -> bool: ...

    # --- dtypes and creation --------------------------------------------------------------
    @abstractmethod
    def compute_dtype(self, x: Tensor) -> Any:
        """float64 for float64 input, float32 otherwise (the accumulation dtype)."""

    @abstractmethod
    def dtype(self, x: Tensor) -> Any: ...

    @abstractmethod
    def cast(self, x: Tensor, dtype: Any) -> Tensor: ...

    @abstractmethod
    def zeros(self, shape: Sequence[int], like: Tensor) -> Tensor:
        """Zeros with the dtype and device of ``like`` (no gradient)."""

    @abstractmethod
    def eye(self, n: int, like: Tensor) -> Tensor: ...

    @abstractmethod
    def scalar(self, value: float, like: Tensor) -> Tensor:
        """A 0-d tensor with the dtype and device of ``like`` (keeps float64 maths float64)."""

    @abstractmethod
    def constant(self, array: Any, like: Tensor) -> Tensor:
        """A tensor holding the numpy ``array``, with the dtype and device of ``like`` (no
        gradient): masks and index data built on the host."""

    @abstractmethod
    def to_numpy(self, x: Tensor) -> Any:
        """A host numpy copy of ``x`` (not differentiable; bf16 becomes float32): for index data
        such as ``cu_seqlens``, read once per call."""

    # --- elementwise and reductions ---------------------------------------------------------
    @abstractmethod
    def exp(self, x: Tensor) -> Tensor: ...

    def softmax_exp(self, x: Tensor) -> Tensor:
        """``exp(x)`` of scores already shifted by a row maximum or log-sum-exp (x <= 0 almost
        everywhere), whose results a softmax normalises: a framework may use a faster kernel
        with a few float32 roundings of error here (MindSpore's CPU float32 exp: up to 5e-6
        relative), where :meth:`exp` must stay within one or two."""
        return self.exp(x)

    @abstractmethod
    def log(self, x: Tensor) -> Tensor: ...

    @abstractmethod
    def rsqrt(self, x: Tensor) -> Tensor: ...

    @abstractmethod
    def sigmoid(self, x: Tensor) -> Tensor: ...

    @abstractmethod
    def softplus(self, x: Tensor) -> Tensor: ...

    @abstractmethod
    def silu(self, x: Tensor) -> Tensor: ...

    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        """``a * b`` with broadcasting; for hand-written loops where one side broadcasts (a
        framework may expand it first: MindSpore's CPU broadcasting kernels are 20-30x slower
        than its same-shape ones)."""
        return a * b

    def sub(self, a: Tensor, b: Tensor) -> Tensor:
        """``a - b`` with broadcasting, for the same loops as :meth:`mul` (a row statistic taken
        from a block of scores, say)."""
        return a - b

    @abstractmethod
    def sum(self, x: Tensor, dim: int | tuple[int, ...], keepdim: bool = False) -> Tensor: ...

    @abstractmethod
    def amax(self, x: Tensor, dim: int, keepdim: bool = False) -> Tensor:
        """The largest entry along ``dim`` (for hand-written loops; need not be differentiable)."""

    @abstractmethod
    def maximum(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise ``max(a, b)`` with broadcasting (need not be differentiable)."""

    @abstractmethod
    def cumsum(self, x: Tensor, dim: int) -> Tensor: ...

    @abstractmethod
    def softmax(self, x: Tensor, dim: int) -> Tensor: ...

    @abstractmethod
    def top_k_mask(self, x: Tensor, k: int) -> Tensor:
        """A bool tensor like ``x``, True at the ``k`` largest entries along the last dim (ties at
        the k-th value all count). Not differentiable."""

    # --- shapes -----------------------------------------------------------------------------
    @abstractmethod
    def swapaxes(self, x: Tensor, a: int, b: int) -> Tensor:
        """Swap two dims (may return a view: matmul reads transposed views without a copy)."""

    @abstractmethod
    def permute(self, x: Tensor, dims: Sequence[int]) -> Tensor:
        """Reorder dims and return a contiguous tensor."""

    @abstractmethod
    def cat(self, xs: Sequence[Tensor], dim: int) -> Tensor: ...

    @abstractmethod
    def stack(self, xs: Sequence[Tensor], dim: int) -> Tensor: ...

    @abstractmethod
    def split(self, x: Tensor, sizes: Sequence[int], dim: int) -> list[Tensor]:
        """Consecutive pieces of ``x`` along ``dim`` with the given sizes (summing to its length).
        Unlike slices, their gradients come back as one concatenation, with no zero-filled
        full-size tensor per piece."""

    @abstractmethod
    def pad_dim(self, x: Tensor, dim: int, before: int, after: int) -> Tensor:
        """Zero-pad ``x`` along ``dim``."""

    @abstractmethod
    def repeat_interleave(self, x: Tensor, repeats: int, dim: int) -> Tensor: ...

    @abstractmethod
    def take(self, x: Tensor, index: Any, dim: int) -> Tensor:
        """``x`` gathered along ``dim`` at the positions of ``index`` (a 1-D numpy int array);
        the gradient adds back into the positions taken."""

    @abstractmethod
    def add_rows(self, x: Tensor, index: Any, rows: Tensor) -> Tensor:
        """``x`` ``[N, ...]`` with ``rows[i]`` added to ``x[index[i]]`` (``index`` a 1-D numpy int
        array, repeats add up), as a new tensor; not differentiable (for hand-written backwards)."""

    # --- linear algebra ----------------------------------------------------------------------
    @abstractmethod
    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        """``a @ b`` in the inputs' dtype, also under a framework's autocast (the GDN state maths
        stay fp32 in a bf16 model); :meth:`linear` is the one that autocast may lower."""

    @abstractmethod
    def tril(self, x: Tensor, diagonal: int = 0) -> Tensor: ...

    @abstractmethod
    def flush_subnormal(self, x: Tensor) -> Tensor:
        """x with entries below the dtype's smallest normal magnitude set to 0 (not differentiable;
        for hand-written loops). Products of decays (the summary's M, gradients flowing back
        through them) sink into subnormal floats, which CPUs multiply up to 20x slower; their
        value is far below fp32 resolution of anything they are added to."""

    @abstractmethod
    def solve_unit_lower(self, a: Tensor, b: Tensor) -> Tensor:
        """Solve ``(I + tril(a, -1)) x = b``; the diagonal and upper part of ``a`` are ignored."""

    @abstractmethod
    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """``x @ weight.T`` (no bias)."""

    @abstractmethod
    def arange(self, n: int, like: Tensor) -> Tensor:
        """``0 .. n-1`` as int64 on the device of ``like`` (no gradient)."""

    @abstractmethod
    def masked_attention(self, q: Tensor, k: Tensor, v: Tensor, visible: Tensor) -> Tensor:
        """Softmax attention ``softmax(q k^T / sqrt(D), over keys where visible) v``.

        q ``[B, H, Tq, D]``, k and v ``[B, H, Tk, D]`` (heads already repeated), visible a bool
        ``[B or 1, 1, Tq, Tk]``. A query row with no visible key gives zeros (not NaN)."""

    def autocast_dtype(self, x: Tensor) -> Any:
        """The dtype a framework's autocast lowers matmuls to on ``x``'s device while it is on
        (torch's bf16 autocast), else None. Code that calls kernels directly casts its inputs to
        it, as autocast would."""
        return None

    def attention_kernel(self, q: Tensor) -> AttentionKernel | None:
        """The fused attention kernel that serves tensors like ``q`` (its device and dtype), or
        None where the framework has none (then :mod:`hyperpar_gdn.ops.attention.softmax` walks blocks
        with the functions above)."""
        return None

    @abstractmethod
    def cross_entropy_sum(
        self, logits: Tensor, labels: Tensor, *, ignore_index: int = IGNORE_INDEX
    ) -> Tensor:
        """The sum of token cross-entropies, computed in fp32 (fp64 for fp64 logits), over the
        tokens whose label is not ``ignore_index``: logits ``[..., V]``, labels ``[...]`` int."""

    @abstractmethod
    def depthwise_conv1d(self, x: Tensor, weight: Tensor, *, left_pad: int) -> Tensor:
        """Depthwise 1-D convolution over time: x ``[B, C, T]``, weight ``[C, W]``, no bias.

        ``x`` is zero-padded by ``left_pad`` on the left and not at all on the right; the output
        has ``T + left_pad - W + 1`` steps.
        """

    # --- autograd -----------------------------------------------------------------------------
    @abstractmethod
    def custom_vjp(
        self,
        forward: Callable[..., tuple[tuple[Tensor, ...], tuple[Tensor, ...]]],
        backward: Callable[..., tuple[Tensor | None, ...]],
        *inputs: Tensor,
    ) -> tuple[Tensor, ...]:
        """Apply ``forward(*inputs) -> (outputs, saved)`` with the hand-written gradient
        ``backward(saved, *grad_outputs) -> grads`` (one per input; ``None`` for no gradient).
        Inside ``forward`` autograd is off."""


class PlatformUnavailableError(RuntimeError):
    """The platform asked for (``HP_PLATFORM``, a ``device_type``) is not on this machine: no CUDA
    device, no ``torch_npu``. The message names the platform and what to use instead."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a peer died, raised, or never arrived within the
    process-group timeout). The message names the collective, the group's global ranks and the
    rank that saw it, on every platform."""


def check_all_to_all_splits(
    shape: Sequence[int], send_splits: Sequence[int], recv_splits: Sequence[int], world: int
) -> tuple[list[int], list[int]]:
    """Validate an all-to-all's splits against x's ``shape`` and the group size (before any
    communication); returns them as lists of ints. Raises ValueError naming the values."""
    send, recv = [int(s) for s in send_splits], [int(s) for s in recv_splits]
    if len(shape) == 0:
        raise ValueError("all_to_all needs x with at least one dim (split along dim 0), got a 0-d tensor")
    if len(send) != world or len(recv) != world:
        raise ValueError(
            f"all_to_all needs one split per group rank (world={world}); "
            f"got send_splits={send}, recv_splits={recv}"
        )
    if min(send + recv) < 0:
        raise ValueError(f"all_to_all splits must be >= 0; got send_splits={send}, recv_splits={recv}")
    if sum(send) != shape[0]:
        raise ValueError(
            f"all_to_all send_splits={send} sum to {sum(send)} but x has {shape[0]} rows "
            f"(x.shape={tuple(shape)})"
        )
    return send, recv


def check_peers(
    sends: Sequence[tuple[Any, int]], recvs: Sequence[tuple[Any, int]], rank: int, world: int
) -> None:
    """Validate an exchange's peers (group ranks) before any communication: each another rank
    of the group. Raises ValueError naming the value."""
    for what, pairs in (("send dst", sends), ("recv src", recvs)):
        for _, peer in pairs:
            if not 0 <= peer < world or peer == rank:
                raise ValueError(
                    f"{what}={peer} must be another group rank in [0, {world}); this is rank {rank}"
                )


class Collectives(ABC):
    """Differentiable collectives over one process group (the CP axis of a mesh).

    Every method is called by every rank of ``group`` in the same order. The gradient of each is
    the reverse collective. ``bytes_sent`` counts the payload this rank sent, forward and backward.
    """

    bytes_sent: int = 0

    def reset_bytes(self) -> int:
        """Set ``bytes_sent`` to 0 and return the value it had."""
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent

    @abstractmethod
    def all_to_all(
        self, x: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group: Group
    ) -> Tensor:
        """Split ``x`` ``[N, ...]`` along dim 0 by ``send_splits`` (one per group rank, zeros allowed;
        they sum to N); part j goes to group rank j. Returns ``[sum(recv_splits), ...]``: the parts
        the group ranks sent here, in group rank order. ``recv_splits[j]`` must equal what rank j
        put in its ``send_splits`` for this rank (not checked: that would cost a collective). The
        gradient is the reverse all-to-all (the splits swapped).

        Example (2 ranks; rank 0 keeps 1 row and sends 2, rank 1 sends 0 and keeps 3):
        ``all_to_all(x0 [3, D], [1, 2], [1, 0], g) -> x0[:1]`` on rank 0 and
        ``all_to_all(x1 [3, D], [0, 3], [2, 3], g) -> cat(x0[1:], x1)`` ``[5, D]`` on rank 1."""

    @abstractmethod
    def all_gather(self, x: Tensor, group: Group) -> Tensor:
        """Return ``[world, *x.shape]``: every rank's ``x`` stacked in group rank order.
        The gradient is reduce-scattered back to its owner."""

    @abstractmethod
    def all_gather_int(self, value: int, group: Group) -> list[int]:
        """Every group rank's ``value`` (a Python int), in group rank order; not differentiable.
        One int64 per rank: for sizes that differ between ranks (a rank's local sequence length)."""

    @abstractmethod
    def shift_right(self, x: Tensor, group: Group) -> Tensor:
        """Send ``x`` to the next rank and return what the previous rank sent (zeros on rank 0;
        the last rank's ``x`` goes nowhere). The gradient travels the opposite way."""

    @abstractmethod
    def exchange(
        self, sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]], group: Group
    ) -> list[Tensor]:
        """One round of point-to-point messages, posted at once: send each ``(x, dst)`` to group
        rank ``dst`` and receive from each ``(like, src)`` a new tensor shaped like ``like``
        (returned in ``recvs`` order); not differentiable (for hand-written backwards). On NCCL
        and HCCL a send completes only when its peer has posted the receive: one batch per round
        lets every rank post all of it, so no order of the ranks' rounds deadlocks and a round
        costs one latency. Two messages between the same pair in one round match in order.

        Example (a ring of 3): rank r calls ``exchange([(x, (r + 1) % 3)], [(x, (r - 1) % 3)], g)``
        and gets ``[x of rank r - 1]``."""

    def send(self, x: Tensor, dst: int, group: Group) -> None:
        """Send ``x`` to group rank ``dst``: an :meth:`exchange` of one send."""
        self.exchange([(x, dst)], [], group)

    def recv(self, like: Tensor, src: int, group: Group) -> Tensor:
        """Receive a tensor shaped like ``like`` from group rank ``src``: an :meth:`exchange` of
        one receive."""
        return self.exchange([], [(like, src)], group)[0]

    @abstractmethod
    def barrier(self, group: Group) -> None: ...

    @abstractmethod
    def all_reduce_sum(self, x: Tensor, group: Group | None = None) -> Tensor:
        """The sum of ``x`` over the group's ranks, not differentiable (gradients, metrics).
        Use the returned tensor: torch sums in place, MindSpore returns a new tensor."""


class Platform(ABC):
    """A backend: its tensor functions, its collectives, its device and its process groups."""

    name: str
    ops: TensorOps
    collectives: Collectives

    @property
    @abstractmethod
    def device(self) -> Any:
        """The device this process computes on (a framework device object or name)."""

    @abstractmethod
    def init_distributed(self, *, timeout_s: float = 600.0) -> None:
        """Join the default process group from the launcher's environment (idempotent)."""

    @abstractmethod
    def is_initialized(self) -> bool: ...

    @abstractmethod
    def rank(self) -> int: ...

    @abstractmethod
    def world_size(self) -> int: ...

    @abstractmethod
    def new_group(self, ranks: Sequence[int]) -> Group:
        """A process group over global ``ranks``; every process must call it, in the same order."""

    def adopt_mesh(self, obj: object) -> tuple[Group, list[int], str | None] | None:
        """``(group, global ranks in group order, axis name or None)`` for a 1-D device mesh of the
        framework's own type (e.g. a torch ``DeviceMesh``), without communication; ``None`` when
        ``obj`` is not such a mesh. Raises ``ValueError`` for one that is not 1-D."""
        return None

    @abstractmethod
    def destroy(self) -> None:
        """Tear down the process groups this platform created."""

    # --- helpers for scripts and checks that must not name a framework ------------------------
    @abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the framework's generator (identical parameters on every rank)."""

    @abstractmethod
    def from_numpy(self, array: Any, *, dtype: str = "float32") -> Tensor:
        """A tensor on this platform's device; dtype is "float32", "float64", "bfloat16" or an
        integer type name."""

    @abstractmethod
    def to_numpy(self, x: Tensor) -> Any:
        """A numpy copy (bf16 becomes float32)."""

    @abstractmethod
    def value_and_grads(
        self, fn: Callable[..., Tensor], inputs: Sequence[Tensor], cotangent: Tensor, module: Any
    ) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
        """Run ``out = fn(*inputs)`` and differentiate ``sum(out * cotangent)`` with respect to
        ``inputs`` and the trainable parameters of ``module`` (by parameter name)."""
