"""Glossaries (glossary.py): terms read from TSV, found on word boundaries in any case, as the model's token ids."""

import pytest

from vaswani_transformer.inference.glossary import Glossary, Term, suffix_ids


def test_a_glossary_file_is_read_as_written_and_its_terms_found_on_word_boundaries_in_any_case(tmp_path, corpus):
    path = tmp_path / "terms.tsv"
    path.write_text('woman\tDame\n\nyoung woman\tjunge Dame\n  dog \t Köter\n"hat"\tHut\n', encoding="utf-8")
    glossary = Glossary.read(path)
    assert glossary.terms == (
        Term("woman", "Dame"), Term("young woman", "junge Dame"), Term("dog", "Köter"), Term('"hat"', "Hut")
    )  # fmt: skip
    # Real test sentences: "woman" at the start and inside, "dog" beside punctuation, never inside other words.
    sentences = list(corpus["test_2016_flickr"]["en"])
    with_woman = next(s for s in sentences if s.startswith("A woman "))
    assert glossary.matches(with_woman.upper()) == [Term("woman", "Dame")]
    assert glossary.matches("A YOUNG Woman walks her dog, and a woman her dogs.") == [
        Term("young woman", "junge Dame"), Term("dog", "Köter"), Term("woman", "Dame")
    ]  # fmt: skip
    assert glossary.matches("Two women and a dogsled near the hat.") == []
    assert len(glossary) == 4 and Glossary([]).matches("A woman.") == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "woman\tDame\nman\n",
            "terms.tsv:2: 1 fields; a glossary line is a source term, one tab, and its target term.",
        ),
        ("woman\tDame\tFrau\n", "terms.tsv:1: 3 fields"),
        ("woman\tDame\n\t\nman\t \n", "terms.tsv:3: the target term is empty"),
        (
            "woman\tDame\n\nWOMAN\tFrau\n",
            "terms.tsv:3: the source term 'WOMAN' repeats that of {tmp_path}/terms.tsv:1 (in any case)",
        ),
    ],
)
def test_a_bad_glossary_line_is_refused_in_one_line_naming_the_file_and_line(tmp_path, text, message):
    path = tmp_path / "terms.tsv"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError) as refused:
        Glossary.read(path)
    expected = f"{tmp_path}/" + message.format(tmp_path=tmp_path)
    assert str(refused.value).startswith(expected) and "\n" not in str(refused.value)


def test_a_glossary_that_is_no_utf8_or_no_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "terms.tsv"
    path.write_bytes("woman\tDame\nstreet\tStraße\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"terms.tsv, line 2: not valid UTF-8"):
        Glossary.read(path)
    with pytest.raises(FileNotFoundError, match="missing.tsv does not exist"):
        Glossary.read(tmp_path / "missing.tsv")


def test_pairs_given_in_code_are_checked_with_their_own_names():
    with pytest.raises(ValueError, match=r"^glossary\[1\]: the source term is empty"):
        Glossary([("woman", "Dame"), (" ", "Frau")], where="glossary[{}]", numbers=[0, 1])


def test_target_terms_are_the_tokens_they_have_inside_a_sentence(tokenizer):
    glossary = Glossary([("woman", "Dame"), ("t-shirt", "T-Shirt"), ("dog", "Hund")])
    sentences = ["A woman in a t-shirt.", "Nothing here.", "A dog, a woman and a DOG."]
    ids = glossary.target_ids(sentences, tokenizer)
    in_a_sentence = tokenizer("Eine Dame im T-Shirt mit einem Hund.", add_special_tokens=False)["input_ids"]
    dame, shirt, hund = (
        [t for t in ids[0] + ids[2] if tokenizer.decode(t).strip() == w][0] for w in ("Dame", "T-Shirt", "Hund")
    )
    for term in (dame, shirt, hund):
        assert any(in_a_sentence[i : i + len(term)] == term for i in range(len(in_a_sentence)))
    assert ids == [[dame, shirt], [], [hund, dame]]
    assert Glossary([]).target_ids(sentences, tokenizer) == [[], [], []]


def test_a_target_term_with_a_special_token_is_refused(tokenizer):
    with pytest.raises(ValueError, match="glossary target term 'das </s>' holds a special token"):
        Glossary([("the end", "das </s>")]).target_ids(["The end."], tokenizer)


def test_the_tokens_that_continue_a_word_are_those_decoded_without_a_space_before_them(tokenizer):
    # "Herrin" is "ĠHerr" + "in" for a byte-level BPE: "in" continues the word, "ĠDame" and "." do not.
    continuing = set(suffix_ids(tokenizer))
    pieces = tokenizer(" Herrinnen sitzen.", add_special_tokens=False)["input_ids"]
    assert len(pieces) >= 4 and pieces[1] in continuing and pieces[0] not in continuing
    assert not continuing & {*tokenizer(" Dame.", add_special_tokens=False)["input_ids"], *tokenizer.all_special_ids}
    assert 0.1 < len(continuing) / len(tokenizer) < 0.9
