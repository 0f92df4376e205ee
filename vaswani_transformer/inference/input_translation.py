"""Translating a text file, an HTML document or stdin as it is read, as `vaswani-transformer translate` does."""

import contextlib
import logging
import re
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..data.corpora import iter_lines
from ..data.text_format import TranslatedText, file_format, split_text
from ..utils.files import ensure_writable
from ..utils.plotting import attention_maps, plot_attention, pyplot
from .alignment import aligner_for, format_alignment
from .confidence import SCORE_SEPARATOR, format_confidence
from .config import InferenceConfig
from .engines import Engine, load_engine, model_languages
from .glossary import Glossary
from .translation import translate_stream

logger = logging.getLogger(__name__)

# What `translate --alignments` writes between a translation and its alignment, as Marian's `--alignment` does.
ALIGNMENT_SEPARATOR = " ||| "
# The start of a line that reads as HTML: a doctype, or a tag of a common element.
_HTML_START = re.compile(
    r"\s*<(!doctype\s+html|html|head|body|p|div|span|a|b|i|em|strong|h[1-6]|ul|ol|li|table|tr|td|br|img|title|meta)"
    r"[\s/>]",
    re.IGNORECASE,
)


def translate_input(
    model: str,
    source: str = "-",
    config: InferenceConfig | None = None,
    *,
    write: Callable[[str], object],
    num_workers: int = 1,
    attention_dir: str | None = None,
    alignments: bool = False,
    glossary: str | Path | None = None,
    scores: bool = False,
) -> None:
    """Translate a file or stdin line by line (or an HTML document whole), handing each translation to `write`.

    Each line is split into sentences unless `config.split_sentences` is False; lines typed in a terminal are
    answered one by one (a batch of 1 unless `config.batch_size` says otherwise). Each translation keeps the line
    end its line came with (LF or CRLF; a last line without one gets the one before it, or LF); an HTML document
    keeps its own, its inline markup carried over by word alignment (`markup.py`). A file's sentences are counted
    first, for a progress bar (on stderr, in sentences, with the time left) that log records are written above,
    and that ends its line before an error propagates; stdin has none. Input read as text whose first line looks
    like HTML (stdin, or a file of no known suffix) gets one warning that names `--input-format html`. Every option
    is checked, and the attention directory proved writable, before the model loads.

    See README.md, "Command line", and docs/translating-documents.md.

    Args:
        model: a model directory or Hub id; its source language, where it says one, picks the segmenter's rules.
        source: a text file, an HTML document (.html, .htm, or `config.input_format="html"`), or "-" for stdin.
        config: engine, device, decoding, batches and input format; default `InferenceConfig()`.
        write: called with each translation and its line end, in the input's order, as soon as it is made
            (`translate` prints it as it is).
        num_workers: CPU processes translating batches side by side (`translation.map_in_workers`).
        attention_dir: also draw each non-blank line's encoder-decoder attention (last layer, every head, §3.2.3)
            as `attention_dir/sentence-N.png`, N its line number; the torch engine, text input only.
        alignments: write each line's word alignment after its translation, as Marian does: `translation ||| 0-0
            1-2 ...` (Pharaoh's source-target word pairs, from 0: `alignment.Aligner`); text input only.
        glossary: a TSV file of terms, source TAB target (`glossary.Glossary.read`), read before the model loads: a
            sentence that holds a source term gets its target term (constrained beam search); others translate
            byte for byte as without it.
        scores: write each line's confidence last, as Marian's n-best lists end with their score: `translation |||
            -0.2731` (after the alignment where there is one): the mean log-probability of its tokens over all
            its sentences, in nats (`confidence`); an empty field for a blank line. Text input only.

    Raises:
        ValueError: `attention_dir` with another engine, `attention_dir`, `alignments` or `scores` with an HTML
            document, `num_workers` above 1 reading a terminal, `glossary` with `config.num_beams` 1, a bad line of
            the glossary (named file:line), or from `translation.translate_stream`.
        OSError: `attention_dir` cannot be written, `source` or `glossary` cannot be read, or from
            `engines.load_engine`.
        ImportError: `attention_dir` without matplotlib (the `plot` extra).
    """
    config = config or InferenceConfig()
    guessed = config.input_format == "auto" and file_format(source) is None  # read as text for want of a suffix
    text_format = config.input_format if config.input_format != "auto" else file_format(source) or "text"
    interactive = source == "-" and sys.stdin.isatty()
    _check_options(config, text_format, num_workers, attention_dir, interactive, alignments, scores)
    if glossary is not None and config.num_beams == 1:
        raise ValueError("--glossary needs beam search (constrained, of at least 2 beams): drop --num-beams 1.")
    terms = Glossary.read(glossary) if glossary is not None else None
    ends: deque[str] = deque()
    lines = _read_input(source, text_format, ends)
    source_lang = _source_lang(model)
    if guessed:
        lines = _warned_if_html(lines, "stdin" if source == "-" else source)
    total = _count_sentences(source, text_format, source_lang, config.split_sentences) if source != "-" else None
    engine = load_engine(model, config)
    draw = _attention_drawer(engine, Path(attention_dir)) if attention_dir else None
    aligner = aligner_for(engine, model, config.device) if alignments or text_format == "html" else None
    sources: deque[str] = deque()
    with (
        logging_redirect_tqdm([logging.root, logging.getLogger("transformers")]),
        tqdm(total=total, unit="sent", desc="Translating", disable=source == "-") as progress,
    ):
        stream = translate_stream(
            engine,
            engine.tokenizer,
            _remembered(lines, sources),
            batch_size=config.batch_size_for(interactive),
            long_inputs=config.long_inputs,
            num_workers=num_workers,
            split_sentences=config.split_sentences,
            source_lang=source_lang,
            text_format=text_format,
            progress_bar=progress,
            aligner=aligner,
            alignments=alignments,
            glossary=terms,
            scores=scores,
        )
        _hand_over(stream, sources, ends, write, draw, alignments, scores)


def _hand_over(
    stream: Iterator[str] | Iterator[TranslatedText],
    sources: deque[str],
    ends: deque[str],
    write: Callable[[str], object],
    draw: Callable[[int, str, str], None] | None,
    alignments: bool,
    scores: bool,
) -> None:
    # Each translation, with its alignment and confidence where asked for and its line end, to `write`, then to the
    # attention maps.
    last_end = "\n"
    for number, translated in enumerate(stream, 1):
        text = translated if isinstance(translated, str) else translated.text
        shown = text
        if alignments:
            shown += ALIGNMENT_SEPARATOR + format_alignment(translated.alignment or [])
        if scores:
            shown += SCORE_SEPARATOR + format_confidence(translated.confidence)
        last_end = ends.popleft() or last_end
        write(shown + last_end)
        line = sources.popleft()
        if draw is not None and line.strip():
            draw(number, line, text)


def _check_options(
    config: InferenceConfig,
    text_format: str,
    num_workers: int,
    attention_dir: str | None,
    interactive: bool,
    alignments: bool,
    scores: bool,
) -> None:
    # What cannot work, refused before the model loads; the attention maps' directory and matplotlib, before any
    # line is translated rather than after the first.
    if attention_dir and config.engine != "torch":
        raise ValueError("--attention-dir draws the model's own attention weights: use it with --engine torch.")
    if attention_dir and text_format == "html":
        raise ValueError("--attention-dir draws each line's attention: translate an HTML document without it.")
    if alignments and text_format == "html":
        raise ValueError(
            "--alignments numbers the words of each line: translate an HTML document without it (its markup is "
            "carried over by alignment on its own)."
        )
    if scores and text_format == "html":
        raise ValueError(
            "--scores writes a confidence after each line: translate an HTML document without it (a document is "
            "written back as HTML)."
        )
    if attention_dir:
        ensure_writable(attention_dir)
        pyplot()
    if num_workers > 1 and interactive:
        raise ValueError(
            "--num-workers above 1 translates batches ahead, so a typed line would wait for the lines after it: "
            "use it with --input FILE or piped input, or leave it at 1 in a terminal."
        )


def _read_input(source: str, text_format: str, ends: deque[str]) -> Iterator[str]:
    # The texts to translate; each line's end ("\r\n", "\n", or "" for a last line without one) joins `ends` as the
    # line is read. A document is one text, read before the model loads (its markup spans its lines), its last line
    # end held back for the output.
    if source != "-":
        iter_lines(source)  # a missing file or a directory, refused at once in one line
    lines = iter_lines(_raw_lines(source, ends), name="stdin" if source == "-" else source)
    if text_format != "html":
        return lines
    read = list(lines)
    document = "".join(line + end for line, end in zip(read, ends, strict=True))
    last = ends[-1] if ends else ""
    ends.clear()
    ends.append(last)
    return iter([document.removesuffix(last)])


def _raw_lines(source: str, ends: deque[str]) -> Iterator[bytes]:
    # The input's lines as bytes, each one's line end recorded as it is read.
    with open(source, "rb") if source != "-" else contextlib.nullcontext(sys.stdin.buffer) as handle:
        for raw in handle:
            ends.append("\r\n" if raw.endswith(b"\r\n") else "\n" if raw.endswith(b"\n") else "")
            yield raw


def _count_sentences(source: str, text_format: str, language: str | None, split: bool) -> int | None:
    # The sentences of a file, for the progress bar: split as the translation splits them. A pipe (`<(...)`) cannot
    # be read twice.
    if not Path(source).is_file():
        return None
    try:
        if text_format == "html":
            return len(split_text("\n".join(iter_lines(source)), "html", language, split)[0])
        return sum(len(split_text(line, "text", language, split)[0]) for line in iter_lines(source))
    except ValueError:  # a line that is not UTF-8, or HTML the parser cannot read: refused in its place, later
        return None


def _warned_if_html(lines: Iterator[str], name: str) -> Iterator[str]:
    # The lines, with one warning where the first that is not blank reads as HTML.
    checked = False
    for line in lines:
        if not checked and line.strip():
            checked = True
            if _HTML_START.match(line):
                logger.warning(
                    f"{name} looks like HTML (it begins with {line.strip()[:30]!r}) and is translated as text, line "
                    "by line, tags and all; pass --input-format html to translate it as a document, its markup kept."
                )
        yield line


def _remembered(lines: Iterable[str], sources: deque[str]) -> Iterator[str]:
    # The lines, each kept in `sources` until its translation comes back (for its attention map).
    for line in lines:
        sources.append(line.rstrip("\n"))
        yield line


def _source_lang(model: str) -> str | None:
    # The source language picks the segmenter's rules (abbreviations, punctuation).
    try:
        return model_languages(model)[0]
    except ValueError:  # a model that does not say: English's rules
        return None


def _attention_drawer(engine: Engine, attention_dir: Path) -> Callable[[int, str, str], None]:
    # draw(number, source, translation): the encoder-decoder attention of the last layer, every head, as a PNG.
    model, tokenizer = engine.model, engine.tokenizer  # the torch engine, as `_check_options` made sure
    model.set_attn_implementation("eager")  # the only implementation that returns attention weights

    def draw(number: int, source: str, translation: str) -> None:
        output, source_tokens, target_tokens = attention_maps(model, tokenizer, source, translation)
        plot_attention(output, source_tokens, target_tokens, "cross", -1, attention_dir / f"sentence-{number}.png")

    return draw
