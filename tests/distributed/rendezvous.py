"""Every rank's point-to-point traffic of a GDN layer, replayed under strict rendezvous, without a
device.

NCCL and HCCL complete a send only when its peer has posted the matching receive; gloo buffers
sends, so a run on gloo cannot show a deadlock or a serialized chain. Here:

1. :func:`record_layer` runs the real CP code (the mode's forward and its backward) of each rank
   of a CP group in turn, in this process, on torch's fake process group (values are not moved;
   every call's shapes and order are real), and records what each rank hands the process group:
   a :class:`Step` per ``batch_isend_irecv`` (its sends and receives, posted at once), per lone
   ``isend``/``irecv`` waited on its own, per collective (all-to-all, all-gather, all-reduce).
2. :func:`replay` advances the ranks in rounds: a posted send and its peer's posted receive (the
   next unmatched ones between the two ranks, of equal shapes) complete together; a collective
   completes when every member has posted it; a rank posts its next step when its current one
   has completed. No rank able to advance while some have steps left is a deadlock. The rounds in
   which a message of the state exchange (p2p, scan) moved are its depth.

Run as a script it prints the depth table of docs/backends.md::

    python tests/distributed/rendezvous.py
"""

from __future__ import annotations

import math
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from hyperpar_gdn.distributed.cp.common import CPGroup, LayerCall
from hyperpar_gdn.distributed.cp.state_passing import state_passing_forward
from hyperpar_gdn.distributed.cp.two_level import make_levels, node_spans, two_level_forward
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.distributed.sequence import GlobalSequence
from hyperpar_gdn.models.gated_deltanet import GatedDeltaNet
from hyperpar_gdn.ops.gdn.layer import LayerDims, LayerWeights
from hyperpar_gdn.platform import torch_collectives
from hyperpar_gdn.platform.torch_collectives import TorchCollectives
from hyperpar_gdn.platform.torch_ops import TorchOps

PER_RANK, HEADS, DIM, CHUNK = 8, 8, 4, 4  # tokens per rank (4 per head_tail piece, above the halo of 3)
STATE_FILES = ("cp/scan.py", "cp/state_passing.py")  # where the state exchange's messages come from


@dataclass(frozen=True)
class Op:
    kind: str  # "send" or "recv"
    peer: int  # global rank
    shape: tuple[int, ...]


@dataclass
class Step:
    """What one rank posts at once: point-to-point ``ops``, or one collective ``name`` over
    ``group`` (global ranks). ``state``: issued by the state exchange (p2p, scan)."""

    ops: list[Op] = field(default_factory=list)
    name: str | None = None
    group: tuple[int, ...] = ()
    state: bool = False


def _from_state_exchange() -> bool:
    """Whether the code that asked the platform for this message is the state exchange's (the
    innermost frame outside the platform's collectives, torch and this recorder)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = frame.filename.replace("\\", "/")
        if path.endswith("torch_collectives.py") or "/torch/" in path or path == __file__:
            continue
        return path.endswith(STATE_FILES)
    return False


def _group_ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


@contextmanager
def recording(steps: list[Step]) -> Iterator[None]:
    """Record every call the torch platform's collectives make into ``steps`` (the calls go on
    to the process group, here the fake one)."""
    originals = {
        name: getattr(dist, name)
        for name in ("batch_isend_irecv", "isend", "irecv", "all_to_all_single", "all_reduce")
    }
    gather, p2p_op = torch_collectives._all_gather_single, dist.P2POp
    kinds = {originals["isend"]: "send", originals["irecv"]: "recv"}

    def batch(ops):
        steps.append(
            Step(
                ops=[Op(kinds[op.op], op.peer, tuple(op.tensor.shape)) for op in ops],
                state=_from_state_exchange(),
            )
        )
        return originals["batch_isend_irecv"](ops)

    def single(kind):
        def call(tensor, dst=None, group=None, tag=0, **peers):
            peer = peers.get("group_dst", peers.get("group_src"))
            peer = dst if peer is None else _group_ranks(group)[peer]
            steps.append(Step(ops=[Op(kind, peer, tuple(tensor.shape))], state=_from_state_exchange()))
            return originals["isend" if kind == "send" else "irecv"](tensor, dst, group, tag, **peers)

        return call

    def collective(name, function):
        def call(*args, group=None, **kwargs):
            steps.append(Step(name=name, group=_group_ranks(group)))
            return function(*args, group=group, **kwargs)

        return call

    patches = {
        "batch_isend_irecv": batch,
        "isend": single("send"),
        "irecv": single("recv"),
        "all_to_all_single": collective("all_to_all", originals["all_to_all_single"]),
        "all_reduce": collective("all_reduce", originals["all_reduce"]),
    }
    real = {patches["isend"]: originals["isend"], patches["irecv"]: originals["irecv"]}
    patches["P2POp"] = lambda op, *args, **kwargs: p2p_op(real.get(op, op), *args, **kwargs)
    originals["P2POp"] = p2p_op
    for name, function in patches.items():
        setattr(dist, name, function)
    torch_collectives._all_gather_single = collective("all_gather", gather)
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
        torch_collectives._all_gather_single = gather


@dataclass(frozen=True)
class Case:
    mode: str  # p2p, scan, all_gather, ulysses, or "<mode>/<inner>" two levels (ulysses x mode)
    layout: str
    packed: bool
    cp: int

    @property
    def name(self) -> str:
        return f"{self.mode}/{self.layout}" + ("/docs" if self.packed else "") + f"/cp{self.cp}"


def _documents(t: int) -> list[int]:
    """cu_seqlens of documents of odd lengths crossing ranks (and head_tail pieces)."""
    cuts, at, step = [0], 0, 5
    while at + step < t:
        at += step
        cuts.append(at)
        step = 7 if step == 5 else 5
    return [*cuts, t]


def record_layer(case: Case) -> tuple[dict[int, list[Step]], dict[int, list[Step]]]:
    """Every rank's steps of one GDN layer's forward and of its backward (global rank -> steps)."""
    torch.manual_seed(0)
    module = GatedDeltaNet(16, HEADS, HEADS, DIM, DIM)
    dims, weights = LayerDims.of(module), LayerWeights.of(module)
    call = LayerCall(weights=weights, dims=dims, chunk_size=CHUNK)
    cp, t = case.cp, case.cp * PER_RANK
    lengths = [PER_RANK] * cp
    tokens = TokenLayout.of(case.layout, lengths)
    cu = _documents(t) if case.packed else None
    x_all = torch.randn(1, t, 16)
    forward: dict[int, list[Step]] = {}
    backward: dict[int, list[Step]] = {}
    for rank in range(cp):
        dist.init_process_group("fake", store=_fake_store(), rank=rank, world_size=cp)
        try:
            group = CPGroup(xp=TorchOps(), comm=TorchCollectives(), group=None, rank=rank, size=cp)
            x = x_all[:, tokens.positions(rank)].clone().requires_grad_(True)
            forward[rank], backward[rank] = [], []
            if "/" in case.mode:  # two levels
                state_mode, inner = case.mode.split("/")
                platform = SimpleNamespace(new_group=lambda ranks: dist.new_group(ranks))
                levels = make_levels(platform, group, list(range(cp)), int(inner))
                docs = None
                if cu is not None:  # as the GDN style takes them from the forward's context
                    seq = GlobalSequence.build(lengths, rank=rank, layout=case.layout, cu_seqlens=cu)
                    spans = node_spans(lengths, int(inner), rank, layout=case.layout)
                    docs = seq.documents(spans, dims.conv_kernel_size)
                with recording(forward[rank]):
                    y = two_level_forward(
                        state_mode, levels, call, x, None, lengths, docs, layout=case.layout
                    )
            else:
                layout = None if tokens.is_contiguous else tokens
                docs = None
                if cu is not None:  # as the GDN style takes them from the forward's context
                    seq = GlobalSequence.build(lengths, rank=rank, layout=case.layout, cu_seqlens=cu)
                    docs = (
                        seq.whole_docs()
                        if case.mode == "ulysses"
                        else seq.shard_docs(dims.conv_kernel_size, by_fragment=layout is not None)
                    )
                with recording(forward[rank]):
                    if case.mode == "ulysses":
                        from hyperpar_gdn.distributed.cp.ulysses import ulysses_forward

                        y = ulysses_forward(group, call, x, None, lengths, docs, layout)
                    else:
                        y = state_passing_forward(case.mode, group, call, x, None, docs, layout)
            with recording(backward[rank]):
                y.sum().backward()
            module.zero_grad(set_to_none=True)
        finally:
            dist.destroy_process_group()
    return forward, backward


def _fake_store():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


class Deadlock(AssertionError):
    pass


def replay(steps: dict[int, list[Step]]) -> tuple[int, int]:
    """Advance the ranks under strict rendezvous (module docstring). Returns (rounds in all,
    rounds in which a state exchange message moved). Raises :class:`Deadlock` (naming every
    waiting rank's step) when no rank can advance, AssertionError when a matched send and
    receive differ in shape."""
    at = dict.fromkeys(steps, 0)
    pending = {r: list(s[0].ops) if s else [] for r, s in steps.items()}
    rounds = state_rounds = 0
    while any(at[r] < len(steps[r]) for r in steps):
        current = {r: steps[r][at[r]] for r in steps if at[r] < len(steps[r])}
        done: set[int] = set()
        moved_state = False
        for r, step in current.items():  # collectives: every member at the same one
            if step.name is not None and all(
                m in current and current[m].name == step.name and current[m].group == step.group
                for m in step.group
            ):
                done.add(r)
        matched: dict[int, list[Op]] = {r: [] for r in current}
        for a, step in current.items():  # point-to-point: the next unmatched pair of a and b
            if step.name is not None:
                continue
            for b in {op.peer for op in pending[a] if op.kind == "send"}:
                if b not in current or current[b].name is not None:
                    continue
                sends = [op for op in pending[a] if op.kind == "send" and op.peer == b]
                recvs = [op for op in pending[b] if op.kind == "recv" and op.peer == a]
                for send, recv in zip(sends, recvs, strict=False):
                    assert send.shape == recv.shape, (
                        f"rank {a} sends {send.shape}, rank {b} expects {recv.shape}"
                    )
                    matched[a].append(send)
                    matched[b].append(recv)
                    moved_state |= step.state or current[b].state
        for r, ops in matched.items():
            for op in ops:
                pending[r].remove(op)
            if current[r].name is None and not pending[r]:
                done.add(r)
        if not done and not any(matched.values()):
            raise Deadlock(
                "no rank can advance: "
                + "; ".join(f"rank {r} waits in {s.name or pending[r]}" for r, s in sorted(current.items()))
            )
        rounds += 1
        state_rounds += moved_state
        for r in done:
            at[r] += 1
            pending[r] = list(steps[r][at[r]].ops) if at[r] < len(steps[r]) else []
    return rounds, state_rounds


CP_SIZES = (2, 3, 4, 5, 8, 16, 32, 64)


def cases(cp_sizes=CP_SIZES) -> list[Case]:
    out = []
    for cp in cp_sizes:
        for layout in ("contiguous", "head_tail"):
            for packed in (False, True):
                for mode in ("p2p", "scan", "all_gather"):
                    out.append(Case(mode, layout, packed, cp))
                if HEADS % cp == 0:
                    out.append(Case("ulysses", layout, packed, cp))
                inner = 2 if cp == 4 else 4 if cp % 4 == 0 and cp > 4 else None
                if inner is not None:
                    out += [Case(f"{m}/{inner}", layout, packed, cp) for m in ("p2p", "scan", "all_gather")]
    return out


def depth_bound(case: Case) -> int | None:
    """The most rounds in sequence the state exchange may take, forward or backward: p2p's chain
    (cp - 1 contiguous, 2 cp - 2 head_tail, over the outer ranks for two levels), the scan's
    ceil(log2 n) over its n fragments; None: no state exchange of its own (all_gather, ulysses)."""
    mode, n = case.mode, case.cp
    if "/" in mode:
        mode, inner = mode.split("/")
        n //= int(inner)
    fragments = n if case.layout == "contiguous" else 2 * n
    if mode == "p2p":
        return fragments - 1 if case.layout == "contiguous" else fragments - 2
    if mode == "scan":
        return math.ceil(math.log2(fragments))
    return None


def main() -> None:
    sizes = tuple(int(v) for v in sys.argv[1:]) or CP_SIZES
    rows: dict[tuple[str, str], dict[int, str]] = {}
    for case in cases(sizes):
        if case.packed:
            continue
        fwd, bwd = record_layer(case)
        (_, f_state), (_, b_state) = replay(fwd), replay(bwd)
        rows.setdefault((case.mode, case.layout), {})[case.cp] = f"{f_state}/{b_state}"
    print("| mode | layout | " + " | ".join(f"cp {c}" for c in sizes) + " |")
    print("|" + " --- |" * (2 + len(sizes)))
    for (mode, layout), by_cp in rows.items():
        print(f"| {mode} | {layout} | " + " | ".join(by_cp.get(c, "-") for c in sizes) + " |")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
