"""The `vaswani-transformer` command: train, ablate, evaluate, translate, serve, push, average, convert, export.

A thin layer over the library: each subcommand parses its options and calls one function.
Expected failures (bad paths, bad values) print one line on stderr and exit with status 2.
Torch and transformers are imported only by the command that runs, and by the options of the command
given (their defaults live beside the code that uses them): `vaswani-transformer --help` needs neither.
"""

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Collection, Sequence
from concurrent.futures import BrokenExecutor
from dataclasses import MISSING, fields
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, get_args, get_origin

if TYPE_CHECKING:  # imported where a command runs: `--help` needs neither torch nor transformers
    from .inference.config import InferenceConfig
    from .training.config import TrainingConfig


def _model_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _add_num_workers(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num-workers",
        type=int,
        default=1,
        help="CPU processes that translate batches side by side, one thread each: for files, faster than one "
        "process with a thread per core (about one worker per core), each translation waiting for the batches "
        "after it; the torch engine on the CPU, not on macOS or Windows (default: 1)",
    )


def _add_inference_options(parser: argparse.ArgumentParser, skip: Collection[str] = ()) -> None:
    from .inference.config import InferenceConfig

    _add_config_options(parser, InferenceConfig, {}, skip)


def _inference_config(args: argparse.Namespace) -> "InferenceConfig":
    from .inference.config import InferenceConfig

    # A command without an option (evaluate's split_sentences) takes the field's default.
    given = [name for name in _option_names(InferenceConfig) if hasattr(args, name)]
    return InferenceConfig(**{name: getattr(args, name) for name in given})


def _option_names(config_class: type) -> list[str]:
    # The fields of a config dataclass that are command-line options: those with help text.
    return [option.name for option in fields(config_class) if "help" in option.metadata]


def _add_config_options(
    parser: argparse.ArgumentParser, config_class: type, groups: dict, skip: Collection[str] = ()
) -> None:
    # One option per field of `config_class` with help (but those in `skip`), named, typed and defaulted by the
    # field, in the `--help` section its metadata names (`groups` holds the sections made so far).
    for option in fields(config_class):
        if "help" not in option.metadata or option.name in skip:
            continue
        settings = dict(option.metadata)
        name = settings.pop("group")
        group = groups[name] if name in groups else groups.setdefault(name, parser.add_argument_group(name))
        flag = settings.pop("flag", "--" + option.name.replace("_", "-"))
        default = option.default_factory() if option.default_factory is not MISSING else option.default
        kind = option.type
        if isinstance(kind, UnionType):  # X | None
            kind = next(t for t in get_args(kind) if t is not type(None))
        kind = get_origin(kind) or kind  # list[str] -> list
        if default is MISSING:
            settings["required"] = True
        elif default is not None and not isinstance(default, bool | list | dict):  # 0 is a default to state
            settings["help"] += f" (default: {default})"
        if kind is bool:  # a flag that turns the default over (--no-access-log sets access_log False)
            settings.update(action="store_false" if default else "store_true")
        elif "nargs" in settings:  # a list after one flag (--choose-num-beams 4 6); a later flag replaces it
            settings.update(type=get_args(option.type)[0], default=[])
        elif kind in (list, dict):  # repeatable; a dict from KEY=VALUE pairs
            settings.update(action="append", default=[], type=_model_option if kind is dict else str)
        else:
            settings.update(type=kind, default=None if default is MISSING else default)
        group.add_argument(flag, dest=option.name, **settings)


def _add_training_options(train: argparse.ArgumentParser, skip: Collection[str] = ()) -> None:
    from .training.config import TrainingConfig

    # The corpus options, which fill `TrainingConfig.data` and `files`, come first.
    corpus = train.add_argument_group("corpus")
    corpus.add_argument(
        "--data-dir",
        help="directory with train.<lang>, val.<lang> and test*.<lang> files, one sentence per line, aligned by line",
    )
    corpus.add_argument("--dataset", help="Hub dataset id read with datasets.load_dataset, e.g. wmt14")
    corpus.add_argument("--train-files", nargs=2, metavar=("SRC", "TGT"), help="explicit training files")
    corpus.add_argument("--validation-files", nargs=2, metavar=("SRC", "TGT"), help="explicit validation files")
    _add_config_options(train, TrainingConfig, {"corpus": corpus}, skip)


def _add_ablation_options(ablate: argparse.ArgumentParser) -> None:
    from .experiments.ablation import RUN_SETTINGS, AblationConfig

    _add_training_options(ablate, skip=tuple(RUN_SETTINGS))
    _add_config_options(ablate, AblationConfig, {})


def _add_evaluate_options(evaluate: argparse.ArgumentParser) -> None:
    evaluate.add_argument("--model", required=True, help="model directory or Hub id")
    evaluate.add_argument("--source", required=True, help="source sentences, one per line")
    evaluate.add_argument("--reference", required=True, help="reference translations, aligned by line")
    evaluate.add_argument("--output", default=None, help="file for the translations (default: none)")
    evaluate.add_argument(
        "--dataset-name", default=None, help="test set name for the model card (default: the source file's folder)"
    )
    evaluate.add_argument("--split", default=None, help="split name for the model card (default: the file's stem)")
    evaluate.add_argument(
        "--no-model-card",
        action="store_true",
        help="do not record the score in a local model's README.md (a score of other --num-beams, "
        "--length-penalty or --engine than the model's own generate() is never recorded: the card describes the "
        "model as saved)",
    )
    _add_num_workers(evaluate)
    _add_inference_options(evaluate, skip={"split_sentences", "input_format"})  # line by line, as the references


def _add_translate_options(translate: argparse.ArgumentParser) -> None:
    translate.add_argument("--model", required=True, help="model directory or Hub id")
    translate.add_argument(
        "--input",
        default="-",
        help="text file, each line split into sentences (--no-split-sentences), or an HTML document (.html, .htm; "
        "--input-format); - for stdin",
    )
    translate.add_argument(
        "--attention-dir",
        default=None,
        help="also draw each sentence's encoder-decoder attention (last layer, every head) as DIR/sentence-N.png",
    )
    translate.add_argument(
        "--alignments",
        action="store_true",
        help="write each line's word alignment after its translation, as Marian does: TRANSLATION ||| 0-0 1-2 ... "
        "(Pharaoh source-target word pairs, from the encoder-decoder attention); text input only",
    )
    translate.add_argument(
        "--glossary",
        default=None,
        metavar="TSV",
        help="terms to translate as given, one a line: source term TAB target term; a sentence holding a source "
        "term (whole words, any case) gets its target term by constrained beam search, others translate as without",
    )
    translate.add_argument(
        "--scores",
        action="store_true",
        help="write each line's confidence last, as Marian's n-best lists end with their score: TRANSLATION ||| "
        "-0.2731 (after the alignment with --alignments): the mean log-probability of its tokens over its sentences, "
        "in nats, 0 the most sure; empty for a blank line; text input only",
    )
    _add_num_workers(translate)
    _add_inference_options(translate)


def _add_push_options(push: argparse.ArgumentParser) -> None:
    from .exchange.hub import COMMIT_MESSAGE

    push.add_argument("output_dir", metavar="OUTPUT_DIR", help="directory written by `train`")
    push.add_argument("--repo-id", required=True, help="Hub repository, ORG/NAME (created if missing)")
    push.add_argument(
        "--private", action="store_true", default=None, help="create the repository private (default: the owner's)"
    )
    push.add_argument("--commit-message", default=COMMIT_MESSAGE, help="commit message (default: %(default)s)")


def _add_average_options(average: argparse.ArgumentParser) -> None:
    average.add_argument("run_dir", metavar="OUTPUT_DIR", help="output directory of `train` (with checkpoints/)")
    average.add_argument(
        "--last", type=int, required=True, help="number of newest checkpoints to average (paper: 5 base, 20 big)"
    )
    average.add_argument(
        "--output-dir", default=None, help="where to write the averaged model (default: OUTPUT_DIR itself)"
    )


def _add_convert_options(convert: argparse.ArgumentParser) -> None:
    convert.add_argument("source_dir", metavar="SRC_DIR", help="directory saved by MarianMTModel.save_pretrained")
    convert.add_argument("output_dir", metavar="OUT_DIR", help="where to write the converted model")
    convert.add_argument(
        "--paper-decoding",
        action="store_true",
        help="decode as the paper does (beam 4, GNMT length penalty 0.6, input length + 50) instead of as Marian did",
    )


def _add_export_options(export: argparse.ArgumentParser) -> None:
    from .exchange.marian import DEFAULT_MAX_POSITIONS

    export.add_argument("model_dir", metavar="MODEL_DIR", help="model directory with its tokenizer, as `train` writes")
    export.add_argument("output_dir", metavar="OUT_DIR", help="where to write the CTranslate2 model")
    export.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16", "float32"],
        help="weight type stored (default: float32; CTranslate2 can also quantize when loading)",
    )
    export.add_argument(
        "--max-positions",
        type=int,
        default=DEFAULT_MAX_POSITIONS,
        help=f"longest source or target, in tokens (default: {DEFAULT_MAX_POSITIONS})",
    )
    export.add_argument("--force", action="store_true", help="overwrite OUT_DIR if it exists")


def _add_serve_options(serve: argparse.ArgumentParser) -> None:
    from .serving.config import ServingConfig

    serve.add_argument(
        "models",
        metavar="MODEL",
        nargs="+",
        help="model directory or Hub id, or SRC-TGT=MODEL (en-de=DIR1 de-en=DIR2: several pairs, each batched alone)",
    )
    serve.add_argument("--source-lang", default=None, help="the model's source language, where its files do not say it")
    serve.add_argument("--target-lang", default=None, help="the model's target language, where its files do not say it")
    # A file's format is its name's (POST /translate_file); --threads is ServingConfig's, which defaults it alike.
    _add_inference_options(serve, skip={"input_format", "threads"})
    _add_config_options(serve, ServingConfig, {})


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser of `vaswani-transformer` and its subcommands.

    The options of `train` are generated from the fields of `TrainingConfig` (their help, type and
    default), and `serve`'s server options from those of `ServingConfig`; the rest are written here.

    See README.md, "Command line".

    Args:
        commands: the commands whose options to add (their defaults import torch); None for all. The
            others are listed, with their help line, and take no options.
    """
    parser = argparse.ArgumentParser(
        prog="vaswani-transformer",
        description="Train, evaluate and run the Transformer of 'Attention Is All You Need'.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_line, add_options, _) in COMMANDS.items():
        command = subparsers.add_parser(name, help=help_line)
        if commands is None or name in commands:
            add_options(command)
    return parser


def _training_config(args: argparse.Namespace) -> "TrainingConfig":
    # The TrainingConfig of `train`'s options (those a command has: `ablate` sets some itself).
    from .data.corpora import corpus_location
    from .training.config import TrainingConfig

    files = {}
    if args.train_files:
        files["train"] = tuple(args.train_files)
    if args.validation_files:
        files["validation"] = tuple(args.validation_files)
    if not (args.data_dir or args.dataset or files):
        raise ValueError("Give the corpus with one of --data-dir, --dataset, or --train-files.")
    options = {name: getattr(args, name) for name in _option_names(TrainingConfig) if hasattr(args, name)}
    options["model_overrides"] = dict(options["model_overrides"])
    config = TrainingConfig(data="", files=files, **options)  # the options' checks first, before the corpus's
    config.data = corpus_location(args.data_dir, args.dataset)
    return config


def _train(args: argparse.Namespace) -> None:
    from .training.run import train
    from .utils.files import ensure_writable

    config = _training_config(args)
    if not config.prepare_only:  # which writes nothing there
        ensure_writable(config.output_dir)  # before hours of training, not at the first checkpoint
    print(train(config))


def _ablate(args: argparse.Namespace) -> None:
    from .experiments.ablation import AblationConfig, run_ablation

    options = {name: getattr(args, name) for name in _option_names(AblationConfig)}
    print(run_ablation(AblationConfig(training=_training_config(args), **options)))


def _train_interrupted(output_dir: str) -> str:
    # What Ctrl-C in `train` leaves, and how to go on: KeyboardInterrupt's traceback says neither.
    from .training.checkpoints import list_checkpoints

    saved = list_checkpoints(Path(output_dir) / "checkpoints")
    if not saved:
        return "interrupted before its first checkpoint: run the same command again to start over."
    return f"interrupted; the last checkpoint is {saved[-1]}: run the same command with --resume to continue from it."


def _evaluate(args: argparse.Namespace) -> None:
    from .inference.config import torch_threads
    from .inference.evaluation import evaluate_test_set

    config = _inference_config(args)
    with torch_threads(config.cpu_threads()):
        evaluation = evaluate_test_set(
            args.model,
            args.source,
            args.reference,
            config,
            output=args.output,
            num_workers=args.num_workers,
            model_card=not args.no_model_card,
            dataset_name=args.dataset_name,
            split=args.split,
            on_report=lambda report: print(json.dumps(report)),
        )
    if evaluation.card.note:
        print(evaluation.card.note, file=sys.stderr)


def _translate(args: argparse.Namespace) -> None:
    from .inference.config import torch_threads
    from .inference.input_translation import translate_input

    config = _inference_config(args)
    with torch_threads(config.cpu_threads()):
        translate_input(
            args.model,
            args.input,
            config,
            write=lambda translation: print(translation, end="", flush=True),  # with its own line end
            num_workers=args.num_workers,
            attention_dir=args.attention_dir,
            alignments=args.alignments,
            glossary=args.glossary,
            scores=args.scores,
        )


def _push(args: argparse.Namespace) -> None:
    from huggingface_hub.errors import HfHubHTTPError

    from .exchange.hub import push_translator

    # The connection errors of huggingface_hub's HTTP client (httpx2 or httpx, by version) are no OSError.
    unreachable = tuple(
        importlib.import_module(client).TransportError
        for client in ("httpx2", "httpx")
        if importlib.util.find_spec(client)
    )
    try:
        print(push_translator(args.output_dir, args.repo_id, private=args.private, commit_message=args.commit_message))
    except HfHubHTTPError as error:  # authentication, permissions: one line, not a traceback
        raise OSError(f"the Hub refused the upload to {args.repo_id}: {error}") from error
    except unreachable as error:
        raise OSError(
            f"could not reach the Hub to upload to {args.repo_id} ({error}); check the network, or HF_ENDPOINT"
        ) from error


def _average(args: argparse.Namespace) -> None:
    from .training.checkpoints import average_run_checkpoints

    print(average_run_checkpoints(args.run_dir, args.last, args.output_dir))


def _convert_marian(args: argparse.Namespace) -> None:
    from .exchange.marian import convert_marian_directory

    print(convert_marian_directory(args.source_dir, args.output_dir, paper_decoding=args.paper_decoding))


def _export_ctranslate2(args: argparse.Namespace) -> None:
    from .exchange.ctranslate2 import write_ctranslate2_export

    print(
        write_ctranslate2_export(
            args.model_dir,
            args.output_dir,
            quantization=args.quantization,
            max_positions=args.max_positions,
            force=args.force,
        )
    )


def _serve(args: argparse.Namespace) -> None:
    from .serving.config import ServingConfig

    config = ServingConfig(**{name: getattr(args, name) for name in _option_names(ServingConfig)})
    inference = _inference_config(args)
    from .serving.app import serve

    serve(args.models, config, inference, args.source_lang, args.target_lang)


# Each command: its line in `--help`, the function that adds its options, and the one that runs it.
COMMANDS = {
    "train": ("train a translator on a parallel corpus (§5)", _add_training_options, _train),
    "ablate": (
        "train and score the rows of Table 3 (§6.2) with one recipe, seeds side by side (docs/table3.md)",
        _add_ablation_options,
        _ablate,
    ),
    "evaluate": ("translate a test set and report sacreBLEU", _add_evaluate_options, _evaluate),
    "translate": ("translate lines, or an HTML document, from a file or stdin", _add_translate_options, _translate),
    "push": ("upload a trained model directory to the Hugging Face Hub", _add_push_options, _push),
    "average": ("average a run's last checkpoints into a model (§6.1)", _add_average_options, _average),
    "convert-marian": (
        "import a Hugging Face MarianMTModel directory (OPUS-MT)",
        _add_convert_options,
        _convert_marian,
    ),
    "export-ctranslate2": (
        "convert a saved model to CTranslate2 for serving",
        _add_export_options,
        _export_ctranslate2,
    ),
    "serve": (
        "serve a translator over HTTP: the LibreTranslate API and a page at / (the `serve` extra)",
        _add_serve_options,
        _serve,
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `vaswani-transformer` console script.

    See README.md, "Command line".

    Args:
        argv: the arguments after the program name; default: `sys.argv[1:]`.

    Returns:
        The exit status: 0; 141 (128 + SIGPIPE), quietly, when the reader of the output has gone; 130
        (128 + SIGINT) after one line saying how to resume, when Ctrl-C stops `train`; or
        2 after one line on stderr for an expected failure (a ValueError,
        OSError, MemoryError or BrokenExecutor, or the ImportError of an optional dependency not
        installed: a bad path or value, a full device, a missing extra, a worker of `--num-workers`
        killed). Invalid options exit with
        status 2 through argparse (SystemExit).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    # The top level takes no option but --help: the first other word names the command, the one parser to build.
    args = build_parser([word for word in argv if not word.startswith("-")][:1]).parse_args(argv)
    command = COMMANDS[args.command][2]
    try:
        command(args)
    except BrokenPipeError:
        # The reader of the output left (`translate ... | head`): stop quietly, as Unix tools do (128 + SIGPIPE),
        # with nothing left to flush into the closed pipe at exit.
        with contextlib.suppress(OSError, ValueError):  # a stdout with no descriptor (a test's) has none to close
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (ValueError, OSError, ImportError, MemoryError, BrokenExecutor) as error:
        # The package says which extra to install by chaining the ImportError it explains
        # (`raise ImportError(advice) from error`); any other ImportError is a bug, shown with its traceback.
        if isinstance(error, ImportError) and not isinstance(error.__cause__, ImportError):
            raise
        print(f"vaswani-transformer {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.command == "ablate":
            print("vaswani-transformer ablate: interrupted; run the same command again to go on (finished runs are "
                  "skipped, a stopped one resumes from its last checkpoint).", file=sys.stderr)  # fmt: skip
            return 130
        if args.command != "train":
            raise
        print(f"vaswani-transformer train: {_train_interrupted(args.output_dir)}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
