"""Running fla's Triton kernels on this CPU under Triton's interpreter (``TRITON_INTERPRET=1``).

:func:`interpreted_triton` is a context manager that works around what stands between fla 0.6 and
triton 3.9's interpreter, changing triton's classes only while it is entered (and restoring them
after); nothing is changed when fla or triton is imported:

1. The autotuner benchmarks every config through the active driver, and the interpreter has none:
   its benchmark returns constant timings, so it takes the first config.
2. Some fla kernels loop with Python's ``range`` and call ``.to(...)`` on the loop index, which the
   interpreter leaves a plain int: while a kernel or device function runs, ``range`` in its module
   yields interpreter scalars.
3. The interpreter keeps bf16 values as their uint16 bit patterns and multiplies those as integers
   (``tl.dot``, elementwise arithmetic) and rounds fp32 -> bf16 by truncation: bf16 operands are
   widened to fp32 exactly for a product or an elementwise operation, an elementwise result is
   rounded back to bf16 to nearest even (torch's conversion), and so is every fp32 -> bf16 cast,
   as a GPU does.
4. Speed only: a device function called from a running kernel re-patches ``triton.language``,
   which the running kernel has already patched; that repeat is skipped.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch


@contextlib.contextmanager
def interpreted_triton() -> Iterator[None]:
    """The workarounds of the module docstring, for the duration of the ``with`` block."""
    import triton.language as tl
    from triton.runtime import autotuner, interpreter

    handle = interpreter.TensorHandle

    def as_int(x: Any) -> int:
        if isinstance(x, tl.tensor):
            return int(np.asarray(x.handle.data).reshape(-1)[0])
        return int(getattr(x, "value", x))

    def scalar_range(*args: Any) -> Iterator[Any]:
        for i in builtins.range(*(as_int(a) for a in args)):
            yield interpreter._implicit_cvt(i)

    def with_range(call: Callable) -> Callable:
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            scope = self.fn.__globals__
            had, old = "range" in scope, scope.get("range")
            scope["range"] = scalar_range
            try:
                return call(self, *args, **kwargs)
            finally:
                if had:
                    scope["range"] = old
                else:
                    del scope["range"]

        return wrapped

    patched: list[set[int]] = []  # per running kernel: the language modules patched for it

    def langs_of(fn: Any) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def grid_call(call: Callable) -> Callable:
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            patched.append(langs_of(self.fn))
            try:
                return call(self, *args, **kwargs)
            finally:
                patched.pop()

        return wrapped

    def device_call(call: Callable) -> Callable:
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            langs = langs_of(self.fn)
            if not patched or not langs <= patched[-1]:
                if patched:
                    patched[-1] |= langs
                return call(self, *args, **kwargs)
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as error:
                raise interpreter.InterpreterError(repr(error)) from error

        return wrapped

    def to_f32(bits: Any) -> np.ndarray:
        return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)

    def to_bf16(values: Any) -> np.ndarray:
        values = np.ascontiguousarray(values, dtype=np.float32)
        return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)

    def widen(h: Any) -> Any:
        return handle(to_f32(h.data), tl.float32) if h.dtype.scalar == tl.bfloat16 else h

    builder = interpreter.InterpreterBuilder
    originals = {
        (builder, "cast_impl"): builder.cast_impl,
        (builder, "create_dot"): builder.create_dot,
        (builder, "binary_op"): builder.binary_op,
        (builder, "unary_op"): builder.unary_op,
        (autotuner.Autotuner, "_bench"): autotuner.Autotuner._bench,
        (interpreter.GridExecutor, "__call__"): interpreter.GridExecutor.__call__,
        (interpreter.InterpretedFunction, "__call__"): interpreter.InterpretedFunction.__call__,
    }

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        source, target = src.dtype.scalar, dst_type.scalar
        if source == tl.bfloat16 and target == tl.float32:
            return handle(to_f32(src.data), target)
        if source == tl.float32 and target == tl.bfloat16:
            return handle(to_bf16(src.data), target)
        return originals[(builder, "cast_impl")](self, src, dst_type)

    def create_dot(self: Any, a: Any, b: Any, d: Any, *rest: Any) -> Any:
        return originals[(builder, "create_dot")](self, widen(a), widen(b), d, *rest)

    def binary_op(self: Any, lhs: Any, rhs: Any, op: Any) -> Any:
        call = originals[(builder, "binary_op")]
        if tl.bfloat16 not in (lhs.dtype.scalar, rhs.dtype.scalar):
            return call(self, lhs, rhs, op)
        out = call(self, widen(lhs), widen(rhs), op)
        if out.data.dtype == np.float32 and lhs.dtype.scalar == tl.bfloat16:
            return handle(to_bf16(out.data), tl.bfloat16)
        return out

    def unary_op(self: Any, arg: Any, op: Any) -> Any:
        call = originals[(builder, "unary_op")]
        if arg.dtype.scalar != tl.bfloat16:
            return call(self, arg, op)
        out = call(self, widen(arg), op)
        return handle(to_bf16(out.data), tl.bfloat16) if out.data.dtype == np.float32 else out

    def constant_timings(self: Any, *args: Any, config: Any, **meta: Any) -> list[float]:
        return [1.0, 1.0, 1.0]

    replacements = {
        (builder, "cast_impl"): cast_impl,
        (builder, "create_dot"): create_dot,
        (builder, "binary_op"): binary_op,
        (builder, "unary_op"): unary_op,
        (autotuner.Autotuner, "_bench"): constant_timings,
        (interpreter.GridExecutor, "__call__"): grid_call(
            with_range(originals[(interpreter.GridExecutor, "__call__")])
        ),
        (interpreter.InterpretedFunction, "__call__"): with_range(
            device_call(originals[(interpreter.InterpretedFunction, "__call__")])
        ),
    }
    for (owner, name), value in replacements.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name), value in originals.items():
            setattr(owner, name, value)


def patched_names() -> dict[str, Any]:
    """The attributes :func:`interpreted_triton` replaces, by name, as they are now (a test
    compares them before and after the block)."""
    from triton.runtime import autotuner, interpreter

    builder = interpreter.InterpreterBuilder
    return {
        "cast_impl": builder.cast_impl,
        "create_dot": builder.create_dot,
        "binary_op": builder.binary_op,
        "unary_op": builder.unary_op,
        "_bench": autotuner.Autotuner._bench,
        "GridExecutor.__call__": interpreter.GridExecutor.__call__,
        "InterpretedFunction.__call__": interpreter.InterpretedFunction.__call__,
    }
