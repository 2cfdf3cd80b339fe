"""Tracing a device platform's code on a machine without the device (tests only).

Under torch's ``FakeTensorMode`` a CPU-only torch build makes ``device="cuda"`` tensors (shapes,
dtypes and devices only, no memory), and torch's fake process group (``init_process_group("fake",
store=FakeStore(), rank=r, world_size=n)`` from ``torch.testing._internal.distributed.fake_pg``)
accepts the collectives on them at any world size in one process. Together they run one rank's
CUDA code paths without a GPU (``tests/fake_cuda.py`` drives them). ``torch.cuda.is_available()``
stays False there, so the ``cuda`` platform would refuse to be built and would try to select a
device; inside :func:`trace_without_device` it does neither:

- ``TorchPlatform(name)`` is built without the device check;
- joining the process group selects no device, and an existing default group of any backend
  (the fake one) is taken as it is;
- on exit the platform instances built inside are forgotten (``get_platform`` builds a new one).

Nothing else changes: tensors, kernels and collectives take the device paths they take on the
device. Example::

    with trace_without_device("cuda"), FakeTensorMode():
        dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
        mesh = init_device_mesh("cuda", (8,), mesh_dim_names=("cp",))
        ...

Not for training or inference: with it a run on a machine without the device makes no error at
the start and fails at its first tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

__all__ = ["trace_without_device", "traced", "traced_instance"]

TRACEABLE = ("cuda",)  # npu would still need torch_npu to import
_TRACED: ContextVar[frozenset[str]] = ContextVar("hyperpar_gdn_traced_devices", default=frozenset())
_INSTANCES: dict[str, Any] = {}  # the platforms of the running traces, by name


def traced(name: str) -> bool:
    """Whether platform ``name`` is being traced without its device (:func:`trace_without_device`)."""
    return name in _TRACED.get()


def traced_instance(name: str, build: Callable[[], Any]) -> Any:
    """The platform ``name`` of the running trace (built by ``build`` on first use), kept apart
    from ``get_platform``'s own instances and dropped when the trace ends."""
    if name not in _INSTANCES:
        _INSTANCES[name] = build()
    return _INSTANCES[name]


@contextmanager
def trace_without_device(name: str = "cuda") -> Iterator[None]:
    """Let platform ``name`` (``"cuda"``) be built and joined without its device, for a trace
    under fake tensors and torch's fake process group (see the module docstring). On exit the
    platform instances made inside are dropped, so nothing of the trace stays."""
    if name not in TRACEABLE:
        raise ValueError(f"trace_without_device: name={name!r}; choose one of {', '.join(TRACEABLE)}")
    token = _TRACED.set(_TRACED.get() | {name})
    try:
        yield
    finally:
        _TRACED.reset(token)
        if not traced(name):
            _INSTANCES.pop(name, None)
