"""The Transformer of Vaswani et al. (2017), "Attention Is All You Need", as a transformers model.

Read after `layers_vaswani.py` (embeddings and positions §3.4-3.5, attention §3.2, feed-forward §3.3, the encoder
and decoder layers §3.1), this file follows the rest of §3 in the paper's order: the two stacks (§3.1) around
the embedding they share (§3.4), the model, and the translation head: the pre-softmax
projection tied to the embeddings (§3.4) and its label-smoothed loss (§5.4). Decoding (§6.1) is in
`generation_vaswani.py`, the residual dropout and the fused loss in `ops_vaswani.py`, and the check of a
saved model's weights in `loading_vaswani.py`.
"""

from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)

from .compat_vaswani import (
    OutputRecorder,
    cache_field,
    cache_length,
    cache_of,
    capture_outputs,
    check_forward_kwargs,
    make_causal_mask,
    merge_with_config_defaults,
    one_cache,
    shift_tokens_right,
)
from .configuration_vaswani import VaswaniConfig
from .generation_vaswani import VaswaniGenerationMixin, paper_generation_config
from .layers_vaswani import DecoderLayer, Embeddings, EncoderLayer, MultiHeadAttention
from .loading_vaswani import check_weights_fit
from .ops_vaswani import label_smoothed_cross_entropy, linear_label_smoothed_cross_entropy

# Saving copies a model file's relative imports, and `trust_remote_code` fetches them: the pipeline's too.
from .pipeline_vaswani import TranslationPipeline

# §3.1 The stacks ----------------------------------------------------------------------------------


class VaswaniPreTrainedModel(PreTrainedModel):
    """Weight initialisation, the switches transformers reads (attention backends, checkpointing), and loading.

    `from_pretrained` refuses weights that do not fit the model its `config.json` describes (`check_weights_fit`).
    """

    config_class = VaswaniConfig
    config: VaswaniConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _no_split_modules = ["EncoderLayer", "DecoderLayer"]

    @staticmethod
    def _finalize_model_loading(model: PreTrainedModel, load_config: Any, loading_info: Any) -> Any:
        # `from_pretrained` calls this once the file is read. transformers then initialises the weights the file lacks
        # and drops those it has over, with a warning only (a model that translates garbage), or stops with a report
        # and a RuntimeError for weights of other sizes: a config.json that does not describe the weights is refused
        # here first, in one line. The saved code does the same without the package.
        check_weights_fit(
            model,
            loading_info,
            load_config.pretrained_model_name_or_path,
            sizes_may_differ=load_config.ignore_mismatched_sizes,
        )
        return PreTrainedModel._finalize_model_loading(model, load_config, loading_info)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # The paper does not say; these are the initialisations of its tensor2tensor and fairseq
        # implementations: Xavier-uniform projections, and embeddings of standard deviation
        # d_model^-0.5, which the sqrt(d_model) scaling of §3.4 brings to unit variance.
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.d_model**-0.5)
            if module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, VaswaniForConditionalGeneration) and module.final_logits_bias is not None:
            nn.init.zeros_(module.final_logits_bias)


class VaswaniStack(VaswaniPreTrainedModel):
    """Embeddings and a stack of N identical layers (§3.1): what the encoder and the decoder share.

    Args:
        config: the model's configuration.
        embed_tokens: the `(vocab_size, d_model)` embedding shared by both stacks (§3.4).
        layer: `EncoderLayer` or `DecoderLayer`.
        num_layers: N.
    """

    def __init__(self, config: VaswaniConfig, embed_tokens: nn.Embedding, layer: type, num_layers: int) -> None:
        super().__init__(config)
        self.embeddings = Embeddings(config, embed_tokens, "decoder_" if layer is DecoderLayer else "")
        self.layers = nn.ModuleList([layer(config, i) for i in range(num_layers)])
        # Pre-LayerNorm leaves the last layer's output unnormalised.
        self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.normalize_before else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.embed_tokens


class VaswaniEncoder(VaswaniStack):
    """The encoder: embeddings and a stack of N `EncoderLayer`s (§3.1)."""

    _can_record_outputs = {"hidden_states": EncoderLayer, "attentions": MultiHeadAttention}

    def __init__(self, config: VaswaniConfig, embed_tokens: nn.Embedding) -> None:
        super().__init__(config, embed_tokens, EncoderLayer, config.encoder_layers)

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutput:
        """Encode a source batch (§3.1).

        Args:
            input_ids: `(batch, source_len)` token ids; or None, with `inputs_embeds`.
            attention_mask: `(batch, source_len)`, 1 for tokens and 0 for padding; None means no padding.
            inputs_embeds: `(batch, source_len, d_model)` token embeddings in place of `input_ids`, as
                `get_input_embeddings()` gives them: before the sqrt(d_model) scale and the positions (§3.4, §3.5),
                which are applied to them as to the embeddings of ids (see `Embeddings.forward`).
            output_attentions, output_hidden_states: also return every layer's weights or outputs.

        Returns:
            `BaseModelOutput` with `last_hidden_state` `(batch, source_len, d_model)`.

        Raises:
            ValueError: both or neither of `input_ids` and `inputs_embeds`, or `inputs_embeds` not d_model wide.
            TypeError: a keyword argument this model does not take (`compat_vaswani.check_forward_kwargs`).
        """
        check_forward_kwargs(kwargs, type(self).__name__, encoder=True)
        hidden_states = self.embeddings(input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds)
        attention_mask = create_bidirectional_mask(
            config=self.config, inputs_embeds=hidden_states, attention_mask=attention_mask
        )
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, **kwargs)
        if self.layer_norm is not None:
            hidden_states = self.layer_norm(hidden_states)
        return BaseModelOutput(last_hidden_state=hidden_states)


class VaswaniDecoder(VaswaniStack):
    """The decoder: embeddings and a stack of N `DecoderLayer`s (§3.1)."""

    _can_record_outputs = {
        "hidden_states": DecoderLayer,
        "attentions": OutputRecorder(MultiHeadAttention, index=1, layer_name="self_attn"),
        "cross_attentions": OutputRecorder(MultiHeadAttention, index=1, layer_name="encoder_attn"),
    }

    def __init__(self, config: VaswaniConfig, embed_tokens: nn.Embedding) -> None:
        super().__init__(config, embed_tokens, DecoderLayer, config.decoder_layers)

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        """Decode a target batch given the encoder output (§3.1).

        Args:
            input_ids: `(batch, target_len)` decoder input ids: the target shifted right behind
                `decoder_start_token_id`, or only the new tokens when decoding with a cache; or None, with
                `inputs_embeds`.
            encoder_hidden_states: `(batch, source_len, d_model)`.
            attention_mask: `(batch, past_len + target_len)` decoder padding mask; or a `(batch, 1, target_len,
                keys)` boolean mask of the caller's own, True where a position may attend, used as it is (beam
                search's, whose `target_len` inputs are a sentence's beams at one position: §6.1); or None.
            encoder_attention_mask: `(batch, source_len)` source padding mask, one built by
                `cross_attention_mask`, or None.
            cache: the `EncoderDecoderCache` of earlier steps; created when `use_cache` and None.
            use_cache: return a cache for incremental decoding.
            past_key_values: `cache` under its name before transformers 5.24.
            position_ids: `(batch, target_len)` positions of the inputs, or any shape that broadcasts to it (§3.5);
                by default `past_len`, `past_len + 1`, ...
            inputs_embeds: `(batch, target_len, d_model)` token embeddings in place of `input_ids`, before the
                sqrt(d_model) scale and the positions, as in `VaswaniEncoder.forward`.

        Returns:
            `BaseModelOutputWithPastAndCrossAttentions` with `last_hidden_state`
            `(batch, target_len, d_model)` and the cache (`cache`, or `past_key_values` before 5.24).

        Raises:
            ValueError: the encoder output and the decoder input have different numbers of rows; both or neither of
                `input_ids` and `inputs_embeds`, or `inputs_embeds` not d_model wide.
            TypeError: both `cache` and `past_key_values`, or a keyword argument this model does not take.
        """
        check_forward_kwargs(kwargs, type(self).__name__)
        past_key_values = one_cache(cache, past_key_values)
        if use_cache and past_key_values is None:
            past_key_values = EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
        past_length = cache_length(past_key_values) if past_key_values is not None else 0
        hidden_states = self.embeddings(input_ids, past_length, position_ids=position_ids, inputs_embeds=inputs_embeds)
        static_cache = getattr(past_key_values, "is_compileable", False)
        if attention_mask is not None and attention_mask.dim() == 4:
            causal_mask = attention_mask  # the caller's own, as transformers' mask functions take one
        elif hidden_states.shape[1] == 1 and attention_mask is None and not static_cache:
            # One new position, which may attend to every earlier one, and a cache that holds only those (a static
            # one also holds empty slots): nothing to mask, which `create_causal_mask` would take a while to find.
            causal_mask = None
        else:
            self_attention_cache = past_key_values.self_attention_cache if past_key_values is not None else None
            causal_mask = make_causal_mask(self.config, hidden_states, attention_mask, self_attention_cache)
        if hidden_states.shape[0] != encoder_hidden_states.shape[0]:
            raise ValueError(
                f"The decoder input has {hidden_states.shape[0]} rows and the encoder output "
                f"{encoder_hidden_states.shape[0]}: give one encoder row per decoder row."
            )
        encoder_attention_mask = self.cross_attention_mask(
            hidden_states.shape[1], encoder_hidden_states, encoder_attention_mask
        )
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                causal_mask,
                encoder_hidden_states,  # positional, so that gradient checkpointing sees it
                encoder_attention_mask=encoder_attention_mask,
                past_key_values=past_key_values,
                **kwargs,
            )
        if self.layer_norm is not None:
            hidden_states = self.layer_norm(hidden_states)
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states, **cache_field(past_key_values)
        )

    def cross_attention_mask(
        self, queries: int, encoder_hidden_states: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Encoder-decoder attention's mask (§3.2.3) for `queries` positions per encoder row, as the attention takes it.

        `attention_mask` is the
        `(batch, source_len)` padding mask (1 = token) or None; `encoder_hidden_states` `(batch, source_len, d_model)`.
        Returns `create_bidirectional_mask`'s: `(batch, 1, queries, source_len)`, the 2-D mask, or None. Beam search
        builds it once and passes it back as `encoder_attention_mask`, which that builder returns as it is.
        """
        return create_bidirectional_mask(
            config=self.config,
            inputs_embeds=encoder_hidden_states[:, :1].expand(-1, queries, -1),
            attention_mask=attention_mask,
            encoder_hidden_states=encoder_hidden_states,
        )


# The model ----------------------------------------------------------------------------------------


class VaswaniModel(VaswaniPreTrainedModel):
    """Encoder and decoder around one `(vocab_size, d_model)` embedding shared by source and target (§3.4)."""

    _tied_weights_keys = {
        "encoder.embeddings.embed_tokens.weight": "shared.weight",
        "decoder.embeddings.embed_tokens.weight": "shared.weight",
    }
    # Loaded alone (AutoModel) from a translation model's file, it leaves the head's weights there.
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\.weight$", r"^final_logits_bias$"]

    def __init__(self, config: VaswaniConfig) -> None:
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
        self.encoder = VaswaniEncoder(config, self.shared)
        self.decoder = VaswaniDecoder(config, self.shared)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.shared

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.shared = value
        self.encoder.embeddings.embed_tokens = value
        self.decoder.embeddings.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        decoder_position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> Seq2SeqModelOutput:
        """Encode the source (unless `encoder_outputs` is given) and decode the target (§3.1).

        Args:
            input_ids: `(batch, source_len)` source token ids.
            attention_mask: `(batch, source_len)` source padding mask (1 = token).
            decoder_input_ids: `(batch, target_len)` decoder inputs.
            decoder_attention_mask: `(batch, target_len)` target padding mask, a `(batch, 1, target_len,
                past_len + target_len)` boolean mask of the caller's own (see `VaswaniDecoder.forward`), or None.
            encoder_outputs: reuse an earlier encoding of the source.
            cache, use_cache, past_key_values: see `VaswaniDecoder.forward`.
            decoder_position_ids: the decoder inputs' positions (see `VaswaniDecoder.forward`), or None.
            inputs_embeds, decoder_inputs_embeds: `(batch, source_len, d_model)` and `(batch, target_len, d_model)`
                token embeddings in place of `input_ids` and `decoder_input_ids`, as transformers' seq2seq models
                take them (PEFT's prompt tuning does): before the sqrt(d_model) scale, which is applied to them as to
                `get_input_embeddings()(ids)`, so that those give the outputs of the ids (see `Embeddings.forward`).

        Returns:
            `Seq2SeqModelOutput` with the decoder's `last_hidden_state` `(batch, target_len, d_model)`.

        Raises:
            ValueError: `encoder_outputs` and `decoder_input_ids` have different numbers of rows; both or neither of
                an input's ids and embeddings, or embeddings not d_model wide.
            TypeError: both `cache` and `past_key_values`, or a keyword argument this model does not take.
        """
        check_forward_kwargs(kwargs, type(self).__name__)
        cache = one_cache(cache, past_key_values)
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            attention_mask=decoder_attention_mask,
            encoder_attention_mask=attention_mask,
            cache=cache,
            use_cache=use_cache,
            position_ids=decoder_position_ids,
            inputs_embeds=decoder_inputs_embeds,
            **kwargs,
        )
        return Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **cache_field(cache_of(decoder_outputs)),
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )


# The translation head -----------------------------------------------------------------------------


class VaswaniForConditionalGeneration(VaswaniGenerationMixin, VaswaniPreTrainedModel):
    """The Transformer for translation: `VaswaniModel` and the pre-softmax projection tied to the embeddings (§3.4).

    `generate()` decodes with a key/value cache; a new model's generation config is the paper's
    beam search (`paper_generation_config`, §6.1), and `from_pretrained` loads the saved one.
    """

    _tied_weights_keys = {"lm_head.weight": "model.shared.weight"}

    def __init__(self, config: VaswaniConfig) -> None:
        super().__init__(config)
        self.model = VaswaniModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Imported HF Marian models add a fixed bias to the logits; the paper has none.
        if config.add_final_logits_bias:
            self.register_buffer("final_logits_bias", torch.zeros(1, config.vocab_size))
        else:
            self.final_logits_bias = None
        self.generation_config = paper_generation_config(config)
        # transformers 5 has no translation task: `pipeline("translation", trust_remote_code=True)` reads ours here.
        pipeline = {"impl": f"pipeline_vaswani.{TranslationPipeline.__name__}", "pt": ["AutoModelForSeq2SeqLM"]}
        config.custom_pipelines = getattr(config, "custom_pipelines", None) or {"translation": pipeline}
        # save_pretrained names only the saved class in `auto_map`: AutoModel (remote code) loads the base model.
        base_model = {"AutoModel": f"modeling_vaswani.{VaswaniModel.__name__}"}
        config.auto_map = {**base_model, **(getattr(config, "auto_map", None) or {})}
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        decoder_position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> Seq2SeqLMOutput:
        """Next-token logits for every target position and, given `labels`, the label-smoothed loss (§3.4, §5.4).

        Args:
            input_ids: `(batch, source_len)` source ids.
            attention_mask: `(batch, source_len)` source padding mask (1 = token).
            decoder_input_ids: `(batch, target_len)`; derived from `labels` with `shift_tokens_right` if None and
                `decoder_inputs_embeds` is None.
            decoder_attention_mask: `(batch, target_len)`, a caller's own 4-D mask, or None.
            encoder_outputs, cache, use_cache, past_key_values, decoder_position_ids, inputs_embeds,
                decoder_inputs_embeds: see `VaswaniModel.forward`.
            labels: `(batch, target_len)` target ids ending in `</s>`, -100 on padding.
            num_items_in_batch: target tokens of the whole optimizer step (see
                `label_smoothed_cross_entropy`); passed by the Trainer under gradient accumulation.

        Returns:
            `Seq2SeqLMOutput` with `logits` `(batch, target_len, vocab_size)` and `loss` (nats per token).
            With `labels` and gradients enabled (training, outside float16), `logits` is None, and so
            absent from `to_tuple()`: the loss comes from `linear_label_smoothed_cross_entropy`, which
            never holds all of them. Call without `labels`, or under `torch.no_grad()`, to get them.

        Raises:
            ValueError: none of `decoder_input_ids`, `decoder_inputs_embeds` and `labels` is given, `encoder_outputs`
                and the decoder input have different numbers of rows, or as `VaswaniModel.forward`.
            TypeError: both `cache` and `past_key_values`, or a keyword argument this model does not take.
        """
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            raise ValueError(
                "VaswaniForConditionalGeneration needs decoder_input_ids, decoder_inputs_embeds or labels to decode."
            )
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            cache=one_cache(cache, past_key_values),
            use_cache=use_cache,
            decoder_position_ids=decoder_position_ids,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            **kwargs,
        )
        hidden_states, epsilon = outputs.last_hidden_state, self.config.label_smoothing
        logits = loss = None
        if labels is not None and self._loss_without_logits(hidden_states):
            loss = linear_label_smoothed_cross_entropy(
                hidden_states,
                self.lm_head.weight,
                labels,
                epsilon,
                self.final_logits_bias,
                num_items_in_batch,
            )
        else:
            logits = self.lm_head(hidden_states)
            if self.final_logits_bias is not None:
                logits = logits + self.final_logits_bias
            if labels is not None:
                loss = label_smoothed_cross_entropy(logits, labels, epsilon, num_items_in_batch)
        # Everything the model returned but the decoder output, which the logits replace.
        rest = {key: value for key, value in outputs.items() if key != "last_hidden_state"}
        return Seq2SeqLMOutput(loss=loss, logits=logits, **rest)

    def _loss_without_logits(self, hidden_states: torch.Tensor) -> bool:
        # In training, the fused projection and loss spare the (tokens x vocabulary) logits, a step's largest tensor.
        # It reads lm_head's weight without calling lm_head: not where a hook of lm_head must run first (ZeRO-3
        # gathers the weight there, Accelerate's offloading moves it), nor with a bias of its own; not in float16,
        # whose subnormals would swallow its unscaled logit gradients (~1 / vocabulary), which materialised logits get
        # multiplied by the loss scale; not under torch.compile, which cannot trace its data-dependent chunks.
        device = hidden_states.device.type
        return (
            torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and type(self.lm_head) is nn.Linear  # first: a quantized one has no weight tensor to read
            and (hidden_states.requires_grad or self.lm_head.weight.requires_grad)
            and self.lm_head.bias is None
            and not self.lm_head._forward_pre_hooks
            and not hasattr(self.lm_head, "_hf_hook")
            and not is_deepspeed_zero3_enabled()
            and torch.float16 not in (hidden_states.dtype, self.lm_head.weight.dtype)
            and not (torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16)
        )

    def resize_token_embeddings(self, new_num_tokens: int | None = None, **kwargs) -> nn.Embedding:
        """Also resizes `final_logits_bias` `(1, vocab_size)`, which Marian imports have: zeros for new tokens."""
        embeddings = super().resize_token_embeddings(new_num_tokens, **kwargs)
        if self.final_logits_bias is not None:
            old = self.final_logits_bias[:, : embeddings.num_embeddings]
            resized = old.new_zeros(1, embeddings.num_embeddings)
            resized[:, : old.shape[1]] = old
            self.final_logits_bias = resized
        return embeddings

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """For `DataCollatorForSeq2Seq`: `labels` `(batch, target_len)` -> decoder inputs, shifted right (§3.1)."""
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)
