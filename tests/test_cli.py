"""The command line, end to end on a model trained on Multi30k, and loading in a fresh process."""

import json
import os
import subprocess
import sys
from pathlib import Path

from huggingface_hub import ModelCard

from vaswani_transformer.cli import build_parser, main
from vaswani_transformer.training_config import TrainingConfig

SENTENCE = "A man is riding a bicycle down the street."


def test_train_options_are_the_training_config_fields_with_their_defaults():
    required = ["--data-dir", "corpus", "--source-lang", "en", "--target-lang", "de", "--output-dir", "out"]
    args = build_parser().parse_args(["train", *required, "--max-steps", "7"])
    defaults = TrainingConfig(data="corpus", source_lang="en", target_lang="de", output_dir="out", max_steps=7)
    corpus_fields = {"data", "files"}  # from --data-dir, --dataset, --train-files and --validation-files
    for name, default in vars(defaults).items():
        if name in corpus_fields:
            continue
        assert name in vars(args), f"TrainingConfig.{name} has no option of `train`"
        parsed = dict(getattr(args, name)) if name == "model_overrides" else getattr(args, name)
        # keep_checkpoints is filled in after parsing (it follows average_last when unset).
        expected = None if name == "keep_checkpoints" else default
        assert parsed == expected, f"--{name.replace('_', '-')} defaults to {parsed!r}, the config to {expected!r}"
    # And the help states the defaults it applies.
    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "(default: base)" in help_text and "(default: 37000)" in help_text


def test_train_options_reach_the_training_config(monkeypatch, tmp_path):
    import vaswani_transformer.training as training

    seen = {}
    monkeypatch.setattr(training, "train", lambda config: seen.setdefault("config", config) and tmp_path)
    status = main(
        ["train", "--data-dir", "d", "--source-lang", "en", "--target-lang", "de", "--output-dir", str(tmp_path),
         "--max-minutes", "1.5", "--model-option", "dropout=0.2", "--report-to", "tensorboard", "--resume",
         "--preset", "small", "--vocab-size", "8000"]
    )  # fmt: skip
    config = seen["config"]
    assert status == 0 and config.data == "d" and config.max_minutes == 1.5 and config.max_steps is None
    assert config.model_overrides == {"dropout": 0.2} and config.report_to == ["tensorboard"] and config.resume
    assert (config.preset, config.vocab_size) == ("small", 8000)


def test_evaluate_translates_a_test_set_and_reports_sacrebleu(trained_model_dir, multi30k_dir, tmp_path, capsys):
    source, reference = tmp_path / "test.en", tmp_path / "test.de"
    source.write_text("\n".join((multi30k_dir / "test_2016_flickr.en").read_text().splitlines()[:40]) + "\n")
    reference.write_text("\n".join((multi30k_dir / "test_2016_flickr.de").read_text().splitlines()[:40]) + "\n")
    output = tmp_path / "hypotheses.de"
    status = main(
        ["evaluate", "--model", str(trained_model_dir), "--source", str(source), "--reference", str(reference),
         "--output", str(output), "--batch-size", "16", "--dataset-name", "multi30k", "--split", "test_2016_flickr"]
    )  # fmt: skip
    assert status == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["sentences"] == 40 and 0 <= result["bleu"] <= 100
    assert "tok:13a" in result["signature"] and "case:mixed" in result["signature"]
    # Lowercasing merges n-grams, so it can only add matches: the lowercased score is never lower.
    assert "case:lc" in result["signature_lowercased"] and result["bleu_lowercased"] >= result["bleu"]
    hypotheses = output.read_text().splitlines()
    assert len(hypotheses) == 40 and sum(bool(h) for h in hypotheses) > 30
    # The score lands in the model card, as Hub metadata (model-index) and in its text.
    card = ModelCard.load(trained_model_dir / "README.md")
    scores = {(r.dataset_type, r.dataset_split, r.metric_type): r for r in card.data.eval_results}
    recorded = scores[("multi30k", "test_2016_flickr", "sacrebleu")]
    assert recorded.metric_value == result["bleu"] and recorded.metric_config == result["signature"]
    assert f"| sacreBLEU | {result['bleu']} |" in card.text


def test_evaluate_rejects_misaligned_files_in_one_line(trained_model_dir, tmp_path, capsys):
    (tmp_path / "s").write_text("a\nb\n")
    (tmp_path / "r").write_text("a\n")
    status = main(["evaluate", "--model", str(trained_model_dir), "--source", str(tmp_path / "s"),
                   "--reference", str(tmp_path / "r")])  # fmt: skip
    assert status == 2
    error = capsys.readouterr().err
    assert "has 2 lines" in error and "has 1" in error and "Traceback" not in error


def test_translate_reads_stdin_and_writes_one_line_per_input(trained_model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "vaswani_transformer.cli", "translate", "--model", str(trained_model_dir),
         "--num-beams", "2"],
        input=f"{SENTENCE}\n\nTwo dogs play in the snow.\n", capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and lines[0] and lines[1] == "" and lines[2]


def test_saved_directory_loads_with_auto_classes_and_pipeline_in_a_new_process(trained_model_dir):
    script = f"""
import vaswani_transformer
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, pipeline
path = {str(trained_model_dir)!r}
config = AutoConfig.from_pretrained(path)
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForSeq2SeqLM.from_pretrained(path)
assert type(model).__name__ == "VaswaniForConditionalGeneration", type(model)
ids = model.generate(**tokenizer({SENTENCE!r}, return_tensors="pt"))
direct = tokenizer.decode(ids[0], skip_special_tokens=True)
translator = pipeline("translation", model=path, trust_remote_code=True)
piped = translator({SENTENCE!r})[0]["translation_text"]
assert piped == direct and piped, (piped, direct)
print(piped)
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()


def test_plot_attention_script_draws_every_head_of_a_saved_model(trained_model_dir, tmp_path):
    script = Path(__file__).resolve().parents[1] / "scripts" / "plot_attention.py"
    for kind in ("encoder", "decoder", "cross"):
        path = tmp_path / f"{kind}.png"
        result = subprocess.run(
            [sys.executable, str(script), str(trained_model_dir), SENTENCE,
             "--kind", kind, "--layer", "0", "--output", str(path)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    image = imread(tmp_path / "cross.png")
    assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0.01  # not blank


def test_translate_draws_the_attention_of_each_sentence_on_request(trained_model_dir, tmp_path, capsys):
    source = tmp_path / "input.en"
    source.write_text(SENTENCE + "\n\nTwo dogs play in the snow.\n", encoding="utf-8")
    status = main(["translate", "--model", str(trained_model_dir), "--input", str(source),
                   "--attention-dir", str(tmp_path / "attention")])  # fmt: skip
    assert status == 0
    translations = capsys.readouterr().out.splitlines()
    assert len(translations) == 3 and translations[0] and translations[1] == "" and translations[2]
    assert sorted(p.name for p in (tmp_path / "attention").iterdir()) == ["sentence-1.png", "sentence-3.png"]
