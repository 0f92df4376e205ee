"""InferenceConfig: the options translate, evaluate and serve share, one name, default and help text each."""

import argparse
from dataclasses import MISSING, fields

import pytest
import torch

from vaswani_transformer.cli import build_parser, main
from vaswani_transformer.inference import evaluation, input_translation
from vaswani_transformer.inference.config import InferenceConfig, cpu_threads
from vaswani_transformer.serving.config import ServingConfig


def options_of(command: str) -> dict[str, argparse.Action]:
    """The options of one command of the command line, by destination."""
    subparsers = next(a for a in build_parser([command])._actions if isinstance(a, argparse._SubParsersAction))
    return {action.dest: action for action in subparsers.choices[command]._actions}


def test_translate_evaluate_and_serve_show_each_inference_setting_alike_and_as_the_dataclass_says():
    settings = [option for option in fields(InferenceConfig) if "help" in option.metadata]
    assert {option.name for option in settings} >= {"engine", "device", "num_beams", "length_penalty", "batch_size"}
    commands = {command: options_of(command) for command in ("translate", "evaluate", "serve")}
    # evaluate scores line by line, as the references are: it never splits sentences, nor reads HTML; serve takes a
    # file's format from its name.
    # serve's --threads is ServingConfig's, with the same default (`ServingConfig.cpu_threads` calls `cpu_threads`).
    only = {
        "split_sentences": {"translate", "serve"},
        "input_format": {"translate"},
        "threads": {"translate", "evaluate"},
    }
    for option in settings:
        shown = {
            command: options[option.name]
            for command, options in commands.items()
            if option.name in options and command in only.get(option.name, commands)
        }
        assert set(shown) == only.get(option.name, set(commands)), option.name
        for command, action in shown.items():
            flag = option.metadata.get("flag", "--" + option.name.replace("_", "-"))
            assert action.option_strings == [flag], (command, option.name)
            assert action.default == option.default != MISSING, (command, option.name)
            assert action.help.startswith(option.metadata["help"]), (command, option.name)
            assert action.choices == option.metadata.get("choices"), (command, option.name)
        assert len({action.help for action in shown.values()}) == 1, option.name


def test_the_parsed_options_make_the_config_and_its_generate_arguments():
    args = build_parser(["translate"]).parse_args(
        ["translate", "--model", "m", "--num-beams", "2", "--length-penalty", "1.5", "--long-inputs", "truncate"]
    )
    config = InferenceConfig(**{option.name: getattr(args, option.name) for option in fields(InferenceConfig)})
    assert config == InferenceConfig(num_beams=2, length_penalty=1.5, long_inputs="truncate")
    assert config.generate_kwargs == {"num_beams": 2, "length_penalty": 1.5}
    assert InferenceConfig().generate_kwargs == {}  # the model's own decoding (§6.1)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"engine": "onnx"}, "--engine must be one of torch, ctranslate2, got 'onnx'"),
        ({"long_inputs": "skip"}, "--long-inputs must be one of error, truncate, split, got 'skip'"),
        ({"input_format": "pdf"}, "--input-format must be one of auto, text, html, got 'pdf'"),
        ({"batch_size": 0}, "--batch-size must be at least 1 sentence, got 0"),
        ({"num_beams": 0}, "--num-beams: num_beams must be at least 1"),
        ({"length_penalty": float("inf")}, "--length-penalty: length_penalty must be a finite number"),
        ({"threads": 0}, "--threads must be at least 1, got 0"),
    ],
)
def test_a_bad_setting_is_refused_naming_its_flag(setting, message, tmp_path, capsys):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        InferenceConfig(**setting)
    ((name, value),) = setting.items()
    argv = ["translate", "--model", str(tmp_path), "--" + name.replace("_", "-"), str(value)]
    if name in ("engine", "long_inputs", "input_format"):  # argparse refuses what its choices do not hold, with usage
        with pytest.raises(SystemExit, match="2"):
            main(argv)
        assert "invalid choice" in capsys.readouterr().err
    else:  # one line, before the model is looked for
        assert main(argv) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and message in error, error


def test_threads_default_to_the_cores_this_process_may_use_less_one_as_serve_does(monkeypatch):
    # A parallel region waits for its last thread: one per core, and a busy neighbour stalls every operator.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4}, raising=False)
    assert cpu_threads() == 4 == InferenceConfig().cpu_threads() == ServingConfig().cpu_threads()
    assert cpu_threads(processes=2) == 2  # the cores shared by a machine's processes of one run
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0}, raising=False)
    assert cpu_threads() == 1 and InferenceConfig(threads=3).cpu_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # as the user asked PyTorch for them; --threads still wins
    assert cpu_threads() == 3 == ServingConfig().cpu_threads() and cpu_threads(2) == 2


@pytest.mark.parametrize(
    ("command", "module", "function"),
    [("translate", input_translation, "translate_input"), ("evaluate", evaluation, "evaluate_test_set")],
)
def test_threads_reach_torch_while_translate_and_evaluate_run(command, module, function, monkeypatch, tmp_path):
    seen = []

    def record(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise ValueError("recorded")  # the command stops here, in one line (status 2)

    monkeypatch.setattr(module, function, record)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    before = torch.get_num_threads()
    argv = [command, "--model", str(tmp_path)]
    if command == "evaluate":
        argv += ["--source", "s", "--reference", "r"]
    assert main([*argv, "--threads", "3"]) == 2 and main(argv) == 2
    assert seen == [3, 2]  # as given; by default one per core less one
    assert torch.get_num_threads() == before  # the caller's threads, once the command is done
