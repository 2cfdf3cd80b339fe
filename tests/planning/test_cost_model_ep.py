"""Expert parallelism in the cost model and the split ranking: the dispatch bytes against the
exchanges of a dropless dispatch enumerated message by message, the all-to-all time on a node's
and the network's links, the routed experts' memory per rank divided by ep, the (ep, cp, tp)
splits the ranking lists (ep divides cp and the expert count), and its best split against a
minimum taken by hand over the splits' own terms."""

from __future__ import annotations

import itertools
import random

import pytest

from hyperpar_gdn.planning.cost_model import MACHINES
from hyperpar_gdn.planning.cost_model_ep import balanced_pairs, ep_dispatch_bytes, ep_exchange
from hyperpar_gdn.planning.memory import ModelShape, StepOptions, estimate, largest_rank
from hyperpar_gdn.planning.split_ranking import rank_tp_cp_splits

# a small Qwen3.5 MoE: 8 GDN value heads (4 q/k heads), 4 attention heads with 2 K/V heads
MOE = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "tie_word_embeddings": False,
}


def _dispatch_messages(routes: list[list[list[int]]], ep: int, num_experts: int, row: int) -> list[int]:
    """Bytes each rank sends in one MoE block's forward and backward, message by message:
    ``routes[r][t]`` the experts of rank r's token t. Counts: an int64 per expert of each other
    rank; forward, a row to the expert's rank (dispatch) and its output back (combine); backward,
    the output's gradient to the expert's rank and the row's gradient back to the token's rank."""
    local = num_experts // ep
    sent = [0] * ep
    for r in range(ep):
        sent[r] += (ep - 1) * local * 8
        for experts in routes[r]:
            for expert in experts:
                owner = expert // local
                if owner != r:
                    for src in (r, owner, r, owner):  # dispatch, combine, combine's and dispatch's grads
                        sent[src] += row
    return sent


@pytest.mark.parametrize(
    ("ep", "tokens", "top_k", "num_experts", "hidden", "width"),
    [(2, 12, 2, 8, 16, 4), (4, 32, 4, 16, 64, 2), (8, 40, 8, 64, 96, 2), (3, 12, 3, 6, 8, 8)],
)
def test_ep_bytes_equal_the_dispatch_enumerated(
    ep: int, tokens: int, top_k: int, num_experts: int, hidden: int, width: int
) -> None:
    """Random routes: each rank's bytes equal the formula of its sent and received pairs; a
    balanced router (pairs dealt round-robin over the experts): ``ep_exchange``'s bytes."""
    rng = random.Random(ep * 1000 + tokens)
    routes = [[rng.sample(range(num_experts), top_k) for _ in range(tokens)] for _ in range(ep)]
    local = num_experts // ep
    got = _dispatch_messages(routes, ep, num_experts, hidden * width)
    for r in range(ep):
        sent = sum(e // local != r for experts in routes[r] for e in experts)
        received = sum(e // local == r for s in range(ep) if s != r for experts in routes[s] for e in experts)
        formula = ep_dispatch_bytes(
            sent=sent, received=received, hidden=hidden, element_bytes=width, num_experts=num_experts, ep=ep
        )
        assert formula == got[r], f"ep {ep} rank {r}: formula {formula} != enumerated {got[r]}"
    dealt = [[[(r * tokens * top_k + t * top_k + j) % num_experts for j in range(top_k)] for t in range(tokens)]
             for r in range(ep)]  # fmt: skip
    assert tokens * top_k % num_experts == 0  # every expert gets as many pairs: balanced
    balanced = _dispatch_messages(dealt, ep, num_experts, hidden * width)
    priced = ep_exchange(
        tokens=tokens, top_k=top_k, hidden=hidden, element_bytes=width, num_experts=num_experts, ep=ep,
        machine=MACHINES["gpu"],
    )  # fmt: skip
    assert all(b == pytest.approx(priced.bytes, rel=1e-12) for b in balanced), (balanced, priced.bytes)


def test_ep_time_takes_the_links_the_group_crosses() -> None:
    """ep 2 inside a node: four all-to-alls of N k / 2 rows on the node's link, the counts, five
    latencies; ep 16 at tp 1 spans two nodes (8 peers on the network, 7 in the node): the
    network's share sets the time; at tp 8 every peer is on another node."""
    gpu = MACHINES["gpu"]
    n, k, c, e, experts = 4096, 8, 2048, 2, 256
    two = ep_exchange(tokens=n, top_k=k, hidden=c, element_bytes=e, num_experts=experts, ep=2, machine=gpu)
    rows = 4 * (n * k / 2) * c * e / gpu.intra.bandwidth
    counts = experts // 2 * 8 / gpu.intra.bandwidth
    assert two.seconds == pytest.approx(rows + counts + 5 * gpu.intra.latency, rel=1e-12)
    assert two.messages == 5 and balanced_pairs(n, k, 2) == n * k / 2

    def wide(stride: int) -> float:
        return ep_exchange(
            tokens=n,
            top_k=k,
            hidden=c,
            element_bytes=e,
            num_experts=experts,
            ep=16,
            machine=gpu,
            stride=stride,
        ).seconds

    per_peer = n * k / 16 * c * e
    far = 4 * max(7 * per_peer / gpu.intra.bandwidth, 8 * per_peer / gpu.inter.bandwidth)
    count_s = experts // 16 * 8 * 15 / gpu.inter.bandwidth
    assert wide(1) == pytest.approx(far + count_s + 5 * 15 * gpu.inter.latency, rel=1e-12)
    assert wide(8) == pytest.approx(
        4 * 15 * per_peer / gpu.inter.bandwidth + count_s + 75 * gpu.inter.latency
    )
    assert (
        ep_exchange(
            tokens=n, top_k=k, hidden=c, element_bytes=e, num_experts=experts, ep=1, machine=gpu
        ).bytes
        == 0
    )


def _expert_parameters(config: dict) -> int:
    """The routed experts' parameters of the whole model: [E, 2I, C] and [E, C, I] per layer."""
    c, e, i = config["hidden_size"], config["num_experts"], config["moe_intermediate_size"]
    return 3 * c * e * i * config["num_hidden_layers"]


@pytest.mark.parametrize("tp", [1, 2])
def test_expert_memory_per_rank_falls_as_e_over_ep(tp: int) -> None:
    """Without FSDP a rank holds E/ep experts with their gradients and AdamW moments: the
    parameter, gradient and optimizer terms fall by exactly (1 - 1/ep) of the experts' fp32
    bytes (x1, x1, x2) against ep 1 (whose MoE blocks tp splits by columns, so compare at tp 1);
    under FSDP the experts' share is E/(dp cp) at every ep and the gathered layers shrink."""
    shape = ModelShape.of(MOE)
    experts = _expert_parameters(MOE)

    def terms(ep: int, fsdp: bool, at_tp: int = tp) -> dict[str, int]:
        opts = StepOptions(seq_len=4096, cp=8, tp=at_tp, ep=ep, world_size=8 * at_tp, fsdp=fsdp)
        return estimate(shape, opts).terms

    whole = terms(1, False, at_tp=1)
    for ep in (2, 4, 8):
        held = terms(ep, False)
        dropped = experts * 4 * (1 - 1 / ep)
        if tp == 1:
            assert whole["parameters"] - held["parameters"] == pytest.approx(dropped, abs=1)
            assert whole["optimizer"] - held["optimizer"] == pytest.approx(2 * dropped, abs=2)
        if 2 * ep <= 8:  # the experts held, whole over tp at ep > 1: E/ep of them
            smaller = terms(2 * ep, False)
            assert held["parameters"] - smaller["parameters"] == pytest.approx(experts * 4 / (2 * ep), abs=1)
            assert held["gradients"] - smaller["gradients"] == pytest.approx(experts * 4 / (2 * ep), abs=1)
    sharded = [terms(ep, True) for ep in (2, 4, 8)]
    assert all(abs(t["optimizer"] - sharded[0]["optimizer"]) <= 8 for t in sharded)
    gathered = [t["parameters"] for t in sharded]
    assert gathered[0] > gathered[1] > gathered[2]


def test_bad_ep_is_refused_and_never_ranked() -> None:
    """The ranking lists every (tp, cp) with every ep dividing cp and the 16 experts, no other;
    an ep that does not divide the experts, or the dp x cp ranks of a step, is refused by name."""
    shape = ModelShape.of(MOE)
    for devices in (16, 32):
        splits = rank_tp_cp_splits(MOE, devices=devices, seq_len=8192, budget_gib=80)
        listed = {(s.ep, s.tp, s.cp) for s in splits if s.feasible}
        expected = {
            (ep, tp, devices // tp)
            for tp, ep in itertools.product((1, 2, 4), (1, 2, 4, 8, 16))
            if (devices // tp) % ep == 0
        }  # tp 8 and more do not divide the 4 q/k heads
        assert listed == expected, sorted(listed ^ expected)
        assert all(s.cp % s.ep == 0 and shape.num_experts % s.ep == 0 for s in splits)
    with pytest.raises(ValueError, match=r"eps=\(3,\).*num_experts=16"):
        rank_tp_cp_splits(MOE, devices=16, seq_len=8192, eps=(3,))
    only = rank_tp_cp_splits(MOE, devices=16, seq_len=8192, eps=(1, 8))
    assert {s.ep for s in only} == {1, 8} and all(s.cp % s.ep == 0 for s in only)
    with pytest.raises(ValueError, match="ep=3 must divide the dp x cp ranks, world_size / tp = 8"):
        StepOptions(seq_len=64, cp=4, tp=2, ep=3, world_size=16)
    with pytest.raises(ValueError, match="ep=32 does not divide num_experts=16"):
        estimate(shape, StepOptions(seq_len=64, cp=32, ep=32, world_size=32))


def test_the_best_split_is_the_minimum_by_hand() -> None:
    """Each split's EP term is ``ep_exchange`` at its ep, tp apart, on T/cp tokens; its memory the
    largest rank's estimate at its (ep, tp, cp); and the first split is the fastest of those within
    the budget, found by hand over the terms (a budget that some splits miss)."""
    gpu = MACHINES["gpu"]
    seq_len, devices = 65536, 32
    splits = rank_tp_cp_splits(MOE, devices=devices, seq_len=seq_len)
    ok = [s for s in splits if s.feasible]
    for s in ok:
        exchange = ep_exchange(
            tokens=seq_len / s.cp, top_k=4, hidden=256, element_bytes=2, num_experts=16, ep=s.ep, machine=gpu,
            stride=s.tp,
        )  # fmt: skip
        assert s.ep_seconds == exchange.seconds and s.ep_bytes == exchange.bytes
        opts = StepOptions(
            seq_len=seq_len, cp=s.cp, tp=s.tp, ep=s.ep, world_size=devices, cp_mode=s.mode or "p2p", ac=True,
            dtype="bf16", fsdp=True, attention="fused",
        )  # fmt: skip
        assert s.memory_bytes == largest_rank(ModelShape.of(MOE), opts).total
        rows = seq_len / s.cp * (4 * 128 + 128)
        assert s.expert_seconds == pytest.approx(
            18 * rows * 256 / (s.tp if s.ep == 1 else 1) / gpu.matmul_flops
        )
    memories = sorted(s.memory_bytes for s in ok)
    budget = memories[len(memories) // 2] / 2**30  # half of them fit
    ranked = rank_tp_cp_splits(MOE, devices=devices, seq_len=seq_len, budget_gib=budget)
    within = [s for s in ok if s.memory_bytes <= budget * 2**30]
    by_hand = min(
        within,
        key=lambda s: (
            s.cp_seconds + s.rule_seconds + s.tp_seconds + s.fsdp_seconds + s.ep_seconds + s.expert_seconds
        ),
    )
    assert (ranked[0].ep, ranked[0].tp, ranked[0].cp) == (by_hand.ep, by_hand.tp, by_hand.cp)
    assert ranked[0].fits and not all(s.fits for s in ranked if s.feasible)
