"""Translating with a trained model and choosing its decoding on a development set (§6.1)."""

import pytest

from vaswani_transformer.translation import choose_decoding, corpus_bleu, load_translator, translate, validation_bleu


@pytest.fixture(scope="module")
def development_set(corpus):
    validation = corpus["validation"].select(range(48))
    return list(validation["en"]), list(validation["de"])


def test_choose_decoding_scores_every_pair_and_keeps_the_best(trained_model_dir, development_set):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    sources, references = development_set
    before = model.generation_config.to_dict()
    choice = choose_decoding(model, tokenizer, sources, references, num_beams=[1, 4], length_penalties=[0.6, 1.5])
    assert [(t["num_beams"], t["length_penalty"]) for t in choice["tried"]] == [(1, None), (4, 0.6), (4, 1.5)]
    assert choice["bleu"] == max(t["bleu"] for t in choice["tried"])
    # Each score is that decoding's sacreBLEU, and trying them leaves the model's own decoding alone.
    paper = next(t for t in choice["tried"] if (t["num_beams"], t["length_penalty"]) == (4, 0.6))
    assert round(corpus_bleu(translate(model, tokenizer, sources), references)["score"], 2) == paper["bleu"]
    assert model.generation_config.to_dict() == before


def test_choose_decoding_refuses_nothing_to_choose_from(trained_model_dir, development_set):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    with pytest.raises(ValueError, match="at least one"):
        choose_decoding(model, tokenizer, *development_set, num_beams=[], length_penalties=[0.6])
    with pytest.raises(ValueError, match="at least 1"):
        choose_decoding(model, tokenizer, *development_set, num_beams=[0], length_penalties=[0.6])


def test_validation_bleu_scores_beam_search_and_always_leaves_the_model_training(
    trained_model_dir, development_set, monkeypatch
):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    sources, references = development_set
    expected = round(corpus_bleu(translate(model, tokenizer, sources), references)["score"], 2)
    model.train()
    assert validation_bleu(model, tokenizer, sources, references) == expected
    assert model.training
    # A validation that fails (here: generation out of memory) must not leave the run training without dropout.
    monkeypatch.setattr(model, "generate", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        validation_bleu(model, tokenizer, sources, references)
    assert model.training
