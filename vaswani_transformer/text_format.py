"""LibreTranslate's two text formats (`format` "text" and "html"): the sentences of a text, and its translation rebuilt.

The model translates sentences, one per line, as it was trained; `serving.py` calls `split_text`
for every text of a request and `rebuild` with the translations.
"""

import html
import re
from collections.abc import Callable
from html.parser import HTMLParser


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


def split_text(text: str, text_format: str) -> tuple[list[str], Callable[[list[str]], str]]:
    """The sentences to translate in one text, and the function that puts their translations back.

    Text: one sentence per line (the model translates sentences, as it was trained); line breaks
    are kept, a blank line stays blank. HTML: each text node, its whitespace collapsed; tags,
    attributes, comments, scripts and styles are kept as written.

    See docs/serving.md, "The API".

    Args:
        text: one text of `q`.
        text_format: "text" or "html".

    Returns:
        (sentences, rebuild), where `rebuild(translations)` gives the translated text.

    Raises:
        ValueError: HTML that Python's parser cannot read (some `<![` sections).
    """
    if text_format == "text":
        lines = re.split(r"\r?\n", text)
        return lines, "\n".join
    parser = _HTMLText()
    try:
        parser.feed(text)
        parser.close()
    except AssertionError as error:  # Python's parser asserts on some marked sections, e.g. "<![ x"
        raise ValueError(f"the HTML cannot be parsed ({error or 'an unreadable <![ section'})") from error
    if parser.rawdata:  # an unclosed script or style, which the parser holds back: code, kept as written
        parser.parts.append(parser.rawdata)
    sentences = [" ".join(node.split()) for node in parser.texts]

    def rebuild(translations: list[str]) -> str:
        out = []
        for part in parser.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            node = parser.texts[part]
            leading, trailing = node[: len(node) - len(node.lstrip())], node[len(node.rstrip()) :]
            out.append(leading + html.escape(translations[part], quote=False) + trailing)
        return "".join(out)

    return sentences, rebuild
