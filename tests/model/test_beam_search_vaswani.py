"""The fast beam search of §6.1 (`beam_search_vaswani.py`): transformers' hypotheses, with less work per step."""

import math

import pytest
import torch
from conftest import random_model
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
from transformers.generation import logits_process

from vaswani_transformer.model import beam_search_vaswani, generation_vaswani

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(
    "options",
    [
        {},  # the paper's: beam 4, GNMT penalty 0.6, output length at most input length + 50
        {"length_penalty_type": "hf", "num_beams": 5, "length_penalty": 1.0},
        {"num_return_sequences": 4, "length_penalty": 2.0},  # all finished hypotheses, in order
        {"num_return_sequences": 2, "max_length_a": 0.5, "max_length_b": 2, "no_repeat_ngram_size": 2},
        # Token masks, added once per step, before and after a ForcedBOS processor.
        {"min_new_tokens": 12, "min_length": 6, "num_return_sequences": 2},
        {"forced_bos_token_id": 5, "min_new_tokens": 3},
        {"repetition_penalty": 1.3, "num_beams": 3},  # a processor that returns a non-contiguous view
        # transformers' default stopping: a sentence goes on while its best beam may still beat a finished one.
        {"early_stopping": False},
        {"early_stopping": False, "length_penalty_type": "hf", "length_penalty": 1.0, "num_return_sequences": 3},
        {"early_stopping": "never", "num_return_sequences": 2, "length_penalty": 2.0},
        {"early_stopping": "never", "length_penalty": -0.5},
        # Per-sentence state: every sentence stays in the batch, and a full one takes no more hypotheses.
        {"encoder_no_repeat_ngram_size": 3, "num_return_sequences": 4, "length_penalty": 2.0},
    ],
)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_beam_search_returns_what_transformers_beam_search_returns(
    trained_model_dir, test_sentences, monkeypatch, options, device
):
    # generate() runs our beam search, which drops finished sentences from the batch; asking for
    # per-step scores runs transformers' own loop instead. Both must give the same hypotheses, on a GPU
    # too, where the beam-search cache runs its CUDA path (in float32, so that both see the same scores).
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    inputs = tokenizer(test_sentences[0][:48], padding=True, return_tensors="pt").to(device)
    calls = {"search": 0, "batch_narrowed": 0}
    search, select = generation_vaswani.beam_search, generation_vaswani.SourceLengthLimit.select

    def counted_search(*args, **kwargs):
        calls["search"] += 1
        return search(*args, **kwargs)

    def counted_select(self, sentences):
        calls["batch_narrowed"] += 1
        return select(self, sentences)

    monkeypatch.setattr(generation_vaswani, "beam_search", counted_search)
    monkeypatch.setattr(generation_vaswani.SourceLengthLimit, "select", counted_select)
    with torch.no_grad():
        ours = model.generate(**inputs, **options)
        reference = model.generate(**inputs, **options, return_dict_in_generate=True, output_scores=True).sequences
    assert calls["search"] == 1
    assert (calls["batch_narrowed"] > 0) == ("encoder_no_repeat_ngram_size" not in options)
    assert torch.equal(ours, reference)


@pytest.mark.parametrize(
    ("options", "first_step_rows_per_sentence"), [({}, 1), ({"encoder_no_repeat_ngram_size": 3}, 4)]
)
def test_beam_search_decodes_one_row_per_sentence_at_the_first_step(
    trained_model_dir, test_sentences, options, first_step_rows_per_sentence
):
    # The num_beams rows of a sentence are identical before the first step: one of them is enough, unless a
    # logits processor reads the beams of a sentence together. A sentence's beams are one decoder row of as many
    # queries (`BeamSearch._log_probs`), so the decoder's inputs are counted, not its rows.
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    inputs = tokenizer(test_sentences[0][:6], padding=True, return_tensors="pt")
    rows = []
    model.model.decoder.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    with torch.no_grad():
        model.generate(**inputs, num_beams=4, **options)
    assert rows[0] == 6 * first_step_rows_per_sentence
    assert rows[1] == 6 * 4


def test_top_k_gives_what_torch_topk_gives(trained_model_dir, test_sentences):
    # Beam candidates as beam search ranks them: a trained model's next-token log-probabilities for
    # 8 sentences taken as 2 x 4 beams, with suppressed tokens at -inf, cut to whole chunks of 32 (also
    # in column-major layout), to a few chunks, and to a length that 32 does not divide (which goes to
    # torch.topk whole).
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    inputs = tokenizer(list(test_sentences[0]), padding=True, return_tensors="pt")
    start = torch.full((8, 1), model.config.decoder_start_token_id)
    with torch.no_grad():
        log_probs = model(**inputs, decoder_input_ids=start).logits[:, -1].log_softmax(-1)
    log_probs[:, [tokenizer.pad_token_id, tokenizer.bos_token_id]] = -math.inf
    candidates = log_probs.view(2, -1)
    whole_chunks = candidates.shape[1] // 32 * 32
    column_major = candidates[:, :whole_chunks].t().contiguous().t()  # same scores, not laid out row by row
    for scores in (
        candidates[:, :whole_chunks],
        column_major,
        candidates[:, : 9 * 32],
        candidates[:, : whole_chunks - 7],
    ):
        for k in (1, 8):
            values, indices = beam_search_vaswani.top_k(scores, k)
            expected = scores.topk(k)
            assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)
    # Scores rounded to half a nat tie by the hundred: the same values, and k distinct indices that hold them.
    tied = candidates[:, :whole_chunks].mul(2).round().div(2)
    values, indices = beam_search_vaswani.top_k(tied, 8)
    assert torch.equal(values, tied.topk(8).values) and torch.equal(tied.gather(1, indices), values)
    assert all(len(set(row)) == 8 for row in indices.tolist())


def test_token_masks_move_first_only_past_processors_that_keep_minus_infinity():
    # Forcing a token overwrites every score, so a mask after it would change the result if it ran first.
    lp = logits_process
    min_new = lp.MinNewTokensLengthLogitsProcessor(1, 3, eos_token_id=2)
    repetition = lp.RepetitionPenaltyLogitsProcessor(1.2)
    forced = lp.ForcedBOSTokenLogitsProcessor(5)
    suppress = lp.SuppressTokensLogitsProcessor([0, 1])
    masks, others = beam_search_vaswani._hoist_token_masks([repetition, min_new, forced, suppress])
    assert list(masks) == [min_new] and list(others) == [repetition, forced, suppress]


def test_beam_search_returns_an_ordinary_tensor_outside_inference_mode(tokenizer, test_sentences):
    # The search runs in inference mode; what it returns may be changed in place, as transformers' output may.
    model = random_model(tokenizer, seed=3)
    inputs = tokenizer(test_sentences[0][:4], return_tensors="pt", padding=True)
    output = model.generate(**inputs, num_beams=4, max_new_tokens=8)
    assert not output.is_inference()
    output[:, 0] = tokenizer.pad_token_id
    with torch.inference_mode():
        again = model.generate(**inputs, num_beams=4, max_new_tokens=8)
    assert torch.equal(again[:, 1:], output[:, 1:])


def test_every_sequence_s_confidence_is_its_mean_token_log_probability_as_a_forward_pass_gives_it(
    trained_model_dir, corpus
):
    # generate(..., return_dict_in_generate=True) from our beam search: sequences_scores as transformers' loop gives
    # them, and log P(Y|X) / |Y| (tokens with </s>, no length penalty), constrained or not.
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    sentences = corpus["test_2016_flickr"]["en"][48:72]
    inputs = tokenizer(sentences, padding=True, return_tensors="pt")
    dame = tokenizer(" Dame", add_special_tokens=False)["input_ids"]
    terms = [[dame] if i % 3 == 0 else [] for i in range(len(sentences))]
    eos = model.config.eos_token_id
    with torch.no_grad():
        reference = model.generate(**inputs, num_return_sequences=4, return_dict_in_generate=True, output_scores=True)
        for glossary_ids in (None, terms):
            output = model.generate(
                **inputs, num_return_sequences=4, return_dict_in_generate=True, glossary_ids=glossary_ids
            )
            assert isinstance(output, beam_search_vaswani.BeamSearchOutput)
            if glossary_ids is None:
                assert torch.equal(output.sequences, reference.sequences)
                assert torch.allclose(output.sequences_scores, reference.sequences_scores, atol=1e-4)
            for row, sequence in enumerate(output.sequences):
                generated = sequence[1:].tolist()
                length = generated.index(eos) + 1 if eos in generated else len(generated)
                logits = model(
                    input_ids=inputs["input_ids"][row // 4 : row // 4 + 1],
                    attention_mask=inputs["attention_mask"][row // 4 : row // 4 + 1],
                    decoder_input_ids=sequence[None, :length],
                ).logits
                log_probs = logits[0].log_softmax(-1).gather(-1, sequence[1 : length + 1, None])
                assert output.sequences_confidence[row].item() == pytest.approx(log_probs.mean().item(), abs=1e-4)
