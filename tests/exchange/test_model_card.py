"""The model card's policy for test-set scores: which card a score goes into, and why a card is left as it is."""

from vaswani_transformer.exchange.model_card import choose_score_card


def test_a_score_goes_only_into_a_local_models_card_for_its_own_decoding_on_a_named_test_set(tmp_path):
    model, source = tmp_path / "model", tmp_path / "multi30k" / "test_2016_flickr.en"
    model.mkdir()
    source.parent.mkdir()
    source.write_text("A dog runs.\n")
    assert choose_score_card("org/model", source, own_decoding=True).path is None  # a Hub id's card: never
    other = choose_score_card(model, source, own_decoding=False)
    assert other.path is None and "not of the model's own generate()" in other.note
    pipe = choose_score_card(model, "/dev/fd/63", own_decoding=True)
    assert pipe.path is None and "--dataset-name and --split" in pipe.note
    card = choose_score_card(model, source, own_decoding=True)
    assert (card.path, card.note) == (model / "README.md", None)
    assert (card.dataset, card.split) == ("multi30k", "test_2016_flickr")
    named = choose_score_card(model, "/dev/fd/63", own_decoding=True, dataset_name="wmt14", split="newstest2014")
    assert (named.dataset, named.split) == ("wmt14", "newstest2014")
