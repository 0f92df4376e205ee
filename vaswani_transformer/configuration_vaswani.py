"""Configuration of the Transformer of Vaswani et al. (2017), "Attention Is All You Need"."""

from typing import Any

from transformers import PretrainedConfig

# Table 3 of the paper gives the base and big models (N, d_model, d_ff, h, P_drop; d_k = d_v =
# d_model / h). "small" is not in the paper: it is sized to train to a useful translator on a
# 2-core CPU in about a quarter of an hour (Multi30k), keeping the paper's proportions d_ff = 4 d_model.
PRESETS: dict[str, dict[str, Any]] = {
    "small": dict(d_model=256, d_ff=1024, encoder_layers=3, decoder_layers=3, num_attention_heads=4, dropout=0.1),
    "base": dict(d_model=512, d_ff=2048, encoder_layers=6, decoder_layers=6, num_attention_heads=8, dropout=0.1),
    "big": dict(d_model=1024, d_ff=4096, encoder_layers=6, decoder_layers=6, num_attention_heads=16, dropout=0.3),
}


class VaswaniConfig(PretrainedConfig):
    r"""Every hyperparameter of the Transformer, under the names the paper and transformers use.

    The defaults are the paper's base model (Table 3, first row) with its shared 37,000-token
    BPE vocabulary (§5.1); `VaswaniConfig.from_preset("big")` gives the big model.

    Args:
        vocab_size: size of the vocabulary shared by source and target (§3.4).
        d_model: width of every sublayer output and embedding (§3.1).
        d_ff: inner width of the position-wise feed-forward networks (§3.3).
        encoder_layers: number N of encoder layers (§3.1).
        decoder_layers: number N of decoder layers (§3.1).
        num_attention_heads: number h of attention heads; d_k = d_v = d_model / h (§3.2.2).
        dropout: P_drop, applied to each sublayer output before the residual addition and to the
            sums of embeddings and positional encodings (§5.4).
        attention_dropout: dropout on the attention weights (not in the paper; 0 by default).
        activation_dropout: dropout after the ReLU of the feed-forward network (not in the paper;
            0 by default).
        label_smoothing: epsilon_ls of the training loss (§5.4).
        layer_norm_eps: epsilon of every LayerNorm.
        pad_token_id, bos_token_id, eos_token_id: ids of `<pad>`, `<s>` and `</s>`.
        decoder_start_token_id: first decoder input; `<s>`, not `<pad>`, so that the padding row of
            the tied embedding never has to carry meaning.
        tie_word_embeddings: share one matrix between source embedding, target embedding and the
            pre-softmax projection (§3.4).

    Raises:
        ValueError: a size is not positive, a dropout or label smoothing is outside [0, 1), or
            d_model is odd or not divisible by num_attention_heads. The message names the field.
    """

    model_type = "vaswani_transformer"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "encoder_layers",
        "encoder_attention_heads": "num_attention_heads",
        "decoder_attention_heads": "num_attention_heads",
        "encoder_ffn_dim": "d_ff",
        "decoder_ffn_dim": "d_ff",
    }

    vocab_size: int = 37000
    d_model: int = 512
    d_ff: int = 2048
    encoder_layers: int = 6
    decoder_layers: int = 6
    num_attention_heads: int = 8
    dropout: float | int = 0.1
    attention_dropout: float | int = 0.0
    activation_dropout: float | int = 0.0
    label_smoothing: float | int = 0.1
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    decoder_start_token_id: int = 1
    tie_word_embeddings: bool = True
    use_cache: bool = True
    is_encoder_decoder: bool = True

    def __post_init__(self, **kwargs: Any) -> None:
        self._check_values()
        super().__post_init__(**kwargs)

    def _check_values(self) -> None:
        for name in ("vocab_size", "d_model", "d_ff", "encoder_layers", "decoder_layers", "num_attention_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"VaswaniConfig.{name} must be a positive integer, got {value!r}.")
        for name in ("dropout", "attention_dropout", "activation_dropout", "label_smoothing"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"VaswaniConfig.{name} must be a probability in [0, 1), got {value!r}.")
        if self.d_model % self.num_attention_heads:
            raise ValueError(
                f"VaswaniConfig.d_model ({self.d_model}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}) so that d_k = d_v = d_model / h (§3.2.2); change one of them."
            )
        if self.d_model % 2:
            raise ValueError(
                f"VaswaniConfig.d_model must be even, got {self.d_model}: the positional encoding pairs a sine "
                "and a cosine per frequency (§3.5)."
            )
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < self.vocab_size:
                raise ValueError(
                    f"VaswaniConfig.{name} must be a token id in [0, vocab_size={self.vocab_size}), got {value!r}."
                )

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "VaswaniConfig":
        """Build the configuration of a named model size.

        Args:
            name: "base" or "big" (the paper's Table 3), or "small" (for CPU training).
            **overrides: any other field, e.g. `vocab_size=8000`.

        Returns:
            The configuration.

        Raises:
            ValueError: `name` is not a known preset, or an override is invalid.
        """
        if name not in PRESETS:
            raise ValueError(f"Unknown preset {name!r}; choose one of {', '.join(PRESETS)}.")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def head_dim(self) -> int:
        """d_k = d_v = d_model / h (§3.2.2)."""
        return self.d_model // self.num_attention_heads
