"""Export for serving: a saved `VaswaniForConditionalGeneration` as a CTranslate2 model.

CTranslate2 is a C++ inference engine for Transformers; its converters turn Hugging Face models
into its own format. It has no converter for this model, but it has one for HF `MarianMTModel`,
and `convert.to_marian` builds the Marian model that computes exactly our function. This module
registers, through CTranslate2's own extension point (`register_loader`), a loader for
`VaswaniConfig` that hands that Marian copy to CTranslate2's Marian loader with three changes,
each needed for CTranslate2 to decode as our `generate()` does:

- the decoder starts from the embedding of `decoder_start_token_id` (`<s>`), as ours does (§3.1,
  "shifted right"); CTranslate2's Marian loader starts it from a zero vector instead, which only
  matches Marian's convention of starting from `<pad>`;
- every vocabulary row is kept: the Marian loader drops the last row, assuming it is Marian's
  `<pad>`, while our `<pad>` is id 0 and the last row is a real token;
- `<pad>` and `<s>` get a logit bias of -inf, so that the served model never generates them, as
  our generation config suppresses them.

Beam size, length penalty and length limits are options of CTranslate2's `translate_batch`, not
of the model: `beam_size=4` with `length_penalty=1.0` (its default) gives our `generate()` with
`length_penalty_type="hf"`; CTranslate2 has no GNMT length penalty (§6.1).
"""

from pathlib import Path

import torch

from .convert import to_marian

# CTranslate2 cannot extrapolate: it reads positions from a table this long (our model computes them).
DEFAULT_MAX_POSITIONS = 1024


def _import_ctranslate2():
    try:
        import ctranslate2
        import ctranslate2.converters.transformers as ct2_transformers
    except ImportError as error:
        raise ImportError(
            "Exporting to CTranslate2 needs the ctranslate2 package: pip install 'vaswani-transformer[serve]'."
        ) from error
    return ctranslate2, ct2_transformers


def _register_loader(max_positions: int) -> None:
    """Register (again) the CTranslate2 loader of `VaswaniConfig` models, with this position table size."""
    _, ct2 = _import_ctranslate2()

    class VaswaniLoader(ct2.MarianMTLoader):
        @property
        def architecture_name(self) -> str:
            return "AutoModelForSeq2SeqLM"  # resolves to our class once the package is imported

        def get_model_spec(self, model):
            marian = to_marian(model, max_position_embeddings=max_positions)
            marian.config.normalize_before = False
            marian.config.normalize_embedding = False
            # BartLoader's spec, without MarianMTLoader's removal of the last vocabulary row.
            spec = ct2.BartLoader.get_model_spec(self, marian)
            bias = marian.final_logits_bias.squeeze(0).clone()
            bias[[t for t in (model.config.pad_token_id, model.config.bos_token_id) if t is not None]] = -torch.inf
            spec.decoder.projection.bias = bias
            return spec

        def set_decoder(self, spec, decoder):
            ct2.BartLoader.set_decoder(self, spec, decoder)  # no start_from_zero_embedding

        def set_config(self, config, model, tokenizer):
            vocabulary = self.get_vocabulary(model, tokenizer)
            if model.config.bos_token_id is not None:  # models imported from Marian have none
                config.bos_token = vocabulary[model.config.bos_token_id]
            config.eos_token = vocabulary[model.config.eos_token_id]
            config.unk_token = tokenizer.unk_token or vocabulary[model.config.eos_token_id]
            config.decoder_start_token = vocabulary[model.config.decoder_start_token_id]

        def get_vocabulary(self, model, tokenizer):
            tokens = ct2.ModelLoader.get_vocabulary(self, model, tokenizer)[: model.config.vocab_size]
            # Rows beyond the tokenizer's (embeddings resized to a round size) need distinct names.
            return tokens + [f"<unused_{i}>" for i in range(len(tokens), model.config.vocab_size)]

    ct2.register_loader("VaswaniConfig")(VaswaniLoader)


def export_ctranslate2(
    model_dir: str | Path,
    output_dir: str | Path,
    quantization: str | None = None,
    max_positions: int = DEFAULT_MAX_POSITIONS,
    force: bool = False,
) -> Path:
    """`vaswani-transformer export-ctranslate2`: convert a saved model to a CTranslate2 model directory.

    The conversion goes through `ctranslate2.converters.TransformersConverter`; the model directory
    must hold the tokenizer too (CTranslate2 stores the vocabulary as token strings). Serve it with
    `ctranslate2.Translator(output_dir).translate_batch(batch_of_token_lists, beam_size=4)`, where
    the tokens are `tokenizer.convert_ids_to_tokens(tokenizer(text).input_ids)` (with `</s>`).

    Args:
        model_dir: a directory written by `save_pretrained` (model and tokenizer), as `train` writes.
        output_dir: where the CTranslate2 model (`model.bin`, `config.json`, vocabulary) goes.
        quantization: weight type to store ("int8", "int8_float32", "float16", "bfloat16", ...);
            None keeps float32. CTranslate2 can also quantize when loading (`compute_type=`).
        max_positions: longest source or target, in tokens, the exported model can handle.
        force: overwrite `output_dir` if it exists.

    Returns:
        `output_dir`.

    Raises:
        ImportError: ctranslate2 is not installed.
        OSError: `model_dir` holds no model or no tokenizer.
        ValueError: the model uses an option CTranslate2's Marian format cannot express (see
            `convert.to_marian`), or `output_dir` exists and `force` is False.
    """
    import vaswani_transformer  # noqa: F401  (AutoConfig and AutoModelForSeq2SeqLM must know our classes)

    model_dir, output_dir = Path(model_dir), Path(output_dir)
    if not (model_dir / "config.json").is_file():
        raise OSError(f"{model_dir} holds no saved model (no config.json); pass a directory written by `train`.")
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise OSError(f"{model_dir} holds no tokenizer; CTranslate2 needs one: save it with tokenizer.save_pretrained.")
    if output_dir.exists() and not force:
        raise ValueError(f"{output_dir} exists; remove it or pass --force to overwrite it.")
    if max_positions < 1:
        raise ValueError(f"max_positions must be a positive number of tokens, got {max_positions}.")
    _, ct2 = _import_ctranslate2()
    _register_loader(max_positions)
    converter = ct2.TransformersConverter(str(model_dir))
    return Path(converter.convert(str(output_dir), quantization=quantization, force=force))
