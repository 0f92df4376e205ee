"""The Transformer of Vaswani et al. (2017), "Attention Is All You Need", as a transformers model.

Read top to bottom, this file follows §3 of the paper: positional encoding (§3.5), scaled
dot-product and multi-head attention (§3.2), the position-wise feed-forward network (§3.3), the
encoder and decoder layers with their residual + LayerNorm sublayers and the two stacks (§3.1),
the embeddings shared by both stacks (§3.4), the model, and the translation head: the pre-softmax
projection tied to the embeddings (§3.4) and its label-smoothed loss (§5.4). Decoding (§6.1) is in
`generation_vaswani.py`, the CPU kernels of the linear maps, dropout and loss in `ops_vaswani.py`.
"""

import contextlib
import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

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
from .generation_vaswani import BeamSearchCache, VaswaniGenerationMixin, paper_generation_config
from .ops_vaswani import (
    Linear,
    attention_in_float32,
    eager_attention_is_faster,
    label_smoothed_cross_entropy,
    linear_label_smoothed_cross_entropy,
    residual_dropout,
)

# Saving copies a model file's relative imports, and `trust_remote_code` fetches them: the pipeline's too.
from .pipeline_vaswani import TranslationPipeline

# §3.5 Positional encoding -------------------------------------------------------------------------


class SinusoidalPositionalEncoding(nn.Module):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)) (§3.5).

    Sines and cosines are interleaved as in the paper's formula. The encoding is computed from the
    positions on every call rather than read from a table, so any length works, longer than any
    seen in training included; it has no parameters and nothing is saved. Computing it costs
    O(length * d_model), negligible beside one attention layer.
    """

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.d_model = d_model

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """Encode positions (§3.5).

        Args:
            positions: integer positions, any shape `(*)`, counted from 0.

        Returns:
            float32 tensor of shape `(*, d_model)`.
        """
        # 1 / 10000^(2i / d_model), i = 0 .. d_model/2 - 1: wavelengths in a geometric progression.
        even_dims = torch.arange(0, self.d_model, 2, dtype=torch.float32, device=positions.device)
        inverse_frequency = torch.exp(even_dims * (-math.log(10000.0) / self.d_model))
        angles = positions.float().unsqueeze(-1) * inverse_frequency
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)


class LearnedPositionalEmbedding(nn.Embedding):
    """One trained d_model vector per position, up to a fixed number of positions (Table 3, row E).

    The paper found "nearly identical results" to the sinusoids, which it kept because they may
    extrapolate to lengths unseen in training; these cannot. Call it with `(*)` integer positions
    to get `(*, d_model)` embeddings.
    """


# §3.2 Attention -----------------------------------------------------------------------------------


def scaled_dot_product_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V (§3.2.1, Eq. 1), spelled out.

    This is the "eager" implementation of transformers' attention interface: the only one that
    returns the attention weights, so `output_attentions=True` takes it whatever the model's
    `attn_implementation`. `"sdpa"` (the default) computes the same with PyTorch's fused kernel.

    Args:
        module: the calling attention module (gives `training`).
        query: `(batch, heads, target_len, d_k)`.
        key: `(batch, heads, source_len, d_k)`.
        value: `(batch, heads, source_len, d_v)`.
        attention_mask: additive float mask broadcastable to `(batch, heads, target_len, source_len)`,
            0 where attending is allowed and the dtype's minimum where it is not; or a boolean mask,
            True where attending is allowed (the SDPA format); or None.
        scaling: 1 / sqrt(d_k).
        dropout: dropout probability on the weights.

    Returns:
        The output, `(batch, target_len, heads, d_v)`, and the weights, `(batch, heads, target_len, source_len)`.
    """
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is None and module.is_causal and query.shape[2] > 1:  # SDPA's mask builder left it to is_causal
        attention_mask = weights.new_ones(weights.shape[-2:], dtype=torch.bool).tril(key.shape[2] - query.shape[2])
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        weights = torch.where(attention_mask, weights, torch.finfo(weights.dtype).min)
    elif attention_mask is not None:
        weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1)
    if module.training and dropout:
        weights = F.dropout(weights, p=dropout)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output, weights


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V) (§3.2.2).

    The h projections of each kind are one bias-free linear map, d_model to h * d_k for queries and
    keys and to h * d_v for values, as in the paper's parameter matrices (d_k = d_v = d_model / h
    unless the config sets them, Table 3 rows A and B; biases only with `attention_bias`). The
    module serves the three uses of §3.2.3: encoder self-attention, masked decoder self-attention
    (`is_causal=True`) and encoder-decoder attention (`is_cross_attention=True`, keys and values
    from the encoder output).
    """

    def __init__(
        self, config: VaswaniConfig, layer_idx: int = 0, is_causal: bool = False, is_cross_attention: bool = False
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.scaling = config.key_dim**-0.5
        self.dropout = config.attention_dropout
        # Read by the SDPA path: False for non-causal attention, or an unpadded encoder batch would be masked causally.
        self.is_causal = is_causal
        self.is_cross_attention = is_cross_attention
        keys_width, values_width = self.num_heads * config.key_dim, self.num_heads * config.value_dim
        self.q_proj = Linear(config.d_model, keys_width, bias=config.attention_bias)
        self.k_proj = Linear(config.d_model, keys_width, bias=config.attention_bias)
        self.v_proj = Linear(config.d_model, values_width, bias=config.attention_bias)
        self.out_proj = Linear(values_width, config.d_model, bias=config.attention_bias)

    def _split_heads(self, states: torch.Tensor) -> torch.Tensor:
        # (batch, length, heads * d) -> (batch, heads, length, d)
        return states.view(*states.shape[:-1], self.num_heads, -1).transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from `hidden_states` to itself, or to `key_value_states` for cross-attention (§3.2.2).

        Args:
            hidden_states: queries, `(batch, target_len, d_model)`.
            key_value_states: encoder output `(batch, source_len, d_model)` for cross-attention, else None.
                It may have batch / beams rows: each then serves `beams` consecutive rows of queries.
            attention_mask: mask from `transformers.masking_utils`, or None. Self-attention with a
                `BeamSearchCache` uses the cache's mask instead.
            past_key_values: an `EncoderDecoderCache` during incremental decoding. Self-attention
                appends this step's keys and values; cross-attention computes the encoder's once
                and then reuses them.

        Returns:
            The output `(batch, target_len, d_model)` and, with eager attention or `output_attentions`, the weights
            `(batch, heads, target_len, key_len)` (None otherwise); with shared encoder rows,
            `(batch / beams, heads, beams * target_len, key_len)`, and in self-attention with a
            `BeamSearchCache` holding `length` positions, `(batch / beams, heads, beams, length * num_beams)`.
        """
        cache = None
        if past_key_values is not None:
            caches = past_key_values
            cache = caches.cross_attention_cache if self.is_cross_attention else caches.self_attention_cache
        rows = hidden_states.shape[0]
        if self.is_cross_attention and key_value_states is not None and key_value_states.shape[0] != rows:
            # Beam search gives each sentence's encoder output once for all its beams (`beam_search`): the
            # beams' queries attend to it as one longer query sequence, its keys and values computed once.
            hidden_states = hidden_states.reshape(key_value_states.shape[0], -1, hidden_states.shape[-1])
        elif isinstance(cache, BeamSearchCache):
            # So do the beams' one new position each in self-attention, to the keys and values of every
            # beam's slot, each beam masked to its own ancestors' (`BeamSearchCache`).
            hidden_states = hidden_states.reshape(cache.batch_size, -1, hidden_states.shape[-1])
        query = self._split_heads(self.q_proj(hidden_states))
        if self.is_cross_attention and cache is not None and past_key_values.is_updated.get(self.layer_idx):
            key, value = cache.layers[self.layer_idx].keys, cache.layers[self.layer_idx].values
        else:
            source = key_value_states if self.is_cross_attention else hidden_states
            key, value = self._split_heads(self.k_proj(source)), self._split_heads(self.v_proj(source))
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)
                if self.is_cross_attention:
                    past_key_values.is_updated[self.layer_idx] = True
                elif isinstance(cache, BeamSearchCache):
                    attention_mask = cache.mask.to(key.device)  # layers may sit on several devices

        implementation = self.config._attn_implementation
        if implementation == "sdpa" and (  # only Eq. 1 spelled out gives the weights
            kwargs.get("output_attentions")
            or eager_attention_is_faster(query, key, attention_mask, self.is_causal, decoding=cache is not None)
        ):
            implementation = "eager"
        elif implementation != "sdpa" and isinstance(cache, BeamSearchCache):
            # Flash attention, and kernels registered by users, may ignore a mask of this kind: the beams'
            # ancestry needs it, and the eager path applies it.
            implementation = "eager"
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, scaled_dot_product_attention)
        dropout = self.dropout if self.training else 0.0
        precision = contextlib.nullcontext()
        if implementation == "sdpa" and attention_in_float32(query):
            precision = torch.autocast("cpu", enabled=False)
            query, key, value = query.float(), key.float(), value.float()
            if attention_mask is not None and attention_mask.is_floating_point():
                attention_mask = attention_mask.float()
        with precision:
            output, weights = attention(
                self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs
            )
        output = self.out_proj(output.reshape(*hidden_states.shape[:-1], -1))
        return output.reshape(rows, -1, output.shape[-1]), weights


# §3.3 Position-wise feed-forward network ----------------------------------------------------------


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2 (§3.3, Eq. 2), d_model -> d_ff -> d_model.

    max(0, .) is ReLU, the config's `activation_function` by default; imported models may use another.
    """

    def __init__(self, config: VaswaniConfig) -> None:
        super().__init__()
        self.fc1 = Linear(config.d_model, config.d_ff)
        self.fc2 = Linear(config.d_ff, config.d_model)
        self.activation = ACT2FN[config.activation_function]
        self.activation_dropout = config.activation_dropout

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`(batch, length, d_model)` -> `(batch, length, d_model)` (§3.3, Eq. 2)."""
        hidden_states = self.activation(self.fc1(hidden_states))
        if self.training and self.activation_dropout:
            hidden_states = F.dropout(hidden_states, p=self.activation_dropout)
        return self.fc2(hidden_states)


# §3.1 Encoder and decoder layers ------------------------------------------------------------------


class SublayerConnection(nn.Module):
    """LayerNorm(x + Dropout(Sublayer(x))): the residual connection around each sublayer (§3.1, §5.4).

    With `config.normalize_before` (not in the paper) it is x + Dropout(Sublayer(LayerNorm(x))) instead.
    """

    def __init__(self, config: VaswaniConfig) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = config.dropout
        self.normalize_before = config.normalize_before

    def forward(self, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Apply `sublayer`, `(batch, length, d_model)` -> same shape, with its residual connection (§3.1)."""
        if self.normalize_before:
            return x + residual_dropout(sublayer(self.layer_norm(x)), self.dropout, self.training)
        return self.layer_norm(x + residual_dropout(sublayer(x), self.dropout, self.training))


class EncoderLayer(GradientCheckpointingLayer):
    """One of the N identical encoder layers: self-attention, then feed-forward (§3.1)."""

    def __init__(self, config: VaswaniConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(config, layer_idx)
        self.self_attn_sublayer = SublayerConnection(config)
        self.feed_forward = PositionwiseFeedForward(config)
        self.feed_forward_sublayer = SublayerConnection(config)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs) -> torch.Tensor:
        """`(batch, source_len, d_model)` -> `(batch, source_len, d_model)` (§3.1); the mask hides padding."""
        hidden_states = self.self_attn_sublayer(
            hidden_states, lambda x: self.self_attn(x, attention_mask=attention_mask, **kwargs)[0]
        )
        return self.feed_forward_sublayer(hidden_states, self.feed_forward)


class DecoderLayer(GradientCheckpointingLayer):
    """One of the N identical decoder layers: masked self-attention, encoder-decoder attention, feed-forward (§3.1)."""

    def __init__(self, config: VaswaniConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(config, layer_idx, is_causal=True)
        self.self_attn_sublayer = SublayerConnection(config)
        self.encoder_attn = MultiHeadAttention(config, layer_idx, is_cross_attention=True)
        self.encoder_attn_sublayer = SublayerConnection(config)
        self.feed_forward = PositionwiseFeedForward(config)
        self.feed_forward_sublayer = SublayerConnection(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """`(batch, target_len, d_model)` -> the same; `attention_mask` is the causal (and padding) mask of §3.2.3,
        `encoder_hidden_states` `(batch, source_len, d_model)` has the padding mask `encoder_attention_mask`."""
        hidden_states = self.self_attn_sublayer(
            hidden_states,
            lambda x: self.self_attn(x, attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)[0],
        )
        hidden_states = self.encoder_attn_sublayer(
            hidden_states,
            lambda x: self.encoder_attn(x, encoder_hidden_states, encoder_attention_mask, past_key_values, **kwargs)[0],
        )
        return self.feed_forward_sublayer(hidden_states, self.feed_forward)


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
        self.embeddings = Embeddings(config, embed_tokens)
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
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, **kwargs
    ) -> BaseModelOutput:
        """Encode a source batch (§3.1).

        Args:
            input_ids: `(batch, source_len)` token ids.
            attention_mask: `(batch, source_len)`, 1 for tokens and 0 for padding; None means no padding.
            output_attentions, output_hidden_states: also return every layer's weights or outputs.

        Returns:
            `BaseModelOutput` with `last_hidden_state` `(batch, source_len, d_model)`.

        Raises:
            TypeError: a keyword argument this model does not take (`compat_vaswani.check_forward_kwargs`).
        """
        check_forward_kwargs(kwargs, type(self).__name__, encoder=True)
        hidden_states = self.embeddings(input_ids, attention_mask=attention_mask)
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
        input_ids: torch.LongTensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        """Decode a target batch given the encoder output (§3.1).

        Args:
            input_ids: `(batch, target_len)` decoder input ids: the target shifted right behind
                `decoder_start_token_id`, or only the new tokens when decoding with a cache.
            encoder_hidden_states: `(batch, source_len, d_model)`, or `(batch / beams, source_len, d_model)`:
                one row for `beams` consecutive decoder rows, as beam search gives it.
            attention_mask: `(batch, past_len + target_len)` decoder padding mask, or None.
            encoder_attention_mask: `(batch, source_len)` source padding mask (`batch / beams` rows with
                the encoder output), one built by `cross_attention_mask`, or None.
            cache: the `EncoderDecoderCache` of earlier steps; created when `use_cache` and None.
            use_cache: return a cache for incremental decoding.
            past_key_values: `cache` under its name before transformers 5.24.

        Returns:
            `BaseModelOutputWithPastAndCrossAttentions` with `last_hidden_state`
            `(batch, target_len, d_model)` and the cache (`cache`, or `past_key_values` before 5.24).

        Raises:
            ValueError: the encoder output's rows do not divide the decoder input's.
            TypeError: both `cache` and `past_key_values`, or a keyword argument this model does not take.
        """
        check_forward_kwargs(kwargs, type(self).__name__)
        past_key_values = one_cache(cache, past_key_values)
        if use_cache and past_key_values is None:
            past_key_values = EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
        past_length = cache_length(past_key_values) if past_key_values is not None else 0
        hidden_states = self.embeddings(input_ids, past_length)
        if input_ids.shape[1] == 1 and attention_mask is None and not getattr(past_key_values, "is_compileable", False):
            # One new position, which may attend to every earlier one, and a cache that holds only those (a static
            # one also holds empty slots): nothing to mask, which `create_causal_mask` would take a while to find.
            causal_mask = None
        else:
            self_attention_cache = past_key_values.self_attention_cache if past_key_values is not None else None
            causal_mask = make_causal_mask(self.config, hidden_states, attention_mask, self_attention_cache)
        if hidden_states.shape[0] % encoder_hidden_states.shape[0]:
            raise ValueError(
                f"The decoder input has {hidden_states.shape[0]} rows and the encoder output "
                f"{encoder_hidden_states.shape[0]}: give one encoder row per decoder row, or one per group of "
                "consecutive decoder rows (the beams of a sentence)."
            )
        queries = hidden_states.shape[0] // encoder_hidden_states.shape[0] * hidden_states.shape[1]
        encoder_attention_mask = self.cross_attention_mask(queries, encoder_hidden_states, encoder_attention_mask)
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

        The rows sharing an encoder row (a sentence's beams) attend to it as one sequence. `attention_mask` is the
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


# §3.4 Embeddings ----------------------------------------------------------------------------------


class Embeddings(nn.Module):
    """Token embedding times sqrt(d_model) plus the positional encoding, then dropout (§3.4, §3.5, §5.4).

    The positional encoding is sinusoidal, or learned with `position_embedding_type="learned"`.
    """

    def __init__(self, config: VaswaniConfig, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        if config.position_embedding_type == "learned":
            self.max_positions = config.max_position_embeddings
            self.positional_encoding = LearnedPositionalEmbedding(config.max_position_embeddings, config.d_model)
        else:
            self.max_positions = None
            self.positional_encoding = SinusoidalPositionalEncoding(config.d_model)
        self.dropout = config.dropout

    def forward(
        self, input_ids: torch.Tensor, past_length: int = 0, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`(batch, length)` token ids -> `(batch, length, d_model)` (§3.4, §3.5); positions start at `past_length`.

        With `attention_mask` `(batch, length)` and left padding, each row's positions start at its first token.

        Raises:
            ValueError: learned positions and a sequence longer than `max_position_embeddings`.
        """
        end = past_length + input_ids.shape[1]
        if self.max_positions is not None and end > self.max_positions:
            raise ValueError(
                f"The sequence reaches position {end} but the model learned only max_position_embeddings="
                f"{self.max_positions} positions; shorten the input (e.g. tokenizer(..., truncation=True, "
                f"max_length={self.max_positions})) or use sinusoidal positions."
            )
        embeddings = self.embed_tokens(input_ids) * self.scale
        positions = torch.arange(past_length, end, device=input_ids.device)
        if attention_mask is not None and not bool(attention_mask[:, 0].all()):  # a sentence padded on the left
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        embeddings = embeddings + self.positional_encoding(positions).to(embeddings.dtype)
        return residual_dropout(embeddings, self.dropout, self.training)


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
        **kwargs,
    ) -> Seq2SeqModelOutput:
        """Encode the source (unless `encoder_outputs` is given) and decode the target (§3.1).

        Args:
            input_ids: `(batch, source_len)` source token ids.
            attention_mask: `(batch, source_len)` source padding mask (1 = token).
            decoder_input_ids: `(batch, target_len)` decoder inputs.
            decoder_attention_mask: `(batch, target_len)` target padding mask, or None.
            encoder_outputs: reuse an earlier encoding of the source. With `attention_mask` it may have
                one row per group of consecutive decoder rows (`batch / beams`, as `beam_search` gives it).
            cache, use_cache, past_key_values: see `VaswaniDecoder.forward`.

        Returns:
            `Seq2SeqModelOutput` with the decoder's `last_hidden_state` `(batch, target_len, d_model)`.

        Raises:
            ValueError: the rows of `encoder_outputs` do not divide those of `decoder_input_ids`.
            TypeError: both `cache` and `past_key_values`, or a keyword argument this model does not take.
        """
        check_forward_kwargs(kwargs, type(self).__name__)
        cache = one_cache(cache, past_key_values)
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            attention_mask=decoder_attention_mask,
            encoder_attention_mask=attention_mask,
            cache=cache,
            use_cache=use_cache,
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
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)
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
        **kwargs,
    ) -> Seq2SeqLMOutput:
        """Next-token logits for every target position and, given `labels`, the label-smoothed loss (§3.4, §5.4).

        Args:
            input_ids: `(batch, source_len)` source ids.
            attention_mask: `(batch, source_len)` source padding mask (1 = token).
            decoder_input_ids: `(batch, target_len)`; derived from `labels` with `shift_tokens_right` if None.
            decoder_attention_mask: `(batch, target_len)`, or None.
            encoder_outputs, cache, use_cache, past_key_values: see `VaswaniModel.forward`.
            labels: `(batch, target_len)` target ids ending in `</s>`, -100 on padding.
            num_items_in_batch: target tokens of the whole optimizer step (see
                `label_smoothed_cross_entropy`); passed by the Trainer under gradient accumulation.

        Returns:
            `Seq2SeqLMOutput` with `logits` `(batch, target_len, vocab_size)` and `loss` (nats per token).
            With `labels` and gradients enabled (training, outside float16), `logits` is None, and so
            absent from `to_tuple()`: the loss comes from `linear_label_smoothed_cross_entropy`, which
            never holds all of them. Call without `labels`, or under `torch.no_grad()`, to get them.

        Raises:
            ValueError: neither `decoder_input_ids` nor `labels` is given, or the rows of
                `encoder_outputs` do not divide those of the decoder input.
            TypeError: both `cache` and `past_key_values`, or a keyword argument this model does not take.
        """
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        if decoder_input_ids is None:
            raise ValueError("VaswaniForConditionalGeneration needs decoder_input_ids or labels to decode.")
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            cache=one_cache(cache, past_key_values),
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states, epsilon = outputs.last_hidden_state, self.config.label_smoothing
        logits = loss = None
        if labels is not None and self._loss_without_logits(hidden_states):
            loss = linear_label_smoothed_cross_entropy(
                hidden_states, self.lm_head.weight, labels, epsilon, self.final_logits_bias, num_items_in_batch
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
            and (hidden_states.requires_grad or self.lm_head.weight.requires_grad)
            and type(self.lm_head) in (nn.Linear, Linear)
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


# Loading ------------------------------------------------------------------------------------------

# The config fields that set the length of some weight's axis, and the layer a weight belongs to.
_SIZE_FIELDS = ("vocab_size", "d_model", "d_ff", "d_k", "d_v", "max_position_embeddings")
_LAYER = re.compile(r"(?:^|\.)(encoder|decoder)\.layers\.(\d+)\.")


def check_weights_fit(model: PreTrainedModel, loading_info: Any, where: str, sizes_may_differ: bool = False) -> None:
    """Refuse weights that the model `config.json` describes lacks, or has in other sizes.

    Args:
        model: the model `from_pretrained` built from `config.json`, the weights read into it.
        loading_info: transformers' report of that reading (`LoadStateDictInfo`): `missing_keys`,
            `unexpected_keys`, and `mismatched_keys` as (name, shape in the file, shape in the model).
        where: the model's directory or Hub id, for the message.
        sizes_may_differ: `from_pretrained`'s `ignore_mismatched_sizes`: weights of other shapes are initialised
            anew, as the caller asked, not refused.

    Raises:
        ValueError: the file lacks a weight of the model (the tied copies of the shared embedding, §3.4, are
            never stored), holds one the model has not (but those `_keys_to_ignore_on_load_unexpected` names), or
            one of another shape. The message names the field of config.json and both values where the weights
            tell them (layers, d_ff, vocab_size, ...), and the first few weights.
    """
    # Names of weights stored under another name: those transformers ties once they are read (the output projection,
    # §3.4) and the parameters of a module that has several names (the embedding the two stacks share).
    tied, seen = set(getattr(model, "all_tied_weights_keys", None) or {}), set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            tied.add(name)
        seen.add(id(parameter))
    missing = sorted(set(loading_info.missing_keys) - tied)
    ignored = model._keys_to_ignore_on_load_unexpected or ()
    unexpected = sorted(name for name in loading_info.unexpected_keys if not any(re.search(p, name) for p in ignored))
    mismatched = [] if sizes_may_differ else sorted(loading_info.mismatched_keys)
    if mismatched:
        problem = _size_that_differs(model.config, mismatched)
    elif missing or unexpected:
        kinds = (("missing", missing), ("left over", unexpected))
        listed = "; ".join(f"{kind}: {_first_few(names)}" for kind, names in kinds if names)
        problem = f"{_layers_that_differ(model.config, missing, unexpected)} ({listed})"
    else:
        return
    raise ValueError(f"{where}: {problem}; use the config.json saved with these weights.")


def _size_that_differs(config: VaswaniConfig, mismatched: list[tuple[str, tuple, tuple]]) -> str:
    # The first axis whose length in the model is the value of exactly one size field names that field.
    first = None
    for name, in_file, in_model in mismatched:
        shapes = f"{name}: {tuple(in_file)} in the file, {tuple(in_model)} in the model"
        first = first or shapes
        for file_length, model_length in zip(in_file, in_model, strict=False):
            fields = [field for field in _SIZE_FIELDS if getattr(config, field, None) == model_length]
            if file_length != model_length and len(fields) == 1:
                said = f"config.json has {fields[0]}={model_length} but the weights have {fields[0]}={file_length}"
                return f"{said} ({shapes})"
    return f"the weights do not fit config.json ({first})"


def _layers_that_differ(config: VaswaniConfig, missing: list[str], unexpected: list[str]) -> str:
    # Layers the file lacks from the first on, or has beyond the last: the file's stack has that many.
    for stack in ("encoder", "decoder"):
        lacking = {int(m[2]) for name in missing if (m := _LAYER.search(name)) and m[1] == stack}
        over = {int(m[2]) for name in unexpected if (m := _LAYER.search(name)) and m[1] == stack}
        if lacking or over:
            field = f"{stack}_layers"
            in_file = min(lacking) if lacking else max(over) + 1
            return f"config.json has {field}={getattr(config, field)} but the weights have {field}={in_file}"
    return "the weights do not fit config.json"


def _first_few(names: list[str], count: int = 3) -> str:
    return ", ".join(names[:count]) + (f" and {len(names) - count} more" if len(names) > count else "")
