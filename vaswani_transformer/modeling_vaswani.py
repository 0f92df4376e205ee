"""The Transformer of Vaswani et al. (2017), "Attention Is All You Need", as a transformers model.

Read top to bottom, this file follows §3 of the paper: positional encoding (§3.5), the linear
maps of every projection, scaled dot-product and multi-head attention (§3.2), the position-wise
feed-forward network (§3.3), the residual dropout (§5.4) and the encoder and decoder layers with
their residual + LayerNorm sublayers (§3.1), the two stacks with their shared embeddings (§3.4),
and the model with its label-smoothed loss (§5.4).
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache
from transformers.generation import (
    EosTokenCriteria,
    LogitsProcessor,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
    logits_process,
)
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_vaswani import VaswaniConfig

# §3.5 Positional encoding ----------------------------------------------------------------------


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
        """Encode positions.

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


# Linear maps x W^T + b: every projection of §3.2.2, §3.3 and §3.4 -------------------------------


def _onednn_linear_op() -> Callable | None:
    try:
        return torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None
    except (AttributeError, RuntimeError):  # a PyTorch built without oneDNN
        return None


# PyTorch computes float32 products on the CPU with MKL, which on AMD processors does not run its AVX-512 code: on
# an AMD EPYC, oneDNN (also in PyTorch, and also Intel's) computed them 2 to 2.8 times as fast (README, Performance).
# PyTorch sends only bfloat16 and float16 products to oneDNN; this operator is the one `torch.compile` emits for
# linear layers on the CPU. CTranslate2 too takes oneDNN rather than MKL on processors other than Intel's.
_ONEDNN_LINEAR = _onednn_linear_op()
# oneDNN costs about 10 us more a call, which only products of at least 2^21 multiply-adds earn back.
_ONEDNN_MIN_PRODUCT = 2**21


def _uses_onednn(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    # Where oneDNN's operator has no rule, F.linear: TorchScript tracing, torch.func transforms, torch.compile (which
    # chooses its own kernels), autocast; and where the user turned oneDNN off (`torch.backends.mkldnn.flags`).
    return (
        _ONEDNN_LINEAR is not None
        and torch.backends.mkldnn.enabled
        and input.device.type == weight.device.type == "cpu"
        and input.dim() >= 2
        and input.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and input.numel() * weight.shape[0] >= _ONEDNN_MIN_PRODUCT
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and not torch._C._are_functorch_transforms_active()
    )


def _transposed_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # a^T b of (rows, m) and (rows, n), a weight gradient, as `linear`: a^T (b^T)^T, or (b^T a)^T. oneDNN copies the
    # transposed first operand into a contiguous one, so the narrower of a and b takes that place.
    return linear(b.t(), a.t()).t() if a.shape[1] > b.shape[1] else linear(a.t(), b.t())


class OneDNNLinear(torch.autograd.Function):
    """x W^T + b (§3.2.2, §3.3, §3.4) and its gradients, each product computed by oneDNN: see `linear`.

    `apply(input, weight, bias)` takes `(*, in_features)` float32 CPU input, an `(out_features,
    in_features)` weight and an `(out_features,)` bias or None, and returns `(*, out_features)`.
    The gradients are linear maps again, computed by `linear`, so they can be differentiated in turn.
    Raises RuntimeError (from oneDNN) if the shapes do not fit.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        return _ONEDNN_LINEAR(input, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:  # dL/dx = dL/dy W: a linear map whose weight is W^T
            grad_input = linear(grad_output, weight.t())
        if ctx.needs_input_grad[1]:  # dL/dW = (dL/dy)^T x
            grad_weight = _transposed_product(grad_output.flatten(0, -2), input.flatten(0, -2))
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.flatten(0, -2).sum(0)
        return grad_input, grad_weight, grad_bias


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b, as `torch.nn.functional.linear`, through oneDNN for float32 products on the CPU.

    Every projection of the model is one: W^Q, W^K, W^V and W^O (§3.2.2), W_1 and W_2 (§3.3, Eq. 2)
    and the pre-softmax projection (§3.4). The same function and gradients as `F.linear` to float32
    rounding, but its products run up to 2.8 times as fast where MKL, PyTorch's usual library for
    them, leaves the CPU's vector units partly idle (AMD processors; README, Performance). Products
    of fewer than 2^21 multiply-adds, other dtypes and devices, autocast, `torch.compile`, TorchScript
    tracing, `torch.func` transforms, and `torch.backends.mkldnn.flags(enabled=False)` take `F.linear`.

    Args:
        input: `(*, in_features)`.
        weight: `(out_features, in_features)`.
        bias: `(out_features,)`, or None.

    Returns:
        `(*, out_features)`.

    Raises:
        RuntimeError: the shapes do not fit (from the product).
    """
    if not _uses_onednn(input, weight, bias):
        return F.linear(input, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias)):
        return OneDNNLinear.apply(input, weight, bias)
    return _ONEDNN_LINEAR(input, weight, bias, "none", [], "")


class Linear(nn.Linear):
    """`nn.Linear` computed by `linear` (§3.2.2, §3.3, §3.4): the same parameters, initialisation and state dict.

    Maps `(*, in_features)` to `(*, out_features)`; raises RuntimeError if the input's last dimension is not
    `in_features`.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)


# §3.2 Attention ----------------------------------------------------------------------------------


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
    returns the attention weights. `attn_implementation="sdpa"` (the default) computes the same
    with PyTorch's fused kernel.

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
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        weights = weights.masked_fill(~attention_mask, torch.finfo(weights.dtype).min)
    elif attention_mask is not None:
        weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1)
    weights = F.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output, weights


def _eager_is_faster(module: nn.Module, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    # PyTorch's fused CPU kernel has a fixed cost of some 0.2 ms a call, more than the whole of Eq. 1
    # spelled out for a few queries (README, Performance): one query per sentence (self-attention at
    # every decoding step), the num_beams queries of a sentence in beam search's attention, or
    # an encoder's short sentences at translation time. Measured without gradients only: in training
    # the two took as long. Where the SDPA mask builder left a causal mask to the kernel's `is_causal`
    # (mask None), the eager path would not mask, so that case stays with the kernel.
    if query.device.type != "cpu":
        return False
    if query.shape[2] == 1:
        return True
    return (
        not torch.is_grad_enabled()
        and query.shape[2] * key.shape[2] <= 1024
        and (mask is not None or not module.is_causal)
    )


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
        # Read by the SDPA path of the attention interface: it must be False for non-causal attention,
        # or an unpadded encoder batch would silently be masked causally.
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
        """Attend from `hidden_states` to itself, or to `key_value_states` for cross-attention.

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
            The output `(batch, target_len, d_model)` and, with eager attention, the weights
            `(batch, heads, target_len, key_len)` (None otherwise); with shared encoder rows,
            `(batch / beams, heads, beams * target_len, key_len)`, and in self-attention with a
            `BeamSearchCache` holding `length` positions, `(batch / beams, heads, beams, length * num_beams)`.
        """
        cache = None
        if past_key_values is not None:
            cache = (
                past_key_values.cross_attention_cache
                if self.is_cross_attention
                else past_key_values.self_attention_cache
            )
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
        if implementation == "sdpa" and _eager_is_faster(self, query, key, attention_mask):
            implementation = "eager"
        elif implementation != "sdpa" and isinstance(cache, BeamSearchCache):
            # Flash attention, and kernels registered by users, may ignore a mask of this kind: the beams'
            # ancestry needs it, and the eager path applies it.
            implementation = "eager"
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, scaled_dot_product_attention)
        output, weights = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        output = self.out_proj(output.reshape(*hidden_states.shape[:-1], -1))
        return output.reshape(rows, -1, output.shape[-1]), weights


# §3.3 Position-wise feed-forward network ---------------------------------------------------------


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
        """`(batch, length, d_model)` -> `(batch, length, d_model)`."""
        hidden_states = self.activation(self.fc1(hidden_states))
        hidden_states = F.dropout(hidden_states, p=self.activation_dropout, training=self.training)
        return self.fc2(hidden_states)


# §5.4 Residual dropout ---------------------------------------------------------------------------


def residual_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Zero each element with probability p and scale the others by 1 / (1 - p) (§5.4, "Residual Dropout").

    `F.dropout`, except in training on the CPU. There PyTorch draws each element's Bernoulli variable with a
    call of its own into the generator, about 16 ns an element and a tenth of a training step (README,
    Performance); here each element takes 16 bits of 64-bit random draws instead, a quarter of a call,
    and is dropped when they fall among the lowest round(p * 2^16) of the 2^16 values. The rate is thus p
    to within 2^-17, and the kept elements are scaled by the inverse of the exact rate kept, so that every
    element keeps its expected value.

    Args:
        x: any shape.
        p: dropout probability, in [0, 1].
        training: drop only when True (the module's `training`).

    Returns:
        A tensor of the shape and dtype of `x`.

    Raises:
        ValueError: p is outside [0, 1] (from `F.dropout`).
    """
    dropped = round(p * 2**16)
    if not training or x.device.type != "cpu" or not 0 < dropped < 2**16:
        return F.dropout(x, p=p, training=training)
    # `random_(-2^63, None)` draws all 64 bits; `random_()` leaves the sign bit 0, which the top 16-bit lane needs.
    draws = torch.empty(-(-x.numel() // 4), dtype=torch.int64, device=x.device).random_(-(2**63), None)
    keep = draws.view(torch.int16)[: x.numel()].view(x.shape) >= dropped - 2**15
    return x * keep * (2**16 / (2**16 - dropped))


# §3.1 Encoder and decoder layers -----------------------------------------------------------------


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
        """Apply `sublayer`, `(batch, length, d_model)` -> same shape, with its residual connection."""
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
        """`(batch, source_len, d_model)` -> `(batch, source_len, d_model)`; the mask hides padding."""
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
        """`(batch, target_len, d_model)` -> `(batch, target_len, d_model)`.

        `attention_mask` is the causal (and padding) mask of §3.2.3; `encoder_hidden_states` is
        `(batch, source_len, d_model)` with its padding mask `encoder_attention_mask`.
        """
        hidden_states = self.self_attn_sublayer(
            hidden_states,
            lambda x: self.self_attn(x, attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)[0],
        )
        hidden_states = self.encoder_attn_sublayer(
            hidden_states,
            lambda x: self.encoder_attn(
                x,
                key_value_states=encoder_hidden_states,
                attention_mask=encoder_attention_mask,
                past_key_values=past_key_values,
                **kwargs,
            )[0],
        )
        return self.feed_forward_sublayer(hidden_states, self.feed_forward)


# §3.1 and §3.4 The stacks and their embeddings -----------------------------------------------------


class VaswaniPreTrainedModel(PreTrainedModel):
    """Weight initialisation and the switches transformers reads (attention backends, checkpointing)."""

    config_class = VaswaniConfig
    config: VaswaniConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _no_split_modules = ["EncoderLayer", "DecoderLayer"]

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

    def forward(self, input_ids: torch.Tensor, past_length: int = 0) -> torch.Tensor:
        """`(batch, length)` token ids -> `(batch, length, d_model)`; positions start at `past_length`.

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
        embeddings = embeddings + self.positional_encoding(positions).to(embeddings.dtype)
        return residual_dropout(embeddings, self.dropout, self.training)


class VaswaniEncoder(VaswaniPreTrainedModel):
    """The encoder: embeddings and a stack of N `EncoderLayer`s (§3.1)."""

    _can_record_outputs = {"hidden_states": EncoderLayer, "attentions": MultiHeadAttention}

    def __init__(self, config: VaswaniConfig, embed_tokens: nn.Embedding) -> None:
        super().__init__(config)
        self.embeddings = Embeddings(config, embed_tokens)
        self.layers = nn.ModuleList([EncoderLayer(config, i) for i in range(config.encoder_layers)])
        # Pre-LayerNorm leaves the last layer's output unnormalised.
        self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.normalize_before else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.embed_tokens

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, **kwargs
    ) -> BaseModelOutput:
        """Encode a source batch.

        Args:
            input_ids: `(batch, source_len)` token ids.
            attention_mask: `(batch, source_len)`, 1 for tokens and 0 for padding; None means no padding.
            output_attentions, output_hidden_states: also return every layer's weights or outputs.

        Returns:
            `BaseModelOutput` with `last_hidden_state` `(batch, source_len, d_model)`.
        """
        hidden_states = self.embeddings(input_ids)
        attention_mask = create_bidirectional_mask(
            config=self.config, inputs_embeds=hidden_states, attention_mask=attention_mask
        )
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, **kwargs)
        if self.layer_norm is not None:
            hidden_states = self.layer_norm(hidden_states)
        return BaseModelOutput(last_hidden_state=hidden_states)


class VaswaniDecoder(VaswaniPreTrainedModel):
    """The decoder: embeddings and a stack of N `DecoderLayer`s (§3.1)."""

    _can_record_outputs = {
        "hidden_states": DecoderLayer,
        "attentions": OutputRecorder(MultiHeadAttention, index=1, layer_name="self_attn"),
        "cross_attentions": OutputRecorder(MultiHeadAttention, index=1, layer_name="encoder_attn"),
    }

    def __init__(self, config: VaswaniConfig, embed_tokens: nn.Embedding) -> None:
        super().__init__(config)
        self.embeddings = Embeddings(config, embed_tokens)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.decoder_layers)])
        self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.normalize_before else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.embed_tokens

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        """Decode a target batch given the encoder output.

        Args:
            input_ids: `(batch, target_len)` decoder input ids: the target shifted right behind
                `decoder_start_token_id`, or only the new tokens when decoding with a cache.
            encoder_hidden_states: `(batch, source_len, d_model)`, or `(batch / beams, source_len, d_model)`:
                one row for `beams` consecutive decoder rows, as beam search gives it.
            attention_mask: `(batch, past_len + target_len)` decoder padding mask, or None.
            encoder_attention_mask: `(batch, source_len)` source padding mask (`batch / beams` rows with
                the encoder output), or None.
            past_key_values: the cache of earlier steps; created when `use_cache` and None.
            use_cache: return a cache for incremental decoding.

        Returns:
            `BaseModelOutputWithPastAndCrossAttentions` with `last_hidden_state`
            `(batch, target_len, d_model)` and `past_key_values`.

        Raises:
            ValueError: the encoder output's rows do not divide the decoder input's.
        """
        if use_cache and past_key_values is None:
            past_key_values = EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        hidden_states = self.embeddings(input_ids, past_length)
        if input_ids.shape[1] == 1 and attention_mask is None and not getattr(past_key_values, "is_compileable", False):
            # One new position, which may attend to every earlier one, and a cache that holds only those (a static one
            # also holds empty slots): nothing to mask. `create_causal_mask` finds that too, at 2% to 3% of a step of
            # beam search on the CPU (README, Performance).
            causal_mask = None
        else:
            causal_mask = create_causal_mask(
                config=self.config,
                inputs_embeds=hidden_states,
                attention_mask=attention_mask,
                past_key_values=past_key_values.self_attention_cache if past_key_values is not None else None,
            )
        if hidden_states.shape[0] % encoder_hidden_states.shape[0]:
            raise ValueError(
                f"The decoder input has {hidden_states.shape[0]} rows and the encoder output "
                f"{encoder_hidden_states.shape[0]}: give one encoder row per decoder row, or one per group of "
                "consecutive decoder rows (the beams of a sentence)."
            )
        encoder_attention_mask = create_bidirectional_mask(
            config=self.config,
            # Queries as cross-attention sees them: the rows that share an encoder row, as one sequence.
            inputs_embeds=hidden_states.reshape(encoder_hidden_states.shape[0], -1, hidden_states.shape[-1]),
            attention_mask=encoder_attention_mask,
            encoder_hidden_states=encoder_hidden_states,
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
            last_hidden_state=hidden_states, past_key_values=past_key_values
        )


# The model ---------------------------------------------------------------------------------------


class VaswaniModel(VaswaniPreTrainedModel):
    """Encoder and decoder around one embedding matrix shared by source and target (§3.4)."""

    _tied_weights_keys = {
        "encoder.embeddings.embed_tokens.weight": "shared.weight",
        "decoder.embeddings.embed_tokens.weight": "shared.weight",
    }

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
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> Seq2SeqModelOutput:
        """Encode the source (unless `encoder_outputs` is given) and decode the target.

        Args:
            input_ids: `(batch, source_len)` source token ids.
            attention_mask: `(batch, source_len)` source padding mask (1 = token).
            decoder_input_ids: `(batch, target_len)` decoder inputs.
            decoder_attention_mask: `(batch, target_len)` target padding mask, or None.
            encoder_outputs: reuse an earlier encoding of the source. With `attention_mask` it may have
                one row per group of consecutive decoder rows (`batch / beams`, as `beam_search` gives it).
            past_key_values, use_cache: see `VaswaniDecoder.forward`.

        Returns:
            `Seq2SeqModelOutput` with the decoder's `last_hidden_state` `(batch, target_len, d_model)`.

        Raises:
            ValueError: the rows of `encoder_outputs` do not divide those of `decoder_input_ids`.
        """
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            attention_mask=decoder_attention_mask,
            encoder_attention_mask=attention_mask,
            past_key_values=past_key_values,
            use_cache=use_cache,
            **kwargs,
        )
        return Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            past_key_values=decoder_outputs.past_key_values,
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Decoder inputs for teacher forcing: `<s> y_1 ... y_{n-1}` from labels `y_1 ... y_n` (§3.1, "shifted right").

    Args:
        labels: `(batch, target_len)` target ids, -100 where ignored (padding).
        pad_token_id: id that replaces -100.
        decoder_start_token_id: the first decoder input.

    Returns:
        `(batch, target_len)` decoder input ids.
    """
    shifted = labels.new_empty(labels.shape)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill_(shifted == -100, pad_token_id)


def label_smoothed_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, epsilon: float, num_items_in_batch: int | torch.Tensor | None = None
) -> torch.Tensor:
    """Cross entropy against the smoothed targets (1 - epsilon) * one_hot(y) + epsilon / vocab_size (§5.4).

    This is the label smoothing of Szegedy et al. (2016) that the paper cites, computed in at least
    float32 by `torch.nn.functional.cross_entropy(label_smoothing=epsilon)`. Training computes the
    same loss without the logits: `linear_label_smoothed_cross_entropy`.

    Args:
        logits: `(batch, target_len, vocab_size)`.
        labels: `(batch, target_len)` target ids; -100 marks positions to ignore (padding).
        epsilon: epsilon_ls in [0, 1).
        num_items_in_batch: divide the summed loss by this number of target tokens (for gradient
            accumulation and data parallelism, where the tokens of the whole update count); by
            default the mean over this batch's non-ignored tokens.

    Returns:
        The scalar loss, in nats per target token.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # a softmax over tens of thousands of classes needs float32's range
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=epsilon, reduction="sum")
    return loss / (labels.ne(-100).sum() if num_items_in_batch is None else num_items_in_batch)


class LinearLabelSmoothedCrossEntropy(torch.autograd.Function):
    """The summed label-smoothed cross entropy (§5.4) of logits = hidden W^T + b (§3.4), and its gradients, by chunks.

    With log-probabilities log p = logits - logsumexp(logits), the loss of one position is
    logsumexp - (1 - epsilon) * logit_y - epsilon * mean(logits), and its gradient with respect to
    the logits is p - epsilon / V - (1 - epsilon) * one_hot(y). Both are computed in the forward
    pass, a chunk of positions at a time, and the chunk's logits gradient is turned at once into
    the gradients of the hidden states, W and b, so that the (positions x V) logits never exist
    whole: for a batch of 25,000 target tokens on one device and a 37,000-token vocabulary (the
    paper's sizes) they would take 3.7 GB in float32, and their gradient as much again. Ignored
    positions (padding) add nothing to the loss and get zero gradients. With `drop_ignored` their logits
    are never computed; without, they are computed and weighted 0, which spares the host the number of
    positions kept: a synchronisation that on an accelerator would stall the queue of kernels.

    `apply(hidden, weight, bias, labels, epsilon, drop_ignored)` takes `(positions, d_model)` hidden
    states, the `(V, d_model)` weight, a `(V,)` bias or None, `(positions,)` labels (-100 ignored),
    epsilon and a bool, and returns the summed loss in nats, a scalar in at least float32. Its
    gradients are constants of the forward pass: differentiating them again raises RuntimeError
    (`once_differentiable`).
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        epsilon: float,
        drop_ignored: bool,
    ) -> torch.Tensor:
        vocab_size = weight.shape[0]
        # On the CPU, chunks of about 8 MiB of float32 logits; on accelerators, large chunks keep the kernel
        # launches few. At least 256 positions a chunk keep the matrix products efficient.
        budget = 2**21 if hidden.device.type == "cpu" else 2**27
        chunk = max(256, budget // vocab_size)
        dtype = torch.promote_types(weight.dtype, torch.float32)  # a softmax over the vocabulary needs float32
        keep = labels.ne(-100)
        computed_hidden = hidden[keep] if drop_ignored else hidden
        computed_labels = (labels[keep] if drop_ignored else labels.masked_fill(~keep, 0))[:, None]
        weights = None if drop_ignored else keep[:, None].to(dtype)
        loss = torch.zeros((), dtype=dtype, device=hidden.device)
        grad_computed = torch.empty_like(computed_hidden, dtype=dtype)
        mixed = hidden.dtype != dtype or weight.dtype != dtype  # mixed precision: products in the hidden states' dtype
        onednn = _uses_onednn(computed_hidden, weight, bias)
        # Without oneDNN every chunk's logits go to one buffer: MKL's product writing a fresh block, which the CPU
        # page-faulted in anew, ran at half the speed of the others (README, Performance); oneDNN's does not.
        logits_buffer = None if onednn else hidden.new_empty(min(chunk, len(computed_hidden)), vocab_size, dtype=dtype)
        grad_weight = torch.zeros_like(weight, dtype=dtype)
        grad_bias = torch.zeros(vocab_size, dtype=dtype, device=hidden.device) if bias is not None else None
        for start in range(0, computed_hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            if onednn:
                logits = linear(computed_hidden[rows], weight, bias)
            else:
                logits = logits_buffer[: len(computed_hidden[rows])]
                if mixed:
                    logits.copy_(F.linear(computed_hidden[rows], weight, bias))
                elif bias is not None:
                    torch.addmm(bias, computed_hidden[rows], weight.t(), out=logits)
                else:
                    torch.mm(computed_hidden[rows], weight.t(), out=logits)
            target_logit = logits.gather(-1, computed_labels[rows]).squeeze(-1)
            mean_logit = logits.mean(dim=-1)
            # logsumexp and the softmax from one pass of exp, in place: the logits are spent.
            max_logit = logits.amax(dim=-1, keepdim=True)
            probabilities = logits.sub_(max_logit).exp_()
            normaliser = probabilities.sum(dim=-1, keepdim=True)
            log_z = (max_logit + normaliser.log()).squeeze(-1)
            losses = log_z - (1.0 - epsilon) * target_logit - epsilon * mean_logit
            grad = probabilities.div_(normaliser).sub_(epsilon / vocab_size)
            grad.scatter_add_(-1, computed_labels[rows], grad.new_full((grad.shape[0], 1), epsilon - 1.0))
            if weights is not None:
                losses = losses * weights[rows, 0]
                grad.mul_(weights[rows])
            loss += losses.sum()
            grad_computed[rows] = linear(grad.to(weight.dtype), weight.t())  # G W, a linear map whose weight is W^T
            if onednn:
                grad_weight += _transposed_product(grad, computed_hidden[rows])
            elif mixed:  # the product in the hidden states' dtype, accumulated in float32
                grad_weight += grad.t().to(hidden.dtype) @ computed_hidden[rows]
            else:
                # Accumulated by MKL's product itself: a separate addition would pass over all of W's gradient
                # again, as long as that product with the paper's vocabulary (README, Performance). oneDNN's
                # product, above, is faster even with the separate addition.
                grad_weight.addmm_(grad.t(), computed_hidden[rows])
            if grad_bias is not None:
                grad_bias += grad.sum(dim=0)
        grad_hidden = grad_computed
        if drop_ignored:  # back to every position, zero where ignored
            grad_hidden = torch.zeros_like(hidden, dtype=dtype).index_put_((keep,), grad_computed)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = hidden.dtype, weight.dtype, bias.dtype if bias is not None else None
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Scaled in float32 first, then cast: a loss scale (float16 training) acts before any rounding.
        grads = [g * grad_output if g is not None else None for g in ctx.saved_tensors]
        grads = [g.to(dtype) if g is not None else None for g, dtype in zip(grads, ctx.dtypes, strict=True)]
        return *grads, None, None, None


def linear_label_smoothed_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    epsilon: float,
    bias: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """`label_smoothed_cross_entropy` of the logits hidden W^T + b (§3.4, §5.4), without materialising them.

    The same value and gradients as the pre-softmax projection followed by
    `label_smoothed_cross_entropy`, in float32 logits (`LinearLabelSmoothedCrossEntropy`), with
    memory for a chunk of the (positions x vocab_size) logits instead of all of them and their gradient.

    Args:
        hidden: `(batch, target_len, d_model)` decoder output.
        weight: `(vocab_size, d_model)` pre-softmax projection (tied to the embeddings).
        labels: `(batch, target_len)` target ids; -100 marks positions to ignore (padding).
        epsilon: epsilon_ls in [0, 1).
        bias: `(vocab_size,)` or `(1, vocab_size)` fixed logit bias (imported Marian models), or None.
        num_items_in_batch: as in `label_smoothed_cross_entropy`.

    Returns:
        The scalar loss, in nats per target token.

    Raises:
        RuntimeError: the shapes of `hidden` and `weight` do not fit (from the matrix product).
    """
    bias = bias.flatten() if bias is not None else None
    # Ignored positions are left out on the CPU only: elsewhere it would cost a host synchronisation per step.
    drop_ignored = hidden.device.type == "cpu"
    loss = LinearLabelSmoothedCrossEntropy.apply(
        hidden.flatten(0, 1), weight, bias, labels.flatten(), epsilon, drop_ignored
    )
    return loss / (labels.ne(-100).sum() if num_items_in_batch is None else num_items_in_batch)


class VaswaniForConditionalGeneration(VaswaniPreTrainedModel, GenerationMixin):
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
        past_key_values: Cache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> Seq2SeqLMOutput:
        """Next-token logits for every target position and, given `labels`, the label-smoothed loss.

        Args:
            input_ids: `(batch, source_len)` source ids.
            attention_mask: `(batch, source_len)` source padding mask (1 = token).
            decoder_input_ids: `(batch, target_len)`; derived from `labels` with `shift_tokens_right` if None.
            decoder_attention_mask: `(batch, target_len)`, or None.
            encoder_outputs, past_key_values, use_cache: see `VaswaniModel.forward`.
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
        """
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None:
                decoder_input_ids = shift_tokens_right(
                    labels, self.config.pad_token_id, self.config.decoder_start_token_id
                )
        if decoder_input_ids is None:
            raise ValueError("VaswaniForConditionalGeneration needs decoder_input_ids or labels to decode.")
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            past_key_values=past_key_values,
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
        return Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            decoder_hidden_states=outputs.decoder_hidden_states,
            decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states,
            encoder_attentions=outputs.encoder_attentions,
        )

    def _loss_without_logits(self, hidden_states: torch.Tensor) -> bool:
        # In training, the fused projection and loss spare the (tokens x vocabulary) logits, the largest tensor
        # of a step (README, Fine-tuning). It reads lm_head's weight without calling lm_head, so not where a hook
        # of lm_head must run first (DeepSpeed ZeRO-3 gathers the partitioned weight there, Accelerate's
        # offloading brings it to the device), nor for an output layer with a bias of its own. Not in float16
        # either: its unscaled logit gradients, about 1 / vocabulary, would fall among float16's subnormals,
        # where the materialised logits get them multiplied by the loss scale first.
        device = hidden_states.device.type
        return (
            torch.is_grad_enabled()
            and (hidden_states.requires_grad or self.lm_head.weight.requires_grad)
            and type(self.lm_head) in (nn.Linear, Linear)
            and self.lm_head.bias is None
            and not self.lm_head._forward_pre_hooks
            and not hasattr(self.lm_head, "_hf_hook")
            and not is_deepspeed_zero3_enabled()
            and torch.float16 not in (hidden_states.dtype, self.lm_head.weight.dtype)
            and not (torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16)
        )

    # Set by `generate` for the duration of one call; read by the beam search hooks below.
    _gnmt_length_penalty = False

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config=None,
        logits_processor: LogitsProcessorList | None = None,
        **kwargs,
    ):
        """`GenerationMixin.generate`, plus the paper's decoding (§6.1): GNMT length penalty, per-sentence limit.

        "We used beam search with a beam size of 4 and length penalty alpha = 0.6 [Wu et al., 2016]":
        with `length_penalty_type="gnmt"` (in the generation config or as an argument) a finished
        hypothesis Y scores log P(Y|X) / lp(Y), lp(Y) = ((5 + |Y|) / 6) ** alpha, alpha being
        `length_penalty` and |Y| counting the generated tokens with `</s>`. `"hf"` (the default when
        the generation config says nothing) keeps transformers' log P(Y|X) / |Y| ** alpha.

        "We set the maximum output length during inference to input length + 50": with
        `max_length_a` and `max_length_b` set (fairseq's max_len_a and max_len_b), sentence i of the
        batch ends with `</s>` after at most `max_length_a * source_length_i + max_length_b` tokens,
        source_length_i counting its non-padding tokens. Without them, HF's batch-wide
        `max_new_tokens` alone applies. With learned positions (Table 3, row E) at most
        `max_position_embeddings` tokens are generated: the model has no position vector beyond them.

        Args:
            inputs: `(batch, source_len)` source ids (or pass `input_ids=`).
            generation_config: replaces the model's generation config.
            logits_processor: extra logits processors.
            **kwargs: `attention_mask` and any generation parameter (`num_beams`, `max_new_tokens`,
                `length_penalty_type`, `max_length_a`, ...).

        Beam search with `early_stopping=True` that returns only the sequences (the paper's, and
        what `translate`, the pipeline and `evaluate` ask for) runs `beam_search`, which gives HF's
        hypotheses faster; anything else runs HF's own loop.

        Returns:
            What `GenerationMixin.generate` returns: `(batch * num_return_sequences, output_len)` ids.

        Raises:
            ValueError: `length_penalty_type` is neither "gnmt" nor "hf".
        """
        config = generation_config or self.generation_config
        penalty_type = kwargs.pop("length_penalty_type", getattr(config, "length_penalty_type", None)) or "hf"
        if penalty_type not in ("gnmt", "hf"):
            raise ValueError(f"length_penalty_type must be 'gnmt' (the paper's) or 'hf', got {penalty_type!r}.")
        a = kwargs.pop("max_length_a", getattr(config, "max_length_a", None))
        b = kwargs.pop("max_length_b", getattr(config, "max_length_b", None))
        source = inputs if inputs is not None else kwargs.get("input_ids")
        if a is not None and b is not None and source is not None:
            mask = kwargs.get("attention_mask")
            source_lengths = mask.sum(-1) if mask is not None else source.ne(self.config.pad_token_id).sum(-1)
            limits = (a * source_lengths + b).long()
            logits_processor = LogitsProcessorList(
                [*(logits_processor or []), SourceLengthLimit(limits, config.eos_token_id)]
            )
            longest = int(limits.max()) + 1  # room for the final </s>
            kwargs["max_new_tokens"] = min(longest, kwargs.get("max_new_tokens") or config.max_new_tokens or longest)
        if self.config.position_embedding_type == "learned":
            # Learned positions end at max_position_embeddings (Table 3, row E): stop there instead of
            # failing in the middle of a batch. The last generated token is never fed back, hence no - 1.
            limit = self.config.max_position_embeddings
            kwargs["max_new_tokens"] = min(limit, kwargs.get("max_new_tokens") or config.max_new_tokens or limit)
        self._gnmt_length_penalty = penalty_type == "gnmt"
        try:
            return super().generate(
                inputs, generation_config=generation_config, logits_processor=logits_processor, **kwargs
            )
        finally:
            self._gnmt_length_penalty = False

    # HF's beam search divides a hypothesis' log-probability by length ** length_penalty in exactly
    # two places, the two methods below. For the GNMT penalty they receive, for the length at hand,
    # the exponent e with length ** e = ((5 + length) / 6) ** alpha: the rest of HF's beam search
    # (cache reordering, early stopping, batching of finished hypotheses) is reused unchanged.

    def _update_finished_beams(self, **kwargs):
        if self._gnmt_length_penalty:
            length = kwargs["cur_len"] + 1 - kwargs["decoder_prompt_len"]
            kwargs["length_penalty"] = _gnmt_as_power(length, kwargs["length_penalty"])
        return super()._update_finished_beams(**kwargs)

    def _check_early_stop_heuristic(self, **kwargs):
        if self._gnmt_length_penalty:
            if kwargs["early_stopping"] == "never" and kwargs["length_penalty"] > 0.0:
                length = kwargs["max_length"] - kwargs["decoder_prompt_len"]
            else:
                length = kwargs["cur_len"] - kwargs["decoder_prompt_len"]
            kwargs["length_penalty"] = _gnmt_as_power(length, kwargs["length_penalty"])
        return super()._check_early_stop_heuristic(**kwargs)

    def _beam_search(
        self,
        input_ids: torch.LongTensor,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        synced_gpus: bool = False,
        **model_kwargs,
    ) -> torch.LongTensor:
        # By now `generate` has merged the generation config, encoded the source once, copied it to
        # every beam and built the logits processors; only the search loop is replaced, and only for
        # the plain beam search of §6.1. Scores, attentions, sampling and the like stay with HF's loop.
        if _plain_beam_search(input_ids, generation_config, stopping_criteria, synced_gpus, model_kwargs):
            length_penalty = gnmt_length_penalty if self._gnmt_length_penalty else _power_length_penalty
            return beam_search(self, input_ids, logits_processor, generation_config, length_penalty, **model_kwargs)
        return super()._beam_search(
            input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, **model_kwargs
        )

    def _reorder_cache(self, past_key_values: EncoderDecoderCache, beam_idx: torch.Tensor) -> EncoderDecoderCache:
        # Called after each step to follow the surviving beams, by HF's beam search (a DynamicCache, whose
        # self-attention keys and values are gathered) and by `beam_search` (a BeamSearchCache, which
        # follows them through its ancestry). Beams move only within their sentence, and every beam of a
        # sentence attends to the same encoder output: the cross-attention keys and values stay in order.
        past_key_values.self_attention_cache.reorder_cache(beam_idx)
        return past_key_values

    def resize_token_embeddings(self, new_num_tokens: int | None = None, **kwargs) -> nn.Embedding:
        """`PreTrainedModel.resize_token_embeddings`, also resizing `final_logits_bias` (zeros for new tokens)."""
        embeddings = super().resize_token_embeddings(new_num_tokens, **kwargs)
        if self.final_logits_bias is not None:
            old = self.final_logits_bias[:, : embeddings.num_embeddings]
            resized = old.new_zeros(1, embeddings.num_embeddings)
            resized[:, : old.shape[1]] = old
            self.final_logits_bias = resized
        return embeddings

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Used by `DataCollatorForSeq2Seq`: `labels` `(batch, target_len)` -> decoder inputs, same shape."""
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)


# §6.1 Decoding ------------------------------------------------------------------------------------


def paper_generation_config(config: VaswaniConfig) -> GenerationConfig:
    """The paper's decoding (§6.1): beam size 4, GNMT length penalty alpha 0.6, output length at most input length + 50.

    Search stops as soon as 4 hypotheses are finished; `max_new_tokens` 256 caps every batch;
    `<pad>` and `<s>` are never generated.

    Args:
        config: gives the special token ids.

    Returns:
        A `GenerationConfig` for `VaswaniForConditionalGeneration.generate`.
    """
    return GenerationConfig(
        num_beams=4,
        length_penalty=0.6,
        length_penalty_type="gnmt",
        early_stopping=True,
        max_new_tokens=256,
        max_length_a=1.0,
        max_length_b=50,
        decoder_start_token_id=config.decoder_start_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        suppress_tokens=[t for t in (config.pad_token_id, config.bos_token_id) if t is not None],
    )


def gnmt_length_penalty(length: int, alpha: float) -> float:
    """lp(Y) = ((5 + |Y|) / 6) ** alpha, the length penalty of Wu et al. (2016) that §6.1 uses with alpha 0.6.

    Args:
        length: |Y|, output tokens (with `</s>`), >= 1.
        alpha: the strength; 0 disables the penalty.

    Returns:
        The divisor of the hypothesis' log-probability.
    """
    return ((5.0 + length) / 6.0) ** alpha


def _power_length_penalty(length: int, alpha: float) -> float:
    # transformers' length normalisation: |Y| ** alpha.
    return float(length) ** alpha


def _gnmt_as_power(length: int, alpha: float) -> float:
    # The exponent e with length ** e == gnmt_length_penalty(length, alpha); at length 1 both are 1.
    if length <= 1:
        return alpha
    return math.log(gnmt_length_penalty(length, alpha)) / math.log(length)


class SourceLengthLimit(LogitsProcessor):
    """Forces `</s>` once sentence i has `limits[i]` output tokens: the per-sentence length limit of §6.1.

    Args:
        limits: `(batch,)` maximum number of output tokens before `</s>`, per source sentence.
        eos_token_id: id of `</s>`.
    """

    def __init__(self, limits: torch.Tensor, eos_token_id: int) -> None:
        self.limits = limits
        self.eos_token_id = eos_token_id

    def select(self, sentences: torch.Tensor) -> "SourceLengthLimit":
        """The limit for the sentences left in a batch: `sentences` `(kept,)` indexes this batch."""
        return SourceLengthLimit(self.limits[sentences.to(self.limits.device)], self.eos_token_id)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        """`input_ids` `(batch * beams, 1 + generated)` (the decoder start first), `scores` `(batch * beams, vocab)`."""
        limits = self.limits.to(input_ids.device).repeat_interleave(input_ids.shape[0] // self.limits.shape[0])
        at_limit = input_ids.shape[1] - 1 >= limits
        if at_limit.any():
            forced = torch.full_like(scores[0], float("-inf"))
            forced[self.eos_token_id] = 0.0
            scores = torch.where(at_limit[:, None], forced, scores)
        return scores


def _plain_beam_search(
    input_ids: torch.Tensor,
    generation_config: GenerationConfig,
    stopping_criteria: StoppingCriteriaList,
    synced_gpus: bool,
    model_kwargs: dict,
) -> bool:
    # What `beam_search` does exactly as HF's loop does: deterministic search that stops a sentence
    # at num_beams finished hypotheses, ends on </s> or the length limit, returns only sequences.
    config = generation_config
    return (
        input_ids.shape[1] < config.max_length
        and not config.do_sample
        and config.early_stopping is True
        and not config.return_dict_in_generate
        and config._eos_token_tensor is not None
        and not synced_gpus
        and all(isinstance(c, (MaxLengthCriteria, EosTokenCriteria)) for c in stopping_criteria)
        and isinstance(model_kwargs.get("past_key_values"), EncoderDecoderCache)
        # `beam_search` replaces the self-attention cache and fills the cross-attention one: both must be
        # empty, and the first the default dynamic cache (not a static or offloaded one the user asked for).
        and type(model_kwargs["past_key_values"].self_attention_cache) is DynamicCache
        and not model_kwargs["past_key_values"].self_attention_cache.offloading
        and model_kwargs["past_key_values"].self_attention_cache.get_seq_length() == 0
        and model_kwargs["past_key_values"].cross_attention_cache.get_seq_length() == 0
        and "encoder_outputs" in model_kwargs
    )


# Processors that look at each row on its own: beam search may drop finished sentences under them.
_ROW_WISE_PROCESSORS = (
    logits_process.ForcedBOSTokenLogitsProcessor,
    logits_process.ForcedEOSTokenLogitsProcessor,
    logits_process.MinLengthLogitsProcessor,
    logits_process.MinNewTokensLengthLogitsProcessor,
    logits_process.NoBadWordsLogitsProcessor,
    logits_process.NoRepeatNGramLogitsProcessor,
    logits_process.RepetitionPenaltyLogitsProcessor,
    logits_process.SequenceBiasLogitsProcessor,
    logits_process.SuppressTokensAtBeginLogitsProcessor,
    logits_process.SuppressTokensLogitsProcessor,
)

# Processors that forbid the same tokens in every row (a -inf where they act, the score elsewhere).
# HF's versions each pass over all (rows, vocab) scores with torch.where: with min_length,
# min_new_tokens and suppress_tokens, three times the output projection in beam search over a small
# model on the CPU (README, Performance; the paper's configuration has only suppress_tokens).
# Evaluated on one row of zeros they give a 0 / -inf mask, whose -inf columns are then filled.
_TOKEN_MASKS = (
    logits_process.MinLengthLogitsProcessor,
    logits_process.MinNewTokensLengthLogitsProcessor,
    logits_process.SuppressTokensAtBeginLogitsProcessor,
    logits_process.SuppressTokensLogitsProcessor,
)
# Processors that keep -inf at -inf and read each token's score alone: a token mask may move before them.
_COMMUTE_WITH_MASKS = (
    *_TOKEN_MASKS,
    logits_process.EncoderNoRepeatNGramLogitsProcessor,
    logits_process.EncoderRepetitionPenaltyLogitsProcessor,
    logits_process.NoBadWordsLogitsProcessor,
    logits_process.NoRepeatNGramLogitsProcessor,
    logits_process.RepetitionPenaltyLogitsProcessor,
    logits_process.SequenceBiasLogitsProcessor,
)


def _hoist_token_masks(processors: LogitsProcessorList) -> tuple[LogitsProcessorList, LogitsProcessorList]:
    # (the token masks that can run first, the other processors in their order)
    masks, others = LogitsProcessorList(), LogitsProcessorList()
    for processor in processors:
        if isinstance(processor, _TOKEN_MASKS) and all(isinstance(p, _COMMUTE_WITH_MASKS) for p in others):
            masks.append(processor)
        else:
            others.append(processor)
    return masks, others


def top_k(scores: torch.Tensor, k: int, chunk: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest scores of each row and their indices, best first: the values of `torch.topk(scores, k)`.

    Beam search picks its candidates among num_beams * vocabulary scores per sentence (§6.1). On the
    CPU, `torch.topk` costs several passes over such a row: with a small model it took as long as the
    output projection (README, Performance). The k largest scores lie in the k chunks with the largest
    maxima, so one vectorised max over chunks of `chunk` scores narrows the search to k * chunk of them.
    Among equal scores the indices may come in another order than `torch.topk`'s, which PyTorch does
    not specify either. Other devices, and rows whose length `chunk` does not divide, go to `torch.topk`.

    Args:
        scores: `(rows, n)`.
        k: how many to keep, at most n.
        chunk: scores per chunk.

    Returns:
        Values and indices, each `(rows, k)`.

    Raises:
        RuntimeError: k > n (from `torch.topk`).
    """
    rows, n = scores.shape
    if scores.device.type != "cpu" or n % chunk or k * chunk >= n:
        return scores.topk(k)
    best_chunks = scores.view(rows, n // chunk, chunk).amax(dim=-1).topk(k, sorted=False).indices
    indices = (best_chunks[..., None] * chunk + torch.arange(chunk, device=scores.device)).view(rows, -1)
    values, best = scores.gather(1, indices).topk(k)
    return values, indices.gather(1, best)


def _beam_search_cache_unsupported(*args, **kwargs) -> None:
    # What `BeamSearchCache` and its layers refuse: an edit that would leave the beams' ancestry and their slots apart.
    raise NotImplementedError(
        "BeamSearchCache serves `beam_search`: it appends positions, follows the beams through their ancestry "
        "(`reorder_cache`) and drops finished sentences; use a DynamicCache to reset, crop, repeat, select or "
        "reorder the rows of a cache, or to build attention masks from it."
    )


class BeamSearchCacheLayer(DynamicLayer):
    """One decoder layer's masked self-attention keys and values (§3.2.3) during beam search (§6.1).

    Each position's keys and values are written once, in the slot of the beam that produced them:
    buffers laid out `(batch, heads, capacity, num_beams, d_k)`, which grow to twice the length needed
    when full. `keys` and `values` are `(batch, heads, length * num_beams, d_k)` views of them, every slot
    of every position of a sentence, to which its beams attend as one query sequence, each masked to its
    own ancestors by `BeamSearchCache.mask`. Reordering the beams thus moves no keys or values: gathering
    the surviving beams' copies after every step read and wrote the whole cache, 10% of the operator time
    of a `small` batch of beam search (README, Performance). They are copied only when the buffers grow
    and when sentences leave the batch. Made for `BeamSearchCache`, which appends and drops sentences:
    reordering, cropping and repeating rows, and building masks from the layer, raise NotImplementedError.
    """

    is_croppable = False

    def __init__(self, num_beams: int) -> None:
        super().__init__()
        self.num_beams = num_beams

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.length = 0
        self._buffers = tuple(self._allocate(states, capacity=32) for states in (key_states, value_states))
        self.is_initialized = True

    def _allocate(self, states: torch.Tensor, capacity: int) -> torch.Tensor:
        # states: `(batch, heads, ..., d)`, giving the batch, heads and d of the new buffer
        return states.new_empty(states.shape[0], states.shape[1], capacity, self.num_beams, states.shape[-1])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one position, `(batch, heads, num_beams, d_k)` keys and values (one per slot, or one for all).

        Returns:
            All keys and values, `(batch, heads, length * num_beams, d_k)`, position-major.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.length == self._buffers[0].shape[2]:
            grown = tuple(self._allocate(buffer, capacity=2 * self.length) for buffer in self._buffers)
            for new, old in zip(grown, self._buffers, strict=True):
                new[:, :, : self.length] = old
            self._buffers = grown
        for buffer, states in zip(self._buffers, (key_states, value_states), strict=True):
            buffer[:, :, self.length] = states
        self.length += 1
        self.keys, self.values = (buffer[:, :, : self.length].flatten(2, 3) for buffer in self._buffers)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Positions held (not slots: `keys` has `num_beams` slots per position)."""
        return self.length if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sentences `indices` `(new_batch,)`, in that order."""
        if self.is_initialized:
            indices = indices.to(self.device)
            self._buffers = tuple(buffer.index_select(0, indices) for buffer in self._buffers)
            self.keys, self.values = (buffer[:, :, : self.length].flatten(2, 3) for buffer in self._buffers)

    reorder_cache = crop = batch_repeat_interleave = get_mask_sizes = _beam_search_cache_unsupported


class BeamSearchCache(Cache):
    """The masked self-attention cache of `beam_search`: one `BeamSearchCacheLayer` per decoder layer.

    It keeps each beam's ancestry: `ancestry[sentence, beam, position]`, `(batch, beams, length)`, is the
    slot in which that beam's hypothesis wrote its keys and values for the position. Beam i of a sentence
    may attend to the slot of its ancestry at each position and to no other (§3.2.3: a position attends
    to the positions up to and including it, here of its own hypothesis); that is `mask`, `(batch, 1,
    beams, length * num_beams)`, True where attending is allowed, the SDPA format, made once per step
    for every layer. `beams` is the rows per sentence of the step: 1 or num_beams at the first one.

    Only `update`, `reorder_cache` and the length queries are supported: resetting, cropping, repeating or
    selecting rows through the `Cache` interface would leave the ancestry behind, and raise NotImplementedError.

    Args:
        num_layers: decoder layers.
        batch_size: sentences.
        num_beams: slots per position.
        rows_per_sentence: decoder rows per sentence at the first step (1 or num_beams).
        device: where the ancestry and the mask are made (the decoder input's device); the attention
            moves the mask to each layer's device.
    """

    def __init__(
        self, num_layers: int, batch_size: int, num_beams: int, rows_per_sentence: int, device: torch.device
    ) -> None:
        super().__init__(layers=[BeamSearchCacheLayer(num_beams) for _ in range(num_layers)])
        self.num_beams = num_beams
        self.ancestry = torch.empty(batch_size, rows_per_sentence, 0, dtype=torch.long, device=device)
        self.mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        """Sentences still in the batch."""
        return self.ancestry.shape[0]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one position to layer `layer_idx`: `(batch, heads, beams, d_k)` keys and values.

        Returns:
            All keys and values of the layer, `(batch, heads, length * num_beams, d_k)`.
        """
        if layer_idx == 0:
            # Each beam writes the new position into its own slot (with one row per sentence, slot 0
            # stands for all, which the layer fills alike).
            batch, beams, _ = self.ancestry.shape
            slots = torch.arange(beams, device=self.ancestry.device).expand(batch, beams)
            self.ancestry = torch.cat((self.ancestry, slots[..., None]), dim=2)
            all_slots = torch.arange(self.num_beams, device=self.ancestry.device)
            self.mask = (self.ancestry[..., None] == all_slots).flatten(2)[:, None]
        return super().update(key_states, value_states, layer_idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Go on with row `beam_idx[i]` of the last step as row i, `(new_batch * num_beams,)`.

        The rows are numbered sentence by sentence, `beams` each, and those of a sentence stay together.
        A sentence none of whose rows go on leaves the batch: its keys and values go, which copies the
        others' (the only copy besides the buffers' growth).
        """
        batch, beams, length = self.ancestry.shape
        sentences = beam_idx[:: self.num_beams] // beams
        if sentences.shape[0] != batch:
            for layer in self.layers:
                layer.batch_select_indices(sentences)
        self.ancestry = self.ancestry.view(batch * beams, length)[beam_idx].view(-1, self.num_beams, length)

    reset = crop = batch_repeat_interleave = batch_select_indices = _beam_search_cache_unsupported


@torch.no_grad()
def beam_search(
    model: "VaswaniForConditionalGeneration",
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    generation_config: GenerationConfig,
    length_penalty: Callable[[int, float], float],
    **model_kwargs,
) -> torch.LongTensor:
    """Beam search with a key/value cache, stopping a sentence at num_beams finished hypotheses (§6.1).

    It chooses the candidates that `GenerationMixin._beam_search` chooses with `early_stopping=True`,
    with less work per step (README, Performance): the first step decodes one row per sentence, not
    num_beams identical ones; the beams of a sentence share one copy of its encoder output and of the
    cross-attention keys and values; a sentence with num_beams finished hypotheses leaves the batch
    (its rows of the caches, the encoder output and the mask go); the self-attention keys and values
    stay where they were written, each beam attending to its ancestors' (`BeamSearchCache`); token
    masks among the logits processors fill the columns they forbid; a candidate's sequence is built
    only when it ends, and finished hypotheses are merged only on steps where some end. A hypothesis
    Y that ends scores log P(Y|X) / length_penalty(|Y|, alpha), |Y| counting the generated tokens
    with `</s>`. Sentences stay in the batch, and the first step runs every row, as in HF's loop,
    when a logits processor keeps state per sentence that this function cannot narrow.

    Args:
        model: gives the forward pass and the cache reordering.
        input_ids: `(batch * num_beams, prompt_len)` decoder prompt, the decoder start token in each row.
        logits_processor: applied to the log-probabilities of every step, as HF's loop applies them.
        generation_config: gives `num_beams`, `length_penalty` (alpha), `max_length` (prompt included),
            `num_return_sequences` and the `</s>` and `<pad>` ids.
        length_penalty: (|Y|, alpha) -> divisor, e.g. `gnmt_length_penalty`.
        **model_kwargs: `encoder_outputs` and `attention_mask` expanded to the beams, and
            `past_key_values`, an empty `EncoderDecoderCache` whose cross-attention cache is used, as
            `generate` prepares them.

    Returns:
        `(batch * num_return_sequences, output_len)` token ids, the best hypotheses first, padded
        after `</s>` to the longest one returned.
    """
    num_beams, alpha = generation_config.num_beams, generation_config.length_penalty
    max_length = generation_config.max_length
    eos = generation_config._eos_token_tensor
    pad = generation_config._pad_token_tensor
    fill = int(pad or eos[0])  # as HF fills, a pad id of 0 included
    rows, prompt_len = input_ids.shape
    batch = rows // num_beams
    device = input_ids.device
    # Keep enough candidates that num_beams survive even if every end-of-sentence token is among them.
    num_candidates = max(2, 1 + eos.numel()) * num_beams
    can_drop = all(isinstance(p, (*_ROW_WISE_PROCESSORS, SourceLengthLimit)) for p in logits_processor)
    token_masks, logits_processor = _hoist_token_masks(logits_processor)

    # The finished hypotheses of every sentence, best first.
    finished = input_ids.new_full((batch, num_beams, max_length), fill)
    finished_scores = torch.full((batch, num_beams), -1.0e9, device=device)
    finished_lengths = torch.zeros(batch, num_beams, dtype=torch.long, device=device)
    is_finished = torch.zeros(batch, num_beams, dtype=torch.bool, device=device)

    # The running beams of the sentences still in the batch (`active`, by their index in the batch).
    # All beams of a sentence start alike. Where every processor reads each row alone, the first step
    # runs one row per sentence, whose best continuations become its beams; otherwise it runs them all,
    # and only the first of each sentence may expand.
    active = torch.arange(batch, device=device)
    first_rows = input_ids[::num_beams] if can_drop else input_ids
    sequences = input_ids.new_full((first_rows.shape[0], max_length), fill)
    sequences[:, :prompt_len] = first_rows
    scores = torch.zeros(batch, first_rows.shape[0] // batch, device=device)
    scores[:, 1:] = -1.0e9
    self_attention_cache = BeamSearchCache(
        model.config.decoder_layers, batch, num_beams, first_rows.shape[0] // batch, device
    )
    cache = EncoderDecoderCache(self_attention_cache, model_kwargs["past_key_values"].cross_attention_cache)
    # `generate` copied the encoder output to every beam; all beams of a sentence attend to the same,
    # so the decoder gets one row per sentence, and its keys and values are computed once.
    encoder_states = model_kwargs["encoder_outputs"].last_hidden_state[::num_beams]
    attention_mask = model_kwargs.get("attention_mask")
    attention_mask = attention_mask[::num_beams] if attention_mask is not None else None

    for length in range(prompt_len, max_length):
        logits = model(
            decoder_input_ids=sequences[:, length - 1 : length],
            encoder_outputs=BaseModelOutput(last_hidden_state=encoder_states),
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]
        log_probs = logits.float().log_softmax(dim=-1)
        vocab_size = log_probs.shape[-1]
        if token_masks:
            # A handful of forbidden tokens: filling their columns spares a pass over all the scores.
            mask = token_masks(sequences[:1, :length], log_probs.new_zeros(1, vocab_size))[0]
            log_probs.index_fill_(1, (mask == float("-inf")).nonzero().squeeze(1), float("-inf"))
        log_probs = logits_processor(sequences[:, :length], log_probs)
        beams = scores.shape[1]
        # reshape: a processor may return a strided view, which `view` cannot regroup (RepetitionPenaltyLogitsProcessor)
        candidates = log_probs.reshape(len(active), beams, vocab_size).add_(scores[..., None]).reshape(len(active), -1)
        candidate_scores, candidate_ids = top_k(candidates, min(num_candidates, candidates.shape[1]))
        sentence_rows = torch.arange(len(active), device=device)[:, None]
        candidate_rows = candidate_ids // vocab_size + sentence_rows * beams
        candidate_tokens = candidate_ids % vocab_size
        ends = torch.isin(candidate_tokens, eos) | (length + 1 >= max_length)

        # A candidate among the best num_beams that ends joins its sentence's finished hypotheses,
        # of which the best num_beams are kept, until the sentence has num_beams of them.
        just_finished = ends[:, :num_beams] & ~is_finished[active].all(dim=1, keepdim=True)
        if just_finished.any():
            generated = length + 1 - prompt_len
            new_scores = candidate_scores[:, :num_beams] / length_penalty(generated, alpha) - 1.0e9 * ~just_finished
            new = sequences[candidate_rows[:, :num_beams]]
            new[..., length] = candidate_tokens[:, :num_beams]
            merged_scores, best = torch.cat((finished_scores[active], new_scores), dim=1).topk(num_beams)
            finished[active] = torch.cat((finished[active], new), dim=1)[sentence_rows, best]
            new_lengths = finished_lengths.new_full(new_scores.shape, generated)
            finished_lengths[active] = torch.cat((finished_lengths[active], new_lengths), dim=1).gather(1, best)
            is_finished[active] = torch.cat((is_finished[active], just_finished), dim=1).gather(1, best)
            finished_scores[active] = merged_scores
        done = is_finished[active].all(dim=1)
        if bool(done.all()) or length + 1 >= max_length:
            break

        # The best num_beams candidates that go on become the beams of the next step.
        running = (candidate_scores - 1.0e9 * ends).topk(num_beams).indices
        scores = candidate_scores.gather(1, running) - 1.0e9 * ends.gather(1, running)
        beam_rows = candidate_rows.gather(1, running)
        tokens = candidate_tokens.gather(1, running)
        if can_drop and bool(done.any()):
            kept = (~done).nonzero().squeeze(1)
            active, scores, beam_rows, tokens = active[kept], scores[kept], beam_rows[kept], tokens[kept]
            encoder_states = encoder_states[kept]
            attention_mask = attention_mask[kept] if attention_mask is not None else None
            cache.cross_attention_cache.reorder_cache(kept)  # the self-attention cache finds `kept` in beam_rows
            logits_processor = LogitsProcessorList(
                p.select(kept) if isinstance(p, SourceLengthLimit) else p for p in logits_processor
            )
        sequences = sequences[beam_rows.view(-1)]
        sequences[:, length] = tokens.view(-1)
        cache = model._reorder_cache(cache, beam_rows.view(-1))

    returned = generation_config.num_return_sequences
    output_length = prompt_len + int(finished_lengths[:, :returned].max())
    return finished[:, :returned, :output_length].reshape(batch * returned, output_length)
