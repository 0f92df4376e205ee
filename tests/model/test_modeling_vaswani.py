"""The model against §3 of the paper (`modeling_vaswani.py`), on real Multi30k sentences."""

import math

import pytest
import torch
import torch.nn.functional as F
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from conftest import random_model, seq2seq_batch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
from transformers.cache_utils import DynamicCache, EncoderDecoderCache, StaticCache

from vaswani_transformer.model import modeling_vaswani
from vaswani_transformer.model.compat_vaswani import cache_of
from vaswani_transformer.model.layers_vaswani import SinusoidalPositionalEncoding
from vaswani_transformer.model.modeling_vaswani import shift_tokens_right


def test_embeddings_are_scaled_by_sqrt_d_model(tokenizer):
    model = random_model(tokenizer)
    ids = torch.tensor([[5, 6, 7]])
    embedded = model.model.encoder.embeddings(ids)
    expected = model.model.shared(ids) * math.sqrt(32) + SinusoidalPositionalEncoding(32)(torch.arange(3))
    torch.testing.assert_close(embedded, expected)


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
    batch = seq2seq_batch(tokenizer, sources, targets)
    assert (batch["attention_mask"] == 0).any(), "the batch should contain padding"
    with torch.no_grad():
        batched = model(**batch)
        for i, (source, target) in enumerate(zip(sources, targets, strict=True)):
            alone = model(**seq2seq_batch(tokenizer, [source], [target]))
            length = alone.logits.shape[1]
            torch.testing.assert_close(batched.logits[i, :length], alone.logits[0], atol=1e-5, rtol=1e-5)
            source_length = int(batch["attention_mask"][i].sum())
            torch.testing.assert_close(
                batched.encoder_last_hidden_state[i, :source_length],
                alone.encoder_last_hidden_state[0],
                atol=1e-5,
                rtol=1e-5,
            )


def test_left_padding_translates_as_right_padding(tokenizer, test_sentences):
    # Each sentence's positions start at its first token (§3.5), wherever the padding is.
    model = random_model(tokenizer, seed=4)
    right = tokenizer(test_sentences[0][:4], padding=True, return_tensors="pt")
    left = tokenizer.pad({"input_ids": [ids[ids != tokenizer.pad_token_id] for ids in right["input_ids"]]},
                         padding_side="left", return_tensors="pt")  # fmt: skip
    assert (left["attention_mask"][:, 0] == 0).any() and (right["attention_mask"][:, -1] == 0).any()
    with torch.no_grad():
        encoded = [model.get_encoder()(**batch).last_hidden_state for batch in (right, left)]
    for i in range(4):
        torch.testing.assert_close(
            encoded[0][i][right["attention_mask"][i].bool()], encoded[1][i][left["attention_mask"][i].bool()]
        )
    assert torch.equal(model.generate(**left, max_new_tokens=8), model.generate(**right, max_new_tokens=8))


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
    batch = seq2seq_batch(tokenizer, test_sentences[0][:2], test_sentences[1][:2])
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(batch["labels"])
    changed = decoder_input_ids.clone()
    changed[:, 5:] = torch.randint(4, len(tokenizer), changed[:, 5:].shape)
    with torch.no_grad():
        original = model(batch["input_ids"], batch["attention_mask"], decoder_input_ids=decoder_input_ids).logits
        altered = model(batch["input_ids"], batch["attention_mask"], decoder_input_ids=changed).logits
    torch.testing.assert_close(original[:, :5], altered[:, :5], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(original[:, 5:], altered[:, 5:])


@pytest.mark.parametrize("cache_name", ["cache", "past_key_values"])
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_cached_incremental_decoding_equals_the_full_forward_pass(tokenizer, test_sentences, cache_kind, cache_name):
    # A dynamic cache holds only the positions seen, so a single new query needs no mask; a static one also
    # holds empty slots, which the causal mask must hide. The cache comes under the name transformers 5.24 gives
    # it or under the older one, and goes back under the running release's.
    model = random_model(tokenizer)
    batch = seq2seq_batch(tokenizer, test_sentences[0][:3], test_sentences[1][:3])
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
                use_cache=True,
                **{cache_name: cache},
            )
            cache = cache_of(out)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_model_loss_ignores_padding_and_uses_the_configured_epsilon(tokenizer, test_sentences):
    model = random_model(tokenizer, label_smoothing=0.2)
    batch = seq2seq_batch(tokenizer, test_sentences[0][:4], test_sentences[1][:4])
    with torch.no_grad():
        out = model(**batch)
    mask = batch["labels"] != -100
    log_probs = F.log_softmax(out.logits, dim=-1)[mask]
    targets = batch["labels"][mask]
    nll = -log_probs.gather(1, targets[:, None]).squeeze(1)
    smooth = -log_probs.mean(dim=-1)
    expected = ((1 - 0.2) * nll + 0.2 * smooth).mean()
    torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=1e-5)


def test_inputs_embeds_of_the_input_embeddings_give_the_logits_and_loss_of_the_ids(tokenizer, test_sentences):
    # Every transformers seq2seq model takes `inputs_embeds` and `decoder_inputs_embeds`; PEFT passes both (None for
    # LoRA, the prompt's and the tokens' embeddings for prompt tuning). They are `get_input_embeddings()`'s output,
    # before the sqrt(d_model) scale: the model scales them and adds the positions as it does for ids (§3.4, §3.5).
    model = random_model(tokenizer)
    batch = seq2seq_batch(tokenizer, test_sentences[0][:4], test_sentences[1][:4])
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(batch["labels"])
    embed = model.get_input_embeddings()
    with torch.no_grad():
        from_ids = model(**batch, inputs_embeds=None, decoder_inputs_embeds=None)  # as PEFT's LoRA calls it
        from_embeddings = model(
            inputs_embeds=embed(batch["input_ids"]),
            attention_mask=batch["attention_mask"],
            decoder_inputs_embeds=embed(decoder_input_ids),
            labels=batch["labels"],
        )
    torch.testing.assert_close(from_embeddings.logits, from_ids.logits)
    torch.testing.assert_close(from_embeddings.loss, from_ids.loss)
    # generate() encodes the embeddings and decodes from the decoder start token, as from the ids.
    source = {"attention_mask": batch["attention_mask"], "num_beams": 2, "max_new_tokens": 8}
    torch.testing.assert_close(
        model.generate(inputs_embeds=embed(batch["input_ids"]), **source),
        model.generate(input_ids=batch["input_ids"], **source),
    )


def test_gradients_reach_embeddings_given_in_place_of_ids(tokenizer, test_sentences):
    # Prompt tuning trains vectors put before the tokens' embeddings: the loss must reach them.
    model = random_model(tokenizer)
    batch = seq2seq_batch(tokenizer, test_sentences[0][:2], test_sentences[1][:2])
    prompt = torch.zeros(2, 3, model.config.d_model, requires_grad=True)
    embeddings = torch.cat([prompt, model.get_input_embeddings()(batch["input_ids"])], dim=1)
    mask = torch.cat([torch.ones(2, 3, dtype=batch["attention_mask"].dtype), batch["attention_mask"]], dim=1)
    model(inputs_embeds=embeddings, attention_mask=mask, labels=batch["labels"]).loss.backward()
    assert prompt.grad is not None and prompt.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({"input_ids": True, "inputs_embeds": True, "decoder_input_ids": True}, "input_ids or inputs_embeds"),
        ({"decoder_input_ids": True}, "got neither"),
        (
            {"input_ids": True, "decoder_input_ids": True, "decoder_inputs_embeds": True},
            "decoder_input_ids or decoder_inputs_embeds, exactly one of them; got both",
        ),
        (
            {"input_ids": True, "decoder_inputs_embeds": "narrow"},
            r"d_model=32\) token embeddings, got shape \(1, 2, 5\)",
        ),
    ],
)
def test_ids_and_embeddings_of_one_input_are_refused_together_in_one_line(tokenizer, inputs, message):
    model = random_model(tokenizer)
    ids = torch.tensor([[5, 6]])
    values = {
        "input_ids": ids,
        "decoder_input_ids": ids,
        "inputs_embeds": model.get_input_embeddings()(ids),
        "decoder_inputs_embeds": model.get_input_embeddings()(ids),
    }
    arguments = {name: values[name] if given is True else values[name][..., :5] for name, given in inputs.items()}
    with pytest.raises(ValueError, match=message):
        model(**arguments)


def test_shift_tokens_right_starts_with_the_decoder_start_token():
    labels = torch.tensor([[10, 11, 2, -100]])
    assert shift_tokens_right(labels, pad_token_id=0, decoder_start_token_id=1).tolist() == [[1, 10, 11, 2]]


def test_beams_as_queries_of_one_row_get_the_logits_of_beams_decoded_as_rows(tokenizer, test_sentences):
    # Beam search decodes a sentence's beams as one decoder row: its beams' tokens are queries at one position
    # (`decoder_position_ids`), each masked to itself (a 4-D `decoder_attention_mask`), and all attend to the
    # sentence's one encoder output (padded sources).
    model = random_model(tokenizer, seed=3)
    inputs = tokenizer(test_sentences[0][:3], padding=True, return_tensors="pt")
    beams = 2
    with torch.no_grad():
        encoded = model.get_encoder()(**inputs)
        tokens = torch.randint(4, len(tokenizer), (3, beams))
        own_beam = torch.eye(beams, dtype=torch.bool).expand(3, 1, beams, beams)
        as_queries = model(
            encoder_outputs=encoded,
            attention_mask=inputs["attention_mask"],
            decoder_input_ids=tokens,
            decoder_attention_mask=own_beam,
            decoder_position_ids=torch.zeros(1, 1, dtype=torch.long),
        ).logits
        as_rows = model(
            encoder_outputs=(encoded.last_hidden_state.repeat_interleave(beams, dim=0),),
            attention_mask=inputs["attention_mask"].repeat_interleave(beams, dim=0),
            decoder_input_ids=tokens.view(-1, 1),
        ).logits
        torch.testing.assert_close(as_queries.flatten(0, 1), as_rows[:, 0], rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="one encoder row per decoder row"):
            model(encoder_outputs=encoded, attention_mask=inputs["attention_mask"], decoder_input_ids=tokens.view(6, 1))


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_decoder_attends_alike_with_the_encoder_mask_it_built_once(tokenizer, test_sentences, attn_implementation):
    # Beam search builds the encoder-decoder mask once for all its steps and hands it back: for each kind of mask
    # (boolean for SDPA, additive for eager), the decoder must attend as with the padding mask it came from.
    model = random_model(tokenizer, seed=4)
    model.config._attn_implementation = attn_implementation
    inputs = tokenizer(test_sentences[0][:3], padding=True, return_tensors="pt")
    assert not inputs["attention_mask"].all()
    decoder = model.get_decoder()
    with torch.no_grad():
        encoded = model.get_encoder()(**inputs).last_hidden_state
        built = decoder.cross_attention_mask(4, encoded, inputs["attention_mask"])
        assert built.shape == (3, 1, 4, encoded.shape[1])
        decoder_input_ids = torch.randint(4, len(tokenizer), (3, 4))  # 4 beams, one row of queries a sentence
        outputs = [
            decoder(decoder_input_ids, encoded, encoder_attention_mask=mask).last_hidden_state
            for mask in (inputs["attention_mask"], built)
        ]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


def test_training_forward_returns_the_loss_and_gradients_of_the_logits_without_the_logits(
    tokenizer, test_sentences, monkeypatch
):
    model = random_model(tokenizer, seed=3)  # eval mode: no dropout, so both passes compute the same function
    batch = seq2seq_batch(tokenizer, test_sentences[0][:4], test_sentences[1][:4])
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

        batch = seq2seq_batch(tokenizer, test_sentences[0][:4], test_sentences[1][:4])
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


def test_gradient_checkpointing_gives_the_same_gradients(tokenizer, test_sentences):
    batch = seq2seq_batch(tokenizer, test_sentences[0][:3], test_sentences[1][:3])
    gradients = []
    for checkpointing in (False, True):
        model = random_model(tokenizer, seed=9, dropout=0.3).train()
        if checkpointing:
            # Its name since transformers 5.2x; before, gradient_checkpointing_enable (deprecated since).
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        torch.manual_seed(1)  # the same dropout masks in both runs, and again in the recomputed forward pass
        model(**batch).loss.backward()
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], gradient, atol=1e-6, rtol=1e-5, msg=name)


def test_bf16_autocast_on_cpu_runs_and_stays_close_to_float32(tokenizer, test_sentences):
    model = random_model(tokenizer, seed=10)
    batch = seq2seq_batch(tokenizer, test_sentences[0][:3], test_sentences[1][:3])
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


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")  # torch.ao's own deprecation
def test_dynamic_int8_quantization_finds_every_linear_map_and_the_quantized_model_translates(
    trained_model_dir, test_sentences
):
    # `quantize_dynamic(model, {nn.Linear})` swaps the modules whose type is nn.Linear itself: every projection of
    # the model must be one (a subclass, as the model's were before 0.3, was skipped in silence: same speed, same
    # output). The int8 model translates nearly as the float32 one does (docs/compatibility.md, "Quantization").
    import sacrebleu

    quantize_dynamic = getattr(getattr(torch.ao, "quantization", None), "quantize_dynamic", None)
    if quantize_dynamic is None:
        pytest.skip("this PyTorch has no torch.ao.quantization.quantize_dynamic")
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    projections = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    layers = model.config.encoder_layers * 6 + model.config.decoder_layers * 10  # q, k, v, out (x2 in the decoder), fc
    assert len(projections) == layers + 1  # and the pre-softmax projection
    quantized = quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    dynamic = torch.ao.nn.quantized.dynamic.Linear
    assert all(isinstance(quantized.get_submodule(name), dynamic) for name in projections)
    sources, references = test_sentences
    batch = tokenizer(list(sources), padding=True, return_tensors="pt")
    with torch.no_grad():
        float32, int8 = (
            tokenizer.batch_decode(m.generate(**batch), skip_special_tokens=True) for m in (model, quantized)
        )
    assert all(int8)
    assert sacrebleu.corpus_bleu(int8, [float32]).score > 50, (int8, float32)
    # Its loss, with gradients on and its weights frozen, comes from the logits (a quantized map has no weight tensor).
    quantized.requires_grad_(False)
    loss = quantized(**seq2seq_batch(tokenizer, sources, references)).loss
    with torch.no_grad():
        expected = model(**seq2seq_batch(tokenizer, sources, references)).loss
    assert torch.isfinite(loss) and abs(loss.item() - expected.item()) < 0.05
