"""The MindSpore backend of ``scripts/bench_ops.py``: ``ours`` on MindSpore tensors beside the
torch implementations on the same values (see :class:`MindSporeBackend`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from benchkit.gdn_ops import GRAD_NAMES, BenchConfig, TorchBackend, matmul_rates

__all__ = ["MindSporeBackend"]


class MindSporeBackend(TorchBackend):
    """``ours`` on MindSpore tensors (PyNative, CPU, kernels launched synchronously as the
    MindSpore platform runs them), beside the torch implementations on the same input values:
    ``ours_torch`` (the same code on torch tensors) and ``transformers`` (the reference for the
    speed-ups and the agreement). Matmul rates are MindSpore's; the FLOP counter runs the torch
    twin of ``ours`` (the same algorithm, so the same count).

    Two thread pools share the cores here: torch's OpenMP threads spin after each parallel region
    and starve MindSpore's (measured: torch 20-50x slower beside MindSpore with 2 threads each).
    Run with ``OMP_WAIT_POLICY=PASSIVE`` or ``--threads 1``; anything else is flagged in the report.
    """

    name = "mindspore"

    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__(cfg)
        import mindspore

        from hyperpar_gdn.platform.mindspore_cpu_share import CpuShare, apply_cpu_share
        from hyperpar_gdn.platform.mindspore_ops import enable_launch_blocking

        self.ms = mindspore
        mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
        if cfg.threads is not None:  # MindSpore's CPU kernel threads, before its first kernel
            apply_cpu_share(CpuShare(threads=cfg.threads, cpus=None, threads_asked=True))
        enable_launch_blocking()
        self._grad_fns: dict[int, Callable] = {}
        self._torch_ours: Callable | None = None

    def info(self) -> dict[str, Any]:
        policy = os.environ.get("OMP_WAIT_POLICY", "")
        fair = policy.upper() == "PASSIVE" or self.cfg.threads == 1
        return {
            **super().info(),
            "mindspore": self.ms.__version__,
            "omp_wait_policy": policy or None,
            "thread_pools_fair": fair,
        }

    def make_inputs(self) -> dict[str, Any]:
        """The torch inputs, plus MindSpore copies of them under ``ms_<name>``."""
        inputs = super().make_inputs()
        for name in ("q", "k", "v", "g", "beta", "do"):
            inputs[f"ms_{name}"] = self.ms.Tensor(inputs[name].detach().numpy())
        return inputs

    def implementations(self) -> dict[str, Callable[[dict[str, Any]], Any]]:
        from hyperpar_gdn.ops import chunk_gated_delta_rule

        torch_impls = super().implementations()
        self._torch_ours = torch_impls["ours"]
        c = self.cfg.chunk_size

        def ours(x: dict[str, Any]) -> Any:
            o, _ = chunk_gated_delta_rule(
                x["ms_q"],
                x["ms_k"],
                x["ms_v"],
                x["ms_g"],
                x["ms_beta"],
                chunk_size=c,
                use_qk_l2norm_in_kernel=True,
            )
            return o

        ours.framework = "mindspore"  # type: ignore[attr-defined]
        return {"ours": ours, "ours_torch": torch_impls["ours"], "transformers": torch_impls["transformers"]}

    @staticmethod
    def _is_mindspore(fn: Callable) -> bool:
        return getattr(fn, "framework", None) == "mindspore"

    def forward(self, fn: Callable, x: dict[str, Any]) -> Any:
        return fn(x) if self._is_mindspore(fn) else super().forward(fn, x)

    def forward_backward(self, fn: Callable, x: dict[str, Any]) -> tuple[Any, list[Any]]:
        if not self._is_mindspore(fn):
            return super().forward_backward(fn, x)
        names = [name[1:] for name in GRAD_NAMES]
        grad_fn = self._grad_fns.get(id(fn))
        if grad_fn is None:

            def of_tensors(*tensors: Any) -> Any:
                return fn({f"ms_{name}": t for name, t in zip(names, tensors, strict=True)})

            grad_fn = self.ms.value_and_grad(
                of_tensors, grad_position=tuple(range(len(names))), sens_param=True
            )
            self._grad_fns[id(fn)] = grad_fn
        o, grads = grad_fn(*(x[f"ms_{name}"] for name in names), x["ms_do"])
        return o, list(grads)

    def to_numpy(self, x: Any) -> np.ndarray:
        if isinstance(x, self.ms.Tensor):
            return x.asnumpy().astype(np.float64)
        return super().to_numpy(x)

    def measured_flops(self, fn: Callable, x: dict[str, Any]) -> int:
        assert self._torch_ours is not None, "implementations() first"
        return super().measured_flops(self._torch_ours, x)

    def matmul_rates(self, size: int, repeats: int) -> dict[str, Any]:
        """:func:`matmul_rates` with MindSpore's matmul (``mint.matmul``)."""
        rng = np.random.default_rng(self.cfg.seed)

        def randn(*shape: int) -> Any:  # mint.randn has no CPU kernel in MindSpore 2.10
            return self.ms.Tensor(rng.standard_normal(shape).astype(np.float32))

        return matmul_rates(self.cfg, self.ms.mint.matmul, randn, size=size, repeats=repeats)
