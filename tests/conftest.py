"""Shared fixtures: the Multi30k corpus from ../shared, a tokenizer trained on it, and one small trained model."""

import atexit
import importlib.util
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# PyTorch's own kernels, as a user gets them: the opt-in oneDNN products are tested where they are asked for
# (tests/inference/test_cpu_kernels.py).
os.environ.pop("VASWANI_ONEDNN_MIN_PRODUCT", None)
# Remote code goes to a modules cache of each pytest process's own (its subprocesses inherit it), not the user's:
# models saved into directories of one name by concurrent runs (both ends of scripts/test.sh, the xdist workers)
# would write one module at once.
os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="hf-modules-")
atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], ignore_errors=True)
# So do prepared corpora and the datasets they come from (training.corpus): not the user's cache, and shared by
# the tests of one process and the `train` commands they start.
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="hf-datasets-")
atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)
# Under pytest-xdist (scripts/test.sh runs a worker per core) each worker, and each process it starts,
# computes on one thread: an OpenMP region of two threads waits on a core the other worker holds, and spins.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import vaswani_transformer  # noqa: E402, F401  (registers the Auto classes)
from vaswani_transformer import VaswaniConfig, VaswaniForConditionalGeneration  # noqa: E402
from vaswani_transformer.data.corpora import corpus_fingerprint, load_parallel_corpus, text_batches  # noqa: E402
from vaswani_transformer.data.tokenizer import train_tokenizer  # noqa: E402
from vaswani_transformer.inference.engines import Engine  # noqa: E402
from vaswani_transformer.inference.translation import can_fork_workers  # noqa: E402
from vaswani_transformer.training.config import TrainingConfig  # noqa: E402
from vaswani_transformer.training.corpus import prepare_corpus  # noqa: E402

REPOSITORY = Path(__file__).resolve().parents[1]
# The mini model and corpus of the fault campaign (scripts/fault_campaign.py), for training tests that take seconds;
# loaded by its path, so that scripts/ does not join the import path of the whole session.
_spec = importlib.util.spec_from_file_location("fault_campaign", REPOSITORY / "scripts" / "fault_campaign.py")
fault_campaign = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fault_campaign)
MINI_MODEL, make_corpus = fault_campaign.MINI_MODEL, fault_campaign.make_corpus


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A run ends with its longest test: the heavy ones go first, and pytest-xdist's first round hands them out in
    # turn, so that no worker starts one when the others are done. They take session fixtures only: moving a test
    # out of its module would set that module's fixtures up twice. Those that need the trained model alternate with
    # those that do not, so that one worker trains it while the other computes instead of waiting for it.
    heavy = [item for item in items if item.get_closest_marker("heavy")]
    needs = [item for item in heavy if "trained_model_dir" in item.fixturenames]
    free = [item for item in heavy if "trained_model_dir" not in item.fixturenames]
    alternated = [item for pair in itertools.zip_longest(free, needs) for item in pair if item is not None]
    items[:] = alternated + [item for item in items if not item.get_closest_marker("heavy")]


def _multi30k_candidates() -> list[Path]:
    # $MULTI30K_DIR; else shared/ beside the repository; else, for a clone of a local checkout (a CI job's clean
    # clone elsewhere), shared/ beside the checkout it was cloned from. The corpus is read in place, never copied.
    candidates = [Path(os.environ["MULTI30K_DIR"])] if os.environ.get("MULTI30K_DIR") else []
    candidates.append(REPOSITORY.parent / "shared" / "data" / "multi30k")
    origin = subprocess.run(
        ["git", "config", "--get", "remote.origin.url"], cwd=REPOSITORY, capture_output=True, text=True
    ).stdout.strip()
    if origin and Path(origin).is_dir():
        candidates.append(Path(origin).resolve().parent / "shared" / "data" / "multi30k")
    return candidates


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    candidates = _multi30k_candidates()
    found = next((path for path in candidates if (path / "train.en").is_file()), None)
    if found is None:
        pytest.fail(
            f"The Multi30k corpus is expected in one of {', '.join(map(str, candidates))} (the shared/ folder beside "
            "the repository); set MULTI30K_DIR to its directory."
        )
    return found


@pytest.fixture(scope="session")
def corpus(multi30k_dir):
    return load_parallel_corpus(multi30k_dir, "en", "de")


@pytest.fixture(scope="session")
def tokenizer(corpus):
    return train_tokenizer(text_batches(corpus["train"], ["en", "de"]), vocab_size=2000)


@pytest.fixture(scope="session")
def prepared(multi30k_dir, tokenizer):
    """Multi30k prepared with the `tokenizer` fixture as `train` prepares it, keeping its default max_length."""
    config = TrainingConfig(data=str(multi30k_dir), source_lang="en", target_lang="de", output_dir="", max_steps=1)
    return prepare_corpus(config, tokenizer, corpus_fingerprint(multi30k_dir, "en", "de"))


@pytest.fixture(scope="session")
def test_sentences(corpus):
    """Eight real English test sentences and their German references."""
    test = corpus["test_2016_flickr"].select(range(8))
    return test["en"], test["de"]


def random_model(tokenizer=None, seed: int = 0, **overrides) -> VaswaniForConditionalGeneration:
    """A randomly initialised 2+2-layer model, in eval mode, small enough for exact CPU tests."""
    torch.manual_seed(seed)
    options = dict(d_model=32, d_ff=64, encoder_layers=2, decoder_layers=2, num_attention_heads=4)
    options["vocab_size"] = len(tokenizer) if tokenizer is not None else 100
    config = VaswaniConfig(**{**options, **overrides})
    return VaswaniForConditionalGeneration(config).eval()


def seq2seq_batch(tokenizer, sources, targets):
    """Padded source ids, attention mask and labels, -100 on the labels' padding (as the loss expects)."""
    encoded = tokenizer(list(sources), text_target=list(targets), padding=True, return_tensors="pt")
    encoded["labels"] = encoded["labels"].masked_fill(encoded["labels"] == tokenizer.pad_token_id, -100)
    return encoded


@pytest.fixture(scope="session")
def trained_model_dir(tmp_path_factory, multi30k_dir) -> Path:
    """A small model trained for 150 steps on Multi30k through the command line, saved with its tokenizer.

    Trained once per run: under pytest-xdist the first worker to ask trains it, and the others wait for it; with
    $VASWANI_TEST_SHARED_DIR (scripts/test.sh sets it for both ends), once for the runs that share that directory.
    """
    from filelock import FileLock

    from vaswani_transformer.cli import main

    # The run's directory holds every worker's own; without xdist the session's directory is the run's.
    shared = tmp_path_factory.getbasetemp().parent if XDIST_WORKER else tmp_path_factory.getbasetemp()
    shared = Path(os.environ.get("VASWANI_TEST_SHARED_DIR", shared))
    output_dir, done = shared / "trained", shared / "trained.done"
    with FileLock(shared / "trained.lock"):
        if not done.exists():
            shutil.rmtree(output_dir, ignore_errors=True)  # a worker that failed to train left it half-written
            status = main(
                [
                    "train", "--data-dir", str(multi30k_dir), "--source-lang", "en", "--target-lang", "de",
                    "--output-dir", str(output_dir), "--preset", "small",
                    "--model-option", "d_model=64", "--model-option", "d_ff=256",
                    "--model-option", "num_attention_heads=4",
                    "--model-option", "encoder_layers=2", "--model-option", "decoder_layers=2",
                    "--vocab-size", "2000", "--max-tokens", "2048", "--warmup-steps", "50",
                    "--learning-rate-scale", "0.2",
                    "--max-steps", "150", "--eval-steps", "50", "--save-steps", "50", "--average-last", "2",
                ]
            )  # fmt: skip
            assert status == 0
            done.touch()
    return output_dir


def read_log(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "training_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def mini_corpus(multi30k_dir, tmp_path_factory) -> Path:
    """The first 400 training and 100 validation pairs of Multi30k."""
    return make_corpus(multi30k_dir, tmp_path_factory.mktemp("mini"), 400)


def mini_run(corpus: Path, output_dir: Path, **overrides) -> TrainingConfig:
    settings = dict(
        data=str(corpus), source_lang="en", target_lang="de", output_dir=str(output_dir), model_overrides=MINI_MODEL,
        vocab_size=300, max_tokens=256, warmup_steps=4, max_steps=12, log_steps=1, eval_steps=6, save_steps=3,
        average_last=2,
    )  # fmt: skip
    return TrainingConfig(**{**settings, **overrides})


class Exploit:
    """Unpickling this runs `touch MARKER`: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def free_port() -> int:
    """A TCP port free on this machine now, for the processes of an `accelerate launch` to meet on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cli_arguments(config: TrainingConfig) -> list[str]:
    """`vaswani-transformer train` arguments for `config` (corpus: a `data` directory), generated from its fields.

    The required options and every option whose value differs from its default, under the flag that
    `cli.build_parser` gives the field.
    """
    from dataclasses import MISSING, fields

    arguments = ["train", "--data-dir", config.data]
    for option in fields(TrainingConfig):
        value = getattr(config, option.name)
        default = option.default_factory() if option.default_factory is not MISSING else option.default
        if "help" not in option.metadata or value == default:  # no help: `data` and `files`, the corpus
            continue
        flag = option.metadata.get("flag", "--" + option.name.replace("_", "-"))
        if isinstance(value, dict):  # KEY=VALUE, the value as JSON (the option reads it so)
            arguments += [item for key, v in value.items() for item in (flag, f"{key}={json.dumps(v)}")]
        elif isinstance(value, list) and "nargs" in option.metadata:  # one flag, then the values
            arguments += [flag, *map(str, value)]
        elif isinstance(value, list):
            arguments += [item for v in value for item in (flag, str(v))]
        else:
            arguments += [flag] if value is True else [flag, str(value)]
    return arguments


def run_without_package(code: str, *args: str, cwd: Path, python: str = sys.executable) -> subprocess.CompletedProcess:
    """Run `code` under `python` with its environment's libraries but not this package, as a Hub user runs a model.

    `-S` skips site-packages' path files, the editable install's hook among them; the site-packages directory
    itself joins the path as a plain entry. `cwd` must not hold the package (the script's directory joins the path).
    """
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    code = 'import importlib.util\nassert importlib.util.find_spec("vaswani_transformer") is None\n' + code
    return subprocess.run(
        [python, "-S", "-c", code, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL, cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": purelib},
    )  # fmt: skip


_LOAD_EACH = """
import json, sys
from transformers import AutoModelForSeq2SeqLM
refusals = []
for path in sys.argv[1:]:
    try:
        AutoModelForSeq2SeqLM.from_pretrained(path, trust_remote_code=True)
        refusals.append(None)
    except ValueError as error:
        refusals.append(str(error))
print(json.dumps(refusals))
"""


def load_each_without_package(directories: list[Path], cwd: Path) -> tuple[list[str | None], str]:
    """Load each saved model through its own code (no package): the `ValueError` message of each, or None; stderr."""
    result = run_without_package(_LOAD_EACH, *map(str, directories), cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


# Worker processes (`translation.map_in_workers`) are forked: Linux and other Unixes.
needs_fork = pytest.mark.skipif(not can_fork_workers(), reason="worker processes are forked: Linux and other Unixes")


def tag_with_process(monkeypatch) -> None:
    """Make every batch's translations say which process translated them ("PID|translation")."""
    translate = Engine.translate

    def tagged(self, texts, glossary=None):
        return [f"{os.getpid()}|{t}" for t in translate(self, texts, glossary)]

    monkeypatch.setattr(Engine, "translate", tagged)


def one_line_error(status: int, err: str, expected_status: int = 2) -> str:
    """The one error line of a `train` run that stopped with `expected_status`, after whatever progress bars it drew."""
    assert status == expected_status and "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("vaswani-transformer train:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]
