"""HTML translated sentence by sentence, its inline markup carried over to the translation by word alignment.

A block element (`p`, `li`, `td`, `h1`-`h6`, `div`, ...) holds a run of text whose sentences may cross inline tags
(`b`, `i`, `a`, `span`, unknown ones, ...). `split_html` gives the block's text as plain sentences, each translated
once; `rebuild` puts each inline element back around the target words aligned to the source words it held (the
alignment comes from the translator: `inference/alignment.py`), as Firefox Translations (Bergamot) and DeepL carry
markup. By construction every tag comes back once, balanced, as written:

- elements are placed top-down, each within its parent's target words and apart from its siblings' (the tree of the
  source, so the output nests as the source did); where the aligned words of an element conflict with a sibling's,
  it keeps its largest free run, and where none is left it comes back empty at the place its start maps to;
- markup without words of its own is a point between two words, put after the target word aligned to the source
  word before it: `<br>`, `<img>`, comments, elements around whitespace, and the elements kept as written;
- `<code>`, `<kbd>`, `<samp>`, `<var>` and elements with `translate="no"` or `class="notranslate"` are kept as
  written, content and all, and are left out of the sentence the model translates;
- `<pre>` keeps its lines and each line's leading and trailing whitespace; scripts and styles are kept as written;
- whitespace written as a reference (`&nbsp;`, `&#160;`) or as a character other than ASCII whitespace stays as
  written, in the target gap its source gap maps to.

See docs/translating-documents.md.
"""

import copy
import html
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser

from .segmentation import Alignment, split_sentences, word_spans

# Elements that begin or end a block of text (sentences never cross them): HTML's block-level and table elements,
# and those whose text is not part of the running text (title, options, form controls).
BLOCK_ELEMENTS = frozenset(
    "address article aside blockquote body button caption center colgroup dd details dialog dir div dl dt fieldset "
    "figcaption figure footer form frameset h1 h2 h3 h4 h5 h6 head header hgroup hr html iframe legend li main menu "
    "nav noscript ol optgroup option p pre section select summary table tbody td template textarea tfoot th thead "
    "title tr ul".split()
)
# Inline elements whose content is kept as written: computer code and its input, output and variables (HTML's
# "phrasing content" for code), as translators skip them.
KEPT_ELEMENTS = frozenset({"code", "kbd", "samp", "var"})
# Elements without content or end tag (HTML's void elements).
_VOID_ELEMENTS = frozenset("area base br col embed hr img input link meta param source track wbr".split())
# A character reference, as written (HTML's named references may lack the semicolon).
_REFERENCE = re.compile(r"&(?:#[0-9]+|#[xX][0-9a-fA-F]+|[A-Za-z][A-Za-z0-9]*);?")
_ASCII_SPACE = frozenset(" \t\n\r\f")
# Punctuation that takes no space before it: a point of markup before one gets none after it either.
_CLOSING = frozenset(",.;:!?)]}\u00bb\u201c\u201d\u2026")
_RUN = re.compile(r"\s+|\S+")


def is_kept(name: str, attrs: Sequence[tuple[str, str | None]]) -> bool:
    """Whether an element is kept as written, content and all: `KEPT_ELEMENTS`, `translate="no"` (HTML's
    `translate` attribute) or the class `notranslate` (Google's and DeepL's convention)."""
    values = {key: (value or "") for key, value in attrs}
    return (
        name in KEPT_ELEMENTS
        or values.get("translate", "").strip().lower() == "no"
        or "notranslate" in values.get("class", "").split()
    )


@dataclass
class _Event:
    # One construct of the document as the parser reported it, with its place in the text.
    kind: str  # "start", "startend", "end", "data", "other" (comment, declaration, processing instruction)
    start: int
    name: str = ""
    attrs: list = field(default_factory=list)
    data: str = ""  # "data": the text, references decoded
    tag: str = ""  # "start": the start tag as written
    raw: str = ""


class _Events(HTMLParser):
    """The constructs of an HTML document in order, each with its offset (for its text as written)."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.events: list[_Event] = []
        self.line_starts = [0] + [i + 1 for i, char in enumerate(text) if char == "\n"]

    def _add(self, kind: str, **fields) -> None:
        line, offset = self.getpos()
        self.events.append(_Event(kind, self.line_starts[line - 1] + offset, **fields))

    def handle_starttag(self, tag, attrs):
        self._add("start", name=tag, attrs=attrs, tag=self.get_starttag_text())

    def handle_startendtag(self, tag, attrs):
        self._add("startend", name=tag, attrs=attrs)

    def handle_endtag(self, tag):
        self._add("end", name=tag)

    def handle_data(self, data):
        self._add("data", data=data)

    def _other(self, data):
        self._add("other")

    # Comments, declarations, processing instructions, marked sections (<![CDATA[...]]>, <![if IE]>): as written.
    handle_comment = handle_decl = handle_pi = unknown_decl = _other


def _events(text: str) -> list[_Event]:
    # The document's constructs, each with its text as written: together they are the whole text.
    parser = _Events(text)
    try:
        parser.feed(text)
        parser.close()
    except AssertionError as error:  # Python's parser asserts on some marked sections, e.g. "<![ x"
        raise ValueError(f"the HTML cannot be parsed ({error or 'an unreadable <![ section'})") from error
    events = parser.events
    if not events or events[0].start > 0:  # what the parser skipped at the start (e.g. "</>"), kept as written
        events.insert(0, _Event("verbatim", 0))
    out = []
    for event, end in zip(events, [e.start for e in events[1:]] + [len(text)], strict=True):
        event.raw = text[event.start : end]
        if event.kind == "start" and len(event.raw) > len(event.tag):
            # An unclosed script or style, which the parser holds back: code, kept as written.
            out += [event, _Event("verbatim", event.start + len(event.tag), raw=event.raw[len(event.tag) :])]
            event.raw = event.tag
        else:
            out.append(event)
    return out


@dataclass
class _Item:
    # A piece of a block: text, an inline tag, or markup that is a point of the text.
    kind: str  # "text", "start", "end", "point", "break" (a <br>: a point that separates words)
    raw: str
    text: str = ""  # "text": the characters, references decoded
    reference: bool = False  # "text": one character reference


def _atoms(raw: str, data: str) -> list[_Item]:
    # A text as written, cut into character references and the text between them, each with its characters.
    # Literal text in runs of whitespace and of other characters, so that a block's edges are whitespace of its own.
    atoms, end = [], 0
    for match in _REFERENCE.finditer(raw):
        atoms += [_Item("text", run, run) for run in _RUN.findall(raw[end : match.start()])]
        atoms.append(_Item("text", match.group(), html.unescape(match.group()), reference=True))
        end = match.end()
    atoms += [_Item("text", run, run) for run in _RUN.findall(raw[end:])]
    if "".join(atom.text for atom in atoms) != data:  # the parser read it otherwise: one piece, as it read it
        return [_Item("text", raw, data)]
    return atoms


def _blocks(events: list[_Event]) -> list[str | list[_Item]]:
    # The document as markup kept as written (str) and blocks of inline content (lists of items).
    parts: list[str | list[_Item]] = [[]]
    pre = 0  # <pre> elements open
    verbatim = False  # in a script or style (HTMLParser.CDATA_CONTENT_ELEMENTS)
    kept = ""  # the element kept as written that is open, if one is
    kept_depth = 0  # elements of its name open, itself included
    kept_raw: list[str] = []  # what it holds, as written
    kept_block = False

    def boundary(raw: str) -> None:
        if isinstance(parts[-1], str):
            parts[-1] += raw
        else:
            parts.append(raw)

    def item(new: _Item) -> None:
        if isinstance(parts[-1], str):
            parts.append([])
        parts[-1].append(new)

    def close_kept() -> str:
        raw = "".join(kept_raw)
        boundary(raw) if kept_block else item(_Item("point", raw))
        kept_raw.clear()
        return ""

    for event in events:
        name, block = event.name, event.name in BLOCK_ELEMENTS
        if kept:
            if not kept_block and event.kind in ("start", "end", "startend") and block:
                kept = close_kept()  # an inline element kept ends with its block at the latest
            else:
                kept_raw.append(event.raw)
                if event.kind == "start" and name == kept:
                    kept_depth += 1
                elif event.kind == "end" and name == kept:
                    kept_depth -= 1
                    kept = close_kept() if not kept_depth else kept
                continue
        if event.kind == "start" and is_kept(name, event.attrs) and name not in _VOID_ELEMENTS:
            kept, kept_depth, kept_raw[:], kept_block = name, 1, [event.raw], block
            continue
        if event.kind in ("start", "end") and name in HTMLParser.CDATA_CONTENT_ELEMENTS:
            verbatim = event.kind == "start"
            boundary(event.raw)
        elif event.kind == "verbatim" or verbatim:  # a script's or style's code
            boundary(event.raw)
        elif event.kind == "other":
            item(_Item("point", event.raw))
        elif event.kind in ("start", "end") and block:
            if name == "pre":
                pre = pre + 1 if event.kind == "start" else max(pre - 1, 0)
            boundary(event.raw)
        elif event.kind == "startend" or name in _VOID_ELEMENTS:
            if block:
                boundary(event.raw)
            else:
                item(_Item("break" if name == "br" else "point", event.raw))
        elif event.kind in ("start", "end"):
            item(_Item(event.kind, event.raw))
        elif pre:  # in <pre> a line is a block of its own
            for k, line in enumerate(event.raw.split("\n")):
                if k:
                    boundary("\n")
                for atom in _atoms(line, html.unescape(line)):
                    item(atom)
        else:  # text
            for atom in _atoms(event.raw, event.data):
                item(atom)
    if kept:
        close_kept()
    return [part for part in parts if part]


@dataclass
class _Node:
    # An inline element (or the block itself, or a point of markup), its place in the source text and then in the
    # target's, and what it holds.
    start: str
    end: str = ""
    order: int = 0  # its first item's index: the source's order, for ties
    last: int = 0  # its last item's index
    at: int = 0  # its place in the block's text as a point: before the whitespace that precedes it
    source: list[int] = field(default_factory=lambda: [0, 0])  # [start, end) in the block's text
    children: list["_Node"] = field(default_factory=list)
    point: bool = False
    replaces_space: bool = False  # whitespace as written: it takes the place of the target's at its point
    space_before: bool = False
    space_after: bool = False
    target: list[int] = field(default_factory=lambda: [0, 0])


@dataclass
class _Block:
    # One block's text (what the model reads, whitespace collapsed), its markup as a tree, and its layout.
    items: list[_Item]
    lead: str = ""
    trail: str = ""
    text: str = ""
    root: _Node = field(default_factory=lambda: _Node(""))


def _block(items: list[_Item]) -> _Block:
    # The block's text and the tree of its inline markup; whitespace at its edges kept as written.
    first = next((k for k, it in enumerate(items) if it.kind != "text" or it.text.strip()), len(items))
    last = next((k for k in range(len(items) - 1, -1, -1) if items[k].kind != "text" or items[k].text.strip()), -1)
    block = _Block(items[first : last + 1], "".join(it.raw for it in items[:first]))
    block.trail = "".join(it.raw for it in items[last + 1 :]) if last >= first else ""
    items = block.items
    # Start and end tags that match, by a stack; the others are points, as written.
    matched: dict[int, int] = {}
    stack: list[int] = []
    for k, it in enumerate(items):
        if it.kind == "start":
            stack.append(k)
        elif it.kind == "end" and stack and _tag_name(items[stack[-1]].raw) == _tag_name(it.raw):
            matched[stack.pop()] = k
    text: list[str] = []
    length = 0
    nodes = [block.root]
    pending: list | None = None  # whitespace not yet written: [raw, special, parent, first item]
    waiting: list[_Node] = []  # points that wait to learn whether whitespace follows them

    for k, it in enumerate(items):
        if it.kind == "text":
            runs = [(it.raw, it.text)] if it.reference else [(run, run) for run in _RUN.findall(it.text)]
            for raw, chars in runs:
                if chars.isspace():
                    for node in waiting:
                        node.space_after = True
                    waiting.clear()
                    if pending is None:
                        pending = ["", False, nodes[-1], k]
                    pending[0] += raw
                    pending[1] = pending[1] or it.reference or not set(chars) <= _ASCII_SPACE
                    continue
                waiting.clear()
                if pending is not None:
                    spaced = bool(text)  # whitespace at the block's start, inside its first tags, is no space
                    if spaced:
                        text.append(" ")
                        length += 1
                    if pending[1]:
                        where = length - 1 if spaced else length
                        space = _Node(pending[0], order=pending[3], last=k, source=[where, where], point=True)
                        space.replaces_space = True
                        pending[2].children.append(space)
                    pending = None
                text.append(chars)
                length += len(chars)
        elif it.kind == "start" and k in matched:
            node = _Node(it.raw, order=k, last=matched[k], at=length, space_before=pending is not None)
            node.source[0] = length + (1 if pending is not None and text else 0)
            nodes[-1].children.append(node)
            nodes.append(node)
        elif it.kind == "end" and k in matched.values():
            node = nodes.pop()
            node.end, node.source[1] = it.raw, max(length, node.source[0])
        else:  # a point: void elements, comments, kept elements, tags that match none
            node = _Node(it.raw, order=k, last=k, at=length, point=True, space_before=pending is not None)
            node.source = [length, length]
            node.replaces_space = it.kind == "break"
            nodes[-1].children.append(node)
            waiting.append(node)
            if it.kind == "break" and pending is None:  # a line break separates the words around it
                pending = ["", False, nodes[-1], k]
    if pending is not None and pending[1]:
        space = _Node(pending[0], order=pending[3], last=len(items), at=length, point=True, replaces_space=True)
        space.source = [length, length]
        pending[2].children.append(space)
    block.text = "".join(text)
    block.root.source, block.root.last = [0, length], len(items)
    return block


def _tag_name(tag: str) -> str:
    return re.match(r"</?\s*([^\s/>]*)", tag).group(1).lower()


@dataclass
class _Sentences:
    # A block's sentences in its text, their translations laid out as the block's target text, and the words of both.
    spans: list[tuple[int, int]]  # each sentence's [start, end) in the block's text
    target: str = ""
    target_spans: list[tuple[int, int]] = field(default_factory=list)
    source_words: list[list[tuple[int, int]]] = field(default_factory=list)  # per sentence, offsets in the block
    target_words: list[list[tuple[int, int]]] = field(default_factory=list)  # per sentence, offsets in `target`
    aligned: list[dict[int, list[int]]] = field(default_factory=list)  # per sentence: source word -> target words


def _sentence_spans(text: str, language: str | None, split: bool) -> list[tuple[int, int]]:
    spans, start = [], 0
    for piece in split_sentences(text, language) if split else [text]:
        stripped = piece.strip()
        if stripped:
            begin = start + len(piece) - len(piece.lstrip())
            spans.append((begin, begin + len(stripped)))
        start += len(piece)
    return spans


def _lay_out(block: _Block, spans: list[tuple[int, int]], translations: list[str], alignments) -> _Sentences:
    # The translations in the block's layout (the whitespace between its sentences kept), and their alignments.
    laid = _Sentences(spans)
    parts, end = [], 0
    for (start, stop), translation, pairs in zip(spans, translations, alignments, strict=True):
        parts.append(block.text[end:start])
        offset = sum(map(len, parts))
        laid.target_spans.append((offset, offset + len(translation)))
        parts.append(translation)
        end = stop
        sources = [(start + a, start + b) for a, b in word_spans(block.text[start:stop])]
        targets = [(offset + a, offset + b) for a, b in word_spans(translation)]
        if pairs is None:  # no alignment given: the words in order, spread evenly
            pairs = _monotone(len(sources), len(targets))
        aligned: dict[int, list[int]] = {}
        for i, j in pairs:
            if 0 <= i < len(sources) and 0 <= j < len(targets):
                aligned.setdefault(i, []).append(j)
        laid.source_words.append(sources)
        laid.target_words.append(targets)
        laid.aligned.append(aligned)
    parts.append(block.text[end:])
    laid.target = "".join(parts)
    return laid


def _monotone(sources: int, targets: int) -> Alignment:
    # Each source word to the target word at the same share of the sentence: where no alignment is known.
    if not sources or not targets:
        return []
    return [(i, min(targets - 1, int((i + 0.5) * targets / sources))) for i in range(sources)]


class _Placer:
    """Places a block's markup in its translation: each element's target span, then each point's place."""

    def __init__(self, laid: _Sentences) -> None:
        self.laid = laid

    def map_point(self, position: int) -> int:
        """The target offset of a source offset: after the target word aligned to the source word before it."""
        laid = self.laid
        # The sentence that holds it, its edges included (the block's text has one space at most between two).
        k = next((k for k, (_, end) in enumerate(laid.spans) if position <= end), len(laid.spans) - 1)
        words, targets = laid.source_words[k], laid.target_words[k]
        gap = sum(end <= position for _, end in words)
        start, end = laid.target_spans[k]
        if gap == 0 or not targets:
            return start
        if gap == len(words):
            return end
        if laid.aligned[k].get(gap - 1):
            return targets[max(laid.aligned[k][gap - 1])][1]
        if laid.aligned[k].get(gap):
            return targets[min(laid.aligned[k][gap])][0]
        index = round(gap * len(targets) / len(words))
        return targets[index][0] if index < len(targets) else end

    def target_words(self, span: list[int]) -> list[tuple[int, int]]:
        """The target words (as (sentence, word)) of an element over `span` of the source: those aligned to its
        words; a whole sentence for one it covers whole; an even spread where none of its words is aligned."""
        laid, found = self.laid, []
        for k, words in enumerate(laid.source_words):
            covered = [i for i, (start, end) in enumerate(words) if start < span[1] and end > span[0]]
            if not covered:
                continue
            targets = laid.target_words[k]
            if len(covered) == len(words):
                found += [(k, j) for j in range(len(targets))]
                continue
            aligned = sorted({j for i in covered for j in laid.aligned[k].get(i, ())})
            if not aligned:  # none of its words aligned: where they would be, in order
                spread = dict(_monotone(len(words), len(targets)))
                aligned = sorted({spread[i] for i in covered if i in spread})
            found += [(k, j) for j in aligned]
        return found

    def has_words(self, span: list[int]) -> bool:
        return any(start < span[1] and end > span[0] for words in self.laid.source_words for start, end in words)

    def place(self, node: _Node) -> None:
        """Give each child of `node` (whose `target` is set) its target span, inside `node`'s and apart from its
        siblings', then theirs."""
        low, high = node.target
        spans: list[_Node] = []
        for child in node.children:
            if child.point:
                continue
            words = self.target_words(child.source)
            if words:
                starts = [self.laid.target_words[k][j][0] for k, j in words]
                ends = [self.laid.target_words[k][j][1] for k, j in words]
                wanted = (max(low, min(starts)), min(high, max(ends)))
                free = self._largest_free(wanted, spans)
            else:
                free = None
            if free is None:  # no target words left to it: empty, at the place its start maps to
                child.point = True
            else:
                child.target = list(free)
                spans.append(child)
        for child in node.children:
            if child.point:
                where = min(max(self.map_point(child.source[0]), low), high)
                for other in spans:  # never inside a sibling: at its nearer edge
                    if other.target[0] < where < other.target[1]:
                        nearer_start = where - other.target[0] <= other.target[1] - where
                        where = other.target[0] if nearer_start else other.target[1]
                child.target = [where, where]
            self.place(child)

    def _largest_free(self, wanted: tuple[int, int], taken: list[_Node]) -> tuple[int, int] | None:
        # The run of whole target words within `wanted` that no sibling holds, with the most words.
        words = [
            (start, end)
            for sentence in self.laid.target_words
            for start, end in sentence
            if start >= wanted[0]
            and end <= wanted[1]
            and not any(node.target[0] < end and node.target[1] > start for node in taken)
        ]
        runs: list[list[tuple[int, int]]] = []
        for word in words:
            if runs and not any(runs[-1][-1][1] <= node.target[0] < word[0] for node in taken):
                runs[-1].append(word)
            else:
                runs.append([word])
        if not runs:
            return None
        best = max(runs, key=len)  # max keeps the first of equal runs
        return best[0][0], best[-1][1]


def _render(node: _Node, target: str) -> str:
    # The node as written around its target text, its children in their places; the text escaped.
    if node.point and not node.end:
        return node.start
    out, position = [node.start], node.target[0]
    children = sorted(node.children, key=lambda child: (child.target[0], child.target[1], child.order))
    for k, child in enumerate(children):
        out.append(html.escape(target[position : child.target[0]], quote=False))
        position = child.target[0]
        if child.point and not child.end:
            if child.replaces_space:  # whitespace as written, or a line break, in place of the target's own
                limit = min([node.target[1]] + [c.target[0] for c in children[k + 1 :] if c.target[0] > position])
                while position < limit and target[position].isspace():
                    position += 1
            # The source's whitespace around markup that is no word, where the target has none there.
            start = child.target[0]
            before = " " if child.space_before and 0 < start and not target[start - 1].isspace() else ""
            follows = target[position] if position < len(target) else " "
            after = " " if child.space_after and not follows.isspace() and follows not in _CLOSING else ""
            out.append(before + child.start + after)
        else:
            out.append(_render(child, target))
            position = child.target[1]
    out.append(html.escape(target[position : node.target[1]], quote=False))
    out.append(node.end)
    return "".join(out)


def _wordless_to_points(node: _Node, items: list[_Item], placer: _Placer) -> None:
    # An element without words of its own (around whitespace, an image, nothing) is a point, as written whole.
    for child in node.children:
        if not child.point and not placer.has_words(child.source):
            child.start = "".join(it.raw for it in items[child.order : child.last + 1])
            child.end, child.children, child.point = "", [], True
            child.source = [child.at, child.at]
        else:
            _wordless_to_points(child, items, placer)


def split_html(
    text: str, language: str | None = None, sentences: bool = True
) -> tuple[list[str], Callable[[list[str], list[Alignment | None] | None], str]]:
    """The sentences of an HTML document, as plain text across inline tags, and the function that puts their
    translations back with the markup carried over (see the module docstring).

    Tags, attributes, comments, scripts, styles, `<pre>` layout and kept elements come back as written; the
    translations are escaped (a translation never becomes markup).

    See docs/translating-documents.md.

    Args:
        text: an HTML document or fragment.
        language: ISO 639-1 code of the text, for the segmenter's rules; None for English's.
        sentences: False keeps each block's text whole, as one sentence.

    Returns:
        (sentences, rebuild): `rebuild(translations, alignments=None)` gives the translated document, from one
        translation per sentence and, for each, its word alignment (Pharaoh pairs over `segmentation.word_spans`
        of the sentence and its translation); without one, words are taken to correspond in order.

    Raises:
        ValueError: HTML that Python's parser cannot read (some `<![` sections).
    """
    parts = []
    found: list[str] = []
    for part in _blocks(_events(text)):
        if isinstance(part, str):
            parts.append(part)
            continue
        block = _block(part)
        if not block.text.strip():
            parts.append("".join(it.raw for it in part))
            continue
        spans = _sentence_spans(block.text, language, sentences)
        parts.append((block, spans, len(found)))
        found += [block.text[start:end] for start, end in spans]

    def rebuild(translations: list[str], alignments: list[Alignment | None] | None = None) -> str:
        if len(translations) != len(found):
            raise ValueError(f"{len(translations)} translations for {len(found)} sentences: give one for each.")
        alignments = alignments if alignments is not None else [None] * len(found)
        out = []
        for part in parts:
            if isinstance(part, str):
                out.append(part)
                continue
            block, spans, first = part
            laid = _lay_out(
                block, spans, translations[first : first + len(spans)], alignments[first : first + len(spans)]
            )
            placer = _Placer(laid)
            root = copy.deepcopy(block.root)  # placing writes into the tree, and rebuild may run again
            _wordless_to_points(root, block.items, placer)
            root.target = [0, len(laid.target)]
            placer.place(root)
            out.append(block.lead + _render(root, laid.target) + block.trail)
        return "".join(out)

    return found, rebuild
