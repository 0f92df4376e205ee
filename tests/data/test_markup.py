"""HTML's inline markup carried over to translations by word alignment (`markup.py`): the sentences across inline tags,
and the tags put back around the aligned target words, never lost, duplicated or unbalanced."""

from collections import Counter
from html.parser import HTMLParser

from hypothesis import given, settings
from hypothesis import strategies as st
from lxml import etree

from vaswani_transformer.data.markup import split_html
from vaswani_transformer.data.segmentation import word_spans


def diagonal(source: str, target: str) -> list[tuple[int, int]]:
    """Word i to word i: an alignment of translations that keep the source's word order."""
    return [(i, i) for i in range(min(len(word_spans(source)), len(word_spans(target))))]


class _Tags(HTMLParser):
    # The tags of a document as written (name and attributes), their nesting checked, and its text.
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: Counter = Counter()
        self.open: list[str] = []
        self.balanced = True
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags[self.get_starttag_text()] += 1
        if tag not in ("br", "img"):
            self.open.append(tag)

    def handle_endtag(self, tag):
        self.tags[f"</{tag}>"] += 1
        self.balanced = self.balanced and bool(self.open) and self.open.pop() == tag

    def handle_data(self, data):
        self.text.append(data)


def tags(document: str) -> _Tags:
    parser = _Tags()
    parser.feed(document)
    parser.close()
    return parser


def test_a_sentence_across_inline_tags_is_one_sentence_and_each_tag_follows_its_word():
    found, rebuild = split_html('<p>A <b>woman</b> points a <i>hair drier</i> like it is a <a href="/g">gun</a>.</p>')
    assert found == ["A woman points a hair drier like it is a gun."]
    # The target's order differs: each tag goes around the words aligned to its own.
    target = "Mit einer Waffe zeigt eine Frau einen Föhn."
    #         0   1     2     3     4    5    6     7   8
    alignment = [(0, 4), (1, 5), (2, 3), (3, 6), (4, 7), (5, 7), (10, 2), (11, 8)]
    assert rebuild([target], [alignment]) == (
        '<p>Mit einer <a href="/g">Waffe</a> zeigt eine <b>Frau</b> einen <i>Föhn</i>.</p>'
    )


def test_nested_tags_and_tags_around_several_words_nest_as_they_did():
    page = '<p>Two <a href="/x?a=1&amp;b=2" title="Go &quot;now&quot;">men <b>sit</b> on</a> a bench.</p>'
    found, rebuild = split_html(page)
    assert found == ["Two men sit on a bench."]
    target = "Zwei Männer sitzen auf einer Bank."
    out = rebuild([target], [diagonal(found[0], target)])
    assert out == (
        '<p>Zwei <a href="/x?a=1&amp;b=2" title="Go &quot;now&quot;">Männer <b>sitzen</b> auf</a> einer Bank.</p>'
    )
    # An inner tag whose word went outside the outer one's stays inside it, as in the source: never crossing it.
    crossing = [(0, 0), (1, 1), (2, 5), (3, 3), (4, 4), (5, 5)]
    out = rebuild(["Zwei Männer auf einer Bank sitzen."], [crossing])
    assert tags(out).balanced and tags(out).tags == tags(page).tags


def test_a_tag_whose_words_are_not_aligned_is_placed_and_never_dropped():
    found, rebuild = split_html("<p>A <b>red</b> <i>car</i> stops.</p>")
    # Neither "red" nor "car" aligned to any word; then both aligned to the same one.
    for alignment in ([(0, 0), (3, 2)], [(0, 0), (1, 1), (2, 1), (3, 2)]):
        out = rebuild(["Ein Auto hält."], [alignment])
        assert tags(out).tags == tags("<p>A <b>red</b> <i>car</i> stops.</p>").tags and tags(out).balanced
        assert "".join(tags(out).text) == "Ein Auto hält."


def test_block_elements_are_sentence_boundaries_and_lists_and_tables_come_back_whole():
    page = (
        "<html><head><title>Dogs</title></head><body><h1>Two dogs</h1><ul><li>One <em>runs</em></li><li>One sits."
        "</li></ul><table><tr><td>A cell</td><th>A head</th></tr></table><div>Last</div></body></html>"
    )
    found, rebuild = split_html(page)
    assert found == ["Dogs", "Two dogs", "One runs", "One sits.", "A cell", "A head", "Last"]
    out = rebuild([sentence.upper() for sentence in found], [diagonal(s, s) for s in found])
    assert out == (
        "<html><head><title>DOGS</title></head><body><h1>TWO DOGS</h1><ul><li>ONE <em>RUNS</em></li><li>ONE SITS."
        "</li></ul><table><tr><td>A CELL</td><th>A HEAD</th></tr></table><div>LAST</div></body></html>"
    )
    assert etree.fromstring(out).tag == "html"  # well-formed: lxml's XML parser reads it


def test_pre_code_translate_no_and_references_come_back_as_written():
    page = (
        "<pre>\n  A man is sitting on a bench.\n      Two children are laughing.\n</pre>"
        "<p>Use <code>pip install torch</code> to install it.</p>"
        '<p translate="no">Keep <b>this</b>.</p><p>And <span class="x notranslate">this one</span> too.</p>'
        "<p>A&nbsp;man and 10&#160;dogs&hellip;</p><table><tr><td>&nbsp;</td></tr></table>"
        "<p>One<br>two <kbd>Ctrl</kbd> <samp>ok</samp> <var>x</var></p>"
        '<div class="notranslate"><div>Inner</div> tail <code>a<code>b</code></code></div>'
    )
    found, rebuild = split_html(page)
    assert found == [
        "A man is sitting on a bench.", "Two children are laughing.", "Use to install it.", "And too.",
        "A man and 10 dogs\u2026", "One two",
    ]  # fmt: skip
    out = rebuild([sentence.upper() for sentence in found], [diagonal(s, s) for s in found])
    assert out == (
        "<pre>\n  A MAN IS SITTING ON A BENCH.\n      TWO CHILDREN ARE LAUGHING.\n</pre>"
        "<p>USE <code>pip install torch</code> TO INSTALL IT.</p>"
        '<p translate="no">Keep <b>this</b>.</p><p>AND <span class="x notranslate">this one</span> TOO.</p>'
        "<p>A&nbsp;MAN AND 10&#160;DOGS\u2026</p><table><tr><td>&nbsp;</td></tr></table>"
        "<p>ONE<br>TWO <kbd>Ctrl</kbd> <samp>ok</samp> <var>x</var></p>"
        '<div class="notranslate"><div>Inner</div> tail <code>a<code>b</code></code></div>'
    )


def test_without_an_alignment_the_words_are_taken_in_order_and_rebuild_runs_again():
    found, rebuild = split_html("<p>A <b>dog</b> runs.</p>")
    assert rebuild(["Ein Hund rennt."]) == "<p>Ein <b>Hund</b> rennt.</p>"
    assert rebuild(["Ein Hund läuft."]) == "<p>Ein <b>Hund</b> läuft.</p>"  # each rebuild places a tree of its own


_WORDS = ["a", "man", "dog", "runs", ",", ".", "big", "red", "street", "!"]
_INLINE = ["<b>", '<i class="c">', '<a href="/x?q=1&amp;r=2">', "<span>", "<em>", "<u>"]
_POINTS = [
    "<br>", '<img src="p.png" alt="A">', "<!-- note -->", "<code>x &lt; y</code>", '<span translate="no">N</span>',
]  # fmt: skip


@st.composite
def inline_content(draw, depth: int = 0) -> str:
    """Inline HTML of words (each followed by whitespace as written), points and nested inline elements."""
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["word", "word", "point", "element"] if depth < 3 else ["word"]))
        if kind == "word":
            parts.append(draw(st.sampled_from(_WORDS)) + draw(st.sampled_from([" ", "  ", "&nbsp;", "\n"])))
        elif kind == "point":
            parts.append(draw(st.sampled_from(_POINTS)))
        else:
            start = draw(st.sampled_from(_INLINE))
            name = start[1:].split(">")[0].split()[0]
            parts.append(start + draw(inline_content(depth + 1)) + f"</{name}>")
    return "".join(parts)


@settings(max_examples=100, deadline=None)
@given(st.lists(inline_content(), min_size=1, max_size=3), st.data())
def test_any_alignment_gives_every_tag_once_balanced_and_the_translations_text(blocks, data):
    page = "\n".join(f"<p>{block}</p>" for block in blocks)
    found, rebuild = split_html(page)
    translations = [" ".join(data.draw(st.lists(st.sampled_from(_WORDS + ["X"]), max_size=8))) for _ in found]
    alignments = []
    for source, target in zip(found, translations, strict=True):
        pairs = st.tuples(st.integers(0, len(word_spans(source)) - 1), st.integers(0, len(word_spans(target)) - 1))
        alignments.append(data.draw(st.lists(pairs, max_size=12)) if word_spans(target) else [])
    out = rebuild(translations, alignments)
    before, after = tags(page), tags(out)
    assert after.tags == before.tags and after.balanced and not after.open
    # The text is the translations' (the kept elements' aside), whitespace as the layout has it.
    text = "".join(after.text).replace("\xa0", " ").replace("x < y", " ").replace("N", " ")
    assert text.split() == " ".join(translations).split()
