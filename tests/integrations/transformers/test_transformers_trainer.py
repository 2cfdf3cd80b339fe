"""transformers' ``Trainer`` and TRL's ``SFTTrainer`` under context parallelism, on real gloo ranks.

Oracle: the same Trainer on one process over the same global batches, padded (transformers' CPU
layers do not separate packed documents, so a packed CP run is compared with its documents
padded into rows: the same labelled tokens, the same count). Every case trains with gradient
accumulation 2 and clipping on (max_grad_norm below the gradient norm), fp32, plain SGD (Adam's
first steps turn a 1e-7 gradient difference into a sign flip), and evaluates once.

Equal to the one-process run, relative TOL: every logged loss and grad_norm, the learning rates,
eval_loss and every final weight. Launches: references (1 process), dp1 x cp2 (every mode, both
layouts, padded and packed, dense and MoE, resume, save_model, TRL, the bad set-ups), dp2 x cp2,
cp2 x tp2 and dp2 x tp2 (``tp_size=2``: the model split by heads; its final weights and
``save_model``'s directory whole, in transformers' layout).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks
from tiny_models import tiny_config, tiny_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments  # noqa: E402

from hyperpar_gdn.integrations.transformers.trainer import ContextParallelTrainer  # noqa: E402

TOL = 1e-5
STEPS = 2
VOCAB = 61
# LoRA through TRL's peft_config=: every GDN projection, attention's q and v, the MLP (and a trained
# copy of the LM head, modules_to_save)
LORA_TARGETS = [
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
    "q_proj",
    "v_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
]
# (model, cp_mode, cp_layout, collator) on dp1 x cp2: every mode, both layouts and collators, both models
CASES = (
    ("dense", "p2p", "head_tail", "packed"),
    ("dense", "all_gather", "contiguous", "padded"),
    ("dense", "ulysses", "head_tail", "padded"),
    ("moe", "p2p", "contiguous", "padded"),
    ("moe", "all_gather", "head_tail", "packed"),
    ("moe", "ulysses", "contiguous", "packed"),
)


def _examples(n: int, seed: int) -> list[dict[str, list[int]]]:
    """``n`` token sequences of 12, 16 or 20 tokens: rows divide by 2*cp = 4 into pieces of at least
    the conv halo (3)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = 4 * int(torch.randint(3, 6, (1,), generator=gen))
        ids = torch.randint(0, VOCAB, (length,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": list(ids)})
    return rows


def _padded(multiple: int = 4) -> Any:
    """A collator padding on the right to a multiple of ``multiple`` (labels -100, mask 0)."""

    def collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        longest = max(len(r["input_ids"]) for r in rows)
        t = -(-longest // multiple) * multiple
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        labels = torch.full((len(rows), t), -100, dtype=torch.long)
        mask = torch.zeros(len(rows), t, dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            ids[i, :n], mask[i, :n] = torch.tensor(row["input_ids"]), 1
            # as DataCollatorWithFlattening: no label on a document's first token
            labels[i, 1:n] = torch.tensor(row["labels"][1:])
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    return collate


def _args(out: str, batch: int, **overrides: Any) -> TrainingArguments:
    options = dict(
        output_dir=out,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=2,  # eval_loss averages batch means: the same batches on every run
        gradient_accumulation_steps=2,
        max_grad_norm=0.05,
        learning_rate=0.05,
        optim="sgd",
        logging_steps=1,
        max_steps=STEPS,
        report_to=[],
        train_sampling_strategy="sequential",
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    options.update(overrides)
    return TrainingArguments(**options)


def _summary(trainer: Any) -> dict[str, Any]:
    """Logged values per step, eval_loss and the final weights of a trained Trainer."""
    logs = [h for h in trainer.state.log_history if "loss" in h]
    model = trainer.accelerator.unwrap_model(trainer.model)
    if getattr(trainer, "cp_setup", None) is not None and trainer.cp_setup.tp > 1:
        from hyperpar_gdn.tensor_parallel import canonical_state_dict

        weights = canonical_state_dict(model)  # whole, transformers' row order (collective)
    else:
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "loss": [h["loss"] for h in logs],
        "grad_norm": [h["grad_norm"] for h in logs],
        "lr": [h["learning_rate"] for h in logs],
        "eval_loss": trainer.evaluate()["eval_loss"],
        "weights": weights,
    }


def _train(
    model_kind: str,
    batch: int,
    cp: dict | None,
    collator: str,
    out: str,
    resume: str | None = None,
    **overrides: Any,
) -> Any:
    model = tiny_model(moe=model_kind == "moe").float()
    kwargs = dict(
        model=model,
        args=_args(out, batch, **overrides),
        train_dataset=_examples(16, seed=1),
        eval_dataset=_examples(4, seed=2),
        data_collator=DataCollatorWithFlattening() if collator == "packed" else _padded(),
    )
    trainer = ContextParallelTrainer(**kwargs, **cp) if cp is not None else Trainer(**kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


# --- TRL ----------------------------------------------------------------------------------------


def _sft(
    cp: dict | None,
    out: str,
    *,
    padding_free: bool | None = None,
    lora: bool = False,
    save: str | None = None,
) -> dict[str, Any]:
    """SFTTrainer on text examples: padding-free (packed rows) under CP, padded on one process;
    ``lora``: PEFT's LoRA through ``peft_config=`` (the adapter weights returned); ``save``: the
    directory ``save_model`` writes to."""
    from trl import SFTConfig, SFTTrainer

    from hyperpar_gdn.integrations.transformers.model_dir import train_tokenizer
    from hyperpar_gdn.integrations.transformers.trainer import ContextParallelMixin

    class CPSFTTrainer(ContextParallelMixin, SFTTrainer):
        pass

    tokenizer = train_tokenizer()
    model = tiny_model(moe=False, vocab_size=len(tokenizer)).float()
    words = "the river runs past the old mill and the children watch the boats go by".split()
    texts = [" ".join(words[i % 5 : i % 5 + 3 + i % 7]) for i in range(16)]
    data = datasets.Dataset.from_dict({"text": texts})
    sft_args = dict(
        output_dir=out,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=0.05,
        learning_rate=0.05,
        optim="sgd",
        logging_steps=1,
        max_steps=STEPS,
        report_to=[],
        train_sampling_strategy="sequential",
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        padding_free=cp is not None if padding_free is None else padding_free,
        max_length=None,  # the texts are short; padding-free rows are not truncated
        bf16=False,  # TRL turns on bf16 autocast by default, CPU included
        pad_to_multiple_of=4,
    )
    kwargs = dict(model=model, args=SFTConfig(**sft_args), train_dataset=data, processing_class=tokenizer)
    if lora:
        import peft

        kwargs["peft_config"] = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=LORA_TARGETS, task_type="CAUSAL_LM", modules_to_save=["lm_head"]
        )
    trainer = CPSFTTrainer(**kwargs, **cp) if cp is not None else SFTTrainer(**kwargs)
    trainer.train()
    if save is not None:
        trainer.save_model(save)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {
        "loss": [h["loss"] for h in logs],
        "grad_norm": [h["grad_norm"] for h in logs],
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items() if not lora or _trained(k)},
    }


def _trained(name: str) -> bool:
    """A parameter PEFT trains: an adapter's, or the copy of a module in modules_to_save."""
    return "lora_" in name or ".modules_to_save." in name


# --- workers ------------------------------------------------------------------------------------


def _reference_worker(rank: int, world: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:  # one process: its own folder
        refs = {kind: _summary(_train(kind, 2, None, "padded", out)) for kind in ("dense", "moe")}
        refs["sft"] = _sft(None, out)
        refs["sft_lora"] = _sft(None, out, lora=True)
    return refs


def _cp_worker(rank: int, world: int, cases: tuple, work_dir: str) -> dict[str, Any]:
    """Every case, then (dp1 x cp2) the extras; ``work_dir`` is shared by the ranks (rank 0 writes
    the checkpoints every rank resumes from)."""
    results: dict[str, Any] = {}
    out = str(Path(work_dir) / "out")
    for kind, mode, layout, collator in cases:
        cp = {"cp_size": 2, "cp_mode": mode, "cp_layout": layout}
        batch = 2 // (world // 2)  # the same global batch of 2 rows on dp1 and dp2
        results[(kind, mode, layout, collator)] = _summary(_train(kind, batch, cp, collator, out))
    if world == 2:
        results.update(_extras_worker(rank, out, str(Path(work_dir) / "model")))
    return results


def _extras_worker(rank: int, out: str, save_dir: str) -> dict[str, Any]:
    """save_model, resume from a checkpoint, TRL and the bad set-ups, on the dp1 x cp2 group."""
    cp = {"cp_size": 2, "cp_mode": "p2p"}
    results: dict[str, Any] = {}
    trainer = _train("dense", 2, cp, "padded", out, save_strategy="steps", save_steps=1, optim="adamw_torch")
    trainer.save_model(save_dir)
    whole = _summary(trainer)["weights"]
    resumed = _train(
        "dense", 2, cp, "padded", out, optim="adamw_torch", resume=str(Path(out) / "checkpoint-1")
    )
    results["resume"] = (whole, _summary(resumed)["weights"])
    results["sft"] = _sft(cp, out)
    results["sft_lora"] = _sft(cp, out, lora=True, save=str(Path(save_dir).parent / "adapter"))
    results["errors"] = _bad_setups(out)
    return results


def _bad_setups(out: str) -> dict[str, str]:
    """The one-line error each wrong set-up raises (or "" when none)."""
    from accelerate.parallelism_config import ParallelismConfig

    def no_gdn() -> Any:
        config = tiny_config(moe=False)
        config.layer_types = ["full_attention"] * config.num_hidden_layers
        return transformers.Qwen3_5ForCausalLM(config)

    def odd_heads() -> Any:
        config = tiny_config(moe=False, num_k_heads=1)
        config.linear_num_value_heads = 3
        return transformers.Qwen3_5ForCausalLM(config)

    data = _examples(8, seed=3)
    cases = {
        "cp_size": (tiny_model(moe=False).float(), {}, {"cp_size": 3}, _padded()),
        "ulysses": (odd_heads(), {}, {"cp_size": 2, "cp_mode": "ulysses"}, _padded()),
        "no_gdn": (no_gdn(), {}, {"cp_size": 2}, _padded()),
        "compile": (tiny_model(moe=False).float(), {"torch_compile": True}, {"cp_size": 2}, _padded()),
        "accelerate_cp": (
            tiny_model(moe=False).float(),
            {"parallelism_config": ParallelismConfig(cp_size=2)},
            {"cp_size": 2},
            _padded(),
        ),
        "length": (tiny_model(moe=False).float(), {}, {"cp_size": 2}, _padded(multiple=1)),
    }
    odd = [{key: value[:-1] for key, value in row.items()} for row in data]  # 11, 15 or 19 tokens
    errors = {}
    for name, (model, overrides, cp, collator) in cases.items():
        try:
            args = _args(out, 2, **overrides)
            rows = odd if name == "length" else data
            ContextParallelTrainer(
                model=model, args=args, train_dataset=rows, data_collator=collator, **cp
            ).train()
            errors[name] = ""
        except (ValueError, NotImplementedError, TypeError) as error:
            errors[name] = str(error)
    return errors


# --- tests --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    return run_ranks(_reference_worker, 1, timeout_s=240)[0]


@pytest.fixture(scope="module")
def cp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    work_dir = tmp_path_factory.mktemp("cp2")
    return run_ranks(_cp_worker, 2, CASES, str(work_dir), timeout_s=500, pg_timeout_s=120), work_dir / "model"


def _rel(actual: float | torch.Tensor, expected: float | torch.Tensor) -> float:
    a, e = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def _assert_same_run(got: dict[str, Any], ref: dict[str, Any], label: str) -> None:
    assert len(got["loss"]) == len(ref["loss"]) == STEPS, f"{label}: {len(got['loss'])} logged steps"
    for key in ("loss", "grad_norm") + (("lr", "eval_loss") if "lr" in ref else ()):
        assert _rel(got[key], ref[key]) <= TOL, f"{label} {key}: {got[key]} != {ref[key]}"
    assert max(ref["grad_norm"]) > 0.05, "clipping must act: grad_norm above max_grad_norm"
    for name, expected in ref["weights"].items():
        assert _rel(got["weights"][name], expected) <= TOL, f"{label} weight {name}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_trainer_cp2_equals_one_process(case: tuple, references: dict, cp2: tuple) -> None:
    results, _ = cp2
    for rank, result in enumerate(results):
        _assert_same_run(result[case], references[case[0]], f"rank {rank} {case}")


@pytest.mark.timeout(900)
def test_trainer_dp2_cp2_equals_one_process(references: dict, tmp_path: Path) -> None:
    case = ("dense", "p2p", "head_tail", "packed")
    results = run_ranks(_cp_worker, 4, (case,), str(tmp_path), timeout_s=400, pg_timeout_s=120)
    for rank, result in enumerate(results):
        _assert_same_run(result[case], references["dense"], f"dp2 x cp2 rank {rank}")


def _tp_worker(rank: int, world: int, work_dir: str) -> dict[str, Any]:
    """cp 2 x tp 2 (dp 1): the Trainer's run, and its save_model directory (rank 0 writes it);
    then dp 2 x tp 2 (cp 1, a batch row per replica): the gradient average over dp."""
    cp = {"cp_size": 2, "cp_mode": "p2p", "cp_layout": "head_tail", "tp_size": 2}
    trainer = _train("dense", 2, cp, "padded", str(Path(work_dir) / "out"))
    summary = _summary(trainer)
    trainer.save_model(str(Path(work_dir) / "model"))
    summary["header"] = trainer.cp_header()
    dp = {"cp_size": 1, "cp_mode": "p2p", "tp_size": 2}
    summary["dp2"] = _summary(_train("dense", 1, dp, "padded", str(Path(work_dir) / "out")))
    return summary


@pytest.mark.timeout(900)
def test_trainer_cp2_tp2_equals_one_process(references: dict, tmp_path: Path) -> None:
    results = run_ranks(_tp_worker, 4, str(tmp_path), timeout_s=400, pg_timeout_s=120)
    for rank, result in enumerate(results):
        assert "cp 2 x tp 2 x dp 1 (4 processes" in result["header"], result["header"]
        _assert_same_run(result, references["dense"], f"cp2 x tp2 rank {rank}")
        _assert_same_run(result["dp2"], references["dense"], f"dp2 x tp2 rank {rank}")
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    for name, value in saved.state_dict().items():
        assert _rel(value, references["dense"]["weights"][name]) <= TOL, f"saved weight {name}"


@pytest.mark.timeout(900)
def test_sft_trainer_padding_free_equals_one_process(references: dict, cp2: tuple) -> None:
    results, _ = cp2
    for rank, result in enumerate(results):
        _assert_same_run(result["sft"], references["sft"], f"SFTTrainer rank {rank}")


@pytest.mark.timeout(900)
def test_sft_trainer_lora_equals_one_process(references: dict, cp2: tuple) -> None:
    """TRL's peft_config= under CP: the logged losses and the final adapter weights (the LM head's
    trained copy included) equal one process's; the adapter saved by save_model reloads through
    PEFT with the same weights."""
    import peft

    from hyperpar_gdn.integrations.transformers.model_dir import train_tokenizer

    results, save_dir = cp2
    ref = references["sft_lora"]
    assert any(
        name.endswith("lora_B.default.weight") and w.abs().max() > 0 for name, w in ref["weights"].items()
    )
    for rank, result in enumerate(results):
        got = result["sft_lora"]
        _assert_same_run(got, ref, f"SFTTrainer with LoRA rank {rank}")
        assert got["weights"].keys() == ref["weights"].keys()
        for name, expected in ref["weights"].items():
            assert _rel(got["weights"][name], expected) <= TOL, f"rank {rank}: adapter weight {name}"
    base = tiny_model(moe=False, vocab_size=len(train_tokenizer())).float()
    loaded = peft.PeftModel.from_pretrained(base, save_dir.parent / "adapter")
    trained = results[0]["sft_lora"]["weights"]
    reloaded = {k: v for k, v in loaded.state_dict().items() if _trained(k)}
    assert reloaded.keys() == trained.keys()
    for name, value in reloaded.items():
        assert _rel(value, trained[name]) == 0.0, f"reloaded adapter weight {name}"


@pytest.mark.timeout(900)
def test_resume_and_save_model(cp2: tuple) -> None:
    results, save_dir = cp2
    for rank, result in enumerate(results):
        whole, resumed = result["resume"]
        for name, expected in whole.items():
            assert _rel(resumed[name], expected) <= TOL, f"rank {rank}: resumed weight {name}"
    saved = transformers.AutoModelForCausalLM.from_pretrained(save_dir)
    whole = results[0]["resume"][0]
    for name, value in saved.state_dict().items():
        assert _rel(value, whole[name]) == 0.0, f"saved weight {name}"


@pytest.mark.timeout(900)
def test_bad_setups_fail_on_every_rank(cp2: tuple) -> None:
    results, _ = cp2
    expected = {
        "cp_size": "cp_size=3 does not divide the 2 launched processes",
        "ulysses": "num_v_heads=3 is not divisible by cp=2",
        "no_gdn": "has no Gated DeltaNet (linear_attention) layers",
        "compile": "torch_compile=True is not supported",
        "accelerate_cp": "ParallelismConfig(cp_size=2) is accelerate's context parallelism",
        "length": "is not divisible by 4",
    }
    for rank, result in enumerate(results):
        for name, fragment in expected.items():
            message = result["errors"][name]
            assert fragment in message, f"rank {rank} {name}: {message!r}"
            assert "\n" not in message, f"rank {rank} {name}: more than one line: {message!r}"
