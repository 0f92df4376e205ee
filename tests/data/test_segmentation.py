"""Sentences of real text (`segmentation.py`): a paragraph split into sentences that join back to it, and a sentence
too long for the model cut at a clause or word boundary."""

import logging

from vaswani_transformer.data.segmentation import (
    fit_to_limit,
    join_alignments,
    split_at_limit,
    split_sentences,
    word_spans,
)


def test_a_paragraph_of_test_sentences_splits_into_them_and_joins_back(corpus):
    for language in ("en", "de"):
        sentences = corpus["test_2016_flickr"][language][:8]
        line = "  " + " ".join(sentences) + "\t"
        pieces = split_sentences(line, language)
        assert "".join(pieces) == line
        assert [piece.strip() for piece in pieces] == sentences
    assert split_sentences("Mr. Smith met Dr. Jones. They talked.", "en") == [
        "Mr. Smith met Dr. Jones. ",
        "They talked.",
    ]
    assert split_sentences("   ", "en") == ["   "]


def test_a_sentence_over_the_limit_is_cut_at_every_clause_then_at_a_space_and_said_so(caplog):
    def words(text: str) -> int:
        return len(text.split()) + 1  # a token a word, and </s>

    sentence = "A man in a red shirt, who holds a ladder, cleans the windows of a tall building"
    assert split_at_limit(sentence, words, 11) == [  # 18 tokens: cut at every clause
        "A man in a red shirt,",
        "who holds a ladder,",
        "cleans the windows of a tall building",
    ]
    assert split_at_limit("one two three four five six", words, 4) == ["one two three", "four five six"]
    assert split_at_limit("short", words, 4) == ["short"]
    with caplog.at_level(logging.WARNING, logger="vaswani_transformer.data.segmentation"):
        pieces = fit_to_limit(["A dog runs.", sentence], [4, words(sentence)], 11, words)
    assert pieces.texts[0] == "A dog runs." and pieces.owners == [0, 1, 1, 1] and pieces.split == [1]
    assert all(length <= 11 for length in pieces.lengths)
    translations = ["Ein Hund rennt.", "Ein Mann im roten Hemd,", "der eine Leiter hält,", "putzt die Fenster"]
    assert pieces.join(translations, 2) == [
        "Ein Hund rennt.",
        "Ein Mann im roten Hemd, der eine Leiter hält, putzt die Fenster",
    ]
    assert len(caplog.records) == 1 and "1 sentence(s) longer than the model's limit of 11" in caplog.text


def test_pieces_of_a_split_sentence_translated_much_shorter_are_said_to_be_lost(caplog):
    pieces = fit_to_limit(["One, two three four five six, seven eight."], [12], 6, lambda text: len(text.split()) + 1)
    assert pieces.texts == ["One,", "two three four five six,", "seven eight."]
    with caplog.at_level(logging.WARNING, logger="vaswani_transformer.data.segmentation"):
        caplog.clear()
        assert pieces.join(["Eins,", "zwei drei vier fünf sechs,", "sieben acht."], 1) == [
            "Eins, zwei drei vier fünf sechs, sieben acht."
        ]
        assert not caplog.records
        pieces.join(["Eins,", "zwei", "sieben acht."], 1)
    assert len(caplog.records) == 1
    assert "1 of 3 pieces of long sentences (sentence 1) translated to less than a third of their words" in caplog.text


def test_words_are_letter_runs_and_punctuation_marks_and_alignments_join_end_to_end():
    text = "A man's hair-drier, 2 m."
    assert [text[a:b] for a, b in word_spans(text)] == ["A", "man", "'", "s", "hair", "-", "drier", ",", "2", "m", "."]
    assert join_alignments([([(0, 1), (1, 0)], 2, 2), (None, 0, 0), ([(0, 0)], 1, 3), ([], 1, 1)]) == [
        (0, 1),
        (1, 0),
        (2, 2),
    ]
    assert join_alignments([([(0, 0)], 1, 1), (None, 2, 2)]) is None  # a part with words but no alignment
