"""The command line, end to end on a model trained on Multi30k, and loading in a fresh process."""

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import cli_arguments, mini_run, needs_fork, tag_with_process
from huggingface_hub import ModelCard

from vaswani_transformer.cli import build_parser, main
from vaswani_transformer.training.config import TrainingConfig

SENTENCE = "A man is riding a bicycle down the street."


# TrainingConfig fields that are no option of their own, and the options that fill them.
CORPUS_FIELDS = {"data": ("--data-dir", "--dataset"), "files": ("--train-files", "--validation-files")}
REQUIRED = ["--data-dir", "corpus", "--source-lang", "en", "--target-lang", "de", "--output-dir", "out"]


def train_parser() -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices["train"]


def test_train_options_are_the_training_config_fields_with_their_defaults():
    actions = {action.dest: action for action in train_parser()._actions}
    flags = {flag for action in actions.values() for flag in action.option_strings}
    args = build_parser().parse_args(["train", *REQUIRED, "--max-steps", "7"])
    defaults = TrainingConfig(data="corpus", source_lang="en", target_lang="de", output_dir="out", max_steps=7)
    for option in fields(TrainingConfig):
        name, default = option.name, getattr(defaults, option.name)
        if name in CORPUS_FIELDS:
            assert set(CORPUS_FIELDS[name]) <= flags, f"TrainingConfig.{name} is not reachable from `train`"
            continue
        assert name in actions, f"TrainingConfig.{name} has no option of `train`"
        parsed = dict(getattr(args, name)) if name == "model_overrides" else getattr(args, name)
        # keep_checkpoints is filled in after parsing (it follows average_last when unset).
        expected = None if name == "keep_checkpoints" else default
        assert parsed == expected, f"--{name.replace('_', '-')} defaults to {parsed!r}, the config to {expected!r}"
        # The help states the default the option applies, and no other.
        stated = re.search(r"\(default: ([^)]*)\)$", actions[name].help)
        assert stated is None or stated.group(1) == str(expected), (name, actions[name].help)
        assert actions[name].help == option.metadata["help"] + (f" (default: {expected})" if stated else "")
    help_text = train_parser().format_help()
    assert "(default: base)" in help_text and "(default: 37000)" in help_text and "(default: 4000)" in help_text


def test_train_needs_one_of_max_steps_and_max_minutes_and_its_help_says_so(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("corpus").mkdir()
    actions = {action.dest: action for action in train_parser()._actions}
    assert "--max-minutes" in actions["max_steps"].help and "--max-steps" in actions["max_minutes"].help
    assert "(default:" not in actions["max_steps"].help + actions["max_minutes"].help
    assert main(["train", *REQUIRED]) == 2
    error = capsys.readouterr().err
    assert "--max-steps" in error and "--max-minutes" in error and len(error.strip().splitlines()) == 1


def test_train_options_reach_the_training_config(monkeypatch, tmp_path):
    import vaswani_transformer.training.run as training

    seen = []
    monkeypatch.setattr(training, "train", lambda config: seen.append(config) or tmp_path)
    required = ["--source-lang", "en", "--target-lang", "de", "--output-dir", str(tmp_path)]
    monkeypatch.chdir(tmp_path)
    Path("d").mkdir()
    status = main(
        ["train", "--data-dir", "d", *required, "--max-minutes", "1.5", "--model-option", "dropout=0.2",
         "--model-option", "position_embedding_type=learned", "--report-to", "tensorboard", "--report-to", "wandb",
         "--resume", "--preset", "small", "--vocab-size", "8000", "--skip-nonfinite", "--mixed-precision", "bf16"]
    )  # fmt: skip
    config = seen[-1]
    assert status == 0 and config.data == "d" and config.max_minutes == 1.5 and config.max_steps is None
    assert config.model_overrides == {"dropout": 0.2, "position_embedding_type": "learned"}
    assert config.report_to == ["tensorboard", "wandb"] and config.resume and config.skip_nonfinite
    assert (config.preset, config.vocab_size, config.mixed_precision) == ("small", 8000, "bf16")
    # The corpus options fill `data` and `files`.
    files = ["--train-files", "a.en", "a.de", "--validation-files", "v.en", "v.de"]
    assert main(["train", *files, *required, "--max-steps", "1"]) == 0
    assert seen[-1].data == "" and seen[-1].files == {"train": ("a.en", "a.de"), "validation": ("v.en", "v.de")}
    assert main(["train", "--dataset", "wmt14", "--dataset-config", "de-en", *required, "--max-steps", "1"]) == 0
    assert (seen[-1].data, seen[-1].dataset_config, seen[-1].files) == ("wmt14", "de-en", {})


def test_every_training_config_round_trips_through_the_command_line(monkeypatch, tmp_path):
    import vaswani_transformer.training.run as training

    seen = []
    monkeypatch.setattr(training, "train", lambda config: seen.append(config) or tmp_path)
    overrides = {"dropout": 0.0, "position_embedding_type": "learned", "d_model": 32}
    config = mini_run(
        tmp_path, tmp_path / "out", preset="small", model_overrides=overrides, report_to=["tensorboard"],
        skip_nonfinite=True, resume=True, early_stopping_patience=3, tokenizer="tok", save_minutes=0.5, seed=7,
        choose_num_beams=[1, 4], choose_length_penalty=[0.6, 1.2],
    )  # fmt: skip
    assert main(cli_arguments(config)) == 0
    assert seen == [config]


def test_train_refuses_no_corpus_or_two_in_one_line(capsys):
    for corpus in ([], ["--data-dir", "d", "--dataset", "wmt14"]):
        assert main(["train", *corpus, *REQUIRED[2:], "--max-steps", "1"]) == 2
        error = capsys.readouterr().err
        assert "--data-dir" in error and "--dataset" in error and len(error.strip().splitlines()) == 1


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

    # A score of other decoding than the model's own leaves the card as it is; the model's own, named, does not.
    files = ["--source", str(source), "--reference", str(reference), "--dataset-name", "multi30k"]
    assert main(["evaluate", "--model", str(trained_model_dir), *files, "--num-beams", "1"]) == 0
    assert "left as it is" in capsys.readouterr().err
    assert (trained_model_dir / "README.md").read_text() == card.content
    from transformers import GenerationConfig

    copy = shutil.copytree(trained_model_dir, tmp_path / "copy")  # the fixture's card stays as other tests expect
    own = str(GenerationConfig.from_pretrained(copy).num_beams)
    assert main(["evaluate", "--model", str(copy), *files, "--split", "again", "--num-beams", own]) == 0
    assert "left as it is" not in capsys.readouterr().err
    results = ModelCard.load(copy / "README.md").data.eval_results
    assert ("multi30k", "again") in {(r.dataset_type, r.dataset_split) for r in results}
    # Translations written over the test set's own files, by name or through a link, are refused before anything
    # is translated.
    (tmp_path / "hard.en").hardlink_to(source)
    (tmp_path / "soft.de").symlink_to(reference)
    for given, original in ((source, source), (reference, reference), (tmp_path / "hard.en", source),
                            (tmp_path / "soft.de", reference)):  # fmt: skip
        text = original.read_text()
        assert main(["evaluate", "--model", str(trained_model_dir), *files, "--output", str(given)]) == 2
        assert "would overwrite it" in capsys.readouterr().err and original.read_text() == text


def test_evaluate_rejects_misaligned_files_in_one_line(trained_model_dir, tmp_path, capsys):
    (tmp_path / "s").write_text("a\nb\n")
    (tmp_path / "r").write_text("a\n")
    status = main(["evaluate", "--model", str(trained_model_dir), "--source", str(tmp_path / "s"),
                   "--reference", str(tmp_path / "r")])  # fmt: skip
    assert status == 2
    error = capsys.readouterr().err
    assert "has 2 lines" in error and "has 1" in error and "Traceback" not in error


def test_translate_and_evaluate_decode_with_the_length_penalty_asked_for(trained_model_dir, corpus, tmp_path, capsys):
    from vaswani_transformer.inference.engines import load_translator
    from vaswani_transformer.inference.translation import translate

    sources = corpus["test_2016_flickr"]["en"][:40]
    (tmp_path / "test.en").write_text("\n".join(sources) + "\n")
    (tmp_path / "test.de").write_text("\n".join(corpus["test_2016_flickr"]["de"][:40]) + "\n")
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    # One batch of all 40 both ways: translate_stream and translate group lines into batches differently.
    expected = {
        alpha: translate(model, tokenizer, sources, batch_size=64, length_penalty=alpha) for alpha in (0.0, 3.0)
    }
    # The penalty must matter on this model for the check to mean anything: a larger alpha favours longer outputs.
    assert expected[0.0] != expected[3.0]
    assert sum(len(t.split()) for t in expected[3.0]) > sum(len(t.split()) for t in expected[0.0])
    for alpha in (0.0, 3.0):
        options = ["--model", str(trained_model_dir), "--batch-size", "64", "--length-penalty", str(alpha)]
        assert main(["translate", *options, "--input", str(tmp_path / "test.en")]) == 0
        assert capsys.readouterr().out.splitlines() == expected[alpha]
        output = tmp_path / f"hypotheses-{alpha}.de"
        files = ["--source", str(tmp_path / "test.en"), "--reference", str(tmp_path / "test.de")]
        files += ["--output", str(output)]
        assert main(["evaluate", *options, *files, "--no-model-card"]) == 0
        capsys.readouterr()
        assert output.read_text().splitlines() == expected[alpha]


@needs_fork
def test_translate_and_evaluate_hand_batches_to_worker_processes(
    trained_model_dir, corpus, tmp_path, capsys, monkeypatch
):
    from vaswani_transformer.inference.engines import load_translator
    from vaswani_transformer.inference.translation import translate, translate_stream

    sources = corpus["test_2016_flickr"]["en"][:24]
    (tmp_path / "test.en").write_text("\n".join(sources) + "\n")
    (tmp_path / "test.de").write_text("\n".join(corpus["test_2016_flickr"]["de"][:24]) + "\n")
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    expected = {
        "translate": list(translate_stream(model, tokenizer, sources, batch_size=4)),
        "evaluate": translate(model, tokenizer, sources, batch_size=4),
    }
    tag_with_process(monkeypatch)
    options = ["--model", str(trained_model_dir), "--batch-size", "4", "--num-workers", "2"]
    assert main(["translate", *options, "--input", str(tmp_path / "test.en")]) == 0
    outputs = {"translate": capsys.readouterr().out.splitlines()}
    files = ["--source", str(tmp_path / "test.en"), "--reference", str(tmp_path / "test.de")]
    assert main(["evaluate", *options, *files, "--output", str(tmp_path / "hyp.de"), "--no-model-card"]) == 0
    outputs["evaluate"] = (tmp_path / "hyp.de").read_text().splitlines()
    for command, lines in outputs.items():
        workers = {line.split("|")[0] for line in lines}
        assert str(os.getpid()) not in workers and len(workers) == 2, command
        assert [line.split("|", 1)[1] for line in lines] == expected[command], command


def test_translate_writes_an_html_document_back_with_its_markup_and_a_text_file_with_its_layout(
    trained_model_dir, corpus, tmp_path, capsys, monkeypatch
):
    import html
    import io

    from vaswani_transformer.inference.engines import load_translator
    from vaswani_transformer.inference.translation import translate

    first, second, third = corpus["test_2016_flickr"]["en"][:3]
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    translations = translate(model, tokenizer, [first, second, third], split_sentences=False)
    escaped = [html.escape(translation, quote=False) for translation in translations]
    assert all(len(translation.split()) > 2 for translation in translations)  # real translations
    script = f'<script>if (a < b) {{ alert("{first}"); }}</script>'
    page = (
        f'<!DOCTYPE html>\n<html>\n<body>\n<h1 title="{first}">{first}</h1>\n{script}\n'
        f"<p>{second}\n  {third}</p>\n</body>\n</html>\n"
    )
    (tmp_path / "page.html").write_text(page)
    # The document as one text: tags, attributes and the script as written; a paragraph's lines, one text node.
    expected = page.replace(f">{first}</h1>", f">{escaped[0]}</h1>")
    expected = expected.replace(f"<p>{second}\n  {third}</p>", f"<p>{escaped[1]} {escaped[2]}</p>")
    options = ["translate", "--model", str(trained_model_dir)]
    assert main([*options, "--input", str(tmp_path / "page.html")]) == 0
    assert capsys.readouterr().out == expected
    # From stdin, HTML when asked for; a .html file line by line when asked for.
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(page.encode())))
    assert main([*options, "--input-format", "html"]) == 0
    assert capsys.readouterr().out == expected
    assert main([*options, "--input", str(tmp_path / "page.html"), "--input-format", "text"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(page.splitlines())
    assert main([*options, "--input", str(tmp_path / "page.html"), "--attention-dir", str(tmp_path / "maps")]) == 2
    assert "translate an HTML document without it" in capsys.readouterr().err
    # A text file keeps its paragraphs (sentences on one line), blank lines, indentation and spaces.
    (tmp_path / "notes.txt").write_text(f"  {first} {second}\n\n\n{third}   {first}\n")
    assert main([*options, "--input", str(tmp_path / "notes.txt")]) == 0
    t = translations
    assert capsys.readouterr().out == f"  {t[0]} {t[1]}\n\n\n{t[2]}   {t[0]}\n"


def translate_in_a_new_process(model_dir: Path, text: str, *options: str) -> subprocess.CompletedProcess:
    """`vaswani-transformer translate --model MODEL_DIR OPTIONS` on `text` as stdin, in a process of its own."""
    command = [sys.executable, "-m", "vaswani_transformer.cli", "translate", "--model", str(model_dir), *options]
    return subprocess.run(command, input=text, capture_output=True, text=True, check=True)


def test_translate_reads_stdin_and_writes_one_line_per_input(trained_model_dir):
    result = translate_in_a_new_process(
        trained_model_dir, f"{SENTENCE}\n\nTwo dogs play in the snow.\n", "--num-beams", "2"
    )
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and lines[0] and lines[1] == "" and lines[2]


def test_greedy_translation_of_a_model_with_the_gnmt_penalty_draws_no_warning(trained_model_dir):
    # A fresh process: transformers warns about a generation flag once per process.
    result = translate_in_a_new_process(trained_model_dir, f"{SENTENCE}\n", "--num-beams", "1")
    assert result.stdout.strip() and "length_penalty" not in result.stderr, result.stderr


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


def test_plot_attention_script_draws_every_head_of_a_saved_model(trained_model_dir, tmp_path, monkeypatch):
    script = Path(__file__).resolve().parents[1] / "scripts" / "plot_attention.py"
    path = tmp_path / "cross.png"
    result = subprocess.run(
        [sys.executable, str(script), str(trained_model_dir), SENTENCE, "--layer", "0", "--output", str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # The other kinds in this process: a second interpreter would only load the same libraries again.
    spec = importlib.util.spec_from_file_location("plot_attention", script)
    plot_attention = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_attention)
    for kind in ("encoder", "decoder"):
        output = str(tmp_path / f"{kind}.png")
        options = ["--kind", kind, "--layer", "0", "--output", output]
        monkeypatch.setattr(sys, "argv", ["plot_attention.py", str(trained_model_dir), SENTENCE, *options])
        plot_attention.main()
    for kind in ("encoder", "decoder", "cross"):
        assert (tmp_path / f"{kind}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
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


def test_decoding_choices_follow_one_flag_and_a_later_flag_replaces_them():
    # The main job passes the Multi30k recipe's options first and its own after them.
    args = build_parser().parse_args(
        ["train", *REQUIRED, "--max-steps", "1", "--choose-length-penalty", "0.6", "1.0", "1.4"]
        + ["--choose-num-beams", "4", "6", "--choose-num-beams", "4"]
    )
    assert args.choose_length_penalty == [0.6, 1.0, 1.4] and args.choose_num_beams == [4]


# Round three: bad input and noise (issue 63) ------------------------------------------------------------------------


def test_help_and_usage_errors_import_neither_torch_nor_transformers():
    # They answer at once, where importing torch and transformers took 7 s; `import vaswani_transformer` still
    # registers the Auto classes (the next test).
    script = """
import sys
from vaswani_transformer.cli import main
for argv in (["--help"], [], ["no-such-command"]):
    try:
        main(argv)
    except SystemExit as exit:
        print("exit", exit.code)
print("imported:", sorted({name.split(".")[0] for name in sys.modules} & {"torch", "transformers"}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    lines = result.stdout.splitlines()
    assert "translate" in result.stdout and "export-ctranslate2" in result.stdout  # the commands are listed
    assert lines[-4:] == ["exit 0", "exit 2", "exit 2", "imported: []"], result.stdout + result.stderr


@pytest.mark.parametrize(
    "first",
    [
        "import vaswani_transformer",
        "import transformers, vaswani_transformer",
        "from vaswani_transformer.model.configuration_vaswani import VaswaniConfig",  # imports transformers itself
        "from vaswani_transformer.model.modeling_vaswani import VaswaniModel",
    ],
)
def test_the_auto_classes_know_the_model_whichever_module_is_imported_first(first):
    script = f"""{first}
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM
sizes = dict(d_model=32, d_ff=64, encoder_layers=1, decoder_layers=1, num_attention_heads=4, vocab_size=100)
config = AutoConfig.for_model("vaswani_transformer", **sizes)
models = AutoModel.from_config(config), AutoModelForSeq2SeqLM.from_config(config)
print(type(config).__name__, *(type(model).__name__ for model in models), type(config)._auto_class)  # for auto_map
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    expected = ["VaswaniConfig", "VaswaniModel", "VaswaniForConditionalGeneration", "AutoConfig"]
    assert result.stdout.split() == expected, result.stderr[-3000:]


def run_read_only(directory: Path, *arguments: str) -> subprocess.CompletedProcess:
    """`vaswani-transformer ARGUMENTS` in a process of its own that cannot write into `directory`.

    Root writes through permission bits: as root, the process runs in a mount namespace of its own where
    `directory` is a read-only bind mount (EROFS, as on a read-only volume); else `directory` and its files
    are made read-only (EACCES) while it runs.
    """
    command = [sys.executable, "-m", "vaswani_transformer.cli", *arguments]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if os.geteuid() == 0:
        mount = 'mount --bind -o ro "$0" "$0" && exec "$@"'
        command = ["unshare", "--mount", "sh", "-c", mount, directory, *command]
        return subprocess.run(command, env=env, capture_output=True, text=True)
    paths = [directory, *directory.rglob("*")]
    for path in paths:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        return subprocess.run(command, env=env, capture_output=True, text=True)
    finally:
        for path in paths:
            path.chmod(0o755 if path.is_dir() else 0o644)


@pytest.mark.heavy
def test_evaluate_refuses_a_model_card_it_cannot_write_before_translating(trained_model_dir, multi30k_dir, tmp_path):
    model = shutil.copytree(trained_model_dir, tmp_path / "model", ignore=shutil.ignore_patterns("checkpoints"))
    for lang in ("en", "de"):
        lines = (multi30k_dir / f"test_2016_flickr.{lang}").read_text().splitlines()[:8]
        (tmp_path / f"test.{lang}").write_text("\n".join(lines) + "\n")
    files = ["--source", str(tmp_path / "test.en"), "--reference", str(tmp_path / "test.de")]
    output = tmp_path / "hypotheses.de"
    result = run_read_only(model, "evaluate", "--model", str(model), *files, "--output", str(output))
    assert result.returncode == 2 and result.stdout == "", result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("vaswani-transformer evaluate: error: ") and "Traceback" not in result.stderr
    assert str(model / "README.md") in error and "--no-model-card" in error
    assert not output.exists()  # refused before the test set was translated
    result = run_read_only(model, "evaluate", "--model", str(model), *files, "--no-model-card")
    assert result.returncode == 0 and json.loads(result.stdout.splitlines()[-1])["sentences"] == 8, result.stderr


@pytest.mark.heavy
def test_the_ctranslate2_engine_names_its_option_where_the_model_directory_is_read_only(trained_model_dir, tmp_path):
    pytest.importorskip("ctranslate2")
    model = shutil.copytree(
        trained_model_dir, tmp_path / "model", ignore=shutil.ignore_patterns("checkpoints", "ctranslate2")
    )
    (tmp_path / "in.en").write_text("A dog runs.\n")
    arguments = ["translate", "--model", str(model), "--input", str(tmp_path / "in.en"), "--engine", "ctranslate2"]
    result = run_read_only(model, *arguments)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("vaswani-transformer translate: error: ") and "--ctranslate2-dir" in error
    result = run_read_only(model, *arguments, "--ctranslate2-dir", str(tmp_path / "ct2"))
    assert result.returncode == 0 and result.stdout.strip(), result.stderr[-3000:]
    assert (tmp_path / "ct2" / "model.bin").is_file()


def test_evaluate_refuses_to_write_its_translations_over_the_models_files(trained_model_dir, tmp_path, capsys):
    model = shutil.copytree(trained_model_dir, tmp_path / "model", ignore=shutil.ignore_patterns("checkpoints"))
    (tmp_path / "test.en").write_text("A dog runs.\n")
    (tmp_path / "test.de").write_text("Ein Hund rennt.\n")
    (tmp_path / "linked.txt").hardlink_to(model / "config.json")
    config = (model / "config.json").read_text()
    files = ["--source", str(tmp_path / "test.en"), "--reference", str(tmp_path / "test.de"), "--no-model-card"]
    for output in (model / "config.json", model / "new.json", tmp_path / "linked.txt"):
        assert main(["evaluate", "--model", str(model), *files, "--output", str(output)]) == 2
        error = capsys.readouterr().err
        assert f"--output {output} is a file of the model" in error and error.count("\n") == 1, error
    assert (model / "config.json").read_text() == config and not (model / "new.json").exists()
    # A new file beside the model's, as the recipe writes each test set's translations, is no file of the model.
    assert main(["evaluate", "--model", str(model), *files, "--output", str(model / "test.hyp.de")]) == 0
    assert (model / "test.hyp.de").read_text().strip() and (model / "config.json").read_text() == config


def test_translate_counts_sentences_translated_and_ends_its_bar_before_an_error(trained_model_dir, tmp_path, capsys):
    source = tmp_path / "input.en"
    source.write_text(f"{SENTENCE}\n" * 6)
    options = ["--model", str(trained_model_dir), "--input", str(source), "--batch-size", "4"]
    assert main(["translate", *options]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 6
    # The bar knows the total from the start, so it gives the time left, and counts sentences translated.
    bar = err.split("\n")[-2].split("\r")[-1]
    assert re.match(r"Translating: 100%.* 6/6 \[[0-9:]+<00:00, +[0-9.]+(s/sent|sent/s)\]$", bar), err
    # An error after the first batch (a line over the model's limit) comes on a line of its own, not after the bar.
    # (One sentence: without periods inside, the segmenter cannot split it.)
    source.write_text(f"{SENTENCE}\n" * 5 + " and ".join([SENTENCE.rstrip(".")] * 80) + "\n")
    assert main(["translate", *options, "--long-inputs", "error"]) == 2
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 4
    lines = [line.split("\r")[-1] for line in err.split("\n")]
    assert re.match(r"Translating: .* 4/6 ", lines[-3]) and lines[-2].startswith(
        "vaswani-transformer translate: error:"
    )


def test_translate_applies_a_glossary_writes_scores_and_refuses_a_bad_glossary_line_in_one_line(
    trained_model_dir, tmp_path, capsys
):
    source = tmp_path / "input.en"
    source.write_text("A woman is riding a bicycle down the street.\n\nTwo dogs play in the snow.\n")
    terms = tmp_path / "terms.tsv"
    terms.write_text("woman\tDame\n")
    options = ["--model", str(trained_model_dir), "--input", str(source)]
    assert main(["translate", *options]) == 0
    plain = capsys.readouterr().out.splitlines()
    assert main(["translate", *options, "--glossary", str(terms), "--scores"]) == 0
    lines = [line.rsplit(" ||| ", 1) for line in capsys.readouterr().out.splitlines()]
    assert "Dame" in lines[0][0] and "Dame" not in plain[0]
    assert [text for text, _ in lines[1:]] == plain[1:] and lines[1][1] == ""  # the blank line has no score
    assert all(-math.inf < float(lines[i][1]) <= 0 for i in (0, 2))
    terms.write_text("woman\tDame\nman\tHerr\tMann\n")
    assert main(["translate", *options, "--glossary", str(terms)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines() == [
        f"vaswani-transformer translate: error: {terms}:2: 3 fields; a glossary line is a source term, one tab, and "
        "its target term."
    ]
