"""Every mode's point-to-point traffic replayed under strict rendezvous (NCCL's and HCCL's
semantics for large messages), without a device (:mod:`rendezvous`): the real CP code of each
rank of a CP group runs on torch's fake process group, forward and backward, and the recorded
calls are replayed so that a send completes only with its peer's posted receive.

Asserted for p2p, scan, all_gather, ulysses (where the heads divide), the two-level modes, both
layouts, with and without packed documents, cp 2 to 64, forward and backward: no deadlock; the
state exchange's depth is scan's ceil(log2 n) over its n fragments (cp contiguous, 2 cp
head_tail), p2p's chain exactly (cp - 1 contiguous, 2 cp - 2 head_tail), nothing for all_gather
and ulysses; every other round (conv halos, all-to-alls, all-gathers) is one round each. The
replay itself is checked on hand-made traffic: it finds the deadlock of a ring of lone sends and
counts a chain of lone sends hop by hop.
"""

from __future__ import annotations

import pytest
from rendezvous import CP_SIZES, Deadlock, Op, Step, cases, depth_bound, record_layer, replay


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cp", CP_SIZES, ids=[f"cp{c}" for c in CP_SIZES])
def test_every_mode_replays_without_deadlock_in_bounded_depth(cp: int) -> None:
    failures = []
    mine = [case for case in cases((cp,))]
    assert {c.mode for c in mine} >= {"p2p", "scan", "all_gather"} and len({c.layout for c in mine}) == 2
    for case in mine:
        for phase, steps in zip(("forward", "backward"), record_layer(case), strict=True):
            assert all(steps[r] for r in range(cp)) or case.mode == "ulysses", (case.name, phase)
            try:
                rounds, state = replay(steps)
            except Deadlock as err:
                failures.append(f"{case.name} {phase}: {err}")
                continue
            bound = depth_bound(case)
            if bound is None and state:
                failures.append(f"{case.name} {phase}: {state} state rounds, none expected")
            elif bound is not None and state != bound:
                failures.append(f"{case.name} {phase}: depth {state}, expected {bound}")
            collectives = max(sum(s.name is not None for s in steps[r]) for r in range(cp))
            halo = sum(not s.state and s.name is None for s in steps[0])
            if rounds > state + collectives + halo + 1:
                failures.append(f"{case.name} {phase}: {rounds} rounds beyond the exchanges' own")
    assert not failures, "\n".join(failures)


def _lone(kind: str, peer: int) -> Step:
    return Step(ops=[Op(kind, peer, (2,))])


def test_replay_finds_a_ring_of_lone_sends_deadlocked() -> None:
    ring = {r: [_lone("send", (r + 1) % 3), _lone("recv", (r - 1) % 3)] for r in range(3)}
    with pytest.raises(Deadlock, match="rank 0 waits"):
        replay(ring)
    batched = {
        r: [Step(ops=[Op("send", (r + 1) % 3, (2,)), Op("recv", (r - 1) % 3, (2,))])] for r in range(3)
    }
    assert replay(batched) == (1, 0)


def test_replay_counts_a_chain_hop_by_hop_and_checks_shapes() -> None:
    chain = {
        r: ([_lone("recv", r - 1)] if r else []) + ([_lone("send", r + 1)] if r < 4 else []) for r in range(5)
    }
    assert replay(chain)[0] == 4
    mismatched = {0: [_lone("send", 1)], 1: [Step(ops=[Op("recv", 0, (3,))])]}
    with pytest.raises(AssertionError, match=r"rank 0 sends \(2,\), rank 1 expects \(3,\)"):
        replay(mismatched)
