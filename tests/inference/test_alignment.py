"""Word alignments from the encoder-decoder attention (`alignment.py`): one teacher-forced pass over a source and its
translation, subwords merged into words, the same whichever engine translated."""

import pytest
import torch

from vaswani_transformer.data.segmentation import word_spans
from vaswani_transformer.inference.alignment import Aligner, aligner_for, format_alignment
from vaswani_transformer.inference.engines import Engine, TorchEngine, load_translator
from vaswani_transformer.inference.translation import translate


@pytest.fixture(scope="module")
def translator(trained_model_dir):
    return load_translator(str(trained_model_dir), "cpu")


def test_alignments_pair_words_of_both_sides_and_do_not_depend_on_the_batch(translator, corpus):
    model, tokenizer = translator
    sources = list(corpus["test_2016_flickr"]["en"][:8])
    targets = translate(model, tokenizer, sources)
    aligner = Aligner(model, tokenizer)
    together = aligner.align(sources, targets)
    for source, target, pairs in zip(sources, targets, together, strict=True):
        assert pairs == sorted(set(pairs)) and pairs
        assert all(0 <= i < len(word_spans(source)) and 0 <= j < len(word_spans(target)) for i, j in pairs)
    # Padding changes nothing: each pair aligned alone gives what it gave in the batch of eight.
    assert [aligner.align([s], [t])[0] for s, t in zip(sources, targets, strict=True)] == together
    assert aligner.align(["A dog.", "  "], ["", "Ein Hund."]) == [[], []]
    assert format_alignment([(0, 0), (1, 2), (2, 1)]) == "0-0 1-2 2-1"


def test_each_target_word_takes_the_source_word_its_tokens_attend_to_most(translator):
    # Recomputed by hand from the attention weights of the pass `utils.plotting.attention_maps` makes.
    model, tokenizer = translator
    source, target = "A dog runs on the beach.", translate(model, tokenizer, ["A dog runs on the beach."])[0]
    inputs = tokenizer(source, return_tensors="pt", return_offsets_mapping=True)
    labels = tokenizer(target, return_tensors="pt", return_offsets_mapping=True)
    with torch.no_grad():
        output = model(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            decoder_input_ids=model.prepare_decoder_input_ids_from_labels(labels["input_ids"]),
            output_attentions=True,
        )
    weights = output.cross_attentions[-1][0].mean(dim=0)[:-1, :-1]  # without </s> on either side
    source_words, target_words = word_spans(source), word_spans(target)
    source_offsets = inputs["offset_mapping"][0, :-1].tolist()
    target_offsets = labels["offset_mapping"][0, :-1].tolist()

    def word(spans, offset):
        return next(k for k, (start, end) in enumerate(spans) if start < offset[1] and end > offset[0])

    # Row q is the step that predicts target token q; column p is source token p.
    forward = {
        (word(source_words, source_offsets[int(row.argmax())]), word(target_words, target_offsets[q]))
        for q, row in enumerate(weights)
    }
    backward = {
        (word(source_words, source_offsets[p]), word(target_words, target_offsets[int(column.argmax())]))
        for p, column in enumerate(weights.T)
    }
    agreed = forward & backward
    expected = agreed | {(i, j) for i, j in forward if i not in {a for a, _ in agreed}}
    assert Aligner(model, tokenizer, layer=-1).align([source], [target])[0] == sorted(expected)


def test_another_engines_aligner_loads_the_torch_model_and_a_layer_it_lacks_is_refused(translator, trained_model_dir):
    model, tokenizer = translator

    class Elsewhere(Engine):  # an engine without a torch model, as CTranslate2's
        name = "elsewhere"

    source, target = "Two men sit on a bench.", "Zwei Männer sitzen auf einer Bank."
    own = aligner_for(TorchEngine(model, tokenizer)).align([source], [target])
    assert aligner_for(Elsewhere(), str(trained_model_dir), "cpu").align([source], [target]) == own
    with pytest.raises(ValueError, match="takes the torch model: give its directory"):
        aligner_for(Elsewhere())
    with pytest.raises(ValueError, match=r"alignment layer 2 is no decoder layer: the model has 2 \(0 to 1\)"):
        Aligner(model, tokenizer, layer=2)
