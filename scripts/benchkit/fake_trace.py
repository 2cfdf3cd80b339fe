"""Trace one rank's CUDA code paths on a CPU-only torch build: fake CUDA tensors, torch's fake
process group, and a record of every collective, host read and host-to-device copy.

Under ``FakeTensorMode`` tensors carry shapes, dtypes and devices only; aten's CUDA operators run
their shape rules (``_scaled_dot_product_flash_attention`` and its backward included); torch's
fake process group (``init_process_group("fake", store=FakeStore(), rank=r, world_size=n)``)
accepts every collective at any world size without moving values. Together with the platform's
:func:`~hyperpar_gdn.platform.device_trace.trace_without_device` they run one rank of a CP step
as it runs on a GPU. :class:`FakeCudaTrace` records:

- every collective (the c10d operator, as dispatched): its bytes sent to other ranks in the
  convention of :mod:`hyperpar_gdn.platform.torch_collectives` (independent of the platform's own
  count), dtype, group size, and the scope (a watched module: ``layer3.gdn``) and phase
  (forward / backward) it belongs to;
- every host read of a device value (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``,
  ``bool()``, a data-dependent shape): on a GPU each waits for the device. Inside a watched
  module it raises :class:`HostSyncError`; outside (the model's once-per-forward exchanges) it
  is recorded and answered by ``host_values`` (fake tensors have no values);
- every copy of host memory to the device (``torch.as_tensor(numpy_array, device=cuda)``): a
  plain (pageable, blocking) copy synchronises the stream on CUDA;
- factory calls inside a watched module that make a tensor on another device than the trace's;
- every blocking wait on a process group's work (``Work.wait`` with a timeout).

Two things of torch 2.13's CPU build stand in the way and are worked around here, only while a
trace runs: (1) autograd records a stream for every tensor through the device's guard, and a
CPU-only build registers none for CUDA, so :func:`cuda_guard_for_trace` puts the no-op guard
of the meta device in CUDA's slot of c10's registry and takes it out again; (2) the autograd
engine asks for the current accelerator stream when it passes a CUDA gradient, and a CPU-only
build has no accelerator, so :func:`run_backward` runs the backward graph in Python: every node
once, in the engine's order (highest sequence number first among the ready ones), gradients
summed, reduced and cast to their input's metadata as the engine does.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import math
import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Collective", "FakeCudaTrace", "HostSyncError", "cuda_guard_for_trace", "run_backward"]

_REGISTRY = "_ZN3c104impl26device_guard_impl_registryE"  # c10::impl::device_guard_impl_registry
_CUDA, _META = 1, 14  # c10::DeviceType values
_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__array__", "cpu"}
_PACKAGES = (f"{os.sep}hyperpar_gdn{os.sep}", f"{os.sep}transformers{os.sep}")


class HostSyncError(RuntimeError):
    """A host read of a device value (a synchronisation on a GPU) inside a watched module."""


@dataclass(frozen=True)
class Collective:
    op: str  # the c10d operator: alltoall_base_, _allgather_base_, send, recv_, allreduce_
    scope: str
    phase: str  # "forward" or "backward"
    nbytes: int  # sent to other ranks
    dtype: torch.dtype
    group_size: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Event:
    """A host read (``kind`` the method or the exception) or a host-to-device copy."""

    kind: str
    scope: str
    phase: str
    shape: tuple[int, ...]
    where: str  # the innermost frame of the library or transformers


@contextmanager
def cuda_guard_for_trace() -> Iterator[None]:
    """On a CPU-only build, CUDA's slot of c10's device-guard registry holds meta's no-op guard
    while inside (autograd needs a guard for every device it records); emptied on exit. A build
    with CUDA keeps its own guard."""
    if torch.cuda._is_compiled():
        yield
        return
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    try:
        slots = (ctypes.c_void_p * (_META + 1)).from_address(
            ctypes.addressof(ctypes.c_void_p.in_dll(lib, _REGISTRY))
        )
    except ValueError as err:
        raise RuntimeError(
            f"this torch build ({torch.__version__}) does not export c10's guard registry"
        ) from err
    if slots[_CUDA] or not slots[_META]:
        raise RuntimeError(f"c10's guard registry of torch {torch.__version__} is not laid out as expected")
    slots[_CUDA] = slots[_META]
    try:
        yield
    finally:
        slots[_CUDA] = None


def _fit(grad: torch.Tensor, meta: Any) -> torch.Tensor:
    """A gradient shaped and typed as the input it belongs to (the engine's validate_outputs)."""
    if tuple(grad.shape) != tuple(meta.shape):
        grad = grad.sum_to_size(meta.shape)
    if grad.dtype != meta.dtype:
        grad = grad.to(meta.dtype)
    if grad.device != meta.device:
        raise RuntimeError(f"a gradient on {grad.device} for an input on {meta.device} ({tuple(meta.shape)})")
    return grad


def run_backward(root: torch.Tensor, *, on_node: Callable[[Any], None] | None = None) -> None:
    """``root.backward()`` (a scalar) without the autograd engine: every node of the graph once,
    in the engine's order; leaves' ``.grad`` accumulated. ``on_node(node)`` before each call."""
    first = root.grad_fn
    deps: dict[Any, int] = {}
    stack, seen = [first], {first}
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            deps[nxt] = deps.get(nxt, 0) + 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    buffers: dict[Any, list[torch.Tensor | None]] = {first: [torch.ones_like(root)]}
    order = itertools.count()
    ready = [(-first._sequence_nr(), next(order), first)]
    with torch.no_grad():
        while ready:
            _, _, node = heapq.heappop(ready)
            grads = buffers.pop(node, None) or [None] * len(node._input_metadata)
            if on_node is not None:
                on_node(node)
            if hasattr(node, "_forward_cls"):  # a torch.autograd.Function: materialise, then map
                grads = [
                    torch.zeros(m.shape, dtype=m.dtype, device=m.device) if g is None else g
                    for g, m in zip(grads, node._input_metadata, strict=True)
                ]
                out = node.apply(*grads)
                out = out if isinstance(out, tuple) else (out,)
                wanted = [g for g, need in zip(out, node.needs_input_grad, strict=False) if need]
                edges = [e for e in node.next_functions if e[0] is not None]
                pairs = list(zip(edges, wanted, strict=True))
            else:
                out = node(*grads)
                out = out if isinstance(out, tuple) else (out,)
                pairs = [(e, g) for e, g in zip(node.next_functions, out, strict=True) if e[0] is not None]
            for (nxt, nr), grad in pairs:
                slot = buffers.setdefault(nxt, [None] * len(nxt._input_metadata))
                if grad is not None:
                    grad = _fit(grad, nxt._input_metadata[nr])
                    slot[nr] = grad if slot[nr] is None else slot[nr] + grad
                deps[nxt] -= 1
                if deps[nxt] == 0:
                    heapq.heappush(ready, (-nxt._sequence_nr(), next(order), nxt))


def _where() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if any(p in frame.filename for p in _PACKAGES):
            short = frame.filename.split(os.sep + "site-packages" + os.sep)[-1]
            return f"{short.split(os.sep + 'hyperpar_gdn' + os.sep, 1)[-1]}:{frame.lineno} {frame.name}"
    return "?"


def _is_device(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cuda"


def _is_host_to_device(name: str, args: tuple, out: Any) -> bool:
    """A copy of host memory to the device (under fake tensors ``torch.as_tensor(array,
    device="cuda")`` lands on ``meta``: any device but the host counts)."""
    src = args[1] if name == "copy_" else args[0]
    dst = args[0] if name == "copy_" else out
    return isinstance(src, torch.Tensor) and src.device.type == "cpu" and dst.device.type != "cpu"


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class FakeCudaTrace:
    """One rank's trace on fake CUDA tensors (enter it after ``init_process_group("fake", ...)``).

    ``host_values(tensor, where)``: the value (numpy) of a device tensor read on the host OUTSIDE
    a watched module at ``where`` (file:line function), e.g. the shard lengths of the model's
    once-per-forward exchange (fake tensors have no values; ``tolist()`` reads element by element).
    Watch modules with :meth:`watch` (hooks; their scope covers the backward of what they made);
    run the backward with :meth:`backward`. Results: :attr:`collectives`, :attr:`reads`,
    :attr:`copies`, :attr:`misplaced`, :attr:`waits`."""

    def __init__(self, host_values: Callable[[torch.Tensor, str], Any] | None = None) -> None:
        self.host_values = host_values
        self.collectives: list[Collective] = []
        self.reads: list[Event] = []
        self.copies: list[Event] = []
        self.misplaced: list[Event] = []
        self.waits: list[Event] = []
        self._scopes: list[str] = []
        self._spans: list[tuple[int, int, str]] = []  # forward sequence numbers of each scope's nodes
        self._phase = "forward"
        self._forward_phase = "forward"
        self._backward_scope = "model"
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # host values handed back are real
        self._probe: torch.Tensor | None = None
        self.keep: list[np.ndarray] = []  # the host values handed out

    # --- scopes ---------------------------------------------------------------------------------
    @property
    def scope(self) -> str:
        if self._phase == "backward":
            return self._backward_scope
        return self._scopes[-1] if self._scopes else "model"

    def _sequence_now(self) -> int:
        with torch.enable_grad():
            return (self._probe * 1).grad_fn._sequence_nr()

    def watch(self, module: torch.nn.Module, label: str) -> None:
        """Calls of ``module`` (and the backward of what they compute) count under ``label``."""
        starts: list[int] = []

        def pre(_module: Any, _args: Any) -> None:
            self._scopes.append(label)
            starts.append(self._sequence_now())

        def post(_module: Any, _args: Any, _out: Any) -> None:
            self._spans.append((starts.pop(), self._sequence_now(), label))
            self._scopes.pop()

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` through :func:`run_backward`, each node's work under its scope."""

        def on_node(node: Any) -> None:
            nr = node._sequence_nr()
            self._backward_scope = next((s for a, b, s in self._spans if a <= nr < b), "model")

        self._phase = "backward"
        try:
            run_backward(loss, on_node=on_node)
        finally:
            self._phase, self._backward_scope = self._forward_phase, "model"

    def mark(self, phase: str) -> None:
        """Name what runs from here on (outside a backward): e.g. ``"decode"`` after a prefill."""
        self._phase = self._forward_phase = phase

    def reset(self) -> None:
        """Forget what was recorded (the watched modules stay watched); the phase is forward."""
        self.collectives.clear()
        self.reads.clear()
        self.copies.clear()
        self.misplaced.clear()
        self.waits.clear()
        self._spans.clear()
        self.mark("forward")

    def summary(self) -> dict[str, Any]:
        """What was recorded, as JSON: collectives ``[op, scope, phase, bytes, dtype, group size,
        shape]`` and events ``[kind, scope, phase, shape, where]``."""

        def events(items: list[Event]) -> list[list[Any]]:
            return [[e.kind, e.scope, e.phase, list(e.shape), e.where] for e in items]

        return {
            "collectives": [
                [
                    c.op,
                    c.scope,
                    c.phase,
                    c.nbytes,
                    str(c.dtype).removeprefix("torch."),
                    c.group_size,
                    list(c.shape),
                ]
                for c in self.collectives
            ],
            "reads": events(self.reads),
            "copies": events(self.copies),
            "misplaced": events(self.misplaced),
            "waits": events(self.waits),
        }

    # --- the modes ------------------------------------------------------------------------------
    @contextmanager
    def active(self) -> Iterator[FakeCudaTrace]:
        with cuda_guard_for_trace(), self._works(), self.fake_mode, _Reads(self), _Ops(self):
            self._probe = torch.zeros((), requires_grad=True)
            yield self

    @contextmanager
    def _works(self) -> Iterator[None]:
        """Record every blocking wait on a process group's work: ``Work.wait(timeout=...)``, which
        on NCCL holds the host until the kernel ends (a plain ``wait()`` orders the stream only).
        The works of ``batch_isend_irecv`` and of collectives started with ``async_op=True``."""
        names = ("batch_isend_irecv", "all_to_all_single", "all_gather_into_tensor", "all_reduce", "barrier")
        names += ("all_gather_single",) if hasattr(dist, "all_gather_single") else ()
        originals = {name: getattr(dist, name) for name in names}
        trace = self

        class Timed:
            def __init__(self, work: Any) -> None:
                self._work = work

            def wait(self, *args: Any, **kwargs: Any) -> Any:
                if args or kwargs.get("timeout") is not None:
                    trace.waits.append(Event("wait(timeout)", trace.scope, trace._phase, (), _where()))
                return self._work.wait()

            def __getattr__(self, name: str) -> Any:
                return getattr(self._work, name)

        def wrap(function: Callable) -> Callable:
            def call(*args: Any, **kwargs: Any) -> Any:
                out = function(*args, **kwargs)
                if isinstance(out, list):
                    return [Timed(w) for w in out]
                return out if out is None else Timed(out)

            return call

        for name, function in originals.items():
            setattr(dist, name, wrap(function))
        try:
            yield
        finally:
            for name, function in originals.items():
                setattr(dist, name, function)

    def host_read(self, kind: str, x: torch.Tensor) -> np.ndarray:
        event = Event(kind, self.scope, self._phase, tuple(x.shape), _where())
        self.reads.append(event)
        if self.scope != "model":
            raise HostSyncError(f"host read {kind}() of a device tensor {event.shape} in {event.scope} "
                                f"({event.phase}) at {event.where}")  # fmt: skip
        if self.host_values is None:
            raise HostSyncError(f"host read {kind}() outside the layers at {event.where}, and no host_values")
        return np.asarray(self.host_values(x, event.where))

    def record(self, func: Any, args: tuple, out: Any) -> None:
        name = func._opname if hasattr(func, "_opname") else str(func)
        if func.namespace == "c10d":
            self._collective(name, args)
        elif name in ("_to_copy", "copy_") and _is_host_to_device(name, args, out):
            self.copies.append(Event("h2d", self.scope, self._phase, tuple(out.shape), _where()))
        elif self.scope != "model" and not any(isinstance(a, torch.Tensor) for a in args):
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for o in outs:
                if isinstance(o, torch.Tensor) and o.device.type != "cuda":
                    self.misplaced.append(Event(name, self.scope, self._phase, tuple(o.shape), _where()))

    def _collective(self, name: str, args: tuple) -> None:
        group = next(a for a in args if type(a).__name__ == "ScriptObject")
        pg = dist.ProcessGroup.unbox(group)
        rank, size = pg.rank(), pg.size()
        x = args[1] if name in ("alltoall_base_", "_allgather_base_") else args[0][0]
        if name == "alltoall_base_":
            rows = list(args[4]) or [x.shape[0] // size] * size  # the input splits
            sent = (sum(rows) - rows[rank]) * math.prod(x.shape[1:]) * x.element_size()
        elif name in ("_allgather_base_", "allreduce_"):
            sent = _nbytes(x) * (size - 1)
        elif name in ("send", "recv_"):
            sent = _nbytes(x) if name == "send" else 0
        else:
            raise NotImplementedError(f"the trace does not count c10d.{name}")
        self.collectives.append(
            Collective(name, self.scope, self._phase, sent, x.dtype, size, tuple(x.shape))
        )


class _Reads(TorchFunctionMode):
    """Host reads of device tensors, seen where the code asks for them."""

    def __init__(self, trace: FakeCudaTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_host = name == "to" and any(
            (isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu") for a in (*args[1:], kwargs.get("device"))
            if a is not None
        )  # fmt: skip
        if (name in _READS or to_host) and args and _is_device(args[0]):
            value = self.trace.host_read("to(cpu)" if to_host else name, args[0])
            array = np.array(value, dtype=np.float32 if args[0].is_floating_point() else np.int64)
            self.trace.keep.append(array)  # the host tensor shares its memory
            with unset_fake_temporarily():  # from_numpy: the tensor constructor skips the data here
                host = torch.from_numpy(array).reshape(args[0].shape).to(args[0].dtype)
                return host if name in ("cpu", "to") else func(host, *args[1:], **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if tensors and not any(isinstance(a, FakeTensor) for a in tensors):  # host values stay real
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class _Ops(TorchDispatchMode):
    """Every operator: collectives, host-to-device copies, factories on another device, and
    data-dependent shapes (host reads inside aten)."""

    def __init__(self, trace: FakeCudaTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        try:
            out = func(*args, **(kwargs or {}))
        except (DataDependentOutputException, DynamicOutputShapeException) as err:
            trace = self.trace
            event = Event(type(err).__name__, trace.scope, trace._phase, (), _where())
            trace.reads.append(event)
            raise HostSyncError(
                f"{func} needs a device value on the host in {event.scope} at {event.where}"
            ) from err
        self.trace.record(func, args, out)
        return out
