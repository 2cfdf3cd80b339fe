"""``bench_ops``'s packed case: ``ours`` on T tokens as documents of random lengths
(``cu_seqlens``) against ``ours`` on the same tokens unpacked, forward+backward in alternating
rounds, and the packed output's error against each document run alone."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

import numpy as np

from benchkit.gdn_ops import BenchConfig, TorchBackend
from benchkit.timing import alternating_rounds, rel_err

__all__ = ["TARGET_PACKED_RATIO", "describe_packed", "packed_case"]

TARGET_PACKED_RATIO = 1.15


def packed_case(cfg: BenchConfig) -> dict[str, Any]:
    """Forward+backward of ``ours`` on ``cfg.packed_T`` tokens as ``cfg.packed_docs`` documents
    and unpacked, taking turns each round; medians, samples, their ratio and the error."""
    import torch

    from hyperpar_gdn.ops import chunk_gated_delta_rule

    backend = TorchBackend(BenchConfig(**{**asdict(cfg), "T": cfg.packed_T, "B": 1, "backend": "torch"}))
    x = backend.make_inputs()
    rng = np.random.default_rng(cfg.seed)
    cuts = np.sort(rng.choice(np.arange(1, cfg.packed_T), cfg.packed_docs - 1, replace=False))
    cu = [0, *cuts.tolist(), cfg.packed_T]
    cu_tensor = torch.tensor(cu, dtype=torch.int32)
    names = ("q", "k", "v", "g", "beta")

    def ours(y: dict[str, Any], cu_seqlens: Any = None) -> Any:
        o, _ = chunk_gated_delta_rule(
            *(y[n] for n in names), chunk_size=cfg.chunk_size, use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_seqlens,
        )  # fmt: skip
        return o

    with torch.no_grad():  # each document alone, for the error of the packed output
        alone = torch.cat(
            [ours({n: x[n][:, a:b] for n in names}) for a, b in zip(cu[:-1], cu[1:], strict=True)], 1
        )
        err = rel_err(backend.to_numpy(ours(x, cu_tensor)), backend.to_numpy(alone))
    samples = alternating_rounds(
        {
            "unpacked": lambda: backend.forward_backward(ours, x),
            "packed": lambda: backend.forward_backward(lambda y: ours(y, cu_tensor), x),
        },
        repeats=cfg.repeats,
        warmup=cfg.warmup,
    )
    med = {name: statistics.median(times) for name, times in samples.items()}
    ratio = med["packed"] / med["unpacked"]
    return {
        "T": cfg.packed_T,
        "cu_seqlens": cu,
        "forward_backward_s": med,
        "forward_backward_samples_s": samples,
        "ratio_packed_over_unpacked": ratio,
        "target_ratio": TARGET_PACKED_RATIO,
        "within_target": ratio <= TARGET_PACKED_RATIO,
        "rel_err_vs_documents_alone": err,
    }


def describe_packed(packed: dict[str, Any]) -> str:
    """One line for the report."""
    t = packed["forward_backward_s"]
    return (
        f"packed T={packed['T']} as {len(packed['cu_seqlens']) - 1} documents {packed['cu_seqlens']}: "
        f"fwd+bwd {t['packed'] * 1e3:.1f} ms vs unpacked {t['unpacked'] * 1e3:.1f} ms = "
        f"{packed['ratio_packed_over_unpacked']:.3f}x (target <= {packed['target_ratio']}: "
        f"{'ok' if packed['within_target'] else 'ABOVE TARGET'}); o vs documents alone "
        f"{packed['rel_err_vs_documents_alone']:.1e}"
    )
