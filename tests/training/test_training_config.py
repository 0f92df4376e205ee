"""TrainingConfig: every setting of a run, checked when the config is made, before any work."""

import pytest
from conftest import mini_run

from vaswani_transformer.training.config import TrainingConfig


def test_training_config_needs_a_budget():
    with pytest.raises(ValueError, match="budget"):
        TrainingConfig(data="x", source_lang="en", target_lang="de", output_dir="o")
    with pytest.raises(ValueError, match="max_tokens"):
        TrainingConfig(data="x", source_lang="en", target_lang="de", output_dir="o", max_steps=1, max_tokens=0)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"learning_rate_scale": 0.0}, r"learning_rate_scale must be a positive number, got 0.0"),
        ({"learning_rate_scale": float("nan")}, r"learning_rate_scale must be a positive number, got nan"),
        ({"bleu_sentences": -1}, r"bleu_sentences must be 0 \(no BLEU\) or more, got -1"),
        ({"early_stopping_patience": 0}, r"early_stopping_patience must be at least 1 validation, got 0"),
        ({"choose_length_penalty": [0.6, float("nan")]}, r"choose_length_penalty: length_penalty must be a finite"),
        ({"choose_num_beams": [4, 0]}, r"choose_num_beams: num_beams must be at least 1 \(1 is greedy search\), got 0"),
        ({"model_overrides": {"dropuot": 0.3}}, r"dropuot is no VaswaniConfig field; did you mean dropout\?"),
        ({"model_overrides": {"vocab_size": 100}}, r"cannot set vocab_size: it comes from the tokenizer"),
        ({"model_overrides": {"dropout": 1.5}}, r"VaswaniConfig\.dropout must be a probability"),
    ],
)
def test_impossible_training_settings_are_refused_before_any_work(values, message, tmp_path):
    required = dict(data=str(tmp_path), source_lang="en", target_lang="de", output_dir=str(tmp_path / "out"))
    with pytest.raises(ValueError, match=message):
        TrainingConfig(**required, max_steps=10, **values)


@pytest.mark.parametrize("option", [dict(adam_beta1=1.0), dict(adam_beta2=1.5), dict(adam_epsilon=-1.0)])
def test_adam_settings_are_checked_before_the_corpus_is_read(mini_corpus, tmp_path, option):
    with pytest.raises(ValueError, match=f"{next(iter(option))} must .*§5.3"):
        mini_run(mini_corpus, tmp_path / "refused", **option)


def test_each_group_of_settings_checks_its_own_fields_and_training_config_has_them_all():
    from dataclasses import fields

    from vaswani_transformer.training import config as groups

    with pytest.raises(ValueError, match="max_tokens must be positive, got 0"):
        groups.BatchConfig(max_tokens=0)
    with pytest.raises(ValueError, match=r"keep_checkpoints \(1\) must be at least average_last \(2\)"):
        groups.CheckpointConfig(keep_checkpoints=1, average_last=2)
    assert groups.CheckpointConfig(average_last=3).keep_checkpoints == 3
    names = [f.name for group in reversed(TrainingConfig.__bases__) for f in fields(group)]
    assert [f.name for f in fields(TrainingConfig)] == names and len(set(names)) == len(names)
    # The corpus and output directory first, as `train --help` lists them.
    assert names[:4] == ["data", "source_lang", "target_lang", "output_dir"]
