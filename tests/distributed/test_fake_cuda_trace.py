"""The CUDA code paths, traced without a device: one rank (3) of a cp = 8 run of a tiny
transformers Qwen3.5 (a GDN and an attention layer) on fake CUDA tensors with torch's fake process
group (tests/distributed/fake_cuda_worker.py, in a process of its own; the tracer is
scripts/benchkit/fake_trace.py). A training step (forward and backward) in every mode, both
layouts (the two-level modes with inner_size 2 and 4, contiguous), bf16 and fp32; a prefill and
one decode step on the CP group in every one-level mode and both layouts (bf16); a training step on
packed documents in every mode (bf16) on a model with two GDN layers. Checked:

- no blocking wait on a process group's work anywhere (``Work.wait`` with a timeout holds the host
  on NCCL) and no copy of host memory to the device inside a layer, except, with packed documents,
  the documents' masks, copied once per forward by the first GDN layer (none by the second);
- no host read of a device value inside a layer (the tracer raises there); outside, once per
  forward, the shard lengths' exchange and the sequence description (positions, padding,
  tokens, labels) of the model's hooks, and nothing else;
- no tensor made inside a layer on another device than CUDA; every mixer returns its input's
  dtype and device; every parameter gets a gradient of its dtype;
- the collectives' dtypes as planned (the input dtype; fp32 for the GDN states and summaries);
- the bytes this rank sends, forward and backward: the GDN layer's equal the cost model's for
  this rank (:func:`~hyperpar_gdn.planning.cost_model.rank_bytes_sent`), the attention
  layer's its all-gather of K and V and the reduce-scatter back, the model's the two exchanges.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_cuda_worker import CP, DIMS, PIECE

from hyperpar_gdn.planning.cost_model import Geometry, rank_bytes_sent
from hyperpar_gdn.planning.plan import HEAD_MODES, LAYOUTS, MODES, TWO_LEVEL_MODES

RANK = 3
DTYPES = {"bfloat16": 2, "float32": 4}
CASES = (
    [f"train:{m}:{layout}:{d}:{RANK}" for d in DTYPES for m in MODES for layout in LAYOUTS]
    + [f"train:{m}:contiguous:{d}:{RANK}:{k}" for d in DTYPES for m in TWO_LEVEL_MODES for k in (2, 4)]
    + [f"decode:{m}:{layout}:bfloat16:{RANK}" for m in MODES for layout in LAYOUTS]
    + [f"packed:{m}:{layout}:bfloat16:{RANK}" for m in MODES for layout in LAYOUTS]
    + [f"packed:{m}:contiguous:bfloat16:{RANK}:2" for m in TWO_LEVEL_MODES]
)  # fmt: skip
WORKER = Path(__file__).with_name("fake_cuda_worker.py")


@pytest.fixture(scope="module")
def traced() -> list[dict]:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(WORKER.parents[2]), os.environ.get("PYTHONPATH", "")])
    }
    run = subprocess.run(
        [sys.executable, str(WORKER), "--cases", *CASES], capture_output=True, text=True, timeout=600, env=env
    )
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and len(lines) == len(CASES), run.stderr[-3000:]
    return lines


def _name(case: dict) -> str:
    inner = "" if case["inner_size"] is None else f"/inner {case['inner_size']}"
    return f"{case['kind']} {case['mode']}{inner} {case['layout']} {case['dtype']}"


def _geometry(case: dict) -> Geometry:
    return Geometry(
        CP * PIECE, CP, DIMS["linear_num_key_heads"], DIMS["linear_num_value_heads"], DIMS["linear_key_head_dim"],
        DIMS["linear_value_head_dim"], DIMS["linear_conv_kernel_dim"], 1, DTYPES[case["dtype"]],
        head_tail=case["layout"] == "head_tail", hidden=DIMS["hidden_size"],
    )  # fmt: skip


@pytest.mark.timeout(660)
def test_every_case_runs_without_a_host_read_in_a_layer(traced: list[dict]) -> None:
    for case in traced:
        assert case["error"] is None and not case["failures"], (_name(case), case["error"], case["failures"])
        assert not case["misplaced"], (_name(case), case["misplaced"])
        assert case["waits"] == [], (_name(case), case["waits"])  # no blocking wait anywhere
        copies = [c for c in case["copies"] if c[1] != "model"]
        if case["kind"] == "packed":  # the documents' masks: once per forward, by the first GDN layer
            once = [c for c in copies if c[1] == "gdn" and c[2] == "forward"]
            assert once, _name(case)  # the masks exist: the trace sees the documents
            copies = [c for c in copies if c not in once]
        assert copies == [], (_name(case), copies)  # no host-to-device copy inside a layer
        inside = [r for r in case["reads"] if r[1] != "model"]
        assert not inside, (_name(case), inside)
        # outside the layers, once per forward (a decode case is a prefill, then a step that reads none):
        # the lengths' exchange (one int per rank, read element by element) and the sequence description;
        # before, apply_context_parallel's agreement on the plan (once, not per forward)
        reads = [r for r in case["reads"] if r[2] != "setup"]
        where = sorted({r[4].split(" ")[-1] for r in reads})
        assert where == ["all_gather_int", "to_numpy"], (_name(case), where)
        assert [r[0] for r in reads].count("item") == CP, _name(case)
        assert [r[4].endswith("to_numpy") for r in reads].count(True) == 1, _name(case)


def test_collective_dtypes_as_planned(traced: list[dict]) -> None:
    for case in traced:
        if case["kind"] == "decode":
            continue
        step = [c for c in case["collectives"] if c[2] != "setup"]
        dtypes = {scope: {c[4] for c in step if c[1] == scope} for scope in ("gdn", "attention", "model")}
        state = case["mode"] not in HEAD_MODES  # fp32 summaries; the conv halo in the input dtype
        assert dtypes["gdn"] == ({case["dtype"], "float32"} if state else {case["dtype"]}), (
            _name(case),
            dtypes,
        )
        assert dtypes["attention"] == {case["dtype"]} and dtypes["model"] == {"int64"}, (_name(case), dtypes)


def test_bytes_per_rank_equal_the_cost_model(traced: list[dict]) -> None:
    hkv, d = DIMS["num_key_value_heads"], DIMS["head_dim"]
    for case in traced:
        if case["kind"] == "decode":
            continue
        step = [c for c in case["collectives"] if c[2] != "setup"]
        sent = {scope: sum(c[3] for c in step if c[1] == scope) for scope in ("gdn", "attention", "model")}
        phases = {c[2] for c in step if c[1] == "gdn"}
        assert phases == {"forward", "backward"}, (_name(case), phases)
        predicted = rank_bytes_sent(case["mode"], _geometry(case), RANK, inner_size=case["inner_size"])
        assert sent["gdn"] == predicted, (_name(case), sent["gdn"], predicted)
        # attention: K and V of every rank gathered, the reduce-scatter of their gradients back
        e = DTYPES[case["dtype"]]
        assert sent["attention"] == 2 * (CP - 1) * 2 * hkv * PIECE * d * e, (_name(case), sent["attention"])
        # the hooks: the lengths (one int64 each), then 4 int64 channels of the shard
        assert sent["model"] == 8 * (CP - 1) + 4 * PIECE * 8 * (CP - 1), (_name(case), sent["model"])
