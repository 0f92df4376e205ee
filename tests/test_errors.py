"""Bad input fails clearly: each error case of issue 7 and the message it gives (library and command line).

The command line's contract: an expected error is one line on stderr, `vaswani-transformer
COMMAND: error: ...`, and exit status 2, never a traceback.
"""

import io
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_fork, random_model
from transformers import AutoConfig, AutoTokenizer

from vaswani_transformer import VaswaniConfig
from vaswani_transformer.cli import main
from vaswani_transformer.data.corpora import iter_lines, load_parallel_corpus
from vaswani_transformer.exchange.saving import save_translator
from vaswani_transformer.inference.config import ENGINES, InferenceConfig
from vaswani_transformer.inference.engines import Engine, load_translator
from vaswani_transformer.inference.translation import (
    corpus_bleu,
    translate,
    translate_stream,
)
from vaswani_transformer.model.generation_vaswani import paper_generation_config
from vaswani_transformer.utils.files import ensure_writable

LIMIT = 12  # model_max_length of the saved translator's tokenizer, in tokens
LONG = "A man in a blue shirt is standing on a ladder cleaning the windows of a tall building."


class TerminalInput(io.StringIO):
    """Standard input as a terminal gives it: lines typed one by one."""

    buffer = None  # set in __init__: the bytes of the same text

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.buffer = io.BytesIO(text.encode())

    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def translator_dir(tmp_path_factory, tokenizer) -> Path:
    """A random tiny model saved with the session tokenizer, limited to 12 source tokens and 6 output tokens."""
    model = random_model(tokenizer, seed=3)
    model.generation_config = paper_generation_config(model.config)
    model.generation_config.max_new_tokens = 6  # random weights rarely stop: keep decoding short
    path = save_translator(model, tokenizer, tmp_path_factory.mktemp("translator"))
    AutoTokenizer.from_pretrained(path, model_max_length=LIMIT).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def translator(translator_dir):
    return load_translator(str(translator_dir), "cpu")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(status: int, err: str, *fragments: str) -> None:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert status == 2 and len(lines) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


# Corpus files -------------------------------------------------------------------------------------


def test_parallel_files_with_different_line_counts_name_both_files_and_counts(tmp_path, capsys):
    source, target = tmp_path / "train.en", tmp_path / "train.de"
    source.write_text("one\ntwo\nthree\n", encoding="utf-8")
    target.write_text("eins\nzwei\n", encoding="utf-8")
    status, _, err = run_cli(
        capsys, "train", "--train-files", source, target, "--source-lang", "en", "--target-lang", "de",
        "--output-dir", tmp_path / "out", "--max-steps", "1",
    )  # fmt: skip
    assert_one_line_error(status, err, f"{source} has 3 lines", f"{target} has 2")


@pytest.mark.parametrize(
    "corpus, fragments",
    [
        (["--data-dir", "data/multi30K"], ["--data-dir data/multi30K is not a directory", "--dataset"]),
        (["--data-dir", ".", "--dataset", "org/c", "--train-files", "a", "b"], ["one of --data-dir and --dataset"]),
    ],
)
def test_the_corpus_options_are_not_mixed_up(tmp_path, capsys, monkeypatch, corpus, fragments):
    monkeypatch.chdir(tmp_path)  # where data/multi30K does not exist: a mistyped directory, not a Hub id
    options = ["--source-lang", "en", "--target-lang", "de", "--output-dir", "out", "--max-steps", "1"]
    status, _, err = run_cli(capsys, "train", *corpus, *options)
    assert_one_line_error(status, err, *fragments)


def test_empty_and_missing_corpus_files_are_named(tmp_path):
    source, target = tmp_path / "a.en", tmp_path / "a.de"
    source.write_text("A dog.\n", encoding="utf-8")
    target.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"{target} is empty; it needs one sentence per line"):
        load_parallel_corpus("", "en", "de", files={"train": (source, target)})
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path / 'b.de'} does not exist; check the path"):
        load_parallel_corpus("", "en", "de", files={"train": (source, tmp_path / "b.de")})


def test_undecodable_bytes_in_a_corpus_name_the_file_and_the_line(tmp_path):
    source, target = tmp_path / "a.en", tmp_path / "a.de"
    source.write_text("A dog.\nA cat.\nA bird.\n", encoding="utf-8")
    target.write_bytes(b"Ein Hund.\nEine Katze.\n" + "Ein Vögel.\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"^{target}, line 3: not valid UTF-8 .*convert the file to UTF-8"):
        load_parallel_corpus("", "en", "de", files={"train": (source, target)})


def test_undecodable_bytes_on_stdin_name_the_line():
    stream = io.BytesIO(b"fine\n\xff\xfe bad\n")
    lines = iter_lines(stream, "<stdin>")
    assert next(lines) == "fine"
    with pytest.raises(ValueError, match=r"^<stdin>, line 2: not valid UTF-8 \(invalid start byte, byte 1 of"):
        next(lines)


def test_evaluate_names_an_empty_a_missing_and_an_undecodable_file(tmp_path, capsys):
    empty, bad = tmp_path / "empty.en", tmp_path / "bad.de"
    empty.write_bytes(b"")
    bad.write_bytes(b"ok\n\xe9t\xe9\n")
    model = tmp_path / "no-model"  # every check below comes before the model is loaded
    status, _, err = run_cli(capsys, "evaluate", "--model", model, "--source", empty, "--reference", empty)
    assert_one_line_error(status, err, f"{empty} is empty")
    status, _, err = run_cli(capsys, "evaluate", "--model", model, "--source", tmp_path / "x", "--reference", empty)
    assert_one_line_error(status, err, f"{tmp_path / 'x'} does not exist")
    status, _, err = run_cli(capsys, "evaluate", "--model", model, "--source", bad, "--reference", bad)
    assert_one_line_error(status, err, f"{bad}, line 2: not valid UTF-8")
    with pytest.raises(ValueError, match="No sentences to score"):
        corpus_bleu([], [])


def test_translate_names_a_missing_input_before_loading_the_model(tmp_path, capsys):
    status, _, err = run_cli(capsys, "translate", "--model", tmp_path / "no-model", "--input", tmp_path / "in.en")
    assert_one_line_error(status, err, f"{tmp_path / 'in.en'} does not exist")


@pytest.mark.parametrize(
    "options",
    [["--batch-size", "1"], [], pytest.param(["--num-workers", "2"], marks=needs_fork)],
    ids=["batch of 1", "batches of 64", "2 workers"],
)
def test_translate_names_the_undecodable_line_of_its_input(translator_dir, tmp_path, capsys, options):
    source = tmp_path / "in.en"
    source.write_bytes(b"A dog.\nA cat.\nA caf\xe9.\nA cow.\n")
    status, out, err = run_cli(capsys, "translate", "--model", translator_dir, "--input", source, *options)
    assert_one_line_error(status, err, f"{source}, line 3: not valid UTF-8")
    assert len(out.splitlines()) == 2, "the lines before the bad one were translated and printed"


# Empty strings and empty batches ------------------------------------------------------------------


def test_empty_strings_and_empty_batches_translate_to_empty_output(translator):
    model, tokenizer = translator
    assert translate(model, tokenizer, []) == []
    assert list(translate_stream(model, tokenizer, [])) == []
    translations = translate(model, tokenizer, ["", "A dog.", "   ", ""], batch_size=2, num_beams=1)
    assert len(translations) == 4 and translations[0] == translations[2] == translations[3] == ""
    streamed = list(translate_stream(model, tokenizer, ["\n", "A dog.\n", ""], batch_size=2, num_beams=1))
    assert streamed[0] == streamed[2] == "" and streamed[1] == translations[1]


def test_translate_into_a_pipe_whose_reader_has_gone_stops_quietly(translator_dir, tmp_path):
    # `translate ... | head -n 1`: no "Broken pipe" error and no traceback, the status of a Unix tool ended by SIGPIPE.
    source = tmp_path / "in.en"
    source.write_text("A dog runs.\n" * 300)
    command = (
        f"{sys.executable} -m vaswani_transformer.cli translate --model {translator_dir} --input {source} "
        "--batch-size 1 | head -n 1"
    )
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=300)
    assert result.stdout.count("\n") == 1, result.stdout
    assert "Broken pipe" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == 141, result.stderr[-2000:]


def test_translate_command_keeps_empty_lines_and_accepts_an_empty_file(translator_dir, tmp_path, capsys):
    source = tmp_path / "in.en"
    source.write_text("\nA dog.\n\n", encoding="utf-8")
    status, out, _ = run_cli(capsys, "translate", "--model", translator_dir, "--input", source, "--num-beams", "1")
    assert status == 0 and len(out.splitlines()) == 3
    assert out.splitlines()[0] == out.splitlines()[2] == ""
    source.write_bytes(b"")
    status, out, _ = run_cli(capsys, "translate", "--model", translator_dir, "--input", source)
    assert status == 0 and out == ""


@pytest.mark.parametrize("option, unit", [("batch_size", "sentence"), ("num_workers", "process")])
def test_a_batch_size_or_a_number_of_workers_below_one_is_refused(
    option, unit, translator, translator_dir, tmp_path, capsys
):
    model, tokenizer = translator
    with pytest.raises(ValueError, match=f"{option} must be at least 1 {unit}, got 0"):
        translate(model, tokenizer, ["A dog."], **{option: 0})
    source = tmp_path / "in.en"
    source.write_text("A dog.\n", encoding="utf-8")
    flag = "--" + option.replace("_", "-")
    status, _, err = run_cli(capsys, "translate", "--model", translator_dir, "--input", source, flag, "0")
    assert_one_line_error(status, err, "must be at least 1")
    assert flag in err or option in err  # the batch size's check names its flag, the library's its argument


def test_worker_processes_are_refused_where_they_cannot_run(translator, translator_dir, capsys, monkeypatch):
    _, tokenizer = translator
    on_meta, _ = load_translator(str(translator_dir), "cpu")
    with pytest.raises(ValueError, match=r"num_workers=2 \(--num-workers\) translates with the model in that many CPU"):
        list(translate_stream(on_meta.to("meta"), tokenizer, ["A dog."], num_workers=2))
    # In a terminal a typed line would wait for the lines after it.
    monkeypatch.setattr(sys, "stdin", TerminalInput("A dog.\n"))
    status, _, err = run_cli(capsys, "translate", "--model", translator_dir, "--num-workers", "2")
    assert_one_line_error(status, err, "--num-workers above 1 translates batches ahead", "--input FILE")


@needs_fork
def test_a_worker_process_that_dies_is_one_line_of_error(translator_dir, tmp_path, capsys, monkeypatch):
    source = tmp_path / "in.en"
    source.write_text("A dog.\nA cat.\nTwo birds.\n", encoding="utf-8")
    monkeypatch.setattr(Engine, "translate", lambda self, texts, glossary=None: os._exit(1))  # killed for memory, say
    status, _, err = run_cli(
        capsys, "translate", "--model", translator_dir, "--input", source, "--batch-size", "1", "--num-workers", "2"
    )
    assert_one_line_error(status, err, "terminated abruptly")


# Inputs longer than the model's limit -------------------------------------------------------------


def test_long_inputs_are_truncated_with_one_warning_or_refused(translator, caplog):
    model, tokenizer = translator
    assert len(tokenizer(LONG)["input_ids"]) > LIMIT
    sentences = ["A dog.", LONG, LONG + " Again."]
    with caplog.at_level(logging.WARNING, logger="vaswani_transformer.inference.translation"):
        translations = translate(model, tokenizer, sentences, long_inputs="truncate", num_beams=1)
    warnings = [r.getMessage() for r in caplog.records if r.name == "vaswani_transformer.inference.translation"]
    assert len(translations) == 3 and len(warnings) == 1, warnings
    assert f"Sentence 2 has {len(tokenizer(LONG)['input_ids'])} tokens" in warnings[0]
    assert f"truncated to {LIMIT} tokens" in warnings[0] and "--long-inputs error" in warnings[0]
    # The model was given the first LIMIT - 1 tokens and </s>.
    truncated = tokenizer(LONG, truncation=True, return_tensors="pt")
    assert truncated["input_ids"].shape[1] == LIMIT and truncated["input_ids"][0, -1] == tokenizer.eos_token_id
    output_ids = model.generate(**truncated, num_beams=1)
    assert tokenizer.decode(output_ids[0], skip_special_tokens=True).strip() == translations[1]
    with pytest.raises(ValueError, match=rf"^Sentence 2 has \d+ tokens, more than the model's limit of {LIMIT} "):
        translate(model, tokenizer, sentences)  # refused by default: a truncated sentence loses text
    with pytest.raises(ValueError, match="long_inputs must be one of error, truncate, split, got 'skip'"):
        translate(model, tokenizer, sentences, long_inputs="skip")


def test_a_stream_warns_once_and_numbers_lines_from_its_start(translator, caplog):
    model, tokenizer = translator
    lines = ["A dog.", LONG, "A cat.", LONG]
    with caplog.at_level(logging.WARNING, logger="vaswani_transformer.inference.translation"):
        streamed = translate_stream(model, tokenizer, lines, batch_size=1, long_inputs="truncate", num_beams=1)
        assert len(list(streamed)) == 4
    assert len([r for r in caplog.records if r.name == "vaswani_transformer.inference.translation"]) == 1
    stream = translate_stream(model, tokenizer, lines, batch_size=2, long_inputs="error", num_beams=1)
    with pytest.raises(ValueError, match="^Sentence 2 has"):
        next(stream)
    stream = translate_stream(model, tokenizer, lines[2:], batch_size=1, long_inputs="error", num_beams=1)
    assert next(stream) == translate(model, tokenizer, ["A cat."], num_beams=1)[0]  # the line before the long one
    with pytest.raises(ValueError, match="^Sentence 2 has"):
        next(stream)


def test_learned_positions_limit_the_source_length_too(tokenizer):
    # Table 3 row E has no position vector beyond max_position_embeddings: without truncation the
    # model would raise on a longer source.
    model = random_model(tokenizer, position_embedding_type="learned", max_position_embeddings=16)
    assert tokenizer.model_max_length > 16 and len(tokenizer(LONG + " " + LONG)["input_ids"]) > 16
    assert (
        len(translate(model, tokenizer, [LONG + " " + LONG], long_inputs="truncate", num_beams=1, max_new_tokens=4))
        == 1
    )
    with pytest.raises(ValueError, match="more than the model's limit of 16"):
        translate(model, tokenizer, [LONG + " " + LONG], long_inputs="error")


def test_long_inputs_option_of_the_command_line(translator_dir, tmp_path, capsys, caplog):
    source, reference = tmp_path / "in.en", tmp_path / "ref.de"
    source.write_text(f"A dog.\n{LONG}\n", encoding="utf-8")
    reference.write_text("Ein Hund.\nEin Mann.\n", encoding="utf-8")
    status, _, err = run_cli(
        capsys, "evaluate", "--model", translator_dir, "--source", source, "--reference", reference, "--no-model-card",
    )  # fmt: skip
    assert_one_line_error(status, err, "Sentence 2 has", f"limit of {LIMIT}")  # refused by default
    status, out, _ = run_cli(
        capsys, "translate", "--model", translator_dir, "--input", source, "--num-beams", "1",
        "--long-inputs", "truncate",
    )  # fmt: skip
    assert status == 0 and len(out.splitlines()) == 2
    assert len([r for r in caplog.records if "truncated to" in r.getMessage()]) == 1


# A tokenizer that does not fit the model ----------------------------------------------------------


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_at_load_time(tokenizer, tmp_path, capsys):
    save_translator(random_model(tokenizer, vocab_size=500), tokenizer, tmp_path)
    with pytest.raises(ValueError, match=r"has 2000 tokens but the model has embeddings for config.vocab_size=500"):
        load_translator(str(tmp_path), "cpu")
    source = tmp_path / "in.en"
    source.write_text("A dog.\n", encoding="utf-8")
    status, _, err = run_cli(capsys, "translate", "--model", tmp_path, "--input", source)
    assert_one_line_error(status, err, "2000 tokens", "resize_token_embeddings")


def test_special_token_ids_that_disagree_with_the_config_are_refused(tokenizer, tmp_path):
    save_translator(random_model(tokenizer, eos_token_id=3), tokenizer, tmp_path)
    with pytest.raises(ValueError, match=r"eos_token_id=2 but the model's config has eos_token_id=3: use the tokeni"):
        load_translator(str(tmp_path), "cpu")


# Impossible configurations ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, message",
    [
        ({"d_model": 100, "num_attention_heads": 8}, r"d_model \(100\) must be divisible by num_attention_heads \(8\)"),
        ({"dropout": 1.0}, r"dropout must be a probability in \[0, 1\), got 1.0"),
        ({"dropout": -0.1}, r"dropout must be a probability in \[0, 1\), got -0.1"),
        ({"attention_dropout": 1.5}, r"attention_dropout must be a probability"),
        ({"activation_dropout": "0.1"}, r"activation_dropout must be a probability"),
        ({"label_smoothing": 1}, r"label_smoothing must be a probability"),
        ({"d_model": 0}, r"d_model must be a positive integer, got 0"),
        ({"d_ff": -4}, r"d_ff must be a positive integer, got -4"),
        ({"vocab_size": 0}, r"vocab_size must be a positive integer"),
        ({"num_attention_heads": 0}, r"num_attention_heads must be a positive integer"),
        ({"decoder_layers": 2.5}, r"decoder_layers must be a positive integer, got 2.5"),
        ({"encoder_layers": True}, r"encoder_layers must be a positive integer, got True"),
        ({"d_v": -1}, r"d_v must be a positive integer"),
        ({"eos_token_id": -1}, r"eos_token_id must be a token id in \[0, vocab_size=\d+\), got -1"),
    ],
)
def test_impossible_config_values_name_the_field(values, message, tmp_path):
    with pytest.raises(ValueError, match=rf"^VaswaniConfig\.{message}"):
        VaswaniConfig(**values)
    # The same check guards loading: a config.json edited by hand or downloaded.
    saved = VaswaniConfig(d_model=32, d_ff=64, num_attention_heads=4, vocab_size=100).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**saved, **values}))
    with pytest.raises(ValueError, match=rf"VaswaniConfig\.{message}"):
        VaswaniConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"VaswaniConfig\.{message}"):
        AutoConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--batch-wait-ms", "-1", "--batch-wait-ms must be 0 to 60,000 milliseconds, got -1.0"),
        ("--max-batch-tokens", "0", "--max-batch-tokens must be at least 1, got 0"),
        ("--batch-limit", "0", "--batch-limit must be at least 1, got 0"),
        ("--threads", "0", "--threads must be at least 1, got 0"),
        ("--port", "70000", "--port must be a TCP port from 0 (the system chooses) to 65535, got 70000"),
        ("--port", "-1", "--port must be a TCP port"),
    ],
)
def test_impossible_serve_settings_name_the_flag_before_loading_the_model(flag, value, message, tmp_path, capsys):
    # The model directory does not exist: the settings are refused before anything is loaded.
    status = main(["serve", str(tmp_path / "no-model"), flag, value])
    assert_one_line_error(status, capsys.readouterr().err, f"vaswani-transformer serve: error: {message}")


def test_an_unknown_long_inputs_setting_names_the_flag_and_the_choices():
    with pytest.raises(ValueError, match="^--long-inputs must be one of error, truncate, split, got 'skip'"):
        InferenceConfig(long_inputs="skip")


def test_a_saved_model_with_an_impossible_config_fails_in_one_line(translator_dir, tmp_path, capsys):
    model_dir = shutil.copytree(translator_dir, tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "dropout": 1.2}))
    source = tmp_path / "in.en"
    source.write_text("A dog.\n", encoding="utf-8")
    status, _, err = run_cli(capsys, "translate", "--model", model_dir, "--input", source)
    assert_one_line_error(status, err, "VaswaniConfig.dropout must be a probability in [0, 1), got 1.2")


# Output paths that cannot be written --------------------------------------------------------------


def test_an_output_directory_under_a_file_is_refused_before_any_work(multi30k_dir, tmp_path, capsys):
    # Tests run as root, for whom permissions never block writing: a path through a regular file
    # cannot be created by anyone.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    status, out, err = run_cli(
        capsys, "train", "--data-dir", multi30k_dir, "--source-lang", "en", "--target-lang", "de",
        "--output-dir", blocker / "run", "--max-steps", "1",
    )  # fmt: skip
    assert_one_line_error(status, err, f"Cannot write to {blocker / 'run'}: Not a directory", "choose another path")
    assert "Tokenizing" not in err, "the corpus should not have been read"
    with pytest.raises(OSError, match=f"Cannot write to {blocker}: Not a directory"):
        ensure_writable(blocker)


def test_evaluate_refuses_an_output_it_cannot_write_before_loading_the_model(tmp_path, capsys):
    source = tmp_path / "in.en"
    source.write_text("A dog.\n", encoding="utf-8")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    model = tmp_path / "no-model"
    for output, reason in ((blocker / "hyp.de", "Not a directory"), (tmp_path, "Is a directory")):
        status, _, err = run_cli(
            capsys, "evaluate", "--model", model, "--source", source, "--reference", source, "--output", output
        )
        assert_one_line_error(status, err, f"Cannot write to {output}", reason)
    status, _, err = run_cli(capsys, "translate", "--model", model, "--attention-dir", blocker / "maps")
    assert_one_line_error(status, err, f"Cannot write to {blocker / 'maps'}")


def test_translate_without_matplotlib_refuses_attention_maps_before_translating(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` meets where it is not installed
    model = tmp_path / "no-model"  # never loaded: the check comes first
    status, out, err = run_cli(capsys, "translate", "--model", model, "--attention-dir", tmp_path / "maps")
    assert_one_line_error(status, err, "Plotting needs matplotlib", "pip install 'vaswani-transformer[plot]'")
    assert out == ""


@pytest.mark.parametrize("command", [["translate", "--engine", "ctranslate2"], ["export-ctranslate2"]])
def test_commands_without_ctranslate2_say_what_to_install_in_one_line(
    trained_model_dir, tmp_path, capsys, monkeypatch, command
):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # what `import ctranslate2` meets where it is not installed
    model = ["--model", trained_model_dir] if command[0] == "translate" else [trained_model_dir, tmp_path / "ct2"]
    status, out, err = run_cli(capsys, *command, *model)
    assert_one_line_error(status, err, "needs the ctranslate2 package", "pip install 'vaswani-transformer[serve]'")
    assert out == ""


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any permission bits")
def test_a_read_only_output_directory_is_refused(tmp_path):
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    with pytest.raises(OSError, match=f"Cannot write to {read_only}: Permission denied"):
        ensure_writable(read_only)


# Round two: what a new user hit ------------------------------------------------------------------


def _one_sentence(directory: Path) -> Path:
    source = directory / "in.en"
    source.write_text("A dog runs.\n")
    return source


def test_a_zero_step_or_minute_budget_is_refused_not_read_as_no_limit(multi30k_dir, tmp_path, capsys):
    required = ["train", "--data-dir", multi30k_dir, "--source-lang", "en", "--target-lang", "de"]
    # TRAIN_MINUTES=nan would never stop a run: nan compares false with the clock.
    budgets = (["--max-steps", "0"], ["--max-minutes", "0"], ["--max-steps", "-3"], ["--max-minutes", "nan"])
    for budget in budgets:
        status, _, err = run_cli(capsys, *required, "--output-dir", tmp_path / "out", *budget)
        assert_one_line_error(status, err, budget[0][2:].replace("-", "_"), "positive")
    assert not (tmp_path / "out").exists()


def test_zero_beams_are_refused_in_one_line(translator, translator_dir, tmp_path, capsys):
    model, tokenizer = translator
    with pytest.raises(ValueError, match="num_beams must be at least 1"):
        model.generate(**tokenizer(["A dog runs."], return_tensors="pt"), num_beams=0)
    source = tmp_path / "in.en"
    source.write_text("A dog runs.\n")
    status, _, err = run_cli(capsys, "translate", "--model", translator_dir, "--input", source, "--num-beams", "0")
    assert_one_line_error(status, err, "num_beams", "at least 1")


def test_a_length_penalty_that_is_no_finite_number_is_refused(translator, translator_dir, capsys):
    model, tokenizer = translator
    for alpha in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="length_penalty must be a finite number"):
            model.generate(**tokenizer(["A dog runs."], return_tensors="pt"), num_beams=2, length_penalty=alpha)
    for value in ("nan", "inf"):
        status, _, err = run_cli(capsys, "translate", "--model", translator_dir, "--length-penalty", value)
        assert_one_line_error(status, err, "--length-penalty", "finite number")
    with pytest.raises(SystemExit) as exit_status:  # argparse's refusal of no number, after its usage lines
        main(["translate", "--model", str(translator_dir), "--length-penalty", "long"])
    assert exit_status.value.code == 2 and "--length-penalty: invalid float value: 'long'" in capsys.readouterr().err


def test_either_engine_refuses_a_length_penalty_that_is_no_finite_number_before_loading(tmp_path, capsys):
    for engine in ENGINES:
        with pytest.raises(ValueError, match="^--length-penalty: length_penalty must be a finite number"):
            InferenceConfig(engine=engine, length_penalty=float("nan"))
        status, _, err = run_cli(capsys, "serve", tmp_path / "no-model", "--engine", engine, "--length-penalty", "nan")
        assert_one_line_error(status, err, "--length-penalty", "finite number")


def test_a_cuda_device_without_cuda_is_refused_in_one_line(translator_dir, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    source = tmp_path / "in.en"
    source.write_text("A dog runs.\n")
    status, _, err = run_cli(capsys, "translate", "--model", translator_dir, "--input", source, "--device", "cuda")
    assert_one_line_error(status, err, "no CUDA", "--device cpu")


def test_a_device_torch_does_not_know_is_refused_in_one_line(translator_dir, tmp_path, capsys):
    source = tmp_path / "in.en"
    source.write_text("A dog runs.\n")
    status, _, err = run_cli(capsys, "translate", "--model", translator_dir, "--input", source, "--device", "gpu0")
    assert_one_line_error(status, err, "device 'gpu0' is no torch device", "cuda:0")


@pytest.mark.parametrize("size", [5_000, 100], ids=["truncated", "header only"])
def test_a_truncated_weights_file_is_named_in_one_line(translator_dir, tmp_path, capsys, size):
    damaged = shutil.copytree(translator_dir, tmp_path / "damaged")
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:size])
    status, _, err = run_cli(capsys, "translate", "--model", damaged, "--input", _one_sentence(tmp_path))
    assert_one_line_error(status, err, "model.safetensors is damaged")


def test_a_model_directory_that_does_not_exist_is_named(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    # What HF_HUB_OFFLINE=1 sets, read when huggingface_hub was imported: no wait for a Hub out of reach.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    status, _, err = run_cli(capsys, "translate", "--model", tmp_path / "missing", "--input", _one_sentence(tmp_path))
    assert_one_line_error(status, err, str(tmp_path / "missing"), "does not exist")
    monkeypatch.chdir(tmp_path)
    status, _, err = run_cli(capsys, "translate", "--model", "outputs/missing", "--input", _one_sentence(tmp_path))
    assert_one_line_error(status, err, "outputs/missing is not a directory here")


def test_a_model_directory_without_a_tokenizer_says_so(translator_dir, tmp_path, capsys):
    bare = shutil.copytree(translator_dir, tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    status, _, err = run_cli(capsys, "translate", "--model", bare, "--input", _one_sentence(tmp_path))
    assert_one_line_error(status, err, "holds no tokenizer")


def test_a_byte_order_mark_is_removed_with_one_warning_from_corpora_and_input(multi30k_dir, tmp_path, caplog):
    sources = (multi30k_dir / "train.en").read_text(encoding="utf-8").splitlines()[:3]
    targets = (multi30k_dir / "train.de").read_text(encoding="utf-8").splitlines()[:3]
    (tmp_path / "train.en").write_text("\n".join(sources) + "\n", encoding="utf-8-sig")  # the BOM first
    (tmp_path / "train.de").write_text("\n".join(targets) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="vaswani_transformer.data.corpora"):
        corpus = load_parallel_corpus(tmp_path, "en", "de")
    assert corpus["train"]["en"] == sources and corpus["train"]["de"] == targets
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'train.en'}: removed the UTF-8 byte-order mark at its start."
    ]
    assert list(iter_lines(io.BytesIO("\ufeffTwo dogs.\nA cat.\n".encode()), "<stdin>")) == ["Two dogs.", "A cat."]


def test_a_lone_carriage_return_stays_inside_its_line_as_wc_counts_lines_with_one_warning(tmp_path, caplog):
    (tmp_path / "train.en").write_bytes(b"one\rstill one\ntwo\r\nthree\rstill three\n")
    (tmp_path / "train.de").write_bytes(b"eins\r\nzwei\r\ndrei\r\n")
    with caplog.at_level(logging.WARNING, logger="vaswani_transformer.data.corpora"):
        corpus = load_parallel_corpus(tmp_path, "en", "de")
    assert corpus["train"]["en"] == ["one\rstill one", "two", "three\rstill three"]
    assert corpus["train"]["de"] == ["eins", "zwei", "drei"]
    # One warning for the file with carriage returns inside its lines (not for the CRLF one): a file whose lines
    # end with carriage returns alone would be one line, so the warning says how to convert it.
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'train.en'}, line 1: a carriage return inside the line, kept as text. Lines end at line feeds; "
        "if the file's lines end with carriage returns alone, convert it first: tr '\\r' '\\n' < IN > OUT."
    ]
    # Of a line's carriage returns, only the one of a CRLF ending goes.
    assert list(iter_lines(io.BytesIO(b"one\r\r\ntwo\r"))) == ["one\r", "two\r"]


def test_training_without_a_validation_split_says_what_that_means_once(mini_corpus, tmp_path, caplog):
    from conftest import mini_run

    from vaswani_transformer.training.run import train

    corpus = shutil.copytree(mini_corpus, tmp_path / "corpus")
    for lang in ("en", "de"):
        (corpus / f"val.{lang}").unlink()
    with caplog.at_level(logging.WARNING, logger="vaswani_transformer.training.run"):
        train(mini_run(corpus, tmp_path / "run", max_steps=3, save_steps=3, average_last=1))
    warnings = [r.getMessage() for r in caplog.records if r.name == "vaswani_transformer.training.run"]
    assert len(warnings) == 1 and "No validation split" in warnings[0] and "no best checkpoint" in warnings[0]


def test_a_misspelt_model_option_is_one_line_before_the_corpus_is_read(tmp_path, capsys):
    required = ["train", "--data-dir", tmp_path / "no-corpus", "--source-lang", "en", "--target-lang", "de"]
    status, _, err = run_cli(capsys, *required, "--output-dir", tmp_path / "out", "--max-steps", "5",
                             "--model-option", "d_fff=512")  # fmt: skip
    assert_one_line_error(status, err, "d_fff is no VaswaniConfig field; did you mean d_ff?")
    assert not (tmp_path / "out").exists()


def test_training_with_no_pair_short_enough_is_refused_not_left_waiting(mini_corpus, tmp_path):
    # In a process of its own with a time limit: a regression would wait forever for a first batch.
    command = [sys.executable, "-m", "vaswani_transformer.cli", "train", "--data-dir", str(mini_corpus)]
    command += ["--source-lang", "en", "--target-lang", "de", "--output-dir", str(tmp_path / "run"), "--preset", "tiny"]
    command += ["--vocab-size", "300", "--max-steps", "5", "--max-length", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-2000:]
    assert "No training batches: none of the 400 training pairs" in errors[0] and "--max-length (1)" in errors[0]


def test_push_without_a_reachable_hub_is_one_line(translator_dir, tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:  # a loopback port with nothing listening once it is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_TOKEN="hf_test", HF_HOME=str(tmp_path / "home"))
    result = subprocess.run(
        [sys.executable, "-m", "vaswani_transformer.cli", "push", str(translator_dir), "--repo-id", "org/x"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert_one_line_error(result.returncode, result.stderr, "could not reach the Hub", "HF_ENDPOINT")


def test_the_documented_ctranslate2_snippet_loads_the_tokenizer_without_a_prompt(translator_dir):
    import re
    import subprocess
    import sys

    docs = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text(encoding="utf-8")
    snippet = next(block for block in re.findall(r"```python\n(.*?)```", docs, re.S) if "ctranslate2" in block)
    lines = snippet.splitlines()
    setup = [
        line for line in lines[: next(i for i, line in enumerate(lines) if "AutoTokenizer.from_pretrained" in line) + 1]
    ]
    code = "\n".join(line for line in setup if "import ctranslate2" not in line)  # CTranslate2 is not needed here
    code = code.replace("outputs/multi30k-en-de", str(translator_dir))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "custom code" not in result.stdout + result.stderr


def test_export_with_force_never_deletes_the_model_or_other_files(translator_dir, tmp_path, capsys):
    model_dir = tmp_path / "model"
    shutil.copytree(translator_dir, model_dir)
    before = sorted(p.name for p in model_dir.iterdir())
    for output_dir in (model_dir, tmp_path):  # CTranslate2 would empty the directory it writes to
        assert main(["export-ctranslate2", str(model_dir), str(output_dir), "--force"]) == 2
        assert "holds the model" in capsys.readouterr().err
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "keep.txt").write_text("mine")
    assert main(["export-ctranslate2", str(model_dir), str(notes), "--force"]) == 2
    assert "holds no CTranslate2 model" in capsys.readouterr().err
    assert sorted(p.name for p in model_dir.iterdir()) == before and (notes / "keep.txt").read_text() == "mine"


def test_a_named_pipe_is_read_as_a_file_and_a_directory_or_missing_path_is_named(tmp_path):
    import threading

    pipe = tmp_path / "pipe.en"  # what `--source <(...)` hands over: a pipe, not a regular file
    os.mkfifo(pipe)
    writer = threading.Thread(target=lambda: pipe.write_bytes(b"Two dogs.\nA cat.\n"), daemon=True)
    writer.start()
    assert list(iter_lines(pipe)) == ["Two dogs.", "A cat."]
    writer.join(timeout=10)
    with pytest.raises(IsADirectoryError, match=f"{tmp_path} is a directory, not a text file"):
        iter_lines(tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.en does not exist; check the path"):
        iter_lines(tmp_path / "missing.en")
