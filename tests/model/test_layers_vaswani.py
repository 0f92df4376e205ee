"""The layers of §3 (`layers_vaswani.py`): positions, attention, feed-forward, on real Multi30k sentences."""

import math

import pytest
import torch
from conftest import random_model, seq2seq_batch

from vaswani_transformer.model.layers_vaswani import (
    SinusoidalPositionalEncoding,
    eager_attention_is_faster,
)


def test_positional_encoding_is_the_formula_of_section_3_5():
    d_model = 16
    encoding = SinusoidalPositionalEncoding(d_model)(torch.arange(50))
    expected = torch.empty(50, d_model, dtype=torch.float64)
    for pos in range(50):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            expected[pos, 2 * i] = math.sin(angle)
            expected[pos, 2 * i + 1] = math.cos(angle)
    torch.testing.assert_close(encoding.double(), expected, atol=2e-5, rtol=0)


def test_positional_encoding_has_no_length_limit():
    encoding = SinusoidalPositionalEncoding(8)
    far = encoding(torch.tensor([100_000]))
    assert far.shape == (1, 8) and torch.isfinite(far).all()
    torch.testing.assert_close(encoding(torch.arange(3)), encoding(torch.arange(5))[:3])


def test_attention_projections_have_no_bias():
    model = random_model()
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "k_proj", "v_proj", "out_proj")):
            assert module.bias is None, name


def test_sdpa_and_eager_attention_agree_and_eager_returns_every_attention_map(tokenizer, test_sentences):
    batch = seq2seq_batch(tokenizer, test_sentences[0][:3], test_sentences[1][:3])
    sdpa = random_model(tokenizer, seed=3)
    eager = random_model(tokenizer, seed=3, attn_implementation="eager")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    inputs["decoder_input_ids"] = sdpa.prepare_decoder_input_ids_from_labels(batch["labels"])
    kernel = sdpa(**inputs)  # with gradients enabled, every attention runs PyTorch's fused kernel
    asked = sdpa(**inputs, output_attentions=True)  # asking for the weights spells Eq. 1 out, the causal mask too
    with torch.no_grad():
        mixed = sdpa(**inputs)  # without, short inputs take the eager path on the CPU
        b = eager(**batch, output_attentions=True)
    torch.testing.assert_close(kernel.logits, b.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed.logits, b.logits, atol=1e-5, rtol=1e-5)
    for name in ("logits", "encoder_attentions", "decoder_attentions", "cross_attentions"):
        torch.testing.assert_close(getattr(asked, name), getattr(b, name), atol=1e-5, rtol=1e-5)
    source_len, target_len = batch["input_ids"].shape[1], batch["labels"].shape[1]
    assert len(b.encoder_attentions) == len(b.decoder_attentions) == len(b.cross_attentions) == 2
    assert b.encoder_attentions[0].shape == (3, 4, source_len, source_len)
    assert b.decoder_attentions[0].shape == (3, 4, target_len, target_len)
    assert b.cross_attentions[0].shape == (3, 4, target_len, source_len)
    torch.testing.assert_close(b.cross_attentions[1].sum(-1), torch.ones(3, 4, target_len))
    # Padding gets no attention, and no position attends to a later one.
    padding = batch["attention_mask"] == 0
    assert b.encoder_attentions[0].masked_select(padding[:, None, None, :]).abs().max() == 0
    assert torch.triu(b.decoder_attentions[0], diagonal=1).abs().max() == 0


def test_explicit_head_sizes_shape_the_projections():
    model = random_model(num_attention_heads=2, d_k=8, d_v=12)
    attention = model.model.encoder.layers[0].self_attn
    assert attention.q_proj.weight.shape == attention.k_proj.weight.shape == (16, 32)
    assert attention.v_proj.weight.shape == (24, 32) and attention.out_proj.weight.shape == (32, 24)
    ids = torch.tensor([[5, 6, 7, 2]])
    assert model(input_ids=ids, decoder_input_ids=ids).logits.shape == (1, 4, 100)


def test_attention_without_the_scale_is_eq_1_with_queries_sqrt_d_k_times_larger():
    # scale_attention=False (docs/table3.md, rows U) drops Eq. 1's 1/sqrt(d_k) and nothing else.
    unscaled = random_model(scale_attention=False, d_k=16)
    scaled = random_model(d_k=16)
    scaled.load_state_dict(unscaled.state_dict())
    with torch.no_grad():
        for name, module in scaled.named_modules():
            if name.endswith("q_proj"):
                module.weight.mul_(math.sqrt(16))
    ids = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 11, 2, 0]])
    inputs = dict(input_ids=ids, attention_mask=(ids != 0).long(), decoder_input_ids=ids)
    torch.testing.assert_close(unscaled(**inputs).logits, scaled(**inputs).logits, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(unscaled(**inputs).logits, random_model(d_k=16)(**inputs).logits, atol=1e-3)


def test_learned_positional_embeddings_are_trained_vectors_with_a_clear_length_limit():
    model = random_model(position_embedding_type="learned", max_position_embeddings=16)
    positions = model.model.encoder.embeddings.positional_encoding
    assert isinstance(positions, torch.nn.Embedding) and positions.weight.shape == (16, 32)
    assert positions.weight.requires_grad
    ids = torch.full((1, 16), 7)
    assert torch.isfinite(model(input_ids=ids, decoder_input_ids=ids).logits).all()
    with pytest.raises(ValueError, match="max_position_embeddings=16"):
        model(input_ids=torch.full((1, 17), 7), labels=ids)
    # generate() stops at the last learned position instead of failing halfway through a batch.
    output = model.generate(input_ids=ids[:, :4], num_beams=2, min_new_tokens=40, max_new_tokens=40)
    assert output.shape[1] == 1 + 16


def test_eq_1_is_spelled_out_on_the_cpu_for_few_queries_and_never_in_place_of_the_kernels_causal_mask():
    def query_key(queries, keys):
        return torch.zeros(2, 4, queries, 8), torch.zeros(2, 4, keys, 8)

    faster = eager_attention_is_faster
    mask = torch.ones(1, 1, 4, 16, dtype=torch.bool)
    assert faster(*query_key(1, 500), None, is_causal=True)  # one query: always
    with torch.no_grad():
        assert faster(*query_key(4, 16), mask, is_causal=True)
        assert faster(*query_key(32, 32), None, is_causal=False)  # 1,024 pairs
        assert not faster(*query_key(32, 33), None, is_causal=False)
        # The kernel's own causal mask (mask None) is not replaced by Eq. 1 unmasked.
        assert not faster(*query_key(4, 4), None, is_causal=True)
    # In training the two take as long: the kernel.
    assert not faster(*query_key(4, 16), mask, is_causal=True)
