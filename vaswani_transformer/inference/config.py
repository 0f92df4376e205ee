"""`InferenceConfig`: how a trained model translates, and the one place where each of those settings is defined.

`translate`, `evaluate` and `serve` share these options, generated from the fields (`cli.py`) as `train`'s are
from `TrainingConfig`: one name, one default and one help text each. `serve` adds only its own (`ServingConfig`).
The library's `translation.translate` and `engines.load_engine` take the same defaults from here.
"""

from dataclasses import dataclass

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


@dataclass(frozen=True)
class InferenceConfig:
    """The engine, device, search and batches of `translate`, `evaluate` and `serve` (§6.1).

    Each field's meaning and unit is its `help` metadata, which `--help` prints. `num_beams` and
    `length_penalty` left at None decode as the model's generation config says.

    See docs/serving.md, "Engines".

    Raises:
        ValueError: an unknown `engine`, `long_inputs` or `input_format`, a beam size or batch size below 1, or a
            length penalty that is no finite number.
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
        help="translate and serve split each line (and HTML text node) into sentences, translate them and put the "
        "text back together; the flag translates each line whole, for one sentence per line (evaluate always does)",
        group=DECODING,
        flag="--no-split-sentences",
    )
    input_format: str = option(
        INPUT_FORMATS[0],
        help="what translate's --input holds: html, a document translated whole (its text nodes, sentence by "
        "sentence; tags, scripts and styles kept as written) and written back; text, lines translated one by one, "
        "layout kept; auto: html for a .html or .htm file, else text",
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
        try:
            check_num_beams(self.num_beams)
            if self.length_penalty is not None:
                check_length_penalty(self.length_penalty)
        except ValueError as error:  # named as the command line names the setting
            raise ValueError(f"--{str(error).split(' ', 1)[0].replace('_', '-')}: {error}") from None

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
