"""LibreTranslate's two text formats (`format` "text" and "html"): the sentences of a text, and its translation rebuilt.

The model translates sentences, one at a time, as it was trained; `serving.py` and `translation.py` call
`split_text` for every text and `rebuild` with the translations (and, for HTML, their word alignments, which carry
its inline markup: `markup.py`). A file's format is its suffix's (`file_format`).
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePath

from .markup import split_html
from .segmentation import Alignment, Pieces, split_sentences, text_alignment

# LibreTranslate's `format`s: plain text, and HTML whose text nodes are translated.
TEXT_FORMATS = ("text", "html")
# The files translated whole, by suffix (lowercase), and the format of their text: LibreTranslate's .txt and .html
# (`supportedFilesFormat`), and .htm, the same format under its older name.
FILE_FORMATS = {".txt": "text", ".html": "html", ".htm": "html"}


def file_format(name: str) -> str | None:
    """The format ("text" or "html") of a file named `name`, by its suffix in any case (`FILE_FORMATS`); None for
    another suffix or none (`translate` reads such a file as text, line by line; `serve` refuses it).

    See docs/serving.md, "Files".
    """
    return FILE_FORMATS.get(PurePath(name).suffix.lower())


def _line_sentences(line: str, language: str | None, split: bool) -> tuple[list[str], list[tuple[str, str]]]:
    # The sentences of a line (stripped) and the whitespace around each, which the rebuilt line keeps.
    pieces = split_sentences(line, language) if split else [line]
    sentences = [piece.strip() for piece in pieces]
    spaces = []
    for piece, sentence in zip(pieces, sentences, strict=True):
        lead = piece[: len(piece) - len(piece.lstrip())]
        spaces.append((lead, piece[len(lead) + len(sentence) :]) if sentence else (piece, ""))
    return sentences, spaces


def _glue(spaces: list[tuple[str, str]], translations: list[str]) -> str:
    pairs = zip(spaces, translations, strict=True)
    return "".join(lead + translation + trail for (lead, trail), translation in pairs)


# rebuild(translations, alignments=None): the translated text (`split_text`).
Rebuild = Callable[..., str]


def split_text(
    text: str, text_format: str, language: str | None = None, sentences: bool = True
) -> tuple[list[str], Rebuild]:
    """The sentences to translate in one text, and the function that puts their translations back.

    Text: each line split into sentences (`segmentation.split_sentences`); line breaks as they came (LF or CRLF),
    the spaces between sentences kept, a blank line stays blank. HTML: each block's text, across its inline tags,
    split into sentences, and the markup carried over to the translations by their word alignments
    (`markup.split_html`); tags, attributes, comments, scripts and styles are kept as written, and the translations
    are escaped (a translation never becomes markup).

    See docs/serving.md, "Sentences and paragraphs", and docs/translating-documents.md.

    Args:
        text: one text of `q`, or a file's.
        text_format: "text" or "html".
        language: ISO 639-1 code of the text, for the segmenter's rules; None for English's.
        sentences: False translates each line (or block of HTML) whole, for one sentence per line.

    Returns:
        (sentences, rebuild), where `rebuild(translations, alignments=None)` gives the translated text, from one
        translation per sentence and (for HTML, where they place the inline markup) one word alignment per sentence
        or None; a blank sentence (whitespace of the layout) is "" and needs no translation.

    Raises:
        ValueError: HTML that Python's parser cannot read (some `<![` sections).
    """
    if text_format == "html":
        return split_html(text, language, sentences)
    # Line ends kept: the pieces at odd indices are the line breaks, as written.
    pieces = re.split(r"(\r?\n)", text)
    lines = [_line_sentences(line, language, sentences) for line in pieces[::2]]
    found = [sentence for line_sentences, _ in lines for sentence in line_sentences]

    def rebuild_text(translations: list[str], alignments: list[Alignment | None] | None = None) -> str:
        out, start = [], 0
        for k, (line_sentences, spaces) in enumerate(lines):
            out.append(_glue(spaces, translations[start : start + len(line_sentences)]))
            out.append(pieces[2 * k + 1] if 2 * k + 1 < len(pieces) else "")
            start += len(line_sentences)
        return "".join(out)

    return found, rebuild_text


@dataclass(frozen=True)
class TranslatedText:
    """One text's translation, `text`, and what was asked for beside it (`translation.translate(..., alignments=True)`):
    its `alignment` to the source, (source word, target word) pairs over the whole text's `segmentation.word_spans`."""

    text: str
    alignment: Alignment | None = None


@dataclass(frozen=True)
class Prepared:
    """Texts ready to translate: their sentences (`split_text`) cut to the model's limit (`pieces`), and how the
    pieces' translations become the texts' (`finish`).

    Attributes:
        pieces: what the engine translates (`segmentation.fit_to_limit`).
        sentences: how many sentences each text holds.
        rebuilds: each text's `rebuild`.
        found: the sentences, in order.
    """

    pieces: Pieces
    sentences: list[int]
    rebuilds: list[Rebuild]
    found: list[str]

    def finish(self, translations: list[str], alignments: list[Alignment] | None = None) -> list[TranslatedText]:
        """One translated text per text, from one translation per piece and, where given, one word alignment per
        piece (HTML's markup takes its sentences'; a text's is theirs laid end to end: `text_alignment`)."""
        total = sum(self.sentences)
        per_sentence = self.pieces.join(translations, total)
        aligned = self.pieces.join_alignments(alignments, translations, total) if alignments is not None else None
        texts, start = [], 0
        for count, rebuild in zip(self.sentences, self.rebuilds, strict=True):
            done = per_sentence[start : start + count]
            pairs = aligned[start : start + count] if aligned is not None else None
            whole = None if pairs is None else text_alignment(self.found[start : start + count], done, pairs)
            texts.append(TranslatedText(rebuild(done, pairs), whole))
            start += count
        return texts
