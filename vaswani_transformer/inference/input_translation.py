"""Translating a text file, an HTML document or stdin as it is read, as `vaswani-transformer translate` does."""

import logging
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..data.corpora import iter_lines
from ..data.text_format import file_format
from ..utils.files import ensure_writable
from ..utils.plotting import attention_maps, plot_attention, pyplot
from .config import InferenceConfig
from .engines import Engine, load_engine, model_languages
from .translation import translate_stream


def translate_input(
    model: str,
    source: str = "-",
    config: InferenceConfig | None = None,
    *,
    write: Callable[[str], object],
    num_workers: int = 1,
    attention_dir: str | None = None,
) -> None:
    """Translate a file or stdin line by line (or an HTML document whole), handing each translation to `write`.

    Each line is split into sentences unless `config.split_sentences` is False; lines typed in a terminal are
    answered one by one (a batch of 1 unless `config.batch_size` says otherwise). A file's lines are counted first,
    for a progress bar (on stderr, in sentences, with the time left) that log records are written above, and that
    ends its line before an error propagates; stdin has none. Every option is checked, and the attention directory
    proved writable, before the model loads.

    See README.md, "Command line".

    Args:
        model: a model directory or Hub id; its source language, where it says one, picks the segmenter's rules.
        source: a text file, an HTML document (.html, .htm, or `config.input_format="html"`), or "-" for stdin.
        config: engine, device, decoding, batches and input format; default `InferenceConfig()`.
        write: called with each translation, in the input's order, as soon as it is made (`translate` prints it).
        num_workers: CPU processes translating batches side by side (`translation.map_in_workers`).
        attention_dir: also draw each non-blank line's encoder-decoder attention (last layer, every head, §3.2.3)
            as `attention_dir/sentence-N.png`, N its line number; the torch engine, text input only.

    Raises:
        ValueError: `attention_dir` with another engine or an HTML document, `num_workers` above 1 reading a
            terminal, or from `translation.translate_stream`.
        OSError: `attention_dir` cannot be written, `source` cannot be read, or from `engines.load_engine`.
        ImportError: `attention_dir` without matplotlib (the `plot` extra).
    """
    config = config or InferenceConfig()
    text_format = config.input_format if config.input_format != "auto" else file_format(source) or "text"
    interactive = source == "-" and sys.stdin.isatty()
    _check_options(config, text_format, num_workers, attention_dir, interactive)
    lines, total = _read_input(source, text_format)
    engine = load_engine(model, config)
    draw = _attention_drawer(engine, Path(attention_dir)) if attention_dir else None
    sources: deque[str] = deque()
    stream = translate_stream(
        engine,
        engine.tokenizer,
        _remembered(lines, sources),
        batch_size=config.batch_size_for(interactive),
        long_inputs=config.long_inputs,
        num_workers=num_workers,
        split_sentences=config.split_sentences,
        source_lang=_source_lang(model),
        text_format=text_format,
    )
    _hand_over(stream, sources, write, draw, total=total, show_progress=source != "-")


def _hand_over(
    stream: Iterator[str],
    sources: deque[str],
    write: Callable[[str], object],
    draw: Callable[[int, str, str], None] | None,
    total: int | None,
    show_progress: bool,
) -> None:
    # Each translation to `write`, then to the progress bar and the attention maps. Log records are written above
    # the bar, and it ends its line before an error propagates.
    with (
        logging_redirect_tqdm([logging.root, logging.getLogger("transformers")]),
        tqdm(total=total, unit="sent", desc="Translating", disable=not show_progress) as progress,
    ):
        for number, translation in enumerate(stream, 1):
            write(translation)
            progress.update()
            line = sources.popleft()
            if draw is not None and line.strip():
                draw(number, line, translation)


def _check_options(
    config: InferenceConfig, text_format: str, num_workers: int, attention_dir: str | None, interactive: bool
) -> None:
    # What cannot work, refused before the model loads; the attention maps' directory and matplotlib, before any
    # line is translated rather than after the first.
    if attention_dir and config.engine != "torch":
        raise ValueError("--attention-dir draws the model's own attention weights: use it with --engine torch.")
    if attention_dir and text_format == "html":
        raise ValueError("--attention-dir draws each line's attention: translate an HTML document without it.")
    if attention_dir:
        ensure_writable(attention_dir)
        pyplot()
    if num_workers > 1 and interactive:
        raise ValueError(
            "--num-workers above 1 translates batches ahead, so a typed line would wait for the lines after it: "
            "use it with --input FILE or piped input, or leave it at 1 in a terminal."
        )


def _read_input(source: str, text_format: str) -> tuple[Iterator[str], int | None]:
    # The texts to translate, and how many there are where that is known before reading them.
    lines = iter_lines(sys.stdin.buffer if source == "-" else source)
    if text_format == "html":  # one text, read before the model loads: a document's markup spans its lines
        return iter(["\n".join(lines)]), 1
    if source != "-" and Path(source).is_file():  # a pipe (`<(...)`) cannot be read twice
        with open(source, "rb") as handle:
            return lines, sum(1 for _ in handle)  # lines as iter_lines counts them
    return lines, None


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
