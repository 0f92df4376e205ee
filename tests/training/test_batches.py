"""The data of a run (§5.1): its tokenizer, and token batches that resume where they stopped."""

from vaswani_transformer.training.config import TrainingConfig


def test_a_given_tokenizer_takes_the_runs_max_length(tokenizer, tmp_path):
    from vaswani_transformer.training.batches import run_tokenizer

    tokenizer.save_pretrained(tmp_path)  # saved with its own model_max_length
    max_length = tokenizer.model_max_length + 64
    config = TrainingConfig(data="unused", source_lang="en", target_lang="de", output_dir=str(tmp_path / "run"),
                            tokenizer=str(tmp_path), max_length=max_length, max_steps=1)  # fmt: skip
    assert run_tokenizer(config, resuming=False).model_max_length == max_length, "translation truncates"
