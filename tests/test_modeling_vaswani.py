"""The model against §3 of the paper, on real Multi30k sentences."""

import math

import pytest
import torch
import torch.nn.functional as F
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from conftest import random_model
from torch import nn
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
from transformers.cache_utils import DynamicCache, EncoderDecoderCache, StaticCache
from transformers.generation import logits_process

from vaswani_transformer import VaswaniConfig, VaswaniForConditionalGeneration, modeling_vaswani
from vaswani_transformer.modeling_vaswani import (
    SinusoidalPositionalEncoding,
    label_smoothed_cross_entropy,
    linear,
    linear_label_smoothed_cross_entropy,
    residual_dropout,
    shift_tokens_right,
)


def _batch(tokenizer, sources, targets):
    encoded = tokenizer(list(sources), text_target=list(targets), padding=True, return_tensors="pt")
    encoded["labels"] = encoded["labels"].masked_fill(encoded["labels"] == tokenizer.pad_token_id, -100)
    return encoded


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


def test_embeddings_are_scaled_by_sqrt_d_model(tokenizer):
    model = random_model(tokenizer)
    ids = torch.tensor([[5, 6, 7]])
    embedded = model.model.encoder.embeddings(ids)
    expected = model.model.shared(ids) * math.sqrt(32) + SinusoidalPositionalEncoding(32)(torch.arange(3))
    torch.testing.assert_close(embedded, expected)


needs_onednn = pytest.mark.skipif(modeling_vaswani._ONEDNN_LINEAR is None, reason="PyTorch built without oneDNN")


def _count_onednn_calls(monkeypatch):
    calls, operator = {"n": 0}, modeling_vaswani._ONEDNN_LINEAR

    def counted(*args):
        calls["n"] += 1
        return operator(*args)

    monkeypatch.setattr(modeling_vaswani, "_ONEDNN_LINEAR", counted)
    return calls


def _float32_leaves(*tensors):
    return [t.detach().float().requires_grad_() if t is not None else None for t in tensors]


@needs_onednn
@pytest.mark.parametrize("strided", [False, True])
def test_linear_through_onednn_gives_the_products_and_gradients_of_f_linear(strided):
    torch.manual_seed(0)
    input = torch.randn(37, 4, 256, dtype=torch.float64).transpose(0, 1) if strided else torch.randn(4, 37, 256)
    leaves = [t.double().requires_grad_() for t in (input, torch.randn(512, 256) / 16, torch.randn(512))]
    upstream = torch.randn(4, 37, 512, dtype=torch.float64)
    reference = F.linear(*leaves)
    expected = (reference, *torch.autograd.grad(reference, leaves, upstream))
    ours = _float32_leaves(*leaves)
    output = linear(*ours)
    assert type(output.grad_fn).__name__ == "OneDNNLinearBackward"  # the oneDNN path was taken
    for got, want in zip((output, *torch.autograd.grad(output, ours, upstream.float())), expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6 * want.abs().max().item())
    with torch.no_grad():
        assert torch.equal(linear(*ours), output)


@needs_onednn
def test_linear_leaves_small_products_other_dtypes_and_autocast_to_f_linear():
    def backward_of(input, weight):
        return type(linear(input, weight).grad_fn).__name__

    large = torch.randn(64, 256, requires_grad=True), torch.randn(256, 256)  # 2^22 multiply-adds
    assert backward_of(*large) == "OneDNNLinearBackward"
    assert backward_of(large[0][:8], large[1]) == "MmBackward0"  # 2^19: oneDNN's call costs more than it saves
    assert backward_of(large[0].double(), large[1].double()) == "MmBackward0"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(*large).dtype == torch.bfloat16


@needs_onednn
def test_linear_through_onednn_can_be_differentiated_twice():
    torch.manual_seed(0)
    leaves = [
        (torch.randn(*shape, dtype=torch.float64) / scale).requires_grad_()
        for shape, scale in (((64, 256), 1), ((256, 256), 16))
    ]
    probe = torch.randn(64, 256, dtype=torch.float64)

    def second_order(linear_map, input, weight):
        (grad_input,) = torch.autograd.grad((linear_map(input, weight) ** 2).sum(), input, create_graph=True)
        return torch.autograd.grad((grad_input * probe).sum(), weight)[0]

    expected = second_order(F.linear, *leaves)
    ours = _float32_leaves(*leaves)
    assert type(linear(*ours).grad_fn).__name__ == "OneDNNLinearBackward"
    torch.testing.assert_close(second_order(linear, *ours).double(), expected, rtol=0, atol=1e-5 * expected.abs().max())


@needs_onednn
def test_every_projection_of_a_training_step_goes_through_onednn_and_computes_what_f_linear_computes(
    tokenizer, test_sentences, monkeypatch
):
    model = random_model(tokenizer, d_model=256, d_ff=1024, num_attention_heads=4).train()
    projections = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert projections and all(type(m) is modeling_vaswani.Linear for m in projections)
    batch = _batch(tokenizer, *test_sentences)

    def loss_and_gradients():
        torch.manual_seed(0)
        loss = model(**batch).loss
        return loss, torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])

    with torch.backends.mkldnn.flags(enabled=False):  # the user's switch: F.linear everywhere
        expected = loss_and_gradients()
    calls = _count_onednn_calls(monkeypatch)
    loss, gradients = loss_and_gradients()
    # 2 encoder layers of 4 + 2 projections and 2 decoder layers of 4 + 4 + 2, each a product forward and two
    # backward (every input needs its gradient: the embeddings are trained), then the fused loss's 3 products.
    assert calls["n"] == 3 * (2 * 6 + 2 * 10) + 3
    torch.testing.assert_close(loss, expected[0], rtol=1e-5, atol=0)
    for ours, theirs in zip(gradients, expected[1], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4 * theirs.abs().max().item())


@needs_onednn
def test_fused_loss_through_onednn_gives_the_value_and_gradients_of_float64_logits(monkeypatch):
    torch.manual_seed(0)
    hidden = torch.randn(2, 300, 64, dtype=torch.float64) / 4
    weight, bias = torch.randn(8000, 64, dtype=torch.float64) / 8, torch.randn(8000, dtype=torch.float64)
    labels = torch.randint(0, 8000, (2, 300))
    labels[1, 200:] = -100
    leaves = [t.requires_grad_() for t in (hidden, weight, bias)]
    reference = label_smoothed_cross_entropy(F.linear(*leaves), labels, 0.1)
    expected = (reference, *torch.autograd.grad(reference, leaves))
    ours = _float32_leaves(*leaves)
    calls = _count_onednn_calls(monkeypatch)
    loss = linear_label_smoothed_cross_entropy(ours[0], ours[1], labels, 0.1, bias=ours[2])
    assert calls["n"] == 2 * 3  # 2 chunks (262 positions a chunk, 500 kept): logits, dL/dh and dL/dW of each
    for got, want in zip((loss, *torch.autograd.grad(loss, ours)), expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_attention_projections_have_no_bias():
    model = random_model()
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "k_proj", "v_proj", "out_proj")):
            assert module.bias is None, name


def test_one_embedding_matrix_for_source_target_and_softmax_also_after_save_and_load(tokenizer, tmp_path):
    model = random_model(tokenizer)
    uses = [
        model.model.encoder.embeddings.embed_tokens.weight,
        model.model.decoder.embeddings.embed_tokens.weight,
        model.lm_head.weight,
    ]
    assert all(use is model.model.shared.weight for use in uses)
    with torch.no_grad():
        model.model.shared.weight[7] += 1.0  # a change through one use shows in all
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    shared = loaded.model.shared.weight
    assert loaded.model.encoder.embeddings.embed_tokens.weight is shared
    assert loaded.model.decoder.embeddings.embed_tokens.weight is shared
    assert loaded.lm_head.weight is shared
    torch.testing.assert_close(shared, model.model.shared.weight)


def test_padded_batch_gives_the_same_outputs_as_each_sentence_alone(tokenizer, test_sentences):
    model = random_model(tokenizer)
    sources, targets = test_sentences
    batch = _batch(tokenizer, sources, targets)
    assert (batch["attention_mask"] == 0).any(), "the batch should contain padding"
    with torch.no_grad():
        batched = model(**batch)
        for i, (source, target) in enumerate(zip(sources, targets, strict=True)):
            alone = model(**_batch(tokenizer, [source], [target]))
            length = alone.logits.shape[1]
            torch.testing.assert_close(batched.logits[i, :length], alone.logits[0], atol=1e-5, rtol=1e-5)
            source_length = int(batch["attention_mask"][i].sum())
            torch.testing.assert_close(
                batched.encoder_last_hidden_state[i, :source_length],
                alone.encoder_last_hidden_state[0],
                atol=1e-5,
                rtol=1e-5,
            )


def test_unpadded_encoder_is_not_causal(tokenizer, test_sentences):
    # The SDPA path masks causally any module without is_causal=False; changing the last source token
    # must change the encoding of the first.
    model = random_model(tokenizer)
    ids = tokenizer(test_sentences[0][0], return_tensors="pt")["input_ids"]
    changed = ids.clone()
    changed[0, -2] = (changed[0, -2] + 1) % len(tokenizer)
    with torch.no_grad():
        first = model.model.encoder(input_ids=ids).last_hidden_state[0, 0]
        second = model.model.encoder(input_ids=changed).last_hidden_state[0, 0]
    assert not torch.allclose(first, second)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_later_decoder_inputs_never_change_earlier_logits(tokenizer, test_sentences, attn_implementation):
    model = random_model(tokenizer, attn_implementation=attn_implementation)
    batch = _batch(tokenizer, test_sentences[0][:2], test_sentences[1][:2])
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(batch["labels"])
    changed = decoder_input_ids.clone()
    changed[:, 5:] = torch.randint(4, len(tokenizer), changed[:, 5:].shape)
    with torch.no_grad():
        original = model(batch["input_ids"], batch["attention_mask"], decoder_input_ids=decoder_input_ids).logits
        altered = model(batch["input_ids"], batch["attention_mask"], decoder_input_ids=changed).logits
    torch.testing.assert_close(original[:, :5], altered[:, :5], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(original[:, 5:], altered[:, 5:])


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_cached_incremental_decoding_equals_the_full_forward_pass(tokenizer, test_sentences, cache_kind):
    # A dynamic cache holds only the positions seen, so a single new query needs no mask; a static one also
    # holds empty slots, which the causal mask must hide.
    model = random_model(tokenizer)
    batch = _batch(tokenizer, test_sentences[0][:3], test_sentences[1][:3])
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(batch["labels"])
    with torch.no_grad():
        full = model(batch["input_ids"], batch["attention_mask"], decoder_input_ids=decoder_input_ids).logits
        encoder_outputs = model.get_encoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        cache, steps = None, []
        if cache_kind == "static":
            self_attention = StaticCache(config=model.config, max_cache_len=decoder_input_ids.shape[1] + 8)
            cache = EncoderDecoderCache(self_attention, DynamicCache(config=model.config))
        for t in range(decoder_input_ids.shape[1]):
            out = model(
                attention_mask=batch["attention_mask"],
                encoder_outputs=encoder_outputs,
                decoder_input_ids=decoder_input_ids[:, t : t + 1],
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_label_smoothed_loss_equals_a_hand_computed_value():
    # Vocabulary of 3, epsilon 0.1: the target distribution is 0.9 one-hot + 0.1 / 3 everywhere.
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]]])
    labels = torch.tensor([[0, -100]])  # the second position is padding
    log_z = math.log(math.exp(2.0) + math.exp(0.0) + math.exp(-1.0))
    log_p = [2.0 - log_z, 0.0 - log_z, -1.0 - log_z]
    expected = -(0.9 + 0.1 / 3) * log_p[0] - (0.1 / 3) * (log_p[1] + log_p[2])
    loss = label_smoothed_cross_entropy(logits, labels, epsilon=0.1)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    summed = label_smoothed_cross_entropy(logits, labels, epsilon=0.1, num_items_in_batch=4)
    assert summed.item() == pytest.approx(expected / 4, rel=1e-6)


def test_model_loss_ignores_padding_and_uses_the_configured_epsilon(tokenizer, test_sentences):
    model = random_model(tokenizer, label_smoothing=0.2)
    batch = _batch(tokenizer, test_sentences[0][:4], test_sentences[1][:4])
    with torch.no_grad():
        out = model(**batch)
    mask = batch["labels"] != -100
    log_probs = F.log_softmax(out.logits, dim=-1)[mask]
    targets = batch["labels"][mask]
    nll = -log_probs.gather(1, targets[:, None]).squeeze(1)
    smooth = -log_probs.mean(dim=-1)
    expected = ((1 - 0.2) * nll + 0.2 * smooth).mean()
    torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=1e-5)


def test_shift_tokens_right_starts_with_the_decoder_start_token():
    labels = torch.tensor([[10, 11, 2, -100]])
    assert shift_tokens_right(labels, pad_token_id=0, decoder_start_token_id=1).tolist() == [[1, 10, 11, 2]]


def test_sdpa_and_eager_attention_agree_and_eager_returns_every_attention_map(tokenizer, test_sentences):
    batch = _batch(tokenizer, test_sentences[0][:3], test_sentences[1][:3])
    sdpa = random_model(tokenizer, seed=3)
    eager = random_model(tokenizer, seed=3, attn_implementation="eager")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    inputs["decoder_input_ids"] = sdpa.prepare_decoder_input_ids_from_labels(batch["labels"])
    kernel = sdpa(**inputs)  # with gradients enabled, every attention runs PyTorch's fused kernel
    with torch.no_grad():
        mixed = sdpa(**inputs)  # without, short inputs take the eager path on the CPU
        b = eager(**batch, output_attentions=True)
    torch.testing.assert_close(kernel.logits, b.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed.logits, b.logits, atol=1e-5, rtol=1e-5)
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


def test_beam_search_with_one_beam_equals_greedy_decoding(tokenizer, test_sentences):
    model = random_model(tokenizer, seed=6)
    inputs = tokenizer(test_sentences[0][:4], padding=True, return_tensors="pt")
    greedy = model.generate(**inputs, num_beams=1, max_new_tokens=10)
    beam = model.generate(**inputs, num_beams=1, length_penalty=0.6, early_stopping=True, max_new_tokens=10)
    assert torch.equal(greedy, beam)


def test_beam_search_uses_the_key_value_cache_and_matches_decoding_without_it(tokenizer, test_sentences):
    model = random_model(tokenizer, seed=7)
    inputs = tokenizer(test_sentences[0][:3], padding=True, return_tensors="pt")
    with_cache = model.generate(**inputs, num_beams=4, max_new_tokens=10, use_cache=True)
    without_cache = model.generate(**inputs, num_beams=4, max_new_tokens=10, use_cache=False)
    assert torch.equal(with_cache, without_cache)


def test_beams_sharing_one_encoder_row_get_the_logits_of_copied_rows(tokenizer, test_sentences):
    # Beam search hands the decoder one encoder row per sentence for all its beams (padded sources).
    model = random_model(tokenizer, seed=3)
    inputs = tokenizer(test_sentences[0][:3], padding=True, return_tensors="pt")
    with torch.no_grad():
        encoded = model.get_encoder()(**inputs)
        decoder_input_ids = torch.randint(4, len(tokenizer), (3 * 2, 5))
        shared = model(
            encoder_outputs=encoded, attention_mask=inputs["attention_mask"], decoder_input_ids=decoder_input_ids
        ).logits
        copied = model(
            encoder_outputs=(encoded.last_hidden_state.repeat_interleave(2, dim=0),),
            attention_mask=inputs["attention_mask"].repeat_interleave(2, dim=0),
            decoder_input_ids=decoder_input_ids,
        ).logits
        assert torch.allclose(shared, copied, atol=1e-5)
        with pytest.raises(ValueError, match="rows"):
            model(
                encoder_outputs=encoded,
                attention_mask=inputs["attention_mask"],
                decoder_input_ids=decoder_input_ids[:4],
            )


def test_config_rejects_impossible_values_naming_the_field():
    with pytest.raises(ValueError, match="d_model.*num_attention_heads"):
        VaswaniConfig(d_model=100, num_attention_heads=8)
    with pytest.raises(ValueError, match="dropout"):
        VaswaniConfig(dropout=1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        VaswaniConfig(label_smoothing=-0.1)
    with pytest.raises(ValueError, match="d_ff"):
        VaswaniConfig(d_ff=0)
    with pytest.raises(ValueError, match="encoder_layers"):
        VaswaniConfig(encoder_layers=-2)
    with pytest.raises(ValueError, match="d_model must be even"):
        VaswaniConfig(d_model=33, num_attention_heads=1)
    with pytest.raises(ValueError, match="Unknown preset"):
        VaswaniConfig.from_preset("huge")


def test_presets_are_table_3():
    base, big = VaswaniConfig.from_preset("base"), VaswaniConfig.from_preset("big")
    assert (base.encoder_layers, base.d_model, base.d_ff, base.num_attention_heads, base.dropout) == (
        6,
        512,
        2048,
        8,
        0.1,
    )
    assert (big.encoder_layers, big.d_model, big.d_ff, big.num_attention_heads, big.dropout) == (6, 1024, 4096, 16, 0.3)
    assert (base.key_dim, base.value_dim, big.key_dim, big.value_dim) == (64, 64, 64, 64)
    model = VaswaniForConditionalGeneration(VaswaniConfig.from_preset("base"))
    # Table 3 reports 65M parameters for the base model with its 37,000-token vocabulary.
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(65e6, rel=0.05)


@pytest.mark.parametrize("drop_ignored", [True, False])  # the CPU's way, and the accelerators'
def test_fused_projection_and_loss_give_the_value_and_gradients_of_materialised_logits(drop_ignored):
    def fused_loss(hidden, weight, labels, epsilon, bias=None, items=None):
        bias = bias.flatten() if bias is not None else None
        loss = modeling_vaswani.LinearLabelSmoothedCrossEntropy.apply(
            hidden.flatten(0, 1), weight, bias, labels.flatten(), epsilon, drop_ignored
        )
        return loss / (labels.ne(-100).sum() if items is None else items)

    torch.manual_seed(0)
    # 20,000 classes: the CPU chunk is 256 positions, so 3 x 200 positions take three chunks.
    hidden = torch.randn(3, 200, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(20_000, 16, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 20_000, dtype=torch.float64)
    labels = torch.randint(0, 20_000, (3, 200))
    labels[0, 150:] = -100
    for epsilon, logit_bias, items in ((0.0, None, None), (0.1, bias, None), (0.3, None, 1000)):
        fused = fused_loss(hidden, weight, labels, epsilon, logit_bias, items)
        logits = F.linear(hidden, weight) + (0 if logit_bias is None else logit_bias)
        reference = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=epsilon, reduction="sum")
        reference = reference / (labels.ne(-100).sum() if items is None else items)
        torch.testing.assert_close(fused, reference)
        expected = torch.autograd.grad(reference, (hidden, weight))
        for ours, theirs in zip(torch.autograd.grad(fused, (hidden, weight)), expected, strict=True):
            torch.testing.assert_close(ours, theirs)
    small = (hidden[:1, :5, :4].detach().requires_grad_(), weight[:11, :4].detach().requires_grad_())
    small_labels = labels[:1, :5] % 11
    assert torch.autograd.gradcheck(lambda h, w: fused_loss(h, w, small_labels, 0.1), small)


def test_training_forward_returns_the_loss_and_gradients_of_the_logits_without_the_logits(
    tokenizer, test_sentences, monkeypatch
):
    model = random_model(tokenizer, seed=3)  # eval mode: no dropout, so both passes compute the same function
    batch = _batch(tokenizer, test_sentences[0][:4], test_sentences[1][:4])
    fused = model(**batch)
    assert fused.logits is None
    fused.loss.backward()
    fused_gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    decoder_input_ids = shift_tokens_right(
        batch["labels"], model.config.pad_token_id, model.config.decoder_start_token_id
    )
    logits = model(batch["input_ids"], batch["attention_mask"], decoder_input_ids=decoder_input_ids).logits
    reference = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), label_smoothing=0.1)
    reference.backward()
    torch.testing.assert_close(fused.loss, reference)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).loss, reference)
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused_gradients[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
    # Where the fused loss cannot serve, the logits are materialised: a hook on the output layer must run
    # (DeepSpeed ZeRO-3 and Accelerate's offloading gather or move the weight there), or float16.
    calls = []
    handle = model.lm_head.register_forward_pre_hook(lambda module, args: calls.append(1))
    hooked = model(**batch)
    handle.remove()
    assert calls == [1] and hooked.logits is not None
    torch.testing.assert_close(hooked.loss, reference)
    add_hook_to_module(model.lm_head, ModelHook())  # what Accelerate's offloading attaches (`_hf_hook`)
    offloaded = model(**batch)
    remove_hook_from_module(model.lm_head)
    assert offloaded.logits is not None
    torch.testing.assert_close(offloaded.loss, reference)
    with monkeypatch.context() as patch:
        patch.setattr(modeling_vaswani, "is_deepspeed_zero3_enabled", lambda: True)
        assert model(**batch).logits is not None
    with torch.autocast("cpu", dtype=torch.float16):
        assert model(**batch).logits is not None
    assert model(**batch).logits is None  # and with none of these, fused again


def test_fused_loss_gives_a_trainable_bias_its_gradient_and_refuses_double_backward():
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(13, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (2, 7))
    labels[1, 4:] = -100
    fused = linear_label_smoothed_cross_entropy(hidden, weight, labels, 0.1, bias)
    logits = F.linear(hidden, weight, bias)
    reference = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=0.1)
    (ours,) = torch.autograd.grad(fused, bias, retain_graph=True)
    (theirs,) = torch.autograd.grad(reference, bias)
    torch.testing.assert_close(ours, theirs)
    # Its gradients are constants of the forward pass: differentiating them again must fail, not give 0.
    scale = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    (grad_hidden,) = torch.autograd.grad(fused * scale, hidden, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_hidden.sum().backward()


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm (paper)", "pre-norm option"])
def test_stacks_match_torch_nn_transformer_on_a_padded_batch(tokenizer, test_sentences, norm_first):
    """Parity with an implementation written elsewhere: torch.nn.Transformer (ReLU)."""
    d_model, heads, d_ff, layers = 32, 4, 64, 2
    model = random_model(tokenizer, seed=11, normalize_before=norm_first)
    torch.manual_seed(12)
    reference = torch.nn.Transformer(
        d_model, heads, layers, layers, d_ff, dropout=0.0, batch_first=True, norm_first=norm_first
    ).eval()
    if not norm_first:  # the paper has no LayerNorm after each stack; pre-norm needs one
        reference.encoder.norm = None
        reference.decoder.norm = None
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, torch.nn.LayerNorm):  # away from 1 and 0, so that a mix-up shows
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
            if isinstance(module, torch.nn.MultiheadAttention):
                module.in_proj_bias.zero_()
                module.out_proj.bias.zero_()

        def copy_attention(ours, theirs):
            q, k, v = theirs.in_proj_weight.chunk(3)
            ours.q_proj.weight.copy_(q)
            ours.k_proj.weight.copy_(k)
            ours.v_proj.weight.copy_(v)
            ours.out_proj.weight.copy_(theirs.out_proj.weight)

        def copy_sublayer(ours, norm):
            ours.layer_norm.weight.copy_(norm.weight)
            ours.layer_norm.bias.copy_(norm.bias)

        def copy_feed_forward(ours, theirs):
            for mine, other in ((ours.fc1, theirs.linear1), (ours.fc2, theirs.linear2)):
                mine.weight.copy_(other.weight)
                mine.bias.copy_(other.bias)

        for ours, theirs in zip(model.model.encoder.layers, reference.encoder.layers, strict=True):
            copy_attention(ours.self_attn, theirs.self_attn)
            copy_sublayer(ours.self_attn_sublayer, theirs.norm1)
            copy_feed_forward(ours.feed_forward, theirs)
            copy_sublayer(ours.feed_forward_sublayer, theirs.norm2)
        for ours, theirs in zip(model.model.decoder.layers, reference.decoder.layers, strict=True):
            copy_attention(ours.self_attn, theirs.self_attn)
            copy_sublayer(ours.self_attn_sublayer, theirs.norm1)
            copy_attention(ours.encoder_attn, theirs.multihead_attn)
            copy_sublayer(ours.encoder_attn_sublayer, theirs.norm2)
            copy_feed_forward(ours.feed_forward, theirs)
            copy_sublayer(ours.feed_forward_sublayer, theirs.norm3)
        if norm_first:
            model.model.encoder.layer_norm.load_state_dict(reference.encoder.norm.state_dict())
            model.model.decoder.layer_norm.load_state_dict(reference.decoder.norm.state_dict())

        batch = _batch(tokenizer, test_sentences[0][:4], test_sentences[1][:4])
        decoder_input_ids = model.prepare_decoder_input_ids_from_labels(batch["labels"])
        ours = model.model(batch["input_ids"], batch["attention_mask"], decoder_input_ids=decoder_input_ids)
        source = model.model.encoder.embeddings(batch["input_ids"])
        target = model.model.decoder.embeddings(decoder_input_ids)
        source_padding = batch["attention_mask"] == 0
        memory = reference.encoder(source, src_key_padding_mask=source_padding)
        causal = torch.nn.Transformer.generate_square_subsequent_mask(target.shape[1])
        theirs = reference.decoder(target, memory, tgt_mask=causal, memory_key_padding_mask=source_padding)
    keep = ~source_padding
    torch.testing.assert_close(ours.encoder_last_hidden_state[keep], memory[keep], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.last_hidden_state, theirs, atol=1e-5, rtol=0)


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


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_residual_dropout_drops_each_element_independently_at_rate_p_and_keeps_expectations(p):
    x = torch.rand(1000, 4001) + 0.5  # an odd number of elements: not a whole number of 64-bit draws
    torch.manual_seed(0)
    y = residual_dropout(x, p, training=True)
    dropped = y == 0
    n = dropped.numel()
    assert abs(dropped.float().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)
    # Independent elements: those 1 to 4 apart (sharing a 64-bit draw or not) are dropped together at rate p^2.
    flat = dropped.flatten()
    for offset in (1, 2, 3, 4):
        together = (flat[:-offset] & flat[offset:]).float().mean().item()
        assert abs(together - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / n), offset
    scale = 1 / (1 - round(p * 2**16) / 2**16)
    torch.testing.assert_close(y[~dropped], x[~dropped] * scale)
    assert abs(1 / scale - (1 - p)) < 2**-17
    # The same masks from the same seed; the identity outside training.
    torch.manual_seed(0)
    torch.testing.assert_close(residual_dropout(x, p, training=True), y)
    assert residual_dropout(x, p, training=False) is x
    # The gradient is the mask times the scale.
    leaf = x.clone().requires_grad_()
    torch.manual_seed(0)
    residual_dropout(leaf, p, training=True).sum().backward()
    torch.testing.assert_close(leaf.grad, (~dropped).float() * scale)


def test_gradient_checkpointing_gives_the_same_gradients(tokenizer, test_sentences):
    batch = _batch(tokenizer, test_sentences[0][:3], test_sentences[1][:3])
    gradients = []
    for checkpointing in (False, True):
        model = random_model(tokenizer, seed=9, dropout=0.3).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        torch.manual_seed(1)  # the same dropout masks in both runs, and again in the recomputed forward pass
        model(**batch).loss.backward()
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], gradient, atol=1e-6, rtol=1e-5, msg=name)


def test_bf16_autocast_on_cpu_runs_and_stays_close_to_float32(tokenizer, test_sentences):
    model = random_model(tokenizer, seed=10)
    batch = _batch(tokenizer, test_sentences[0][:3], test_sentences[1][:3])
    with torch.no_grad():
        full = model(**batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half = model(**batch)
    assert half.logits.dtype == torch.bfloat16 and half.loss.dtype == torch.float32
    torch.testing.assert_close(half.loss, full.loss, atol=0.05, rtol=0.01)
    # With gradients, the fused projection and loss (bfloat16 products, float32 softmax) run instead.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        training = model(**batch)
    torch.testing.assert_close(training.loss, full.loss, atol=0.05, rtol=0.01)
    training.loss.backward()
    gradient = model.lm_head.weight.grad
    assert gradient.dtype == torch.float32 and torch.isfinite(gradient).all() and gradient.abs().sum() > 0


def test_resize_token_embeddings_keeps_the_three_uses_tied(tokenizer):
    model = random_model(tokenizer)
    model.resize_token_embeddings(len(tokenizer) + 8)
    shared = model.model.shared.weight
    assert shared.shape[0] == len(tokenizer) + 8 == model.config.vocab_size
    assert model.lm_head.weight is shared
    assert model.model.encoder.embeddings.embed_tokens.weight is shared
    assert model.model.decoder.embeddings.embed_tokens.weight is shared


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
        # Per-sentence state: every sentence stays in the batch, and a full one takes no more hypotheses.
        {"encoder_no_repeat_ngram_size": 3, "num_return_sequences": 4, "length_penalty": 2.0},
    ],
)
def test_beam_search_returns_what_transformers_beam_search_returns(
    trained_model_dir, test_sentences, monkeypatch, options
):
    # generate() runs our beam search, which drops finished sentences from the batch; asking for a
    # dict of outputs runs transformers' own loop instead. Both must give the same hypotheses.
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    inputs = tokenizer(test_sentences[0][:48], padding=True, return_tensors="pt")
    calls = {"search": 0, "batch_narrowed": 0}
    search, select = modeling_vaswani.beam_search, modeling_vaswani.SourceLengthLimit.select

    def counted_search(*args, **kwargs):
        calls["search"] += 1
        return search(*args, **kwargs)

    def counted_select(self, sentences):
        calls["batch_narrowed"] += 1
        return select(self, sentences)

    monkeypatch.setattr(modeling_vaswani, "beam_search", counted_search)
    monkeypatch.setattr(modeling_vaswani.SourceLengthLimit, "select", counted_select)
    with torch.no_grad():
        ours = model.generate(**inputs, **options)
        reference = model.generate(**inputs, **options, return_dict_in_generate=True).sequences
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
    # logits processor reads the beams of a sentence together.
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    inputs = tokenizer(test_sentences[0][:6], padding=True, return_tensors="pt")
    rows = []
    model.model.decoder.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    with torch.no_grad():
        model.generate(**inputs, num_beams=4, **options)
    assert rows[0] == 6 * first_step_rows_per_sentence
    assert rows[1] == 6 * 4


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa", "flash_attention_2"])
def test_beam_search_cache_attends_as_the_reordered_dynamic_cache(attn_implementation):
    # Each beam attends to its own hypothesis' keys and values, whether they move after every step
    # (DynamicCache, eager attention) or stay where they were written (BeamSearchCache): one row per
    # sentence at the first step, then 4 beams reordered at random for 70 steps, past the first capacity
    # (32 positions) and, with SDPA, past the eager path's 1,024 scores to the fused kernel; one sentence
    # leaves on the way. Flash attention takes no ancestry mask (nor runs here): the eager path stands in.
    torch.manual_seed(0)
    config = VaswaniConfig(d_model=16, num_attention_heads=2, d_ff=32, encoder_layers=1, decoder_layers=1)
    attention = modeling_vaswani.MultiHeadAttention(config, is_causal=True).eval()
    batch, beams = 3, 4
    beam_cache = modeling_vaswani.BeamSearchCache(1, batch, beams, 1, torch.device("cpu"))
    ours = EncoderDecoderCache(beam_cache, DynamicCache())
    reference = EncoderDecoderCache(DynamicCache(), DynamicCache())
    rows_per_sentence = 1
    for step in range(70):
        hidden_states = torch.randn(batch * rows_per_sentence, 1, 16)
        with torch.no_grad():
            config._attn_implementation = attn_implementation
            got = attention(hidden_states, past_key_values=ours)[0]
            config._attn_implementation = "eager"
            want = attention(hidden_states, past_key_values=reference)[0]
        torch.testing.assert_close(got, want)
        kept = torch.tensor([0, 2]) if step == 40 else torch.arange(batch)
        parents = torch.randint(0, rows_per_sentence, (len(kept), beams))
        beam_idx = (kept[:, None] * rows_per_sentence + parents).view(-1)
        ours.self_attention_cache.reorder_cache(beam_idx)
        reference.self_attention_cache.reorder_cache(beam_idx)
        batch, rows_per_sentence = len(kept), beams
    assert beam_cache.batch_size == 2
    assert ours.get_seq_length() == reference.get_seq_length() == 70
    # What would leave the ancestry and the slots apart is refused.
    for unsupported in (
        beam_cache.reset,
        lambda: beam_cache.batch_select_indices(torch.tensor([0])),
        lambda: beam_cache.layers[0].reorder_cache(torch.tensor([0])),
        lambda: beam_cache.layers[0].crop(-1),
        lambda: beam_cache.layers[0].get_mask_sizes(1),
    ):
        with pytest.raises(NotImplementedError, match="DynamicCache"):
            unsupported()


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
            values, indices = modeling_vaswani.top_k(scores, k)
            expected = scores.topk(k)
            assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)
    # Scores rounded to half a nat tie by the hundred: the same values, and k distinct indices that hold them.
    tied = candidates[:, :whole_chunks].mul(2).round().div(2)
    values, indices = modeling_vaswani.top_k(tied, 8)
    assert torch.equal(values, tied.topk(8).values) and torch.equal(tied.gather(1, indices), values)
    assert all(len(set(row)) == 8 for row in indices.tolist())


def test_token_masks_move_first_only_past_processors_that_keep_minus_infinity():
    # Forcing a token overwrites every score, so a mask after it would change the result if it ran first.
    lp = logits_process
    min_new = lp.MinNewTokensLengthLogitsProcessor(1, 3, eos_token_id=2)
    repetition = lp.RepetitionPenaltyLogitsProcessor(1.2)
    forced = lp.ForcedBOSTokenLogitsProcessor(5)
    suppress = lp.SuppressTokensLogitsProcessor([0, 1])
    masks, others = modeling_vaswani._hoist_token_masks([repetition, min_new, forced, suppress])
    assert list(masks) == [min_new] and list(others) == [repetition, forced, suppress]


def test_unknown_length_penalty_type_is_rejected(tokenizer, test_sentences):
    inputs = tokenizer(test_sentences[0][:1], return_tensors="pt")
    with pytest.raises(ValueError, match="length_penalty_type"):
        random_model(tokenizer).generate(**inputs, length_penalty_type="wu")


# Table 3: parameters x 10^6 of the base model and of the variations that change them. Rows (A)
# keep the count of the base model (d_k = d_v = d_model / h), so the paper leaves it blank.
TABLE_3 = {
    "base": ({}, 65),
    "A h=1": (dict(num_attention_heads=1), 65),
    "A h=32": (dict(num_attention_heads=32), 65),
    "B d_k=16": (dict(d_k=16), 58),
    "B d_k=32": (dict(d_k=32), 60),
    "C N=2": (dict(encoder_layers=2, decoder_layers=2), 36),
    "C N=4": (dict(encoder_layers=4, decoder_layers=4), 50),
    "C N=8": (dict(encoder_layers=8, decoder_layers=8), 80),
    "C d_ff=1024": (dict(d_ff=1024), 53),
    "C d_ff=4096": (dict(d_ff=4096), 90),
}


def test_table_3_variations_change_the_parameter_count_as_the_paper_reports():
    def millions(**overrides) -> float:
        with torch.device("meta"):  # shapes only
            model = VaswaniForConditionalGeneration(VaswaniConfig.from_preset("base", **overrides))
        return sum(p.numel() for p in model.parameters()) / 1e6

    base = millions()
    # The paper's counts include a vocabulary a few thousand tokens larger than the 37,000 it
    # states (about 2M more embedding parameters in every row), so compare differences from the
    # base model, each within the paper's rounding.
    for row, (overrides, reported) in TABLE_3.items():
        assert millions(**overrides) - base == pytest.approx(reported - 65, abs=1.0), row


def test_explicit_head_sizes_shape_the_projections():
    model = random_model(num_attention_heads=2, d_k=8, d_v=12)
    attention = model.model.encoder.layers[0].self_attn
    assert attention.q_proj.weight.shape == attention.k_proj.weight.shape == (16, 32)
    assert attention.v_proj.weight.shape == (24, 32) and attention.out_proj.weight.shape == (32, 24)
    ids = torch.tensor([[5, 6, 7, 2]])
    assert model(input_ids=ids, decoder_input_ids=ids).logits.shape == (1, 4, 100)


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


def test_config_rejects_unknown_options():
    with pytest.raises(ValueError, match="position_embedding_type"):
        VaswaniConfig(position_embedding_type="rotary")
    with pytest.raises(ValueError, match="activation_function"):
        VaswaniConfig(activation_function="relu7")
    with pytest.raises(ValueError, match="d_k"):
        VaswaniConfig(d_k=0)


def test_sinusoidal_model_encodes_and_decodes_inputs_far_longer_than_any_seen_in_training(trained_model_dir, corpus):
    # §3.5: sinusoids "may allow the model to extrapolate to sequence lengths longer than the ones
    # encountered during training"; nothing in the model limits the length.
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    train = corpus["train"]
    longest = max(len(ids) for lang in ("en", "de") for ids in tokenizer(list(train[lang]))["input_ids"])
    test = corpus["test_2016_flickr"]
    count = 0
    while len(tokenizer(" ".join(test["en"][:count]))["input_ids"]) < 4 * longest:
        count += 1
    source, target = " ".join(test["en"][:count]), " ".join(test["de"][:count])
    batch = tokenizer(source, text_target=target, return_tensors="pt")
    assert batch["input_ids"].shape[1] >= 4 * longest and batch["labels"].shape[1] >= 4 * longest
    with torch.no_grad():
        output = model(**batch)
    assert torch.isfinite(output.logits).all() and torch.isfinite(output.loss)
    # Decoding, too, runs through positions far beyond the training maximum.
    generated = model.generate(
        **tokenizer(source, return_tensors="pt"), num_beams=2, min_new_tokens=4 * longest, max_new_tokens=4 * longest
    )
    assert generated.shape[1] == 4 * longest + 1
