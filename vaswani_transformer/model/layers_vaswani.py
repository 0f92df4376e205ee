"""The layers of the Transformer (§3): positions and embeddings, attention, feed-forward, the layers.

Positional encoding (§3.5) and the embeddings that scale the tokens' and add it (§3.4), scaled dot-product and
multi-head attention (§3.2), the position-wise
feed-forward network (§3.3), and the encoder and decoder layers with their residual + LayerNorm
sublayers (§3.1). `modeling_vaswani.py` stacks them into the model. Attention reads and writes its keys and
values through transformers' `Cache` interface and runs the kernel the config names (`ALL_ATTENTION_FUNCTIONS`),
or Eq. 1 spelled out where a rule says that is faster (`eager_attention_is_faster`).
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_vaswani import VaswaniConfig
from .ops_vaswani import residual_dropout

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


# §3.4 Embeddings ----------------------------------------------------------------------------------


class Embeddings(nn.Module):
    """Token embedding times sqrt(d_model) plus the positional encoding, then dropout (§3.4, §3.5, §5.4).

    The positional encoding is sinusoidal, or learned with `position_embedding_type="learned"`. `inputs` is how
    the model's `forward` names this stack's inputs in messages: "" for the encoder, "decoder_" for the decoder.
    """

    def __init__(self, config: VaswaniConfig, embed_tokens: nn.Embedding, inputs: str = "") -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.inputs = inputs
        self.d_model = config.d_model
        self.scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        if config.position_embedding_type == "learned":
            self.max_positions = config.max_position_embeddings
            self.positional_encoding = LearnedPositionalEmbedding(config.max_position_embeddings, config.d_model)
        else:
            self.max_positions = None
            self.positional_encoding = SinusoidalPositionalEncoding(config.d_model)
        self.dropout = config.dropout

    def forward(
        self,
        input_ids: torch.Tensor | None,
        past_length: int = 0,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`(batch, length)` token ids -> `(batch, length, d_model)` (§3.4, §3.5); positions start at `past_length`.

        With `attention_mask` `(batch, length)` and left padding, each row's positions start at its first token.
        `position_ids`, of a shape that broadcasts to `(batch, length)`, give the positions instead.
        `inputs_embeds`, `(batch, length, d_model)`, replace `embed_tokens(input_ids)`: they are scaled by
        sqrt(d_model) and given their positions alike, so `embed_tokens(ids)` gives the result of `ids`. HF Marian's
        decoder takes them so; its encoder takes them already scaled (docs/compatibility.md, "inputs_embeds").

        Raises:
            ValueError: learned positions and a sequence longer than `max_position_embeddings`; both or neither of
                `input_ids` and `inputs_embeds`, or `inputs_embeds` of another width than d_model.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError(
                f"Give {self.inputs}input_ids or {self.inputs}inputs_embeds, exactly one of them; got "
                f"{'both' if input_ids is not None else 'neither'}."
            )
        if inputs_embeds is not None and (inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.d_model):
            raise ValueError(
                f"{self.inputs}inputs_embeds must be (batch, length, d_model={self.d_model}) token embeddings, got "
                f"shape {tuple(inputs_embeds.shape)}: embed ids with model.get_input_embeddings()."
            )
        tokens = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        end = past_length + tokens.shape[1] if position_ids is None else None
        if self.max_positions is not None and end is None:
            end = int(position_ids.max()) + 1
        if self.max_positions is not None and end > self.max_positions:
            raise ValueError(
                f"The sequence reaches position {end} but the model learned only max_position_embeddings="
                f"{self.max_positions} positions; shorten the input (e.g. tokenizer(..., truncation=True, "
                f"max_length={self.max_positions})) or use sinusoidal positions."
            )
        embeddings = tokens * self.scale
        if position_ids is None:
            position_ids = torch.arange(past_length, end, device=tokens.device)
        encoding = self.positional_encoding(position_ids)
        if attention_mask is not None:  # the encoder's, whose positions start at 0
            # A sentence padded on the left counts its positions from its first token: chosen row by row, with no
            # branch on the data, which would cut torch.compile's graph (and wait for a GPU) at every call.
            counted = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            encoding = torch.where(attention_mask[:, :1, None] == 0, encoding[counted], encoding)
        embeddings = embeddings + encoding.to(embeddings.dtype)
        return residual_dropout(embeddings, self.dropout, self.training)


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
        scaling: 1 / sqrt(d_k) (Eq. 1), or 1.0 with `scale_attention=False` (the unscaled row, `experiments.table3`).
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


def eager_attention_is_faster(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, *, decoding: bool = False
) -> bool:
    """Whether Eq. 1 spelled out (§3.2.1) is faster here than PyTorch's fused attention kernel.

    A rule, not a measurement. On the CPU the fused kernel has a fixed cost per call above Eq. 1
    spelled out for a few queries (docs/performance.md, "Attention for few queries"): one query per
    sentence at every decoding step, a sentence's num_beams queries in beam search, short sentences
    at translation time. In training the two take as long. On CUDA it is faster in the decoding
    steps (§6.1) of float16 and bfloat16 while cuDNN's attention is enabled: PyTorch may take that
    kernel, which builds a plan for every new shape, and as the keys grow by one position a step and
    finished sentences leave the batch, nearly every step would wait for a plan (docs/gpu.md,
    "Decoding"). Where the SDPA mask builder left a causal mask to the kernel's `is_causal` (mask
    None), the eager path would not mask, so that case stays with the kernel.

    Args:
        query: `(batch, heads, queries, d_k)`.
        key: `(batch, heads, keys, d_k)`.
        mask: the attention mask, or None.
        is_causal: whether the attention is masked decoder self-attention.
        decoding: whether the layer decodes incrementally (it has a cache).

    Returns:
        True on the CPU for one query, or, without gradients, for at most 1,024 query-key pairs
        with a mask or without causal masking (the kernel's own causal mask is not replaced); on
        CUDA, without gradients, for a decoding step in float16 or bfloat16 while cuDNN's attention is
        enabled (PyTorch's default; not after the package's `training.devices.avoid_cudnn_attention`
        has turned it off), with a mask, in encoder-decoder attention, or for one query. The CUDA rule
        was measured on one kind of GPU (docs/gpu.md): on a GPU where PyTorch prefers another kernel,
        Eq. 1 is spelled out there too, though no plan stalls it.
    """
    maskable = mask is not None or not is_causal
    if query.device.type == "cuda":
        return (
            decoding
            and not torch.is_grad_enabled()
            and (maskable or query.shape[2] == 1)
            and query.dtype in (torch.float16, torch.bfloat16)
            and torch.backends.cuda.cudnn_sdp_enabled()
        )
    if query.device.type != "cpu":
        return False
    if query.shape[2] == 1:
        return True
    return not torch.is_grad_enabled() and query.shape[2] * key.shape[2] <= 1024 and maskable


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
        self.scaling = config.key_dim**-0.5 if config.scale_attention else 1.0  # Eq. 1's 1/sqrt(d_k)
        self.dropout = config.attention_dropout
        # Read by the SDPA path: False for non-causal attention, or an unpadded encoder batch would be masked causally.
        self.is_causal = is_causal
        self.is_cross_attention = is_cross_attention
        keys_width, values_width = self.num_heads * config.key_dim, self.num_heads * config.value_dim
        self.q_proj = nn.Linear(config.d_model, keys_width, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.d_model, keys_width, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.d_model, values_width, bias=config.attention_bias)
        self.out_proj = nn.Linear(values_width, config.d_model, bias=config.attention_bias)

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
            attention_mask: a mask from `transformers.masking_utils`, a caller's own `(batch, 1, target_len,
                key_len)` boolean mask (True where attending is allowed), or None.
            past_key_values: an `EncoderDecoderCache` during incremental decoding. Self-attention
                appends this step's keys and values through `Cache.update`; cross-attention computes the
                encoder's once and then reuses them.

        Returns:
            The output `(batch, target_len, d_model)` and, with eager attention or `output_attentions`, the weights
            `(batch, heads, target_len, key_len)` (None otherwise).
        """
        cache = None
        if past_key_values is not None:
            caches = past_key_values
            cache = caches.cross_attention_cache if self.is_cross_attention else caches.self_attention_cache
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
        output, weights = self._attend(query, key, value, attention_mask, decoding=cache is not None, **kwargs)
        return self.out_proj(output.reshape(*hidden_states.shape[:-1], -1)), weights

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        decoding: bool,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Eq. 1 by the kernel the model's attention implementation names, or spelled out where that is faster
        # (`eager_attention_is_faster`) or gives the weights. Kernels other than SDPA and eager take padding masks
        # (flash) or block masks (flex), which transformers' mask builders make for them; a 4-D boolean tensor there
        # is a caller's own mask (beam search's), which only Eq. 1 spelled out is sure to apply.
        # Shapes as in `scaled_dot_product_attention`.
        implementation = self.config._attn_implementation
        if implementation == "sdpa" and (
            kwargs.get("output_attentions")
            or eager_attention_is_faster(query, key, attention_mask, self.is_causal, decoding=decoding)
        ):
            implementation = "eager"
        elif implementation not in ("sdpa", "eager") and _is_boolean_tensor_mask(attention_mask):
            implementation = "eager"
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, scaled_dot_product_attention)
        dropout = self.dropout if self.training else 0.0
        return attention(self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs)


def _is_boolean_tensor_mask(mask: object) -> bool:
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.dtype == torch.bool


# §3.3 Position-wise feed-forward network ----------------------------------------------------------


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2 (§3.3, Eq. 2), d_model -> d_ff -> d_model.

    max(0, .) is ReLU, the config's `activation_function` by default; imported models may use another.
    """

    def __init__(self, config: VaswaniConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, config.d_ff)
        self.fc2 = nn.Linear(config.d_ff, config.d_model)
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
