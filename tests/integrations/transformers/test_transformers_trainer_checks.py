"""The Trainer's set-up checks without processes: each refusal is one line naming the value and
what to change (they read only the model, the arguments and WORLD_SIZE, so every rank raises the
same); TRL's packed-document keys must describe the documents of ``cu_seq_lens_q``."""

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
        (None, {"cp_mode": "ring"}, "cp_mode='ring' is not a context-parallel mode"),
        (None, {"cp_layout": "zigzag"}, "layout='zigzag' is not a token layout"),
        (None, {"cp_size": 0}, "cp_size=0 must be a positive int"),
    ],
    ids=["loss_type", "liger", "smoothing", "average_tokens", "rebalance", "mode", "layout", "cp0"],
)
def test_unsupported_options_are_one_line(args: object, options: dict, fragment: str) -> None:
    with pytest.raises((ValueError, NotImplementedError)) as error:
        _check(tiny_model(moe=False), args, **options)
    assert fragment in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_a_model_name_and_router_aux_loss_are_refused() -> None:
    with pytest.raises(TypeError, match="needs the loaded model object"):
        _check("Qwen/Qwen3.5-0.8B")
    moe = tiny_model(moe=True)
    moe.config.output_router_logits = True
    with pytest.raises(NotImplementedError, match="output_router_logits=True"):
        _check(moe)


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
