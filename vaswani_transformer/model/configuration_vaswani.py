"""Configuration of the Transformer of Vaswani et al. (2017), "Attention Is All You Need"."""

from typing import Any

from transformers import PretrainedConfig
from transformers.activations import ACT2FN

# Imported first by every saved model (AutoConfig loads this file first): the import checks the running transformers.
from .compat_vaswani import SUPPORTED_TRANSFORMERS  # noqa: F401

# Table 3 of the paper gives the base and big models (N, d_model, d_ff, h, P_drop; d_k = d_v =
# d_model / h). "small" is not in the paper: it is sized to train to a useful translator on a
# 2-core CPU in about a quarter of an hour (Multi30k), keeping the paper's proportions d_ff = 4 d_model.
# "tiny" is the Transformer-tiny that small corpora such as Multi30k are trained with (d_ff = 2 d_model,
# dropout 0.3): on 2 cores it makes more passes over such a corpus per hour than "small", which pays in BLEU
# (docs/training.md, "Multi30k on 2 cores").
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=128, d_ff=256, encoder_layers=4, decoder_layers=4, num_attention_heads=4, dropout=0.3),
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
        num_attention_heads: number h of attention heads (§3.2.2; Table 3 rows A).
        d_k: width of each head's queries and keys; None means d_model / h (§3.2.2; Table 3 rows A, B).
        d_v: width of each head's values; None means d_model / h (§3.2.2; Table 3 row A).
        dropout: P_drop, applied to each sublayer output before the residual addition and to the
            sums of embeddings and positional encodings (§5.4).
        attention_dropout: dropout on the attention weights (not in the paper; 0 by default).
        activation_dropout: dropout after the ReLU of the feed-forward network (not in the paper;
            0 by default).
        label_smoothing: epsilon_ls of the training loss (§5.4).
        layer_norm_eps: epsilon of every LayerNorm (the paper does not give it).
        position_embedding_type: "sinusoidal" (§3.5, any length) or "learned" (Table 3 row E:
            one trained vector per position, up to `max_position_embeddings`).
        max_position_embeddings: number of learned positions (a positive int or None, checked whatever
            the position type; sinusoidal positions ignore it, Marian's export takes it as its table size).
        normalize_before: False is the paper's post-LayerNorm, LayerNorm(x + Dropout(Sublayer(x)));
            True is pre-LayerNorm, x + Dropout(Sublayer(LayerNorm(x))) with a final LayerNorm on
            each stack. Not in the paper: an option for very deep models, which train more stably so.
        scale_embedding: multiply embeddings by sqrt(d_model) (§3.4). False only for imported
            models trained without it.
        scale_attention: divide the query-key dot products by sqrt(d_k) (§3.2.1, Eq. 1). False only for the
            ablation row of docs/table3.md that tests the section's claim: unscaled products grow with d_k and
            push the softmax into regions of tiny gradients.
        attention_bias: biases on the attention projections. The paper has none (§3.2.2); True
            only for imported models (HF Marian).
        activation_function: the feed-forward non-linearity; "relu" in the paper (Eq. 2). Any name of
            `transformers.activations.ACT2FN` ("swish" for imported OPUS-MT models).
        add_final_logits_bias: add a fixed (not trained) bias to the output logits, as HF Marian
            does. Not in the paper; False by default.
        pad_token_id, bos_token_id, eos_token_id: ids of `<pad>`, `<s>` and `</s>`.
        decoder_start_token_id: first decoder input; `<s>`, not `<pad>`, so that the padding row of
            the tied embedding never has to carry meaning.
        tie_word_embeddings: share one matrix between source embedding, target embedding and the
            pre-softmax projection (§3.4).
        source_lang, target_lang: the pair the model translates, codes such as "en" and "de" (`train --source-lang`
            and `--target-lang`), which the translation pipeline's `src_lang` and `tgt_lang` are checked against;
            None where the model does not say (saved before these fields, imported).

    Raises:
        ValueError: a size is not positive, a dropout or label smoothing is outside [0, 1),
            layer_norm_eps outside (0, 1), a switch not a bool, d_model odd or (with d_k or d_v unset) not
            divisible by num_attention_heads, a special token id (pad, bos, eos, decoder start) outside
            [0, vocab_size) (bos may be None), a blank language, or an option has an unknown value; checked after
            aliases (`hidden_size`, ...) and `from_pretrained`'s overrides are applied. The message names the field.
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
    d_k: int | None = None
    d_v: int | None = None
    dropout: float | int = 0.1
    attention_dropout: float | int = 0.0
    activation_dropout: float | int = 0.0
    label_smoothing: float | int = 0.1
    layer_norm_eps: float = 1e-5
    position_embedding_type: str = "sinusoidal"
    max_position_embeddings: int = 1024
    normalize_before: bool = False
    scale_embedding: bool = True
    scale_attention: bool = True
    attention_bias: bool = False
    activation_function: str = "relu"
    add_final_logits_bias: bool = False
    pad_token_id: int = 0
    bos_token_id: int | None = 1
    eos_token_id: int = 2
    decoder_start_token_id: int = 1
    tie_word_embeddings: bool = True
    source_lang: str | None = None
    target_lang: str | None = None
    use_cache: bool = True
    is_encoder_decoder: bool = True

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        self._check_values()  # after transformers applied the aliases of `attribute_map` (hidden_size, ...)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> "VaswaniConfig | tuple[VaswaniConfig, dict]":
        """`PretrainedConfig.from_dict`, then the checks of `__init__` again: `from_pretrained(path, dropout=...)`
        sets its overrides after the config is built.

        Raises:
            ValueError: as `VaswaniConfig(...)` does.
        """
        loaded = super().from_dict(config_dict, **kwargs)
        (loaded[0] if isinstance(loaded, tuple) else loaded)._check_values()
        return loaded

    def _check_values(self) -> None:
        sizes = ("vocab_size", "d_model", "d_ff", "encoder_layers", "decoder_layers", "num_attention_heads")
        optional_sizes = ("d_k", "d_v", "max_position_embeddings")
        for name in sizes + optional_sizes:
            value = getattr(self, name)
            if value is None and name in optional_sizes:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"VaswaniConfig.{name} must be a positive integer, got {value!r}.")
        switches = ("normalize_before", "scale_embedding", "scale_attention", "attention_bias", "add_final_logits_bias")
        for name in (*switches, "tie_word_embeddings", "use_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"VaswaniConfig.{name} must be a boolean (true or false), got {getattr(self, name)!r}."
                )
        if isinstance(self.layer_norm_eps, bool) or not isinstance(self.layer_norm_eps, (int, float)):
            raise ValueError(f"VaswaniConfig.layer_norm_eps must be a positive number, got {self.layer_norm_eps!r}.")
        if not 0.0 < self.layer_norm_eps < 1.0:
            raise ValueError(f"VaswaniConfig.layer_norm_eps must lie in (0, 1), got {self.layer_norm_eps!r}.")
        for name in ("dropout", "attention_dropout", "activation_dropout", "label_smoothing"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"VaswaniConfig.{name} must be a probability in [0, 1), got {value!r}.")
        if (self.d_k is None or self.d_v is None) and self.d_model % self.num_attention_heads:
            raise ValueError(
                f"VaswaniConfig.d_model ({self.d_model}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}) so that d_k = d_v = d_model / h (§3.2.2); change one of them "
                "or set d_k and d_v explicitly."
            )
        if self.d_model % 2:
            raise ValueError(
                f"VaswaniConfig.d_model must be even, got {self.d_model}: the positional encoding pairs a sine "
                "and a cosine per frequency (§3.5)."
            )
        if self.position_embedding_type not in ("sinusoidal", "learned"):
            raise ValueError(
                "VaswaniConfig.position_embedding_type must be 'sinusoidal' or 'learned', "
                f"got {self.position_embedding_type!r}."
            )
        if self.activation_function not in ACT2FN:
            raise ValueError(
                f"VaswaniConfig.activation_function {self.activation_function!r} is unknown; use one of "
                f"{', '.join(sorted(ACT2FN))}."
            )
        for name, value in (("source_lang", self.source_lang), ("target_lang", self.target_lang)):
            if value is not None and not (isinstance(value, str) and value.strip()):
                raise ValueError(f"VaswaniConfig.{name} must be a language code such as 'en', or None; got {value!r}.")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            if name == "bos_token_id" and value is None:
                continue  # imported models may have none
            if not isinstance(value, int) or not 0 <= value < self.vocab_size:
                raise ValueError(
                    f"VaswaniConfig.{name} must be a token id in [0, vocab_size={self.vocab_size}), got {value!r}."
                )

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "VaswaniConfig":
        """Build the configuration of a named model size.

        Args:
            name: "base" or "big" (the paper's Table 3), or "small" or "tiny" (for CPU training).
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
    def key_dim(self) -> int:
        """d_k: `d_k` if set, else d_model / h (§3.2.2)."""
        return self.d_k or self.d_model // self.num_attention_heads

    @property
    def value_dim(self) -> int:
        """d_v: `d_v` if set, else d_model / h (§3.2.2)."""
        return self.d_v or self.d_model // self.num_attention_heads
