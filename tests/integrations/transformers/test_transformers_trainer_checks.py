"""The Trainer's set-up checks without processes: each refusal is one line naming the value and
what to change (they read only the model, the arguments and WORLD_SIZE, so every rank raises the
same), ``tp_size`` included (the mesh (dp, cp, tp), the heads, the options tp does not serve; the
model is left as it was); TRL's packed-document keys must describe the documents of
``cu_seq_lens_q``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_models import tiny_model

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hyperpar_gdn.integrations.transformers.trainer import _packed_cu_seqlens  # noqa: E402
from hyperpar_gdn.integrations.transformers.trainer_checks import check_trainer_setup  # noqa: E402


def _check(model: object, args: object = None, **options: object) -> object:
    settings = dict(world=4, cp_size=2, cp_mode="p2p", cp_layout=None, cp_chunk_size=64)
    settings.update(options)
    return check_trainer_setup(model, args, **settings)


def test_setup_reads_dp_and_the_default_layout() -> None:
    setup = _check(tiny_model(moe=False))
    assert (setup.dp, setup.cp, setup.layout) == (2, 2, "head_tail")
    assert _check(tiny_model(moe=False), cp_layout="contiguous").layout == "contiguous"


@pytest.mark.parametrize(
    ("args", "options", "fragment"),
    [
        (SimpleNamespace(loss_type="dft"), {}, "loss_type='dft' is not supported"),
        (SimpleNamespace(use_liger_kernel=True), {}, "use_liger_kernel=True is not supported"),
        (SimpleNamespace(label_smoothing_factor=0.1), {}, "label_smoothing_factor=0.1"),
        (SimpleNamespace(average_tokens_across_devices=False), {}, "average_tokens_across_devices=False"),
        (SimpleNamespace(train_sampling_strategy="batch_rebalance"), {}, "batch_rebalance"),
        (
            SimpleNamespace(fsdp="full_shard", fsdp_config={"fsdp_version": 2}),
            {},
            "fsdp='full_shard' with fsdp_version=2 is not supported",
        ),
        (None, {"cp_mode": "ring"}, "cp_mode='ring' is not a context-parallel mode"),
        (None, {"cp_layout": "zigzag"}, "layout='zigzag' is not a token layout"),
        (None, {"cp_size": 0}, "cp_size=0 must be a positive int"),
    ],
    ids=["loss_type", "liger", "smoothing", "average_tokens", "rebalance", "fsdp2", "mode", "layout", "cp0"],
)
def test_unsupported_options_are_one_line(args: object, options: dict, fragment: str) -> None:
    with pytest.raises((ValueError, NotImplementedError)) as error:
        _check(tiny_model(moe=False), args, **options)
    assert fragment in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_a_model_name_is_refused_and_the_router_loss_read_under_tp_and_ep() -> None:
    with pytest.raises(TypeError, match="needs the loaded model object"):
        _check("Qwen/Qwen3.5-0.8B")
    moe = tiny_model(moe=True, num_experts=8)
    moe.config.output_router_logits = True
    coef = moe.config.router_aux_loss_coef
    assert _check(moe).router_coef == coef  # the trainer adds the loss
    assert _check(moe, world=4, tp_size=2).router_coef == coef
    setup = _check(moe, world=8, tp_size=2, ep_size=4)
    assert (setup.dp, setup.cp, setup.tp, setup.ep, setup.router_coef) == (2, 2, 2, 4, coef)
    moe.config.output_router_logits = False
    assert _check(moe, world=8, tp_size=2, ep_size=2).router_coef == 0.0


def test_packed_keys_must_describe_the_same_documents() -> None:
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.int32)
    batch = {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": 5,
        "max_length_k": 5,
        "seq_idx": seq_idx,
    }
    assert torch.equal(_packed_cu_seqlens(batch), cu)
    with pytest.raises(ValueError, match="max_length_q does not describe"):
        _packed_cu_seqlens({**batch, "max_length_q": 4})
    with pytest.raises(ValueError, match="seq_idx does not describe"):
        _packed_cu_seqlens({**batch, "seq_idx": torch.zeros(1, 8, dtype=torch.int32)})
    with pytest.raises(ValueError, match=r"batch keys \['token_type_ids'\] are not handled"):
        _packed_cu_seqlens({"token_type_ids": cu})
    with pytest.raises(ValueError, match="without cu_seq_lens_q"):
        _packed_cu_seqlens({"seq_idx": seq_idx})


def _transformers_model(num_k_heads: int, num_v_heads: int) -> object:
    import transformers
    from tiny_models import tiny_config

    config = tiny_config(moe=False, num_k_heads=num_k_heads)
    config.linear_num_value_heads = num_v_heads
    return transformers.Qwen3_5ForCausalLM(config)


def test_tp_size_sets_the_mesh() -> None:
    setup = _check(tiny_model(moe=False), world=8, tp_size=2)
    assert (setup.dp, setup.cp, setup.tp) == (2, 2, 2)
    assert _check(tiny_model(moe=False), world=4, tp_size=2, cp_mode="ulysses").dp == 1


@pytest.mark.parametrize(
    ("model", "args", "options", "fragment"),
    [
        ("tiny", None, {"tp_size": 0}, "tp_size=0 must be a positive int"),
        (
            "tiny",
            None,
            {"world": 6, "tp_size": 2},
            "cp_size=2 x tp_size=2 = 4 does not divide the 6 launched",
        ),
        ((1, 2), None, {"tp_size": 2}, "layer 0: linear_attn: num_k_heads=1 is not divisible by tp=2"),
        (
            (2, 2),
            None,
            {"tp_size": 2, "cp_mode": "ulysses"},
            "num_v_heads=2 is not divisible by tp x cp = 2 x 2",
        ),
        ("tiny", SimpleNamespace(fp16=True), {"tp_size": 2}, "fp16=True is not supported with tp_size=2"),
        (
            "tiny",
            SimpleNamespace(save_only_model=True, load_best_model_at_end=True),
            {"tp_size": 2},
            "save_only_model=True is not supported with tp_size=2: load_best_model_at_end reads",
        ),
    ],
    ids=["tp0", "world", "k_heads", "ulysses", "fp16", "save_only_model"],
)
def test_bad_tp_setups_are_one_line(model: object, args: object, options: dict, fragment: str) -> None:
    model = tiny_model(moe=False) if model == "tiny" else _transformers_model(*model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises((ValueError, NotImplementedError)) as error:
        _check(model, args, **options)
    assert fragment in str(error.value) and "\n" not in str(error.value), str(error.value)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
