"""Decoding as §6.1 decodes (`generation_vaswani.py`): beam search, length penalty and limit, against transformers."""

import json
import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import load_each_without_package, random_model
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, GenerationConfig
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

from vaswani_transformer.model import layers_vaswani

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_greedy_generate_equals_a_hand_written_greedy_search(tokenizer, test_sentences):
    model = random_model(tokenizer, seed=5)
    inputs = tokenizer(test_sentences[0][:4], padding=True, return_tensors="pt")
    generated = model.generate(**inputs, num_beams=1, do_sample=False, max_new_tokens=12)
    for row, (ids, mask) in enumerate(zip(inputs["input_ids"], inputs["attention_mask"], strict=True)):
        decoded = torch.tensor([[model.config.decoder_start_token_id]])
        with torch.no_grad():
            for _ in range(12):
                logits = model(input_ids=ids[None], attention_mask=mask[None], decoder_input_ids=decoded).logits[0, -1]
                logits[model.generation_config.suppress_tokens] = float("-inf")  # <pad> and <s> (§6.1 config)
                next_id = logits.argmax()
                decoded = torch.cat([decoded, next_id.view(1, 1)], dim=1)
                if next_id == model.config.eos_token_id:
                    break
        expected = decoded[0].tolist()
        assert generated[row, : len(expected)].tolist() == expected
        assert (generated[row, len(expected) :] == model.config.pad_token_id).all()


def test_beam_search_uses_the_key_value_cache_and_matches_decoding_without_it(tokenizer, test_sentences):
    model = random_model(tokenizer, seed=7)
    inputs = tokenizer(test_sentences[0][:3], padding=True, return_tensors="pt")
    with_cache = model.generate(**inputs, num_beams=4, max_new_tokens=10, use_cache=True)
    without_cache = model.generate(**inputs, num_beams=4, max_new_tokens=10, use_cache=False)
    assert torch.equal(with_cache, without_cache)


def test_each_sentence_of_a_batch_stops_at_its_own_length_limit(tokenizer, test_sentences):
    # §6.1: output length at most input length + 50 (here + 3, and </s> otherwise suppressed so
    # that every sentence runs into its limit).
    model = random_model(tokenizer, seed=8)
    inputs = tokenizer(test_sentences[0][:4], padding=True, return_tensors="pt")
    source_lengths = inputs["attention_mask"].sum(-1)
    assert len(set(source_lengths.tolist())) > 1
    for num_beams in (1, 3):
        generated = model.generate(
            **inputs, num_beams=num_beams, max_length_a=1.0, max_length_b=3, suppress_tokens=[2], max_new_tokens=200
        )
        # Tokens before the first </s> (HF's beam search pads finished rows with </s> when pad is id 0).
        output_lengths = (generated[:, 1:] == tokenizer.eos_token_id).int().argmax(-1)
        assert output_lengths.tolist() == (source_lengths + 3).tolist()


@pytest.mark.parametrize("penalty_type", ["gnmt", "hf"])
def test_finished_beam_hypotheses_score_log_probability_over_the_length_penalty(
    trained_model_dir, test_sentences, penalty_type
):
    # §6.1 uses the GNMT penalty lp(Y) = ((5 + |Y|) / 6) ** alpha; HF's |Y| ** alpha stays available.
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    assert model.generation_config.length_penalty_type == "gnmt"  # the paper's, by default
    inputs = tokenizer(test_sentences[0][:4], padding=True, return_tensors="pt")
    output = model.generate(
        **inputs,
        num_beams=4,
        num_return_sequences=4,
        length_penalty=0.6,
        length_penalty_type=penalty_type,
        return_dict_in_generate=True,
        output_scores=True,
        max_new_tokens=60,
    )
    eos = model.config.eos_token_id
    checked = 0
    for row, sequence in enumerate(output.sequences):
        generated = sequence[1:]
        if not (generated == eos).any():
            continue
        length = int((generated == eos).int().argmax()) + 1  # |Y| counts </s>
        source = row // 4
        with torch.no_grad():
            logits = model(
                input_ids=inputs["input_ids"][source : source + 1],
                attention_mask=inputs["attention_mask"][source : source + 1],
                decoder_input_ids=sequence[None, :length],
            ).logits
        log_probability = logits[0].log_softmax(-1).gather(-1, generated[:length, None]).sum().item()
        penalty = ((5 + length) / 6) ** 0.6 if penalty_type == "gnmt" else length**0.6
        assert output.sequences_scores[row].item() == pytest.approx(log_probability / penalty, abs=1e-4)
        checked += 1
    assert checked >= 8


@needs_cuda
@pytest.mark.skipif(torch.cuda.is_available() and not torch.cuda.is_bf16_supported(), reason="needs bfloat16")
def test_bfloat16_decoding_on_cuda_spells_out_eq_1_only_while_cudnn_attention_is_enabled(
    trained_model_dir, test_sentences, monkeypatch
):
    # In 16-bit dtypes PyTorch's SDPA may take cuDNN's kernel, whose plan for every new shape would stall
    # nearly every decoding step: decoding steps then spell out Eq. 1. Once cuDNN's kernel is off (as
    # `train` turns it off), they keep SDPA's flash and memory-efficient kernels.
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir, dtype=torch.bfloat16).to("cuda").eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    inputs = tokenizer(test_sentences[0][:8], padding=True, return_tensors="pt").to("cuda")
    eager_calls = {"n": 0}
    eager = layers_vaswani.scaled_dot_product_attention

    def counted_eager(*args, **kwargs):
        eager_calls["n"] += 1
        return eager(*args, **kwargs)

    monkeypatch.setattr(layers_vaswani, "scaled_dot_product_attention", counted_eager)
    was_enabled = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        counts = []
        for enabled, dtype in ((True, torch.bfloat16), (False, torch.bfloat16), (True, torch.float32)):
            torch.backends.cuda.enable_cudnn_sdp(enabled)
            eager_calls["n"] = 0
            with torch.no_grad():
                ids = model.to(dtype).generate(**inputs)
            counts.append(eager_calls["n"])
            assert ids.shape[0] == 8
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was_enabled)
    layers = model.config.decoder_layers
    assert counts[0] >= 2 * layers * 3  # self- and cross-attention of each layer, at every step of at least 3
    assert counts[1] == counts[2] == 0  # cuDNN's attention off, or float32, which never takes it


def test_unknown_length_penalty_type_is_rejected(tokenizer, test_sentences):
    inputs = tokenizer(test_sentences[0][:1], return_tensors="pt")
    with pytest.raises(ValueError, match="length_penalty_type"):
        random_model(tokenizer).generate(**inputs, length_penalty_type="wu")


def test_low_memory_beam_search_is_refused_as_transformers_refuses_it(tokenizer, test_sentences):
    inputs = tokenizer(test_sentences[0][:1], return_tensors="pt")
    with pytest.raises(ValueError, match="low_memory"):
        random_model(tokenizer).generate(**inputs, num_beams=4, low_memory=True)


def test_generate_from_four_threads_at_once_gives_each_call_what_it_gives_alone(trained_model_dir, test_sentences):
    # One model serves many threads: the length penalty of one call, and its form, never reach another.
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    inputs = tokenizer(list(test_sentences[0]), padding=True, return_tensors="pt")
    calls = [
        dict(
            length_penalty_type=penalty_type, early_stopping=early_stopping, num_return_sequences=4, length_penalty=2.0
        )
        for penalty_type in ("gnmt", "hf")
        for early_stopping in (True, False)
    ] + [dict(length_penalty_type="hf", output_scores=True, return_dict_in_generate=True)]  # transformers' own loop
    calls[-1]["num_beams"] = 3

    def sequences(output):
        return output if torch.is_tensor(output) else output.sequences

    alone = [sequences(model.generate(**inputs, **call)) for call in calls]
    assert not torch.equal(alone[0], alone[2]) and not torch.equal(alone[1], alone[3])  # the two penalties differ
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(3):
            futures = [pool.submit(model.generate, **inputs, **call) for call in calls]
            for future, expected in zip(futures, alone, strict=True):
                assert torch.equal(sequences(future.result()), expected)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_decoding_with_a_static_cache_gives_what_the_dynamic_cache_gives(trained_model_dir, corpus, num_beams):
    # A static cache (`cache_implementation="static"`, the road to a compiled decoding step) holds empty slots that
    # the mask hides, and takes transformers' own beam search instead of ours: the translations must not change.
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    inputs = tokenizer(corpus["test_2016_flickr"]["en"][:24], padding=True, return_tensors="pt")
    dynamic = model.generate(**inputs, num_beams=num_beams)
    static = model.generate(**inputs, num_beams=num_beams, cache_implementation="static")
    width = min(dynamic.shape[1], static.shape[1])  # the static run may pad its rows further
    assert torch.equal(dynamic[:, :width], static[:, :width])
    assert (dynamic[:, width:] == model.config.pad_token_id).all() and (
        static[:, width:] == model.config.pad_token_id
    ).all()


def test_a_decoder_prompt_is_continued_as_transformers_continues_it(tokenizer, test_sentences):
    # A prompt longer than the decoder start needs its keys and values before the first step: transformers' loop.
    model = random_model(tokenizer, seed=9)
    inputs = tokenizer(test_sentences[0][:4], padding=True, return_tensors="pt")
    prompt = model.generate(**inputs, num_beams=4, max_new_tokens=3, min_new_tokens=3)
    ours = model.generate(**inputs, decoder_input_ids=prompt, max_new_tokens=8)
    reference = model.generate(**inputs, decoder_input_ids=prompt, max_new_tokens=8, return_dict_in_generate=True)
    assert prompt.shape[1] == 4 and torch.equal(ours[:, :4], prompt)
    assert torch.equal(ours, reference.sequences)


def test_a_given_generation_config_keeps_the_models_penalty_form(trained_model_dir, test_sentences):
    # transformers fills what a given config leaves unset from the model's: the paper's GNMT penalty (§6.1) included.
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir).eval()
    inputs = AutoTokenizer.from_pretrained(trained_model_dir)(
        list(test_sentences[0]), padding=True, return_tensors="pt"
    )
    settings = dict(max_new_tokens=60, length_penalty=2.0)
    with_kwargs = model.generate(**inputs, **settings)
    given = GenerationConfig(**settings)
    logging.Logger.warning_once.cache_clear()  # transformers warns once per message and process
    with CaptureLogger(hf_logging.get_logger("transformers.generation.utils")) as captured:
        with_config = model.generate(**inputs, generation_config=given)
    hf_penalty = model.generate(**inputs, **settings, length_penalty_type="hf")
    assert torch.equal(with_config, with_kwargs) and not torch.equal(with_config, hf_penalty)
    # What generate() adds (the penalty's form, the length limit) goes into a copy of the given config, not
    # beside it as arguments, which transformers deprecates; the caller's config stays as it was.
    assert "is deprecated" not in captured.out, captured.out
    assert given.to_dict() == GenerationConfig(**settings).to_dict() and type(given.length_penalty) is float


def test_an_explicit_max_length_bounds_the_output_as_in_transformers(tokenizer, test_sentences):
    # The model's generation config sets max_new_tokens, which transformers would let overrule max_length.
    model = random_model(tokenizer, seed=11)
    inputs = tokenizer(test_sentences[0][:4], padding=True, return_tensors="pt")
    assert model.generate(**inputs, max_length=6).shape == (4, 6)
    with CaptureLogger(hf_logging.get_logger("transformers.generation.utils")) as captured:
        assert model.generate(**inputs, generation_config=GenerationConfig(max_length=6)).shape == (4, 6)
    assert "seem to have been set" not in captured.out, captured.out  # the limit it became does not clash with it
    assert model.generate(**inputs, max_length=6, num_beams=1).shape == (4, 6)


def test_stopping_criteria_and_special_tokens_of_the_call_are_honoured_as_in_transformers(tokenizer, test_sentences):
    from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

    model = random_model(tokenizer, seed=11)
    inputs = tokenizer(test_sentences[0][:4], padding=True, return_tensors="pt")

    def both(**options):  # our generate(), and transformers' loop (asked for per-step scores)
        ours = model.generate(**inputs, **options)
        return ours, model.generate(**inputs, **options, return_dict_in_generate=True, output_scores=True).sequences

    for criterion in (MaxLengthCriteria(max_length=4), EosTokenCriteria(eos_token_id=5)):
        ours, reference = both(stopping_criteria=StoppingCriteriaList([criterion]))
        assert torch.equal(ours, reference), type(criterion).__name__
    # The per-sentence limit (§6.1) ends a sentence with this call's </s>, not the model's.
    ended = model.generate(**inputs, eos_token_id=5, max_length_b=3, num_beams=1)
    assert all(5 in row.tolist() for row in ended)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(**inputs, max_new_tokens=0)


def test_learned_positions_cap_the_length_without_raising_max_length(tokenizer, test_sentences):
    model = random_model(tokenizer, seed=11, position_embedding_type="learned", max_position_embeddings=100)
    config = model.generation_config
    config.max_new_tokens = config.max_length_a = config.max_length_b = None
    config.max_length = 10
    inputs = tokenizer(test_sentences[0][:2], padding=True, return_tensors="pt")
    assert model.generate(**inputs, num_beams=1).shape[1] <= 10


@pytest.mark.parametrize("num_beams", [1, 3])
def test_learned_positions_stop_generation_at_the_last_position_after_a_decoder_prompt(tokenizer, num_beams):
    # Table 3, row E: no position vector beyond max_position_embeddings. A prompt of 3 tokens takes 3 of the 8
    # positions; of the new tokens all but the last are fed back, so 8 + 1 - 3 = 6 new tokens fit: 9 in all.
    model = random_model(tokenizer, seed=11, position_embedding_type="learned", max_position_embeddings=8)
    model.generation_config.max_length_a = model.generation_config.max_length_b = None
    inputs = tokenizer(["Two dogs run."], return_tensors="pt")  # fewer than 8 tokens: the encoder's positions
    prompt = torch.tensor([[model.config.decoder_start_token_id, 100, 101]])
    suppress = [model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id]  # never ends early
    output = model.generate(**inputs, decoder_input_ids=prompt, num_beams=num_beams, suppress_tokens=suppress)
    assert output.shape == (1, 9) and torch.equal(output[:, :3], prompt)


# generation_config.json values that cannot decode: (the change, what the refusal must name besides the file).
GENERATION_CONFIGS_THAT_CANNOT_DECODE = [
    ({"length_penalty": "abc"}, ["length_penalty", "a finite number such as 0.6", "'abc'"]),
    ({"num_beams": -1}, ["num_beams", "at least 1"]),
    ({"max_new_tokens": 0}, ["max_new_tokens", "greater than 0"]),
    ({"length_penalty_type": "wu"}, ["length_penalty_type", "'gnmt'", "'hf'"]),
    ({"max_length_b": "fifty"}, ["max_length_b", "a number of at least 0"]),
]


def test_a_generation_config_json_that_cannot_decode_is_refused_at_load_naming_the_file(tmp_path):
    # It loaded, and generate() then failed with a TypeError, or with a message that did not say where the value was.
    model = random_model()
    directories = []
    for number, (changes, _) in enumerate(GENERATION_CONFIGS_THAT_CANNOT_DECODE):
        directory = tmp_path / str(number)
        model.save_pretrained(directory)
        saved = json.loads((directory / "generation_config.json").read_text())
        (directory / "generation_config.json").write_text(json.dumps({**saved, **changes}))
        directories.append(directory)
    refusals, stderr = load_each_without_package(directories, cwd=tmp_path)
    for directory, refused_remotely, (changes, names) in zip(
        directories, refusals, GENERATION_CONFIGS_THAT_CANNOT_DECODE, strict=True
    ):
        with pytest.raises(ValueError) as refused:
            AutoModelForSeq2SeqLM.from_pretrained(directory)
        for message in (str(refused.value), refused_remotely):
            assert message is not None and "\n" not in message, (changes, message)
            assert str(directory / "generation_config.json") in message, message
            assert all(name in message for name in names), (names, message)


def test_generate_refuses_a_length_penalty_that_is_no_number_as_a_value_error(tokenizer, test_sentences):
    inputs = tokenizer(test_sentences[0][:1], return_tensors="pt")
    model = random_model(tokenizer)
    with pytest.raises(ValueError, match="length_penalty must be a finite number such as 0.6, got 'abc'"):
        model.generate(**inputs, length_penalty="abc")
    with pytest.raises(ValueError, match="length_penalty must be a finite number such as 0.6, got 'abc'"):
        model.generate(**inputs, generation_config=GenerationConfig(num_beams=2, length_penalty="abc"))


@pytest.mark.parametrize(
    "shape, what", [((0, 5), "an empty batch"), ((0, 0), "an empty batch"), ((2, 0), "a source of length 0")]
)
def test_generate_refuses_an_empty_batch_or_source_saying_which(shape, what):
    model = random_model()
    ids = torch.ones(shape, dtype=torch.long)
    for num_beams in (1, 4):
        with pytest.raises(ValueError, match=f"generate\\(\\) got {what}"):
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=num_beams)
        with pytest.raises(ValueError, match=f"generate\\(\\) got {what}"):
            model.generate(ids, num_beams=num_beams)


@pytest.mark.parametrize(
    ("glossary_ids", "options", "message"),
    [
        (
            [[[5]]],
            {},
            r"one list of terms per sentence of the batch of 2 \(input_ids\), \[\] for a sentence without; "
            "got 1 lists",
        ),
        ([[[5]], None], {}, r"glossary_ids\[1\] = None: give a list of terms"),
        ([[[5], []], []], {}, r"glossary_ids\[0\]\[1\] = \[\]: a term is a non-empty list of token ids"),
        ([[[5, 2]], []], {}, r"glossary_ids\[0\]\[0\] = \[5, 2\]: .* without </s> \(\[2\]\)"),
        ([[[5, 10**6]], []], {}, r"below the vocabulary size"),
        (
            [[[5]], []],
            {"num_beams": 1},
            r"need beam search, with num_beams of at least 2 and no sampling; got num_beams=1",
        ),
        ([[[5]], []], {"do_sample": True}, r"and do_sample=True"),
        ([[[5]], []], {"glossary_suffix_ids": [5, -1]}, r"glossary_suffix_ids must be a list of token ids below"),
        # What only transformers' loop gives (every step's scores) cannot come with constraints.
        ([[[5]], []], {"return_dict_in_generate": True, "output_scores": True}, r"need this model's own beam search"),
    ],
)
def test_glossary_ids_that_cannot_be_decoded_are_refused_saying_why(
    tokenizer, test_sentences, glossary_ids, options, message
):
    model = random_model(tokenizer)
    inputs = tokenizer(test_sentences[0][:2], padding=True, return_tensors="pt")
    with pytest.raises(ValueError, match=message):
        model.generate(**inputs, glossary_ids=glossary_ids, max_new_tokens=4, **options)


def test_glossary_ids_travel_with_their_call_among_threads(trained_model_dir, test_sentences):
    # One model serves many threads: the terms of one call never reach another's sentences.
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    inputs = tokenizer(list(test_sentences[0]), padding=True, return_tensors="pt")
    words = [" Dame", " Hut", " roter Hut", None]
    calls = [[[tokenizer(w, add_special_tokens=False)["input_ids"]]] * 8 if w else None for w in words]
    alone = [model.generate(**inputs, glossary_ids=ids) for ids in calls]
    assert len({tuple(output.flatten().tolist()) for output in alone}) == 4
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(2):
            futures = [pool.submit(model.generate, **inputs, glossary_ids=ids) for ids in calls]
            for future, expected in zip(futures, alone, strict=True):
                assert torch.equal(future.result(), expected)
