"""LibreTranslate's two text formats (`format` "text" and "html"): the sentences of a text, and its translation rebuilt.

The model translates sentences, one at a time, as it was trained; `serving.py` and `translation.py` call
`split_text` for every text and `rebuild` with the translations. A file's format is its suffix's (`file_format`).
"""

import html
import re
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import PurePath

from .segmentation import split_sentences

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


class _HTMLText(HTMLParser):
    """Splits HTML into markup, kept as written, and text nodes, to be translated (LibreTranslate's format="html")."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str | int] = []  # markup, or the index of a text node
        self.texts: list[str] = []
        self.in_code = False

    def handle_starttag(self, tag, attrs):
        self.parts.append(self.get_starttag_text())
        self.in_code = tag in self.CDATA_CONTENT_ELEMENTS

    def handle_startendtag(self, tag, attrs):
        self.parts.append(self.get_starttag_text())

    def parse_endtag(self, i):
        # `handle_endtag` is given the name lowercased, without what followed it: keep the markup as written.
        before = len(self.parts)
        end = super().parse_endtag(i)
        if end > i and len(self.parts) == before + 1 and isinstance(self.parts[-1], str):
            self.parts[-1] = self.rawdata[i:end]
        return end

    def handle_endtag(self, tag):
        self.parts.append(f"</{tag}>")
        self.in_code = False

    def handle_data(self, data):
        if self.in_code:  # script and style are code, kept as written (the parser did not unescape them)
            self.parts.append(data)
        elif self.parts and isinstance(self.parts[-1], int):  # the parser splits text at a bare "<": one node
            self.texts[-1] += data
        elif not data.strip():  # whitespace between tags is layout
            self.parts.append(data)
        else:
            self.parts.append(len(self.texts))
            self.texts.append(data)

    def handle_comment(self, data):
        self.parts.append(f"<!--{data}-->")

    def handle_decl(self, decl):
        self.parts.append(f"<!{decl}>")

    def handle_pi(self, data):
        self.parts.append(f"<?{data}>")

    def unknown_decl(self, data):  # a marked section: <![CDATA[...]]>, or e.g. <![if IE]>
        self.parts.append(f"<![{data}]]>" if data.startswith("CDATA[") else f"<![{data}]>")


def _line_sentences(line: str, language: str | None, split: bool) -> tuple[list[str], list[tuple[str, str]]]:
    # The sentences of a line (stripped) and the whitespace around each, which the rebuilt line keeps.
    pieces = split_sentences(line, language) if split else [line]
    sentences = [piece.strip() for piece in pieces]
    spaces = []
    for piece, sentence in zip(pieces, sentences, strict=True):
        lead = piece[: len(piece) - len(piece.lstrip())]
        spaces.append((lead, piece[len(lead) + len(sentence) :]) if sentence else (piece, ""))
    return sentences, spaces


def _glue(spaces: list[tuple[str, str]], translations: list[str], escape: Callable[[str], str]) -> str:
    pairs = zip(spaces, translations, strict=True)
    return "".join(lead + escape(translation) + trail for (lead, trail), translation in pairs)


def split_text(
    text: str, text_format: str, language: str | None = None, sentences: bool = True
) -> tuple[list[str], Callable[[list[str]], str]]:
    """The sentences to translate in one text, and the function that puts their translations back.

    Text: each line split into sentences (`segmentation.split_sentences`); line breaks and the spaces between
    sentences are kept, a blank line stays blank. HTML: each text node, its whitespace collapsed, split into
    sentences; tags, attributes, comments, scripts and styles are kept as written, and the translations are
    escaped (a translation never becomes markup).

    See docs/serving.md, "Sentences and paragraphs".

    Args:
        text: one text of `q`, or a file's.
        text_format: "text" or "html".
        language: ISO 639-1 code of the text, for the segmenter's rules; None for English's.
        sentences: False translates each line (or text node) whole, for one sentence per line.

    Returns:
        (sentences, rebuild), where `rebuild(translations)` gives the translated text; a blank sentence (whitespace
        of the layout) is "" and needs no translation.

    Raises:
        ValueError: HTML that Python's parser cannot read (some `<![` sections).
    """
    if text_format == "text":
        lines = [_line_sentences(line, language, sentences) for line in re.split(r"\r?\n", text)]
        found = [sentence for line_sentences, _ in lines for sentence in line_sentences]

        def rebuild_text(translations: list[str]) -> str:
            out, start = [], 0
            for line_sentences, spaces in lines:
                out.append(_glue(spaces, translations[start : start + len(line_sentences)], str))
                start += len(line_sentences)
            return "\n".join(out)

        return found, rebuild_text
    parser = _HTMLText()
    try:
        parser.feed(text)
        parser.close()
    except AssertionError as error:  # Python's parser asserts on some marked sections, e.g. "<![ x"
        raise ValueError(f"the HTML cannot be parsed ({error or 'an unreadable <![ section'})") from error
    if parser.rawdata:  # an unclosed script or style, which the parser holds back: code, kept as written
        parser.parts.append(parser.rawdata)
    nodes = [_line_sentences(" ".join(node.split()), language, sentences) for node in parser.texts]
    found = [sentence for node_sentences, _ in nodes for sentence in node_sentences]
    starts = [0]
    for node_sentences, _ in nodes:
        starts.append(starts[-1] + len(node_sentences))

    def escape(translation: str) -> str:
        return html.escape(translation, quote=False)

    def rebuild(translations: list[str]) -> str:
        out = []
        for part in parser.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            node = parser.texts[part]
            leading, trailing = node[: len(node) - len(node.lstrip())], node[len(node.rstrip()) :]
            glued = _glue(nodes[part][1], translations[starts[part] : starts[part + 1]], escape)
            out.append(leading + glued.strip() + trailing)
        return "".join(out)

    return found, rebuild
