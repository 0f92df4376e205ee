"""TrainingConfig: every setting of a run, checked when the config is made, before any work."""

import pytest
import torch
from conftest import mini_run

from vaswani_transformer.cli import main
from vaswani_transformer.training import run
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
        ({"model_overrides": {"source_lang": "fr"}}, r"cannot set source_lang: it comes from --source-lang"),
        ({"model_overrides": {"dropout": 1.5}}, r"VaswaniConfig\.dropout must be a probability"),
        ({"threads": 0}, r"--threads must be at least 1, got 0"),
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


def test_train_threads_reach_torch_while_the_run_lasts(monkeypatch, tmp_path):
    # `train` beside a busy process took 4-5 s a step on torch's one thread per core; --threads, and by default one
    # per core this process may use less one, shared by the processes accelerate launch starts on the machine.
    seen = []

    def record(config, load=None):
        seen.append(torch.get_num_threads())
        raise ValueError("recorded")  # the run stops here, in one line (status 2)

    monkeypatch.setattr(run, "build_run", record)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(5)), raising=False)
    before = torch.get_num_threads()
    argv = ["train", "--data-dir", str(tmp_path), "--source-lang", "en", "--target-lang", "de"]
    argv += ["--output-dir", str(tmp_path / "out"), "--max-steps", "1"]
    assert main([*argv, "--threads", "3"]) == 2 and main(argv) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert main(argv) == 2
    assert seen == [3, 4, 2]
    assert torch.get_num_threads() == before  # a library caller's process keeps its own
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='two' is no count of processes"):
        TrainingConfig(data="x", source_lang="en", target_lang="de", output_dir="o", max_steps=1).cpu_threads()
