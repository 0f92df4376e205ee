"""Property tests with hypothesis: tokenizer round trip, padding invariance, causal masking, generate's limits.

Examples are few and small (a 2+2-layer model of width 32) so that the whole module runs in
seconds; hypothesis shrinks any failure to a minimal example and prints it.
"""

import unicodedata

import pytest
import torch
from conftest import random_model
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from vaswani_transformer.data.tokenizer import SPECIAL_TOKENS

VOCAB = 100
PAD, EOS = 0, 2
FEW = settings(max_examples=25, deadline=None)


@pytest.fixture(scope="module")
def models() -> dict:
    """One random tiny model per attention implementation (both must mask the same way)."""
    return {name: random_model(seed=5, attn_implementation=name) for name in ("sdpa", "eager")}


def ragged_batch(draw, batch: int | None = None, max_length: int = 10) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Right-padded random ids `(batch, max_len)`, their mask, and each row's length; padding holds random ids."""
    batch = batch or draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, max_length), min_size=batch, max_size=batch))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    # Ids from 3 on: never <pad>, <s> or </s> inside a sentence; the padding is random too, to
    # show that what masked positions hold does not matter.
    ids = torch.randint(3, VOCAB, (len(lengths), max(lengths)), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    return ids, mask, lengths


# Tokenizer ----------------------------------------------------------------------------------------


@FEW
@given(text=st.text(max_size=60))
def test_tokenizer_gives_back_any_nfc_text_without_special_token_strings(tokenizer, text):
    # The two documented exceptions (module docstring of tokenization.py, README): NFC
    # normalization, and the literal strings of the special tokens, which become those tokens.
    text = unicodedata.normalize("NFC", text)
    assume(not any(special in text for special in SPECIAL_TOKENS))
    ids = tokenizer(text)["input_ids"]
    assert ids[-1] == tokenizer.eos_token_id and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_what_the_tokenizer_does_not_give_back(tokenizer):
    # NFC composes "e" + combining acute into "é" and maps singletons such as the Angstrom sign.
    for text in ("caf\u0065\u0301", "5 \u212b"):
        decoded = tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True)
        assert decoded != text and decoded == unicodedata.normalize("NFC", text)
    # Special-token strings in the text are read as the special tokens, and dropped on decoding.
    ids = tokenizer("x </s> y <pad>")["input_ids"]
    assert ids.count(tokenizer.eos_token_id) == 2 and tokenizer.pad_token_id in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "x  y "


# Padding and masking ------------------------------------------------------------------------------


@FEW
@given(data=st.data(), implementation=st.sampled_from(["sdpa", "eager"]))
def test_padding_never_changes_what_the_model_computes_for_a_sentence(models, data, implementation):
    model = models[implementation]
    input_ids, attention_mask, source_lengths = ragged_batch(data.draw)
    decoder_ids, decoder_mask, target_lengths = ragged_batch(data.draw, batch=len(source_lengths))
    use_decoder_mask = data.draw(st.booleans())
    with torch.no_grad():
        batched = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_ids,
            decoder_attention_mask=decoder_mask if use_decoder_mask else None,
        )
        for row, (source_length, target_length) in enumerate(zip(source_lengths, target_lengths, strict=True)):
            alone = model(
                input_ids=input_ids[row : row + 1, :source_length],
                decoder_input_ids=decoder_ids[row : row + 1, :target_length],
            )
            torch.testing.assert_close(
                batched.encoder_last_hidden_state[row, :source_length],
                alone.encoder_last_hidden_state[0],
                atol=1e-5,
                rtol=1e-5,
            )
            torch.testing.assert_close(batched.logits[row, :target_length], alone.logits[0], atol=1e-5, rtol=1e-5)


@FEW
@given(data=st.data(), implementation=st.sampled_from(["sdpa", "eager"]))
def test_later_decoder_inputs_never_change_earlier_logits(models, data, implementation):
    model = models[implementation]
    input_ids, attention_mask, _ = ragged_batch(data.draw)
    target_length = data.draw(st.integers(2, 12))
    cut = data.draw(st.integers(1, target_length - 1))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    decoder_ids = torch.randint(3, VOCAB, (input_ids.shape[0], target_length), generator=generator)
    changed = decoder_ids.clone()
    changed[:, cut:] = torch.randint(3, VOCAB, changed[:, cut:].shape, generator=generator)
    with torch.no_grad():
        original = model(input_ids, attention_mask, decoder_input_ids=decoder_ids).logits
        altered = model(input_ids, attention_mask, decoder_input_ids=changed).logits
    torch.testing.assert_close(original[:, :cut], altered[:, :cut], atol=1e-6, rtol=1e-6)


# generate() ---------------------------------------------------------------------------------------


@FEW
@given(
    data=st.data(),
    num_beams=st.integers(1, 3),
    max_new_tokens=st.integers(1, 12),
    length_limit=st.none() | st.tuples(st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.integers(0, 5)),
    never_stop=st.booleans(),
)
def test_generate_on_random_inputs_never_crashes_and_respects_its_length_limits(
    models, data, num_beams, max_new_tokens, length_limit, never_stop
):
    model = models["sdpa"]
    input_ids, attention_mask, source_lengths = ragged_batch(data.draw)
    kwargs = dict(num_beams=num_beams, max_new_tokens=max_new_tokens, pad_token_id=PAD, eos_token_id=EOS)
    if length_limit is not None:
        kwargs.update(max_length_a=length_limit[0], max_length_b=length_limit[1])
    if never_stop:
        kwargs["suppress_tokens"] = [EOS]  # only a length limit can end a sentence
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    assert output.shape[0] == input_ids.shape[0]
    assert 2 <= output.shape[1] <= 1 + max_new_tokens, "decoder start token + at most max_new_tokens"
    assert output[:, 0].eq(model.config.decoder_start_token_id).all()
    if length_limit is not None:
        a, b = length_limit
        for row, source_length in enumerate(source_lengths):
            tokens = output[row, 1:].tolist()
            before_end = tokens.index(EOS) if EOS in tokens else len(tokens)
            assert before_end <= int(a * source_length + b), (row, tokens)
            if never_stop and a * source_length + b < max_new_tokens:
                assert before_end == int(a * source_length + b), "the limit, not max_new_tokens, ended it"
