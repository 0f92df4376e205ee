"""LibreTranslate's text formats (`text_format.py`): the sentences of a text, and the text rebuilt around them."""

import pytest

from vaswani_transformer.data.text_format import file_format, split_text


@pytest.mark.parametrize(
    ("text", "sentences", "rebuilt"),
    [
        # Line ends as they came, CRLF or LF (issue 74, case 15: CRLF came back as LF).
        ("A dog.\r\n\nA cat.\r\n", ["A dog.", "", "A cat.", ""], "A DOG.\r\n\nA CAT.\r\n"),
        ('<p class="x">A   dog\n runs.</p>', ["A dog runs."], '<p class="x">A DOG RUNS.</p>'),
        # A bare "<" is text: the sentence around it stays one sentence, escaped on the way back.
        (
            "<p>A man is 2 < 3 meters tall.</p>",
            ["A man is 2 < 3 meters tall."],
            "<p>A MAN IS 2 &lt; 3 METERS TALL.</p>",
        ),
        ("<p><![CDATA[x < y]]> A dog.</p>", ["A dog."], "<p><![CDATA[x < y]]> A DOG.</p>"),
        ("<![if IE]><p>Hi</p><![endif]><!-- a note -->", ["Hi"], "<![if IE]><p>HI</p><![endif]><!-- a note -->"),
        ("<script>if (a < b) {}</script><b>Go</b>", ["Go"], "<script>if (a < b) {}</script><b>GO</b>"),
        # End tags as written, and an unclosed script (the parser holds it back to the end) kept.
        ("<P>Hi</P ><b>Go</b foo>", ["Hi", "Go"], "<P>HI</P ><b>GO</b foo>"),
        ("<p>Hi</p><script>var a = 1;", ["Hi"], "<p>HI</p><script>var a = 1;"),
    ],
)
def test_split_text_gives_the_sentences_and_rebuild_keeps_everything_else(text, sentences, rebuilt):
    fmt = "html" if text.startswith("<") else "text"
    found, rebuild = split_text(text, fmt)
    assert found == sentences
    assert rebuild([sentence.upper() for sentence in found]) == rebuilt


def test_a_files_format_is_its_suffixes_in_any_case_and_none_for_another():
    assert [file_format(name) for name in ("a.txt", "dir.x/Page.HTML", "old.htm", "b.TXT")] == [
        "text",
        "html",
        "html",
        "text",
    ]
    assert [file_format(name) for name in ("paper.pdf", "README", "-", "test.en", ".txt")] == [None] * 5
