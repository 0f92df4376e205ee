"""The engines (inference.py): one interface, the model's generate() or its CTranslate2 export, loaded from a config."""

import copy
import re

import pytest
import torch
from conftest import random_model

from vaswani_transformer.inference.config import InferenceConfig
from vaswani_transformer.inference.engines import CTranslate2Engine, Engine, Hypothesis, TorchEngine, load_engine
from vaswani_transformer.inference.glossary import Glossary


def test_the_torch_engine_gives_generates_translations_in_order_and_blank_lines_without_the_model(
    trained_model_dir, test_sentences
):
    sources = list(test_sentences[0][:3])
    engine = load_engine(str(trained_model_dir), InferenceConfig(device="cpu", num_beams=2, length_penalty=1.0))
    assert isinstance(engine, TorchEngine) and engine.name == "torch" and engine.runs_in_cpu_workers
    model, tokenizer = engine.model, engine.tokenizer
    with torch.inference_mode():
        ids = model.generate(**tokenizer(sources, return_tensors="pt", padding=True), num_beams=2, length_penalty=1.0)
    expected = [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]
    calls = []
    batch = engine._translate_batch
    engine._translate_batch = lambda sentences, *rest: calls.append(sentences) or batch(sentences, *rest)
    assert engine.translate([sources[0], " ", sources[1], "", sources[2]]) == [
        expected[0], "", expected[1], "", expected[2]
    ]  # fmt: skip
    assert calls == [sources]  # one batch, blank lines left out
    assert engine.translate(["", "  "]) == ["", ""] and calls == [sources]


def test_an_engine_is_what_the_config_names_with_the_models_limit(trained_model_dir, tmp_path):
    engine = load_engine(str(trained_model_dir))  # the default config: torch, the model's own decoding
    assert isinstance(engine, Engine) and engine.generate_kwargs == {}
    assert engine.source_limit == engine.tokenizer.model_max_length
    assert engine.generation_config.num_beams == engine.model.generation_config.num_beams
    pytest.importorskip("ctranslate2")
    config = InferenceConfig(engine="ctranslate2", ctranslate2_dir=str(tmp_path / "ct2"))
    engine = load_engine(str(trained_model_dir), config)
    assert engine.name == "ctranslate2" and not engine.runs_in_cpu_workers
    assert engine.source_limit <= engine.tokenizer.model_max_length and engine.translate([" "]) == [""]


def _confidences(found):
    return [h.confidence for each in found for h in each]


def test_the_torch_engine_gives_each_hypothesis_its_mean_token_log_probability(trained_model_dir, test_sentences):
    # The beam search's own figure, and for greedy search (transformers' loop) a forward pass: both the mean of the
    # model's log-probabilities of the tokens up to </s>, which transformers' raw logits give too.
    sources = list(test_sentences[0][:6])
    engine = load_engine(str(trained_model_dir), InferenceConfig(device="cpu"))
    model, tokenizer = engine.model, engine.tokenizer
    found = engine.scored_hypotheses(["", *sources], 3)
    assert found[0] == [Hypothesis("", None)]
    assert [[h.text for h in each] for each in found] == engine.hypotheses(["", *sources], 3)
    inputs = tokenizer(sources, return_tensors="pt", padding=True)
    with torch.inference_mode():
        beams = model.generate(**inputs, num_return_sequences=3, return_dict_in_generate=True)
    assert _confidences(found[1:]) == beams.sequences_confidence.tolist()

    greedy = TorchEngine(model, tokenizer, {"num_beams": 1})
    found = greedy.scored_hypotheses(sources)
    with torch.inference_mode():
        output = model.generate(**inputs, num_beams=1, return_dict_in_generate=True, output_logits=True)
    eos = tokenizer.eos_token_id
    for row, hypothesis in enumerate(each[0] for each in found):
        generated = output.sequences[row, 1:].tolist()
        length = generated.index(eos) + 1 if eos in generated else len(generated)
        log_probs = [output.logits[t][row].log_softmax(-1)[generated[t]].item() for t in range(length)]
        assert hypothesis.text == tokenizer.decode(generated[:length], skip_special_tokens=True).strip()
        assert hypothesis.confidence == pytest.approx(sum(log_probs) / length, abs=1e-4)


def test_a_glossary_puts_its_target_terms_into_the_translations_that_hold_its_source_terms(trained_model_dir, corpus):
    sources = list(corpus["test_2016_flickr"]["en"][:40])
    glossary = Glossary([("woman", "Dame"), ("dog", "Köter")])
    holding = [i for i, source in enumerate(sources) if glossary.matches(source)]
    assert 4 <= len(holding) < 20
    engine = load_engine(str(trained_model_dir), InferenceConfig(device="cpu"))
    plain = engine.scored_hypotheses(sources, 2)
    # One glossary for all, or one per sentence (None for none): the same translations.
    for given in (glossary, [glossary if i % 2 else None for i in range(len(sources))]):
        found = engine.scored_hypotheses(sources, 2, given)
        for i in range(len(sources)):
            uses = given if isinstance(given, Glossary) else given[i]
            terms = uses.matches(sources[i]) if uses else []
            if terms:  # each target term as a whole word, never the start of a longer one
                words = [re.compile(rf"(?<!\w){re.escape(term.target)}(?!\w)") for term in terms]
                assert all(word.search(h.text) for word in words for h in found[i]), (sources[i], found[i])
            else:
                assert found[i] == plain[i]
    assert sum(plain[i][0].text != found[i][0].text for i in holding) >= 2
    assert engine.translate(sources, glossary) == [
        each[0].text for each in engine.scored_hypotheses(sources, 1, glossary)
    ]
    with pytest.raises(ValueError, match="2 glossaries for 40 sentences"):
        engine.translate(sources, [glossary, None])
    greedy = TorchEngine(engine.model, engine.tokenizer, {"num_beams": 1})
    assert greedy.translate(sources[:3], Glossary([("zebra", "Zebra")])) == greedy.translate(sources[:3])
    with pytest.raises(ValueError, match="A glossary needs beam search of at least 2 beams .*; got 1"):
        greedy.translate(sources, glossary)


def test_the_ctranslate2_engine_scores_as_the_torch_engine_and_hands_glossary_sentences_to_it(
    trained_model_dir, corpus, tmp_path
):
    # CTranslate2's score is log P(Y|X) / |Y| ** penalty; the engine gives the same mean log-probability as the
    # model's beam search (to CTranslate2's own arithmetic). It has no lexical constraints: a sentence with a term is
    # translated by the model itself, and the others by CTranslate2, as without a glossary.
    pytest.importorskip("ctranslate2")
    sources = list(corpus["test_2016_flickr"]["en"][:40])
    glossary = Glossary([("woman", "Dame")])
    torch_engine = load_engine(str(trained_model_dir), InferenceConfig(device="cpu"))
    engine = load_engine(str(trained_model_dir), InferenceConfig(engine="ctranslate2", ctranslate2_dir=str(tmp_path)))
    hf = copy.deepcopy(engine.generation_config)
    hf.length_penalty_type = "hf"  # CTranslate2 searches with the penalty, whose score the engine undoes
    pairs = [
        (torch_engine, engine),
        (
            TorchEngine(torch_engine.model, torch_engine.tokenizer, {"length_penalty_type": "hf"}),
            CTranslate2Engine(tmp_path, engine.tokenizer, hf),
        ),
    ]
    for ours, theirs in ((a.scored_hypotheses(sources, 2), b.scored_hypotheses(sources, 2)) for a, b in pairs):
        same = [
            (a, b) for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y, strict=True) if a.text == b.text
        ]
        assert len(same) >= 60
        assert all(b.confidence == pytest.approx(a.confidence, abs=2e-3) for a, b in same)
    theirs = engine.scored_hypotheses(sources, 2)
    with_glossary = engine.scored_hypotheses(sources, 2, glossary)
    constrained = torch_engine.scored_hypotheses(sources, 2, glossary)
    for i, source in enumerate(sources):
        assert with_glossary[i] == (constrained[i] if glossary.matches(source) else theirs[i])


def test_a_model_of_another_class_translates_and_scores_but_refuses_a_glossary_in_one_line(tokenizer, test_sentences):
    # transformers' own Marian (the same function as ours: exchange.marian.to_marian) has no constrained beam search.
    from vaswani_transformer.exchange.marian import to_marian

    marian = to_marian(random_model(tokenizer, seed=2))
    marian.generation_config.max_new_tokens = 6
    engine = TorchEngine(marian, tokenizer)
    sources = list(test_sentences[0][:2])
    found = engine.scored_hypotheses(sources)
    assert [each[0].text for each in found] == engine.translate(sources)
    assert all(isinstance(each[0].confidence, float) for each in found)  # a forward pass gives them
    with pytest.raises(
        ValueError, match="^A glossary needs this package's constrained beam search, which MarianMTModel"
    ):
        engine.translate(sources, Glossary([("a", "ein")]))
