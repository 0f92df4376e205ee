"""scripts/finetune.py: fine-tuning a trained model with transformers' Seq2SeqTrainer."""

import importlib.util
import logging
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "finetune.py"


@pytest.fixture(scope="module")
def build_trainer():
    spec = importlib.util.spec_from_file_location("finetune", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_trainer


@pytest.fixture(scope="module")
def new_corpus(multi30k_dir, tmp_path_factory) -> Path:
    """Sentence pairs the model was not trained on: Multi30k's validation set, and 48 test pairs to score."""
    corpus = tmp_path_factory.mktemp("corpus")
    for lang in ("en", "de"):
        (corpus / f"train.{lang}").write_text((multi30k_dir / f"val.{lang}").read_text(encoding="utf-8"))
        lines = (multi30k_dir / f"test_2016_flickr.{lang}").read_text(encoding="utf-8").splitlines()[:48]
        (corpus / f"val.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return corpus


def test_finetuning_lowers_the_validation_loss_and_reports_sacrebleu(
    build_trainer, trained_model_dir, new_corpus, tmp_path
):
    trainer = build_trainer(
        str(trained_model_dir), str(new_corpus), "en", "de", str(tmp_path / "run"),
        max_steps=40, learning_rate=1e-3, warmup_steps=5, per_device_train_batch_size=32,
        per_device_eval_batch_size=48, eval_steps=40, save_steps=40, seed=0,
    )  # fmt: skip
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_loss"] < before["eval_loss"] - 0.05
    assert 0.0 < after["eval_bleu"] <= 100.0


def test_gradient_accumulation_gives_the_update_of_one_bigger_batch(
    build_trainer, trained_model_dir, new_corpus, tmp_path
):
    # The loss is normalised by the target tokens of the whole optimizer step (num_items_in_batch),
    # not averaged over micro-batches of different token counts. Plain SGD, whose update is
    # proportional to the gradient, and no dropout, so that both runs compute the same thing.
    updated = []
    for batch_size, accumulation in ((16, 1), (8, 2)):
        trainer = build_trainer(
            str(trained_model_dir), str(new_corpus), "en", "de", str(tmp_path / f"run-{accumulation}"),
            config_overrides={"dropout": 0.0}, max_steps=1, optim="sgd", learning_rate=1.0, warmup_steps=0,
            lr_scheduler_type="constant", max_grad_norm=0.0, per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation, train_sampling_strategy="sequential", eval_strategy="no",
            save_strategy="no", load_best_model_at_end=False, metric_for_best_model=None, seed=0,
        )  # fmt: skip
        trainer.train()
        updated.append({name: p.detach().clone() for name, p in trainer.model.named_parameters()})
    for name, parameter in updated[0].items():
        torch.testing.assert_close(updated[1][name], parameter, atol=1e-5, rtol=1e-4, msg=name)


def test_finetuning_warns_of_nothing_and_leaves_the_generation_config_as_it_was(
    build_trainer, trained_model_dir, new_corpus, tmp_path, caplog
):
    # Evaluation batches used to warn that both max_new_tokens and max_length were set (the Trainer filled in the
    # latter), and loading the best checkpoint that the tied copies of the shared embedding were missing.
    trainer = build_trainer(
        str(trained_model_dir), str(new_corpus), "en", "de", str(tmp_path / "run"),
        max_steps=2, learning_rate=1e-3, warmup_steps=0, per_device_train_batch_size=16,
        per_device_eval_batch_size=16, eval_steps=2, save_steps=2, seed=0,
    )  # fmt: skip
    generation = trainer.model.generation_config.to_dict()
    transformers_logger = logging.getLogger("transformers")  # which has a handler of its own, not the root's
    transformers_logger.addHandler(caplog.handler)
    try:
        trainer.train()
    finally:
        transformers_logger.removeHandler(caplog.handler)
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert not [w for w in warnings if "max_new_tokens" in w or "missing keys" in w], warnings
    assert trainer.model.generation_config.to_dict() == generation  # as it is saved with the fine-tuned model
    assert trainer.model.lm_head.weight is trainer.model.model.shared.weight  # tied (§3.4), in the best model too
