"""Import Hugging Face `MarianMTModel`s (the OPUS-MT models) as `VaswaniForConditionalGeneration`, and back.

Marian's architecture is the paper's Transformer with a few departures. Each is carried over
exactly, never approximated:

- its sinusoids are laid out [sin | cos] rather than interleaved (§3.5). That is a permutation of
  the d_model dimensions, so the whole residual stream is permuted: every weight that reads from
  or writes to it (embeddings, attention and feed-forward projections, LayerNorms) has its
  d_model axis reordered. LayerNorm and the tied output projection are indifferent to the order,
  so every output is unchanged;
- biases on the attention projections, another activation than ReLU, no sqrt(d_model) embedding
  scale and `final_logits_bias` become the config options `attention_bias`,
  `activation_function`, `scale_embedding` and `add_final_logits_bias`;
- `<pad>` as decoder start token and Marian's generation config (HF's length penalty and length
  limits) are kept as they are, so a converted model decodes like the original until the user
  asks for the paper's decoding (`paper_generation_config`).

`to_marian` is the inverse mapping: it builds the `MarianMTModel` that computes the same function
as one of ours (zero attention biases, zero `final_logits_bias`, ReLU, the permutation undone).
The benchmark runs HF Marian and CTranslate2 on it, and `ctranslate2.py` feeds it to CTranslate2's
Marian converter.
"""

import copy
import json
import shutil
from pathlib import Path

import torch
from transformers import GenerationConfig, MarianConfig, MarianMTModel

from ..model.configuration_vaswani import VaswaniConfig
from ..model.generation_vaswani import paper_generation_config
from ..model.modeling_vaswani import VaswaniForConditionalGeneration

# What MarianTokenizer (and a fast tokenizer, if one was saved) reads from a model directory.
TOKENIZER_FILES = (
    "source.spm",
    "target.spm",
    "vocab.json",
    "target_vocab.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
)


def marian_to_interleaved_permutation(d_model: int) -> torch.Tensor:
    """Index p with `interleaved = marian[..., p]`: Marian's sinusoid layout to the paper's (§3.5).

    Marian lays out [sin_0 .. sin_{d/2-1} | cos_0 .. cos_{d/2-1}]; the paper interleaves
    [sin_0, cos_0, sin_1, cos_1, ...].

    Args:
        d_model: even model width.

    Returns:
        `(d_model,)` long tensor [0, d/2, 1, d/2 + 1, ...].
    """
    half = d_model // 2
    return torch.stack((torch.arange(half), torch.arange(half, d_model)), dim=-1).flatten()


# Our config field -> the MarianConfig field that holds the same value, for conversions both ways.
_MARIAN_FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "d_model",
    "d_ff": "encoder_ffn_dim",
    "encoder_layers": "encoder_layers",
    "decoder_layers": "decoder_layers",
    "num_attention_heads": "encoder_attention_heads",
    "dropout": "dropout",
    "attention_dropout": "attention_dropout",
    "activation_dropout": "activation_dropout",
    "activation_function": "activation_function",
    "scale_embedding": "scale_embedding",
    "pad_token_id": "pad_token_id",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "decoder_start_token_id": "decoder_start_token_id",
}


def _refuse_inexact(problems: list[str], subject: str, remedy: str) -> None:
    if problems:
        raise ValueError(f"{subject}: it has " + "; ".join(problems) + f". {remedy}")


def _config_from_marian(marian_config) -> VaswaniConfig:
    problems = []
    if not marian_config.share_encoder_decoder_embeddings:
        problems.append("separate source and target embeddings (share_encoder_decoder_embeddings=False)")
    if not marian_config.tie_word_embeddings:
        problems.append("an output projection of its own (tie_word_embeddings=False)")
    if marian_config.encoder_attention_heads != marian_config.decoder_attention_heads:
        problems.append("different numbers of encoder and decoder attention heads")
    if marian_config.encoder_ffn_dim != marian_config.decoder_ffn_dim:
        problems.append("different encoder and decoder feed-forward widths")
    if marian_config.d_model % 2:
        problems.append(f"an odd d_model ({marian_config.d_model})")
    if getattr(marian_config, "normalize_before", False):
        problems.append("pre-LayerNorm layers")
    _refuse_inexact(
        problems,
        "This Marian model cannot be converted exactly",
        "The paper's Transformer shares one vocabulary, and its weights with the output projection (§3.4), and has"
        " identical encoder and decoder layer sizes.",
    )
    return VaswaniConfig(
        **{ours: getattr(marian_config, theirs) for ours, theirs in _MARIAN_FIELDS.items()},
        layer_norm_eps=1e-5,  # nn.LayerNorm's default, which Marian uses
        attention_bias=True,
        add_final_logits_bias=True,
        tie_word_embeddings=True,
    )


def _marian_key(key: str) -> str:
    # Our parameter name -> Marian's. Layer indices and the q/k/v/out_proj, fc1/fc2 names are shared.
    return (
        key.replace("self_attn_sublayer.layer_norm", "self_attn_layer_norm")
        .replace("encoder_attn_sublayer.layer_norm", "encoder_attn_layer_norm")
        .replace("feed_forward_sublayer.layer_norm", "final_layer_norm")
        .replace("feed_forward.fc", "fc")
    )


def _residual_axes(key: str) -> tuple[int, ...]:
    """The axes of parameter `key` (our name) that run along the d_model residual stream."""
    if key == "model.shared.weight" or "layer_norm" in key:
        return (-1,)
    if key.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "fc1.weight")):
        return (1,)  # they read the residual stream
    if key.endswith(("out_proj.weight", "fc2.weight", "out_proj.bias", "fc2.bias")):
        return (0,)  # they write to it
    return ()


@torch.no_grad()
def from_marian(marian_model: MarianMTModel) -> VaswaniForConditionalGeneration:
    """Convert a Hugging Face `MarianMTModel` into an equivalent `VaswaniForConditionalGeneration`.

    The result computes the same logits (up to float rounding) and, with the copied generation
    config, the same beam search output. See the module docstring for how each of Marian's
    departures from the paper is carried over.

    See docs/training.md, "Importing Marian (OPUS-MT) models".

    Args:
        marian_model: a `MarianMTModel` with shared source/target embeddings.

    Returns:
        The converted model, in eval mode, on the CPU, in float32, with Marian's generation config.

    Raises:
        ValueError: the Marian model has features the paper's architecture cannot express exactly
            (separate vocabularies, an untied output projection, unequal encoder and decoder sizes, an odd
            d_model, pre-LayerNorm layers).
    """
    config = _config_from_marian(marian_model.config)
    model = VaswaniForConditionalGeneration(config)
    marian_state = {key: tensor.float().cpu() for key, tensor in marian_model.state_dict().items()}
    permutation = marian_to_interleaved_permutation(config.d_model)

    state = {}
    tied = model.all_tied_weights_keys  # copies of model.shared.weight (§3.4)
    for key in model.state_dict():
        if key in tied:
            continue
        if key == "final_logits_bias":
            state[key] = marian_state["final_logits_bias"]
            continue
        tensor = marian_state[_marian_key(key)]
        for axis in _residual_axes(key):
            tensor = tensor.index_select(axis, permutation)
        state[key] = tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(key in tied for key in missing), (missing, unexpected)
    model.tie_weights()

    model.generation_config = copy.deepcopy(marian_model.generation_config)
    return model.eval()


def convert_marian_directory(source_dir: str | Path, output_dir: str | Path, paper_decoding: bool = False) -> Path:
    """`vaswani-transformer convert-marian`: convert a saved Marian model directory and keep its tokenizer.

    See docs/training.md, "Importing Marian (OPUS-MT) models".

    Args:
        source_dir: a directory written by `MarianMTModel.save_pretrained` (an OPUS-MT download, say).
        output_dir: where to save the converted model; Marian's tokenizer files are copied beside it,
            so `AutoTokenizer.from_pretrained(output_dir)` loads Marian's own tokenizer.
        paper_decoding: save the paper's generation config (`paper_generation_config`) instead of Marian's.

    Returns:
        `output_dir`.

    Raises:
        OSError: `source_dir` is no local directory (a Hub id: download it first), holds no tokenizer
            files, or holds no loadable Marian model.
        ValueError: `source_dir` holds a model of another kind, `output_dir` is `source_dir` (saving would
            overwrite the Marian model), or already holds a model or tokenizer (their files would mix with
            the new ones); see also `from_marian`.
    """
    source_dir, output_dir = Path(source_dir), Path(output_dir)
    if output_dir.resolve() == source_dir.resolve():
        raise ValueError(
            f"the output directory {output_dir} is the Marian model's own: converting there would overwrite it."
            " Choose another output directory."
        )
    if not source_dir.is_dir():
        raise OSError(
            f"{source_dir} is no directory: give a Marian model saved locally, e.g. an OPUS-MT model downloaded "
            f"with `hf download Helsinki-NLP/opus-mt-en-de --local-dir DIR`."
        )
    if not any((source_dir / name).is_file() for name in TOKENIZER_FILES):
        raise OSError(
            f"{source_dir} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): the converted model would have none. "
            "Save the Marian tokenizer beside its model (MarianTokenizer.save_pretrained)."
        )
    config_file = source_dir / "config.json"  # without one, from_pretrained says so below
    model_type = json.loads(config_file.read_text()).get("model_type") if config_file.is_file() else "marian"
    if model_type != "marian":
        raise ValueError(
            f"{source_dir} holds a {model_type} model, not a Marian one: convert-marian imports MarianMTModel "
            "(OPUS-MT) models. A model of this package needs no conversion: from_pretrained loads it."
        )
    taken = [name for name in ("config.json", "model.safetensors", *TOKENIZER_FILES) if (output_dir / name).exists()]
    if taken:
        raise ValueError(
            f"{output_dir} already holds {', '.join(taken)}: the converted model's files would mix with them. "
            "Choose a new or empty output directory."
        )
    model = from_marian(MarianMTModel.from_pretrained(source_dir))
    if paper_decoding:
        model.generation_config = paper_generation_config(model.config)
    model.save_pretrained(output_dir)
    for name in TOKENIZER_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, output_dir / name)
    return output_dir


def _marian_config(config: VaswaniConfig, max_position_embeddings: int) -> MarianConfig:
    problems = []
    if config.d_k is not None and config.d_k * config.num_attention_heads != config.d_model:
        problems.append(f"d_k={config.d_k} (Marian's heads have width d_model / h)")
    if config.d_v is not None and config.d_v * config.num_attention_heads != config.d_model:
        problems.append(f"d_v={config.d_v} (Marian's heads have width d_model / h)")
    if config.normalize_before:
        problems.append("pre-LayerNorm layers (normalize_before=True)")
    if config.position_embedding_type != "sinusoidal":
        problems.append("learned positional embeddings")
    if not config.scale_attention:
        problems.append("attention without the 1/sqrt(d_k) scale (scale_attention=False)")
    if config.layer_norm_eps != 1e-5:
        problems.append(f"layer_norm_eps={config.layer_norm_eps} (Marian's is 1e-5)")
    if not config.tie_word_embeddings:
        problems.append("untied output projection (tie_word_embeddings=False)")
    _refuse_inexact(
        problems,
        "This model has no exact HF Marian equivalent",
        "Only models with the paper's architecture (or imported from Marian) can be exported.",
    )
    return MarianConfig(
        **{theirs: getattr(config, ours) for ours, theirs in _MARIAN_FIELDS.items()},
        decoder_vocab_size=config.vocab_size,
        share_encoder_decoder_embeddings=True,
        decoder_attention_heads=config.num_attention_heads,
        decoder_ffn_dim=config.d_ff,
        max_position_embeddings=max_position_embeddings,
        forced_eos_token_id=None,  # MarianConfig's default (0) would force a token we do not force
        tie_word_embeddings=True,
    )


# Marian, and CTranslate2 after it, cannot extrapolate: they read positions from a table this long (ours computes them).
DEFAULT_MAX_POSITIONS = 1024


@torch.no_grad()
def to_marian(
    model: VaswaniForConditionalGeneration, max_position_embeddings: int = DEFAULT_MAX_POSITIONS
) -> MarianMTModel:
    """Build the Hugging Face `MarianMTModel` that computes the same function as `model` (inverse of `from_marian`).

    Every weight is copied with its d_model axis permuted from the paper's interleaved layout to
    Marian's [sin | cos] (§3.5); Marian's attention biases and `final_logits_bias` are zero unless
    `model` has them. The generation config keeps the beam size, limits and special tokens, but
    Marian knows only HF's length penalty: the GNMT penalty and the per-sentence length limit of
    §6.1 (`length_penalty_type`, `max_length_a/b`) are dropped.

    Args:
        model: the model to copy (any device and dtype; the copy is float32 on the CPU).
        max_position_embeddings: rows of Marian's sinusoid table: the longest source or target, in
            tokens, the copy can encode (ours has no limit).

    Returns:
        A `MarianMTModel` in eval mode whose logits match `model`'s up to float rounding.

    Raises:
        ValueError: `model` uses an option Marian cannot express (d_k or d_v other than d_model / h,
            pre-LayerNorm, learned positions, another LayerNorm epsilon, untied output projection).
    """
    config = model.config
    marian = MarianMTModel(_marian_config(config, max_position_embeddings))
    ours = {key: tensor.detach().float().cpu() for key, tensor in model.state_dict().items()}
    inverse = torch.argsort(marian_to_interleaved_permutation(config.d_model))

    state = {key: torch.zeros_like(tensor) for key, tensor in marian.state_dict().items() if key.endswith("bias")}
    for key, tensor in ours.items():
        if key in model.all_tied_weights_keys:
            continue
        if key != "final_logits_bias":
            for axis in _residual_axes(key):
                tensor = tensor.index_select(axis, inverse)
        state[key if key == "final_logits_bias" else _marian_key(key)] = tensor
    missing, unexpected = marian.load_state_dict(state, strict=False)
    assert not unexpected and all(
        "embed_tokens" in key or "embed_positions" in key or key == "lm_head.weight" for key in missing
    ), (missing, unexpected)
    marian.tie_weights()

    settings = {
        key: value
        for key, value in model.generation_config.to_diff_dict().items()
        if key not in ("length_penalty_type", "max_length_a", "max_length_b", "transformers_version")
    }
    marian.generation_config = GenerationConfig(**settings)
    return marian.eval()
