"""Lexically constrained beam search (`constraints_vaswani.py`): every term in every hypothesis, beams by banks."""

import torch
from conftest import random_model
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from vaswani_transformer.model import constraints_vaswani


def _generated(row: torch.Tensor, eos: int) -> tuple[list[int], bool]:
    # The tokens a hypothesis generated before its </s>, and whether it has one (the decoder start left out).
    tokens = row[1:].tolist()
    return (tokens[: tokens.index(eos)], True) if eos in tokens else (tokens, False)


def _holds(tokens: list[int], term: list[int]) -> bool:
    return any(tokens[i : i + len(term)] == term for i in range(len(tokens)))


def test_constrained_beam_search_puts_the_terms_into_every_hypothesis_and_leaves_other_sentences_alone(
    trained_model_dir, corpus
):
    # Post & Vilar (2018): every hypothesis returned holds its sentence's terms, and ends (</s>) only once it holds
    # them all; a sentence without terms is decoded as without glossary_ids, in the same batch.
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    sentences = corpus["test_2016_flickr"]["en"][:48]
    inputs = tokenizer(sentences, padding=True, return_tensors="pt")
    dame, roter_hut = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in (" Dame", " roter Hut"))
    terms = [[dame] if "woman" in sentence.lower() else [] for sentence in sentences]
    first = next(i for i, each in enumerate(terms) if each)
    terms[first] = [roter_hut, dame]  # two terms, one of two tokens
    assert 4 <= sum(map(bool, terms)) < 40 and len(roter_hut) == 2
    with torch.no_grad():
        plain = model.generate(**inputs, num_return_sequences=2)
        constrained = model.generate(**inputs, num_return_sequences=2, glossary_ids=terms)
        unchanged = model.generate(**inputs, num_return_sequences=2, glossary_ids=[[] for _ in sentences])
    assert torch.equal(unchanged, plain)
    eos = model.config.eos_token_id
    for row in range(len(plain)):
        ours, own = _generated(constrained[row], eos), _generated(plain[row], eos)
        each = terms[row // 2]
        if each:
            assert ours[1] and all(_holds(ours[0], term) for term in each), tokenizer.decode(ours[0])
        else:
            assert ours == own
    # The model's own translations seldom hold the terms: they were put there.
    assert sum(not _holds(_generated(plain[row], eos)[0], dame) for row in range(len(plain)) if terms[row // 2]) > 4


def test_a_hypothesis_that_holds_its_terms_wins_at_the_length_limit(tokenizer, test_sentences):
    # An untrained model rarely ends a sentence: every hypothesis meets the length limit, where the ones that hold
    # the term must still come first.
    model = random_model(tokenizer, seed=3)
    inputs = tokenizer(test_sentences[0][:4], padding=True, return_tensors="pt")
    dame = tokenizer(" Dame", add_special_tokens=False)["input_ids"]
    plain = model.generate(**inputs, num_beams=4, max_new_tokens=12)
    constrained = model.generate(**inputs, num_beams=4, max_new_tokens=12, glossary_ids=[[dame]] * 4)
    eos = model.config.eos_token_id
    assert not any(_holds(_generated(row, eos)[0], dame) for row in plain)
    assert all(_holds(_generated(row, eos)[0], dame) for row in constrained)


def test_lexical_constraints_know_which_terms_a_hypothesis_holds_and_forbid_it_to_end_before():
    # Terms (5, 6, 7) and (9) of one sentence, whose five beams hold: the first term's first two tokens at the end;
    # the second term, and the first's last two tokens (no beginning); the second, and a repeated first token (the
    # first term begun once, at the end); nothing; the first term. </s> is 2.
    constraints = constraints_vaswani.LexicalConstraints.from_ids([[[5, 6, 7], [9]]], torch.tensor([2]))
    rows = torch.tensor([[1, 4, 5, 6], [1, 9, 6, 7], [1, 9, 5, 5], [1, 3, 3, 3], [1, 5, 6, 7]])
    met, begun, closing = constraints.state(rows)
    assert met.tolist() == [[False, False], [False, True], [False, True], [False, False], [True, False]]
    assert begun[:, 0].tolist() == [
        [True, False, True], [True, False, False], [True, True, False], [True, False, False], [True, False, False]
    ]  # fmt: skip
    assert begun[:, 1].tolist() == [[True, False, False]] * 5  # a one-token term has only p = 0
    assert closing.tolist() == [False, False, False, False, True]  # only the last ends with a whole term
    forbidden = constraints(rows, torch.zeros(5, 10))
    assert torch.isinf(forbidden[:, 2]).all() and (forbidden[:, [0, 1, 3]] == 0).all()
    both = torch.tensor([[1, 5, 6, 7, 9], [1, 9, 4, 5, 6]])
    assert torch.equal(constraints(both[:1], torch.zeros(1, 10)), torch.zeros(1, 10))
    # Tokens that continue a word (8) may not follow a term, which then ends a word; elsewhere they may.
    words = constraints_vaswani.LexicalConstraints.from_ids([[[5, 6, 7], [9]]], torch.tensor([2]), suffix_ids=[8])
    ended = words(both, torch.zeros(2, 10))
    assert torch.isinf(ended[0, 8]) and (ended[0, :8] == 0).all() and ended[1, 8] == 0


def test_beams_go_to_the_banks_in_turn_highest_first_and_by_score_within_each():
    # Hu et al. (2019)'s round robin: the best of bank 2, of bank 1, of bank 0, then the second best of each, ...
    scores = torch.tensor([[-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -0.5]])
    banks = torch.tensor([[0, 0, 1, 2, 1, 0, 2]])
    valid = torch.tensor([[True, True, True, True, True, True, False]])
    assert constraints_vaswani._allocate(scores, banks, valid).tolist() == [[3, 2, 0, 4, 1, 5, 6]]


def test_a_term_ends_a_word_where_the_tokens_that_continue_one_are_given(tokenizer, test_sentences):
    # An untrained model continues " Dame" with any piece ("Damein"); given the pieces that continue a word
    # (glossary.suffix_ids), no hypothesis does, and the best of each sentence still holds the term (all run into
    # the length limit, where fewer than 4 may hold it).
    from vaswani_transformer.inference.glossary import suffix_ids

    model = random_model(tokenizer, seed=3)
    inputs = tokenizer(list(test_sentences[0]), padding=True, return_tensors="pt")
    dame, pieces = tokenizer(" Dame", add_special_tokens=False)["input_ids"], suffix_ids(tokenizer)
    options = dict(num_beams=4, num_return_sequences=4, max_new_tokens=16, glossary_ids=[[dame]] * 8)

    def continued(output: torch.Tensor) -> int:  # hypotheses in which a piece follows the term
        rows = [_generated(row, model.config.eos_token_id)[0] for row in output]
        return sum(
            any(row[i : i + len(dame)] == dame and row[i + len(dame)] in pieces for i in range(len(row) - len(dame)))
            for row in rows
        )

    assert continued(model.generate(**inputs, **options)) >= 4
    words = model.generate(**inputs, **options, glossary_suffix_ids=pieces)
    assert continued(words) == 0
    assert all(_holds(_generated(row, model.config.eos_token_id)[0], dame) for row in words[::4])  # each best
