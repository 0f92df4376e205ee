"""What differs between transformers releases: the one place the model asks about them.

Saved models carry this file beside `modeling_vaswani.py` (remote code), so a model downloaded from
the Hub runs on whatever transformers its user has. Everything here is detected from the running
release (a signature, a dataclass field), not from its version string, except the range check
itself: docs/compatibility.md lists each name and why it is taken from transformers.

Importing this module checks the running transformers against the supported range and stops with
one line (an `ImportError` naming the range, the installed release and the `pip` command) outside it:
a release the model has not been tested on may decode wrong without an error, the worst failure a
translator can have.
"""

import dataclasses
import inspect
from typing import Any

import transformers
from packaging.version import Version

# The oldest release the whole suite passes on, and the next major release, whose renames are not known yet.
MINIMUM_TRANSFORMERS = "5.20.0"
BELOW_TRANSFORMERS = "6"
SUPPORTED_TRANSFORMERS = f">={MINIMUM_TRANSFORMERS},<{BELOW_TRANSFORMERS}"


def check_transformers_version(version: str) -> None:
    """Refuse a transformers release outside `SUPPORTED_TRANSFORMERS`.

    Args:
        version: a release string, such as `transformers.__version__`.

    Raises:
        ImportError: `version` lies outside the range; the message names it and the `pip` command to fix it.
    """
    if not Version(MINIMUM_TRANSFORMERS) <= Version(version) < Version(BELOW_TRANSFORMERS):
        raise ImportError(
            f"This Vaswani Transformer model needs transformers{SUPPORTED_TRANSFORMERS}, and this environment has "
            f"{version}: run `pip install -U 'transformers{SUPPORTED_TRANSFORMERS}'`."
        )


check_transformers_version(transformers.__version__)

# Names taken from modules transformers does not publish in its documentation (docs/compatibility.md).
from transformers.cache_utils import Cache  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402
from transformers.modeling_outputs import Seq2SeqLMOutput  # noqa: E402
from transformers.models.marian.modeling_marian import shift_tokens_right  # noqa: E402, F401
from transformers.tokenization_utils_base import VERY_LARGE_INTEGER  # noqa: E402, F401
from transformers.utils import TransformersKwargs  # noqa: E402
from transformers.utils.generic import merge_with_config_defaults  # noqa: E402, F401
from transformers.utils.output_capturing import OutputRecorder, capture_outputs  # noqa: E402, F401

# The key/value cache (§3.2.3's keys and values of earlier positions) ------------------------------

# transformers 5.24 renamed `past_key_values` to `cache` in what `generate()` passes to `forward`, in its
# model kwargs and in the output dataclasses' fields; 5.23 and older use `past_key_values`.
CACHE_NAME = "cache" if "cache" in {field.name for field in dataclasses.fields(Seq2SeqLMOutput)} else "past_key_values"
_MASK_CACHE_NAME = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
# Names under which a cache has travelled in some release: never accepted and then dropped in silence.
_CACHE_LIKE = ("cache", "past", "mems")


def one_cache(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    """The cache a `forward` got under either name: `cache` (transformers >= 5.24) or `past_key_values` (older).

    Raises:
        TypeError: both are given.
    """
    if cache is not None and past_key_values is not None:
        raise TypeError("Pass the key/value cache as `cache` or as `past_key_values`, not both.")
    return cache if cache is not None else past_key_values


def cache_length(cache: Cache) -> int:
    """The positions a cache holds: `Cache.get_seq_length()`, a tensor for static caches in some releases (5.4)."""
    return int(cache.get_seq_length())


def cache_field(cache: Cache | None) -> dict[str, Cache | None]:
    """Keyword arguments that put `cache` into an output dataclass under the running release's field name."""
    return {CACHE_NAME: cache}


def cache_of(outputs: Any) -> Cache | None:
    """The cache an output dataclass (or the model kwargs of `generate()`, a dict) holds, whatever its name."""
    return outputs.get(CACHE_NAME) if isinstance(outputs, dict) else getattr(outputs, CACHE_NAME, None)


def make_causal_mask(config: Any, inputs_embeds: Any, attention_mask: Any, cache: Cache | None) -> Any:
    """`transformers.masking_utils.create_causal_mask`, given the cache under the name the running release takes."""
    return create_causal_mask(
        config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, **{_MASK_CACHE_NAME: cache}
    )


# Keyword arguments --------------------------------------------------------------------------------

# What transformers may pass through a model's `**kwargs`, as the running release declares it, and what its
# decorators add (`merge_with_config_defaults` puts the config's `use_cache` into every forward it wraps).
_DECORATOR_KWARGS = {"output_attentions", "output_hidden_states", "return_dict", "use_cache"}
FORWARD_KWARGS = frozenset(TransformersKwargs.__annotations__) | _DECORATOR_KWARGS


def check_forward_kwargs(kwargs: dict[str, Any], where: str, *, encoder: bool = False) -> None:
    """Refuse keyword arguments a `forward` would pass on to nobody.

    A release that renames an argument (as 5.24 renamed the cache) must fail in every test, not decode
    every step from the last token alone.

    Args:
        kwargs: the `**kwargs` a `forward` received.
        where: the class whose `forward` got them, for the message.
        encoder: `generate()` hands an encoder every input it was given but the decoder's and the cache
            (`labels` from the Trainer, say), which the encoder rightly ignores: refuse only cache-like names.

    Raises:
        TypeError: some names are neither arguments of `forward` nor ones transformers declares
            (`TransformersKwargs`); the message names them, cache-like ones first, and where one is cache-like the
            names under which the cache is taken. It names no culprit: the caller may be the user's code, a library
            (PEFT, a Trainer) or transformers, which this function cannot tell apart.
    """
    unknown = sorted(set(kwargs) - FORWARD_KWARGS, key=lambda name: (not _cache_like(name), name))
    if encoder:
        unknown = [name for name in unknown if _cache_like(name)]
    if unknown:
        cache_hint = "; it takes the key/value cache as `cache` or `past_key_values`" if _cache_like(unknown[0]) else ""
        raise TypeError(
            f"{where}.forward() does not take the keyword argument{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(f'`{name}`' for name in unknown)}{cache_hint}: leave "
            f"{'them' if len(unknown) > 1 else 'it'} out of the call."
        )


def _cache_like(name: str) -> bool:
    return any(part in name for part in _CACHE_LIKE)


# Generation ---------------------------------------------------------------------------------------


def prepare_generation_config(model: Any, generation_config: Any) -> Any:
    """The generation config `generate()` will decode with: the given one, its unset fields from the model's.

    `GenerationMixin._prepare_generation_config`, which returns `(config, model_kwargs)` in every 5.x release.
    """
    return model._prepare_generation_config(generation_config)[0]


def default_length_penalty() -> float:
    """transformers' default `length_penalty` (1.0 in every 5.x release), for a config that leaves it unset."""
    return transformers.GenerationConfig._get_default_generation_params()["length_penalty"]


def pipeline_generate_kwargs(pipeline: Any, generate_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The `generate()` keyword arguments of one call of a `Pipeline` (the translation pipeline's `_forward`).

    transformers 5.20 and later merge the call's generation parameters over the pipeline's in
    `Pipeline._prepare_generate_kwargs`; earlier releases pass the pipeline's `generation_config` unless the
    call gives one, as their text-to-text pipelines did.
    """
    if hasattr(pipeline, "_prepare_generate_kwargs"):
        return pipeline._prepare_generate_kwargs(generate_kwargs)
    if "generation_config" in generate_kwargs:
        return generate_kwargs
    return {**generate_kwargs, "generation_config": pipeline.generation_config}
