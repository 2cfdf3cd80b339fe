"""Training options: errors name the option to change; the command line maps onto TrainConfig;
MindSpore is refused clearly; the README's first command after its set-up is the embedded default."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.platform import get_platform
from hyperpar_gdn.train import MODEL_SIZES, TrainConfig, Trainer, UsageError, parse_args
from hyperpar_gdn.train.data.global_batches import Batch, BatchSampler, load_tokens
from hyperpar_gdn.train.data.rank_batches import cut_batch

ROOT = Path(__file__).resolve().parents[2]


def rank_batch(
    batch: Batch,
    *,
    dp_rank: int,
    dp_size: int,
    cp_rank: int,
    cp_size: int,
    doc_boundaries: bool = True,
    layout: str = "contiguous",
) -> SimpleNamespace:
    """The trainer's cut (:func:`cut_batch`) as CP rank ``cp_rank`` of ``cp_size``: a 1-D mesh
    built without communication (cutting needs none) that places this process at ``cp_rank``."""
    ranks = list(range(1, cp_size))
    ranks.insert(cp_rank, get_platform("cpu").rank())
    mesh = DeviceMesh.from_group(get_platform("cpu"), None, ranks, mesh_dim_name="cp")
    shard = cut_batch(
        batch, mesh, dp_rank=dp_rank, dp_size=dp_size, doc_boundaries=doc_boundaries, layout=layout
    )
    return SimpleNamespace(inputs=shard.input_ids, labels=shard.labels, cu_seqlens=shard.cu_seqlens)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cp_mode": "ring"}, "--cp-mode 'ring' is not a mode"),
        ({"save_every": 5}, "--save-every 5 needs --save DIR"),
        ({"keep_last": 2}, "--keep-last 2 needs --save DIR"),
        ({"save": "ck", "keep_last": -1}, "--keep-last must be >= 0; got -1"),
        (
            {"save": "ck", "checkpoint_format": "zip"},
            "--checkpoint-format 'zip' is not one of sharded, whole",
        ),
        ({"async_save": True}, "--async-save needs --save DIR"),
        (
            {"save": "ck", "async_save": True, "checkpoint_format": "whole"},
            "--async-save writes sharded checkpoints; --checkpoint-format whole is written by rank 0",
        ),
        ({"lr": 0.0}, "--lr must be > 0; got 0.0"),
        ({"model_size": "huge"}, "--model-size 'huge' is unknown"),
        ({"steps": 0}, "--steps must be >= 1; got 0"),
        (
            {"cp_layout": "zigzag"},
            "--cp-layout 'zigzag' is not a token layout; choose one of contiguous, head_tail",
        ),
        ({"cp_mode": "ulysses+scan"}, "--cp-mode ulysses+scan requires --cp-inner-size N"),
        ({"cp_mode": "p2p", "cp_inner_size": 2}, "--cp-inner-size 2 goes with the two-level modes"),
    ],
)
def test_option_errors_name_the_option(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**options)


@pytest.mark.parametrize(
    ("options", "world", "message"),
    [
        ({"cp_size": 3, "seq_len": 129}, 4, "4 ranks (torchrun --nproc-per-node x --nnodes, or msrun"),
        ({"cp_size": 3}, 2, "cannot be split into CP groups of --cp-size 3: --cp-size must divide 2"),
        ({"tp": 3}, 8, "cannot be split into TP groups of --tp 3: --tp must divide 8"),
        (
            {"tp": 2, "cp_size": 3},
            8,
            "cannot be split into CP groups of --cp-size 3: --cp-size x --tp = 3 x 2",
        ),
        (
            {"tp": 2, "cp_size": 4, "cp_mode": "ulysses"},
            8,
            "--cp-mode ulysses splits each TP rank's GDN value heads over cp=4, but --model-size tiny has "
            "4 value heads, not divisible by tp x cp = 2 x 4",
        ),
        ({"seq_len": 100, "cp_size": 3}, 3, "--seq-len 100 must be divisible by the CP size 3"),
        (
            {"cp_size": 1, "batch_size": 3},
            2,
            "--batch-size 3 must be divisible by the 2 data-parallel replicas",
        ),
        (
            {"seq_len": 4, "cp_mode": "p2p", "cp_layout": "contiguous"},
            2,
            "--seq-len 4 / 2 = 2 tokens per piece (cp 2, --cp-layout contiguous), fewer than the conv halo 3",
        ),
        (
            {"seq_len": 8, "cp_mode": "p2p"},
            2,
            "--seq-len 8 / 4 = 2 tokens per piece (cp 2, --cp-layout head_tail), fewer than the conv halo 3",
        ),
        ({"seq_len": 66}, 2, "--cp-layout head_tail cuts --seq-len 66 into 2 x cp = 4 equal pieces"),
        (
            {"model_size": "small", "seq_len": 64},
            16,
            "--cp-mode ulysses splits the GDN value heads over cp=16",
        ),
        (
            {"cp_mode": "ulysses+scan", "cp_inner_size": 3, "cp_layout": "contiguous"},
            4,
            "--cp-inner-size 3 must divide cp=4",
        ),
    ],
)
def test_layout_errors_name_the_option(options: dict[str, object], world: int, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**options).mesh_shape(world)


def test_layout_splits_the_world_into_dp_cp_and_tp() -> None:
    assert TrainConfig().mesh_shape(2) == (1, 2, 1)
    assert TrainConfig(cp_size=2).mesh_shape(8) == (4, 2, 1)
    assert TrainConfig(cp_size=1).mesh_shape(4) == (4, 1, 1)
    assert TrainConfig(tp=2, cp_mode="p2p").mesh_shape(8) == (1, 4, 2)  # CP takes the ranks TP leaves
    assert TrainConfig(tp=2, cp_size=2).mesh_shape(8) == (2, 2, 2)
    with pytest.raises(ValueError, match=re.escape("--tp must be >= 1; got 0")):
        TrainConfig(tp=0)


def test_command_line_maps_onto_the_config() -> None:
    config = parse_args(
        "--cp-mode p2p --cp-size 2 --steps 7 --seq-len 32 --model-size small --lr 0.01 --seed 4 "
        "--data x.txt --metrics-json m.json --save ck --save-every 3 --keep-last 2 --no-auto-resume "
        "--resume ck --check-parity --checkpoint-format sharded --async-save".split()
    )
    assert config == TrainConfig(
        cp_mode="p2p",
        cp_size=2,
        steps=7,
        seq_len=32,
        model_size="small",
        lr=0.01,
        seed=4,
        data="x.txt",
        metrics_json="m.json",
        save="ck",
        save_every=3,
        keep_last=2,
        auto_resume=False,
        resume="ck",
        check_parity=True,
        checkpoint_format="sharded",
        async_save=True,
    )
    assert parse_args([]) == TrainConfig()


def test_bad_command_line_names_the_option() -> None:
    with pytest.raises(ValueError, match=r"--save-every 2 needs --save DIR"):
        parse_args(["--save-every", "2"])
    with pytest.raises(UsageError, match=r"argument --steps: invalid int value: 'x' \(see --help\)"):
        parse_args(["--steps", "x"])


def test_mindspore_is_refused_with_what_is_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HP_PLATFORM", "mindspore")
    with pytest.raises(NotImplementedError, match=r"HP_PLATFORM=cpu / cuda / npu is supported.*mindspore"):
        Trainer(TrainConfig())


def test_model_sizes_grow() -> None:
    from hyperpar_gdn.models.lm import HybridLM

    counts = [HybridLM(MODEL_SIZES[name]).num_parameters() for name in ("tiny", "small")]
    assert 200_000 < counts[0] < 300_000 < 4_000_000 < counts[1] < 8_000_000


def test_batches_are_a_function_of_seed_and_position(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 4)
    tokens = load_tokens(str(text))
    assert tokens.tolist()[:3] == [0, 1, 2] and tokens.numel() == 1024
    a = BatchSampler(tokens, seq_len=16, batch_size=4, seed=1)
    first, second = a.next_batch().tokens, a.next_batch().tokens
    b = BatchSampler(tokens, seq_len=16, batch_size=4, seed=1)
    b.load_state_dict({"position": 1, "seed": 1, "num_tokens": 1024})
    assert first.shape == (4, 17) and (second == b.next_batch().tokens).all() and not (first == second).all()
    assert ((first[:, 1:] - first[:, :-1]) % 256 == 1).all()  # contiguous windows of the text
    part = rank_batch(Batch(first, first < 0), dp_rank=1, dp_size=2, cp_rank=1, cp_size=2)
    assert (part.inputs == first[2:, 8:16]).all() and (part.labels == first[2:, 9:17]).all()
    assert part.cu_seqlens is None  # no document starts inside a row: plain windows
    with pytest.raises(FileNotFoundError, match="--data .*missing.txt: no such file"):
        load_tokens(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="the data has 1024 tokens; --seq-len 2000 needs at least 2001"):
        BatchSampler(tokens, seq_len=2000, batch_size=1, seed=0)


def test_readme_first_command_runs_the_embedded_default() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", readme, flags=re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    assert commands, "README.md has no command block"
    assert "pip install" in commands[0] and "pip install" not in commands[1], commands[:2]  # one set-up
    launch = shlex.split(commands[0].split("&&")[-1])  # the first run, after the set-up and its activation
    while launch and re.fullmatch(r"[A-Z_]+=\S*", launch[0]):  # environment assignments
        launch.pop(0)
    assert launch == ["torchrun", "--nproc-per-node", "2", "scripts/train.py"], commands[0]


def test_cp_layout_defaults_to_head_tail_with_softmax_layers(tmp_path: Path) -> None:
    assert TrainConfig().token_layout() == "head_tail"  # the built-in model has softmax layers
    assert TrainConfig(cp_layout="contiguous").token_layout() == "contiguous"
    assert parse_args(["--cp-layout", "contiguous"]).cp_layout == "contiguous"
    config = {"model_type": "qwen3_5_text", "linear_num_key_heads": 2, "linear_num_value_heads": 4}
    for layer_types, expected in (
        (["linear_attention"] * 2, "contiguous"),
        (["full_attention"], "head_tail"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**config, "layer_types": layer_types}))
        assert TrainConfig(model_dir=str(tmp_path)).token_layout() == expected


def test_two_level_modes_take_either_layout_and_default_as_one_level_modes() -> None:
    two_level = {"cp_mode": "ulysses+p2p", "cp_inner_size": 2}
    assert TrainConfig(**two_level).token_layout() == "head_tail"  # softmax layers: as p2p
    assert TrainConfig(**two_level, cp_layout="head_tail").mesh_shape(8) == (1, 8, 1)
    assert TrainConfig(**two_level, cp_layout="contiguous").token_layout() == "contiguous"


def test_head_tail_gives_rank_r_pieces_r_and_2cp_minus_1_minus_r() -> None:
    tokens = torch.arange(17).reshape(1, 17)  # 16 inputs, their labels shifted on the whole row
    starts = torch.zeros(1, 17, dtype=torch.bool)
    for rank, pieces in enumerate(([0, 7], [1, 6], [2, 5], [3, 4])):
        part = rank_batch(
            Batch(tokens, starts), dp_rank=0, dp_size=1, cp_rank=rank, cp_size=4, layout="head_tail"
        )
        expected = [t for p in pieces for t in (2 * p, 2 * p + 1)]
        assert part.inputs.tolist() == [expected]
        assert part.labels.tolist() == [[t + 1 for t in expected]]
    with pytest.raises(ValueError, match=re.escape("T=16 is not divisible by 32 (2*cp, cp=16)")):
        rank_batch(Batch(tokens, starts), dp_rank=0, dp_size=1, cp_rank=0, cp_size=16, layout="head_tail")


def test_documents_pack_the_rows_of_a_replica() -> None:
    """Two rows of 6 inputs; a document starts at input 2 of row 0 and at the label after row 1's
    last input: the replica's rows become one row whose documents restart at the row starts too;
    no label crosses into another document."""
    tokens = torch.arange(14).reshape(2, 7)
    starts = torch.zeros(2, 7, dtype=torch.bool)
    starts[0, 2] = starts[1, 6] = True
    part = rank_batch(Batch(tokens, starts), dp_rank=0, dp_size=1, cp_rank=1, cp_size=2)
    assert part.cu_seqlens.tolist() == [0, 2, 6, 12]
    assert part.inputs.tolist() == [[7, 8, 9, 10, 11, 12]]  # the second half of the packed row
    assert part.labels.tolist() == [[8, 9, 10, 11, 12, -100]]
    first = rank_batch(Batch(tokens, starts), dp_rank=0, dp_size=1, cp_rank=0, cp_size=2)
    assert first.labels.tolist() == [[1, -100, 3, 4, 5, 6]]  # token 2 opens a new document
    plain = rank_batch(
        Batch(tokens, starts), dp_rank=0, dp_size=1, cp_rank=0, cp_size=1, doc_boundaries=False
    )
    assert plain.cu_seqlens is None and plain.labels.tolist() == tokens[:, 1:].tolist()


def test_two_level_beside_data_parallelism() -> None:
    """--cp-size below the world with a two-level mode: dp replicas of (inner x outer) CP."""
    config = TrainConfig(cp_mode="ulysses+scan", cp_inner_size=2, cp_layout="contiguous", cp_size=4)
    assert config.mesh_shape(8) == (2, 4, 1)  # 2 replicas of cp 4 = 2 x 2
    with pytest.raises(ValueError, match=re.escape("--cp-inner-size 2 must divide cp=3")):
        TrainConfig(cp_mode="ulysses+scan", cp_inner_size=2, cp_layout="contiguous", cp_size=3).mesh_shape(6)
