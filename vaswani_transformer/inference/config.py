"""`InferenceConfig`: how a trained model translates, and the one place where each of those settings is defined.

`translate`, `evaluate` and `serve` share these options, generated from the fields (`cli.py`) as `train`'s are
from `TrainingConfig`: one name, one default and one help text each. `serve` adds only its own (`ServingConfig`).
The library's `translation.translate` and `engines.load_engine` take the same defaults from here, and every command
that computes (`train`, `serve` too) its default CPU thread count (`cpu_threads`).
"""

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..model.generation_vaswani import PAPER_LENGTH_PENALTY, PAPER_NUM_BEAMS, check_length_penalty, check_num_beams
from ..utils.options import option

# What translates: the model's generate(), or its CTranslate2 export.
ENGINES = ("torch", "ctranslate2")
# What to do with a sentence over the model's limit. Refusing comes first: a truncated sentence loses text.
# "split" cuts it at a clause or word boundary and translates the pieces (segmentation.fit_to_limit).
LONG_INPUTS = ("error", "truncate", "split")
# Whether `translate` and `serve` split a text into sentences (segmentation.split_sentences); `evaluate` never does.
SPLIT_SENTENCES = True
# What `translate --input` reads: an HTML document whole (its markup kept), or text line by line; "auto" by the
# file's suffix (text_format.file_format).
INPUT_FORMATS = ("auto", "text", "html")
# Sentences per generate() call where the caller does not say.
BATCH_SIZE = 64
ENGINE, DECODING = "engine", "decoding"  # the sections of --help
# What every command's --threads defaults to (`cpu_threads`), for its help.
DEFAULT_THREADS = "one per core this process may use, less one"


def cpu_threads(threads: int | None = None, processes: int = 1) -> int:
    """PyTorch's CPU threads for a command: `threads` where given, else `OMP_NUM_THREADS` where the environment sets
    it (as PyTorch itself reads it), else one per core this process may use, less one.

    The default of `translate`, `evaluate`, `train` and `serve --threads`. A parallel region waits for the last of
    its threads, so a thread that another process pushes off its core stalls every operator of the model: with one
    thread per core, a neighbour on a 2-core machine made `translate` 25x slower and `serve` answer 3 sentences a
    second where one thread answered 252 (docs/serving.md, "Threads"). The core left over keeps the neighbour off.

    Args:
        threads: the count asked for (`--threads`), or None for the default.
        processes: processes of this run on this machine that share its cores (`accelerate launch`'s local ones):
            the default is divided among them.

    Returns:
        At least 1.

    Raises:
        ValueError: `threads` below 1.
    """
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be at least 1, got {threads}.")
        return threads
    if (asked := os.environ.get("OMP_NUM_THREADS", "").strip()).isdigit() and int(asked) >= 1:
        return int(asked)
    # The cores the scheduler lets this process run on (a container's or `taskset`'s), not the machine's.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, (cores - 1) // max(1, processes))


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with PyTorch's intra-op CPU threads set to `threads` (`torch.set_num_threads`), then restore them.

    A command's run sets them where it starts; restoring them leaves a library caller's process as it was.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class InferenceConfig:
    """The engine, device, search and batches of `translate`, `evaluate` and `serve` (§6.1).

    Each field's meaning and unit is its `help` metadata, which `--help` prints. `num_beams` and
    `length_penalty` left at None decode as the model's generation config says.

    See docs/serving.md, "Engines".

    Raises:
        ValueError: an unknown `engine`, `long_inputs` or `input_format`, a beam size, batch size or thread count
            below 1, or a length penalty that is no finite number.
    """

    engine: str = option(
        ENGINES[0],
        help="torch: the model's generate(); ctranslate2: its CTranslate2 export (nearly always the same "
        "translations), made on first use (see --ctranslate2-dir)",
        group=ENGINE,
        choices=ENGINES,
    )
    ctranslate2_dir: str | None = option(
        None,
        help="where the CTranslate2 export lives (default: MODEL/ctranslate2; for a Hub id "
        "$HF_HOME/vaswani_transformer/ctranslate2/ORG--NAME--COMMIT)",
        group=ENGINE,
    )
    device: str | None = option(
        None,
        help="torch device, e.g. cpu or cuda:0 (default: cuda if available); the ctranslate2 engine takes cpu or "
        "cuda (default: cpu)",
        group=ENGINE,
    )
    threads: int | None = option(
        None,
        help=f"CPU threads of PyTorch's operators, and the ctranslate2 engine's intra_threads (default: "
        f"{DEFAULT_THREADS})",
        group=ENGINE,
    )
    num_beams: int | None = option(
        None, help=f"beam size (default: the model's generation config: {PAPER_NUM_BEAMS}, §6.1)", group=DECODING
    )
    length_penalty: float | None = option(
        None,
        help="beam search's length penalty alpha (§6.1) in the model's form, GNMT's ((5 + |Y|) / 6) ** alpha for "
        f"models trained here; none with --num-beams 1 (default: the model's generation config: "
        f"{PAPER_LENGTH_PENALTY}, or what `train --choose-length-penalty` chose on the validation set)",
        group=DECODING,
        metavar="ALPHA",
    )
    batch_size: int | None = option(
        None,
        help=f"sentences per generate() call (default: {BATCH_SIZE}; translate reading a terminal: 1, to answer "
        "each line at once)",
        group=DECODING,
    )
    long_inputs: str = option(
        LONG_INPUTS[0],
        help="a sentence longer than the model's limit (its tokenizer's model_max_length, in tokens): stop with an "
        "error naming it, truncate it with one warning, or split it at a clause or word boundary with one warning",
        group=DECODING,
        choices=LONG_INPUTS,
    )

    split_sentences: bool = option(
        SPLIT_SENTENCES,
        help="translate and serve split each line (and HTML block) into sentences, translate them and put the "
        "text back together; the flag translates each line whole, for one sentence per line (evaluate always does)",
        group=DECODING,
        flag="--no-split-sentences",
    )
    input_format: str = option(
        INPUT_FORMATS[0],
        help="what translate's --input holds: html, a document translated whole (its blocks' sentences across "
        "inline tags, the markup carried over by word alignment; tags, scripts and styles kept as written) and "
        "written back; text, lines translated one by one, layout kept; auto: html for a .html or .htm file, else text",
        group=DECODING,
        choices=INPUT_FORMATS,
    )

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}.")
        if self.long_inputs not in LONG_INPUTS:
            raise ValueError(f"--long-inputs must be one of {', '.join(LONG_INPUTS)}, got {self.long_inputs!r}.")
        if self.input_format not in INPUT_FORMATS:
            raise ValueError(f"--input-format must be one of {', '.join(INPUT_FORMATS)}, got {self.input_format!r}.")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1 sentence, got {self.batch_size}.")
        cpu_threads(self.threads)  # refuses a count below 1
        try:
            check_num_beams(self.num_beams)
            if self.length_penalty is not None:
                check_length_penalty(self.length_penalty)
        except ValueError as error:  # named as the command line names the setting
            raise ValueError(f"--{str(error).split(' ', 1)[0].replace('_', '-')}: {error}") from None

    def cpu_threads(self) -> int:
        """PyTorch's CPU threads for this run: `threads`, or one per core this process may use less one (`cpu_threads`).

        A `threads` below 1 never gets here: the config refuses it when it is made.
        """
        return cpu_threads(self.threads)

    def batch_size_for(self, interactive: bool = False) -> int:
        """Sentences per `generate()` call: `batch_size` where given, else 1 for lines typed in a terminal
        (`interactive`: each answered at once, not after the next 63), else `BATCH_SIZE`."""
        if self.batch_size is not None:
            return self.batch_size
        return 1 if interactive else BATCH_SIZE

    @property
    def generate_kwargs(self) -> dict:
        """The `generate()` arguments this config sets: `num_beams` and `length_penalty` where given."""
        chosen = {"num_beams": self.num_beams, "length_penalty": self.length_penalty}
        return {name: value for name, value in chosen.items() if value is not None}
