"""`translate`'s input (`input_translation.py`): line ends as they came, HTML on stdin noticed, word alignments beside
the translations, and a progress bar that counts sentences."""

import io
import logging
import math
import sys

import pytest

from vaswani_transformer.inference.config import InferenceConfig
from vaswani_transformer.inference.engines import load_translator
from vaswani_transformer.inference.input_translation import translate_input
from vaswani_transformer.inference.translation import translate


class _Stdin:
    """stdin as a pipe gives it: bytes, not a terminal."""

    def __init__(self, data: bytes) -> None:
        self.buffer = io.BytesIO(data)

    def isatty(self) -> bool:
        return False


def _translated(model_dir, source: str = "-", **options) -> str:
    written: list[str] = []
    translate_input(str(model_dir), source, write=written.append, **options)
    return "".join(written)


def test_crlf_lines_come_back_crlf_and_lf_lines_lf(trained_model_dir, corpus, tmp_path):
    # Issue 74, case 15: a CRLF file came back LF only (4 CRLF in, 0 out).
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    first, second, third = corpus["test_2016_flickr"]["en"][:3]
    t = translate(model, tokenizer, [first, second, third, f"{first} {second}"])
    path = tmp_path / "notes.txt"
    path.write_bytes(f"{first}\r\n{second}\n\r\n{third}\r\n{first} {second}".encode())
    assert _translated(trained_model_dir, str(path)) == f"{t[0]}\r\n{t[1]}\n\r\n{t[2]}\r\n{t[3]}\r\n"
    page = tmp_path / "page.html"
    page.write_bytes(f"<html>\r\n<body>\r\n<p>{first}</p>\r\n</body>\r\n</html>\r\n".encode())
    assert _translated(trained_model_dir, str(page)) == f"<html>\r\n<body>\r\n<p>{t[0]}</p>\r\n</body>\r\n</html>\r\n"


def test_html_piped_to_stdin_as_text_is_warned_of_once(trained_model_dir, corpus, monkeypatch, caplog):
    # Issue 74, case 16: HTML on stdin without --input-format html was translated as text, tags mangled, silently.
    first = corpus["test_2016_flickr"]["en"][0]
    page = f"\n<!DOCTYPE html>\n<p>{first}</p>\n<p>{first}</p>\n".encode()
    with caplog.at_level(logging.WARNING, logger="vaswani_transformer.inference.input_translation"):
        monkeypatch.setattr(sys, "stdin", _Stdin(page))
        _translated(trained_model_dir)
        warnings = [r.getMessage() for r in caplog.records if r.name.endswith("input_translation")]
        assert warnings == [
            "stdin looks like HTML (it begins with '<!DOCTYPE html>') and is translated as text, line by line, tags "
            "and all; pass --input-format html to translate it as a document, its markup kept."
        ]
        caplog.clear()
        told = {"config": InferenceConfig(input_format="html")}
        for given, options in ((page, told), (f"{first}\n".encode(), {})):  # told it is HTML, or no HTML
            monkeypatch.setattr(sys, "stdin", _Stdin(given))
            _translated(trained_model_dir, **options)
        assert not [r for r in caplog.records if r.name.endswith("input_translation")]


def test_alignments_follow_each_line_and_the_bar_counts_sentences(trained_model_dir, corpus, tmp_path, capsys):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    first, second = corpus["test_2016_flickr"]["en"][:2]
    path = tmp_path / "two.txt"
    path.write_text(f"{first} {second}\n\n{second}\n")
    out = _translated(trained_model_dir, str(path), alignments=True)
    expected = translate(model, tokenizer, [f"{first} {second}", "", second], alignments=True)
    assert out == "".join(f"{t.text} ||| {' '.join(f'{i}-{j}' for i, j in t.alignment or [])}\n" for t in expected)
    assert "4/4" in capsys.readouterr().err  # two sentences, a blank line, a sentence: 4 of 4, not 3 lines
    page = tmp_path / "page.html"
    page.write_text(f"<p>{first} {second}</p><p>{second}</p>")
    _translated(trained_model_dir, str(page))
    assert "3/3" in capsys.readouterr().err  # the document's sentences, not 1 document
    with pytest.raises(ValueError, match="--alignments numbers the words of each line"):
        translate_input(str(trained_model_dir), str(page), write=print, alignments=True)


def test_a_glossary_file_changes_the_lines_with_its_terms_only_and_scores_come_last(
    trained_model_dir, corpus, tmp_path
):
    lines = [s for s in corpus["test_2016_flickr"]["en"][:30] if "woman" in s][:3]
    lines += [s for s in corpus["test_2016_flickr"]["en"][:30] if "woman" not in s][:3]
    path = tmp_path / "input.txt"
    path.write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n")
    terms = tmp_path / "terms.tsv"
    terms.write_text("woman\tDame\n\nzebra\tZebra\n")
    plain = _translated(trained_model_dir, str(path)).splitlines()
    with_terms = _translated(trained_model_dir, str(path), glossary=str(terms)).splitlines()
    assert all("Dame" in line and "Dame" not in before for line, before in zip(with_terms[:3], plain[:3], strict=True))
    assert with_terms[3:] == plain[3:]  # term-free lines, and the blank one, byte for byte
    scored = _translated(trained_model_dir, str(path), glossary=str(terms), scores=True, alignments=True).splitlines()
    for line, translation in zip(scored, with_terms, strict=True):
        text, pairs, confidence = line.split(" ||| ")
        assert text == translation and (pairs == "") == (translation == "")
        assert confidence == "" if translation == "" else math.isfinite(float(confidence)) and float(confidence) <= 0


def test_a_bad_glossary_line_or_scores_for_html_are_refused_in_one_line_before_the_model_loads(tmp_path):
    terms = tmp_path / "terms.tsv"
    terms.write_text("woman\tDame\nman\n")
    (tmp_path / "input.txt").write_text("A man.\n")
    missing_model = str(tmp_path / "no-model")  # never loaded: the options are refused first
    with pytest.raises(ValueError, match=f"^{terms}:2: 1 fields; a glossary line is a source term, one tab"):
        translate_input(missing_model, str(tmp_path / "input.txt"), write=print, glossary=str(terms))
    (tmp_path / "page.html").write_text("<p>A man.</p>")
    with pytest.raises(ValueError, match="^--scores writes a confidence after each line: translate an HTML"):
        translate_input(missing_model, str(tmp_path / "page.html"), write=print, scores=True)
    with pytest.raises(ValueError, match="^--glossary needs beam search"):
        translate_input(missing_model, "-", InferenceConfig(num_beams=1), write=print, glossary=str(terms))
