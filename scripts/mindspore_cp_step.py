"""One context-parallel training step of the MindSpore ``HybridLM`` with MindSpore alone (no torch).

Run it on a machine that installed only the ``mindspore`` extra (``pip install '.[mindspore]'``):

    HP_PLATFORM=mindspore msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True \
        --log_dir=msrun_log scripts/mindspore_cp_step.py --cp-mode p2p

Every rank builds the same small model (weights from the seed) and the same batch; the model is
made context parallel (``apply_context_parallel``), each rank computes its term of the global mean
loss on its shard (``shard_for_context_parallel``, ``context_parallel_lm_loss``), the gradient
shares are summed over the ranks (``sync_context_parallel_grads``) and one SGD step is taken.
Every rank also runs the same step on the whole sequence without parallelism and compares the
loss and every parameter's gradient (error relative to each tensor's largest value). Rank 0
prints ``mindspore_cp_step: ok ...``; the exit code is 0 only if every rank matched within
``--tolerance``, the step moved every parameter by ``-lr * gradient`` and no rank imported torch.
MindSpore's own log lines go to ``<log_dir>/rank_N/`` (``GLOG_v`` brings them back); a bad option
is one line on rank 0.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from hyperpar_gdn.models.config import HybridLMConfig

# MindSpore is imported inside the functions: its log lines must be routed to files first
# (hyperpar_gdn.cli.run_script does it before the body runs)
CONFIG = HybridLMConfig(num_layers=4, hidden_size=32, intermediate_size=64, vocab_size=64)


def build_model(seed: int) -> Any:
    """The MindSpore ``HybridLM`` with weights drawn from ``seed`` (numpy's and MindSpore's generators)."""
    import mindspore as ms

    from hyperpar_gdn.models.mindspore import HybridLM

    np.random.seed(seed)
    ms.set_seed(seed)
    return HybridLM(CONFIG)


def loss_and_grads(model: Any, input_ids: Any, loss_of_hidden: Any) -> tuple[float, list]:
    """(loss, gradients of every trainable parameter): ``loss_of_hidden(hidden [B, T, C], head
    [V, C])`` after one forward of ``model`` on ``input_ids`` [B, T], and its backward."""
    import mindspore as ms

    params = model.trainable_params()

    def loss_fn(ids: ms.Tensor) -> ms.Tensor:
        return loss_of_hidden(model.final_hidden_states(ids), model.head_weight)

    loss, grads = ms.value_and_grad(loss_fn, None, params)(input_ids)
    return float(loss.asnumpy()), list(grads)


def relative_error(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0, 1 when the step does not match one device, 2 after a user error (one line
    on rank 0)."""
    from hyperpar_gdn.cli import run_script
    from hyperpar_gdn.platform import PlatformUnavailableError

    return run_script(
        "mindspore_cp_step.py", lambda: _main(argv), user_errors=(ValueError, PlatformUnavailableError)
    )


def _main(argv: list[str] | None) -> int:
    import mindspore as ms

    from hyperpar_gdn import (
        apply_context_parallel,
        context_parallel_lm_loss,
        init_device_mesh,
        shard_for_context_parallel,
        sync_context_parallel_grads,
    )
    from hyperpar_gdn.cli import Parser, UsageError
    from hyperpar_gdn.ops.lm_loss import lm_loss_sum_reference
    from hyperpar_gdn.planning.plan import MODE_CHOICES
    from hyperpar_gdn.platform import get_platform

    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cp-mode",
        choices=MODE_CHOICES,
        default="p2p",
        help="CP mode of the GDN layers (auto: the cost model's choice for --seq-len)",
    )
    parser.add_argument(
        "--inner-size",
        type=int,
        default=None,
        help="ranks per inner group of a two-level --cp-mode (default: none, for the one-level modes)",
    )
    parser.add_argument("--seq-len", type=int, default=32, help="tokens T of the batch, split over the ranks")
    parser.add_argument("--seed", type=int, default=0, help="weights and input")
    parser.add_argument("--lr", type=float, default=1e-2, help="learning rate of the step")
    parser.add_argument(
        "--tolerance", type=float, default=1e-4, help="max error relative to each tensor's scale"
    )
    parser.add_argument("--timeout-s", type=float, default=120.0, help="process-group timeout")
    args = parser.parse_args(argv)

    platform = get_platform()
    if platform.name != "mindspore":
        raise UsageError(f"run under HP_PLATFORM=mindspore (got platform {platform.name!r})")
    platform.init_distributed(timeout_s=args.timeout_s)
    rank, world = platform.rank(), platform.world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))

    tokens = np.random.default_rng(args.seed).integers(0, CONFIG.vocab_size, (1, args.seq_len))
    input_ids = platform.from_numpy(tokens, dtype="int64")
    reference = build_model(args.seed)
    model = build_model(args.seed)
    auto = {"seq_len": args.seq_len, "dtype": "float32"} if args.cp_mode == "auto" else {}
    apply_context_parallel(model, mesh, mode=args.cp_mode, inner_size=args.inner_size, **auto)

    shard = shard_for_context_parallel(mesh, input_ids)  # this rank's tokens and shifted labels
    loss_share, grads = loss_and_grads(
        model, shard.input_ids, lambda h, w: context_parallel_lm_loss(h, w, shard.labels, mesh)
    )
    grads = sync_context_parallel_grads(grads, mesh)
    share = ms.Tensor([loss_share], ms.float32)
    loss = float(platform.to_numpy(platform.collectives.all_reduce_sum(share, None))[0])
    # the same step on one device: the whole sequence, the logits whole, labels shifted by hand
    shifted = platform.from_numpy(np.append(tokens[:, 1:], [[-100]], axis=1), dtype="int64")
    labelled = args.seq_len - 1
    ref_loss, ref_grads = loss_and_grads(
        reference, input_ids, lambda h, w: lm_loss_sum_reference(h, w, shifted) / labelled
    )
    errors = [
        relative_error(platform.to_numpy(g), platform.to_numpy(r))
        for g, r in zip(grads, ref_grads, strict=True)
    ]
    worst = max([abs(loss - ref_loss) / abs(ref_loss), *errors])

    params = model.trainable_params()
    before = [p.asnumpy().copy() for p in params]
    ms.nn.SGD(params, learning_rate=args.lr)(tuple(grads))
    expected = [b - args.lr * platform.to_numpy(g) for b, g in zip(before, grads, strict=True)]
    stepped = all(
        np.allclose(p.asnumpy(), e, rtol=1e-5, atol=1e-7) for p, e in zip(params, expected, strict=True)
    )
    torch_loaded = "torch" in sys.modules
    ok = worst <= args.tolerance and stepped and not torch_loaded
    if rank == 0:
        print(
            f"mindspore_cp_step: {'ok' if ok else 'FAILED'} cp={world} mode={args.cp_mode} loss={loss:.6f} "
            f"one-device={ref_loss:.6f} worst relative error={worst:.2e} over {len(errors)} gradients "
            f"(tolerance {args.tolerance:g}); SGD step applied: {stepped}; torch imported: {torch_loaded}",
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
