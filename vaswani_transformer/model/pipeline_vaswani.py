"""`pipeline("translation")` for encoder-decoder models, which transformers 5 no longer ships.

Saved models list this class under `custom_pipelines` in their `config.json` and carry this
file, so `pipeline("translation", model=dir_or_repo, trust_remote_code=True)` works with or
without `vaswani_transformer` installed. For that reason it imports nothing but transformers and
`compat_vaswani.py`, which saved models carry too.
"""

from typing import Any

import torch
from transformers import Pipeline
from transformers.utils import logging

from .compat_vaswani import pipeline_generate_kwargs

logger = logging.get_logger(__name__)


class TranslationPipeline(Pipeline):
    """Translate text with `model.generate()`, using the model's generation config (beam search, §6.1).

    As transformers 4's pipeline did: a string gives `[{"translation_text": str}]`, a list of n
    strings gives n such dicts, in order (n lists of dicts with `num_return_sequences` > 1).
    Generation parameters (`num_beams`, `max_new_tokens`, ...) can be given at creation or per call,
    and so can transformers 4's `truncation` (default True: inputs longer than the tokenizer's
    `model_max_length` are cut there; False leaves them whole) and `clean_up_tokenization_spaces`. A
    blank input translates to an empty string, as with `translate()`. `src_lang` and `tgt_lang`, the
    language arguments of transformers' translation pipeline, are checked against the pair the model
    translates (`VaswaniConfig.source_lang`, `target_lang`; a region or script after the language, as in
    "en_XX" or "de-DE", is ignored) and otherwise unused: the model translates one pair. A model whose
    config does not say its pair takes them with one warning.
    """

    _pipeline_calls_generate = True
    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def __call__(self, text: str | list[str], **generate_kwargs: Any) -> list[dict[str, str]]:
        """Translate `text`, a string or a list of strings (`[]` gives `[]`), with `generate_kwargs` for this call."""
        if isinstance(text, list) and not text:  # transformers' batching fails on no inputs
            return []
        results = super().__call__(text, **generate_kwargs)
        if isinstance(text, list) and all(len(result) == 1 for result in results):
            return [result[0] for result in results]  # one translation per input, not one-element lists
        return results

    def _sanitize_parameters(
        self,
        truncation: bool | None = None,
        clean_up_tokenization_spaces: bool | None = None,
        src_lang: str | None = None,
        tgt_lang: str | None = None,
        **generate_kwargs: Any,
    ) -> tuple[dict, dict, dict]:
        # The languages are checked here, at creation and at every call, before any work; the tokenizer's options go
        # to the steps that tokenize and decode, the rest to generate().
        self._check_languages(src_lang, tgt_lang)
        preprocess = {} if truncation is None else {"truncation": truncation}
        postprocess = (
            {}
            if clean_up_tokenization_spaces is None
            else {"clean_up_tokenization_spaces": clean_up_tokenization_spaces}
        )
        return preprocess, generate_kwargs, postprocess

    def _check_languages(self, src_lang: str | None, tgt_lang: str | None) -> None:
        """Refuse a `src_lang` or `tgt_lang` other than the model's source or target language, in one line.

        Raises:
            ValueError: a language that is not the model's (the message names the model's pair), or no string.
        """
        config = self.model.config
        pair = (getattr(config, "source_lang", None), getattr(config, "target_lang", None))
        given = {"src_lang": (src_lang, pair[0]), "tgt_lang": (tgt_lang, pair[1])}
        for name, (language, known) in given.items():
            if language is None:
                continue
            if not isinstance(language, str) or not language.strip():
                raise ValueError(f"{name} must be a language code such as 'en', got {language!r}.")
            if known is None:
                logger.warning_once(
                    f"This model's config does not say which languages it translates (source_lang, target_lang): "
                    f"{name}={language!r} is taken unchecked."
                )
            elif _primary_language(language) != _primary_language(known):
                raise ValueError(
                    f"This model translates {pair[0] or '?'} to {pair[1] or '?'}, not {name}={language!r}: give "
                    f"{name}={known!r} or leave it out."
                )

    def preprocess(self, text: str, truncation: bool = True) -> dict[str, torch.Tensor]:
        """Tokenize one source sentence: `input_ids` and `attention_mask`, `(1, source_len)`, truncated to the
        tokenizer's `model_max_length` unless `truncation` is False, and `blank`, `(1, 1)`, whether `text` is
        only whitespace.

        See README.md, "Using a trained model".

        Raises:
            TypeError: `text` is not a string.
        """
        if not isinstance(text, str):
            raise TypeError(f"TranslationPipeline translates strings, got {type(text).__name__}.")
        inputs = self.tokenizer(text, return_tensors="pt", truncation=truncation)
        return {**inputs, "blank": torch.tensor([[not text.strip()]])}

    def _forward(self, model_inputs: dict[str, torch.Tensor], **generate_kwargs: Any) -> dict[str, torch.Tensor]:
        blank = model_inputs.pop("blank")
        output_ids = self.model.generate(**model_inputs, **pipeline_generate_kwargs(self, generate_kwargs))
        # One row of hypotheses per input, so that the pipeline's unbatching hands each input its own.
        return {"output_ids": output_ids.reshape(len(blank), -1, output_ids.shape[-1]), "blank": blank}

    def postprocess(
        self, model_outputs: dict[str, torch.Tensor], clean_up_tokenization_spaces: bool | None = None
    ) -> list[dict[str, str]]:
        """Decode `output_ids`, `(1, num_return_sequences, output_len)`, into `[{"translation_text": str}, ...]`.

        `clean_up_tokenization_spaces` goes to the tokenizer's `batch_decode` (None: the tokenizer's own
        setting). See README.md, "Using a trained model".
        """
        texts = self.tokenizer.batch_decode(
            model_outputs["output_ids"][0],
            skip_special_tokens=True,
            clean_up_tokenization_spaces=clean_up_tokenization_spaces,
        )
        if model_outputs["blank"].item():
            texts = [""] * len(texts)
        return [{"translation_text": text} for text in texts]


def _primary_language(code: str) -> str:
    # "en", "EN", "en-US" and "en_XX" (mBART's form) name one language (BCP 47's primary subtag).
    return code.strip().replace("_", "-").split("-")[0].lower()
