"""The §5 recipe as one run: a short real training run, what it saves, and how it resumes."""

import json

import pytest
import torch
from conftest import MINI_MODEL, mini_run, read_log
from huggingface_hub import EvalResult, ModelCard
from safetensors.torch import load_file

from vaswani_transformer.exchange.model_card import write_model_card
from vaswani_transformer.training.checkpoints import average_checkpoints


def test_a_short_training_run_on_multi30k_lowers_the_validation_loss(trained_model_dir):
    log = [record for record in read_log(trained_model_dir) if "validation_loss" in record]
    assert [record["step"] for record in log] == [50, 100, 150]
    losses = [record["validation_loss"] for record in log]
    assert losses[-1] < losses[0] - 0.5, losses
    saved = json.loads((trained_model_dir / "training_config.json").read_text())
    assert saved["adam_beta2"] == 0.98 and saved["adam_epsilon"] == 1e-9
    # Each record says when it was written and how fast the steps before it went.
    minutes = [record["minutes"] for record in log]
    assert minutes == sorted(minutes) and minutes[0] > 0
    assert all(record["target_tokens_per_second"] > 0 for record in log)


def test_trained_directory_holds_model_tokenizer_generation_config_and_code(trained_model_dir):
    names = {path.name for path in trained_model_dir.iterdir()}
    expected = {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "modeling_vaswani.py",
        "configuration_vaswani.py",
        "pipeline_vaswani.py",
        "README.md",
        "learning_curve.png",
    }
    assert expected <= names
    # The last checkpoints stay, for `--resume` and `vaswani-transformer average`.
    assert sorted(p.name for p in (trained_model_dir / "checkpoints").iterdir()) == ["step-100", "step-150"]
    generation = json.loads((trained_model_dir / "generation_config.json").read_text())
    assert generation["num_beams"] == 4 and generation["length_penalty"] == 0.6
    assert generation["length_penalty_type"] == "gnmt"
    assert (trained_model_dir / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"


def test_training_writes_a_model_card_with_hub_metadata_and_the_recipe(trained_model_dir):
    card = ModelCard.load(trained_model_dir / "README.md")
    data = card.data
    assert data.language == ["en", "de"] and data.pipeline_tag == "translation"
    assert data.library_name == "transformers" and data.license == "apache-2.0"
    assert data.datasets == ["multi30k"] and data.metrics == ["sacrebleu"]
    assert "## Intended use" in card.text and "## Limitations" in card.text
    assert "beam size 4, length penalty ((5 + |Y|) / 6)^0.6 (§6.1), at most input length + 50 tokens" in card.text
    log = read_log(trained_model_dir)
    assert f"{log[-1]['step']:,} steps" in card.text and "label smoothing 0.1" in card.text


def test_checkpoint_averaging_is_the_mean_of_the_weights(tmp_path):
    from safetensors.torch import save_file

    paths = []
    for i in range(3):
        path = tmp_path / f"step-{i}.safetensors"
        save_file({"w": torch.full((2, 2), float(i)), "b": torch.tensor([i * 3.0])}, path)
        paths.append(path)
    average = average_checkpoints(paths)
    torch.testing.assert_close(average["w"], torch.full((2, 2), 1.0))
    torch.testing.assert_close(average["b"], torch.tensor([3.0]))
    save_file({"other": torch.zeros(1)}, tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="same tensors"):
        average_checkpoints([paths[0], tmp_path / "bad.safetensors"])
    # The same names with other shapes (another model size) would broadcast into a mean of nothing.
    save_file({"w": torch.zeros(2), "b": torch.zeros(1)}, tmp_path / "other-size.safetensors")
    with pytest.raises(ValueError, match="names and shapes"):
        average_checkpoints([paths[0], tmp_path / "other-size.safetensors"])
    assert load_file(paths[0])["w"].sum() == 0


def test_a_run_resumes_only_with_the_settings_it_started_with(mini_corpus, tmp_path):
    from vaswani_transformer.training import run as training

    output = training.train(mini_run(mini_corpus, tmp_path / "run", max_steps=2, save_steps=1))
    checkpoints = sorted(p.name for p in (output / "checkpoints").iterdir())
    changed = mini_run(mini_corpus, output, max_steps=3, max_tokens=512, model_overrides={**MINI_MODEL, "d_ff": 128})
    changed.resume, changed.compile = True, True  # compiling pads the batches: another list of them
    # Another precision, and the best checkpoint chosen by BLEU where it was by loss (its best score another measure).
    changed.mixed_precision, changed.bleu_sentences = "bf16", 8
    match = (
        r"--model-option was .*'d_ff': 128.*; --max-tokens was 256, now 512; --compile was False, now True; "
        r"--mixed-precision was 'no', now 'bf16'; --bleu-sentences was 0, now 8\."
    )
    with pytest.raises(ValueError, match=match) as error:
        training.train(changed)
    assert "training_config.json" in str(error.value) and "another --output-dir" in str(error.value)
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == checkpoints  # nothing lost
    # The same corpus spelt another way, another attention implementation (the same function) and a longer budget.
    score = EvalResult(
        task_type="translation", dataset_type="mini", dataset_name="mini", dataset_split="val",
        metric_type="sacrebleu", metric_name="sacreBLEU", metric_value=1.5,
    )  # fmt: skip
    assert ModelCard.load(write_model_card(output, eval_result=score)).data.eval_results == [score]
    eager = {**MINI_MODEL, "attn_implementation": "eager"}
    spelt = str(mini_corpus / ".." / mini_corpus.name)
    # The tokenizer is the one saved beside the checkpoints: --vocab-size has nothing to change.
    resumed = mini_run(mini_corpus, output, data=spelt, max_steps=3, model_overrides=eager, vocab_size=400, resume=True)
    training.train(resumed)
    assert [r["step"] for r in read_log(output) if "train_loss" in r][-1] == 3
    assert ModelCard.load(output / "README.md").data.eval_results is None  # measured on the 2-step weights


def test_a_run_resumes_on_its_corpus_as_it_was_or_with_allow_data_change(multi30k_dir, tmp_path, capsys):
    from conftest import cli_arguments, make_corpus

    from vaswani_transformer.cli import main
    from vaswani_transformer.training.run import train

    corpus = make_corpus(multi30k_dir, tmp_path / "corpus", 400)
    output = train(mini_run(corpus, tmp_path / "run", max_steps=3, save_steps=3))
    # The same path, the same size, one letter changed in place.
    train_en = corpus / "train.en"
    text = train_en.read_text(encoding="utf-8")
    train_en.write_text(text.replace("A", "a", 1), encoding="utf-8")
    assert train_en.stat().st_size == len(text.encode("utf-8"))
    assert main(cli_arguments(mini_run(corpus, output, max_steps=6, resume=True))) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("vaswani-transformer train: error: Cannot resume the run in") and "Traceback" not in error
    assert "train.en changed since the run started (same size, another SHA-256)" in error
    assert "--allow-data-change" in error and read_log(output)[-1]["step"] == 3
    # Allowed, the run continues on the new data and records it: the next resume compares with that.
    train(mini_run(corpus, output, max_steps=6, resume=True, allow_data_change=True))
    assert read_log(output)[-1]["step"] == 6
    train(mini_run(corpus, output, max_steps=7, resume=True))
    assert read_log(output)[-1]["step"] == 7
    (corpus / "val.de").write_text("Ein Hund.\n" * 100, encoding="utf-8")  # another size
    with pytest.raises(ValueError, match=r"val.de changed since the run started \(\d+ bytes, now 1000\)"):
        train(mini_run(corpus, output, max_steps=8, resume=True))
