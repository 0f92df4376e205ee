"""Decoding as the paper decodes (§6.1), for `VaswaniForConditionalGeneration.generate()`.

"We used beam search with a beam size of 4 and length penalty alpha = 0.6 [Wu et al., 2016]. [...]
We set the maximum output length during inference to input length + 50, but terminate early when
possible." This module holds that decoding as `VaswaniGenerationMixin`, which the model class
inherits (as transformers' Whisper inherits `WhisperGenerationMixin`): the paper's generation
config, the GNMT length penalty, the per-sentence length limit, and a beam search that gives
transformers' hypotheses with less work per step, with the key/value cache it needs, and, given terms that
translations must contain (`glossary_ids`), constrained beam search. Everything else (greedy search, sampling,
per-step scores, streaming) is transformers' `GenerationMixin`.

The state of one `generate()` call lives in that call's generation config and arguments, never
on the model: one model serves many threads at once.
"""

import copy
import math
import numbers

import torch
from transformers import GenerationConfig, GenerationMixin
from transformers.cache_utils import EncoderDecoderCache
from transformers.generation import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteriaList,
)
from transformers.generation.utils import GenerateOutput

from .beam_search_vaswani import BeamSearch, beam_search, plain_beam_search
from .compat_vaswani import default_length_penalty, prepare_generation_config
from .configuration_vaswani import VaswaniConfig
from .constraints_vaswani import ConstrainedBeamSearch, LexicalConstraints

# The paper's settings (§6.1) ----------------------------------------------------------------------


# "beam search with a beam size of 4 and length penalty alpha = 0.6" (§6.1).
PAPER_NUM_BEAMS = 4
PAPER_LENGTH_PENALTY = 0.6
# "input length + 50" (§6.1): the output's length limit beyond the source's, in tokens.
PAPER_MAX_LENGTH_B = 50


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
        num_beams=PAPER_NUM_BEAMS,
        length_penalty=PAPER_LENGTH_PENALTY,
        length_penalty_type="gnmt",
        early_stopping=True,
        max_new_tokens=256,
        max_length_a=1.0,
        max_length_b=PAPER_MAX_LENGTH_B,
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


def check_num_beams(num_beams: int | None) -> int | None:
    """`num_beams`, the beam size (§6.1: 4), if it is None (the generation config's) or an integer of at least 1.

    Raises:
        ValueError: `num_beams` is below 1 or no integer.
    """
    if num_beams is not None and (_not_a(numbers.Integral, num_beams) or num_beams < 1):
        raise ValueError(f"num_beams must be at least 1 (1 is greedy search), got {num_beams!r}.")
    return num_beams


def check_length_penalty(alpha: float) -> float:
    """`alpha`, the length penalty's strength (§6.1), if it is a finite number.

    Raises:
        ValueError: `alpha` is NaN, infinite (every penalised score would be NaN or 0) or no number (a string).
    """
    if _not_a(numbers.Real, alpha) or not math.isfinite(alpha):
        raise ValueError(f"length_penalty must be a finite number such as 0.6, got {alpha!r}.")
    return alpha


def check_length_penalty_type(penalty_type: str) -> str:
    """`penalty_type`, the length penalty's form, if it is "gnmt" (the paper's, §6.1) or "hf" (transformers').

    Raises:
        ValueError: it is neither.
    """
    if penalty_type not in ("gnmt", "hf"):
        raise ValueError(f"length_penalty_type must be 'gnmt' (the paper's) or 'hf', got {penalty_type!r}.")
    return penalty_type


def check_generation_config(config: GenerationConfig) -> None:
    """Refuse a generation config whose decoding values `generate()` would refuse, or fail on.

    What transformers checks itself (`max_new_tokens` above 0, ...) it checks when the config is made; these are
    the paper's fields (§6.1) and the ones transformers does not check.

    Raises:
        ValueError: `num_beams` (see `check_num_beams`), `length_penalty` (`check_length_penalty`),
            `length_penalty_type` (`check_length_penalty_type`), or `max_length_a` or `max_length_b` (numbers of at
            least 0, or unset) is wrong; the message names the field and the values it takes.
    """
    check_num_beams(config.num_beams)
    if config.length_penalty is not None:
        check_length_penalty(config.length_penalty)
    if (penalty_type := getattr(config, "length_penalty_type", None)) is not None:
        check_length_penalty_type(penalty_type)
    for name in ("max_length_a", "max_length_b"):
        value = getattr(config, name, None)
        if value is not None and (_not_a(numbers.Real, value) or not 0 <= value < math.inf):
            raise ValueError(f"{name} must be a number of at least 0 (fairseq's max_len_a/b), got {value!r}.")


def _not_a(kind: type, value: object) -> bool:
    # JSON's true and false are ints to Python, and no count or strength.
    return isinstance(value, bool) or not isinstance(value, kind)


class GNMTLengthPenalty(float):
    """alpha, the strength of the GNMT length penalty, as a float whose powers are that penalty (§6.1).

    transformers' beam search divides a finished hypothesis' log-probability by `length ** length_penalty`.
    Given this float as `length_penalty`, `length ** GNMTLengthPenalty(alpha)` is
    `gnmt_length_penalty(length, alpha)` instead, so that transformers' loop, and `beam_search`,
    score hypotheses as the paper does with no state outside the call's generation config. In every
    other use (comparisons, arithmetic, JSON) it is the float alpha.
    """

    def __rpow__(self, length: int) -> float:
        return gnmt_length_penalty(length, float(self))

    def __repr__(self) -> str:
        return f"GNMTLengthPenalty({float(self)!r})"


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
        """The limit for the sentences left in a batch: `sentences` `(kept,)` indexes this batch.

        See docs/performance.md, "Finished sentences leave the batch".
        """
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


# transformers' generate() with the paper's decoding -----------------------------------------------


class VaswaniGenerationMixin(GenerationMixin):
    """`GenerationMixin` with the paper's length penalty and length limit (§6.1) and a faster beam search.

    Mixed into `VaswaniForConditionalGeneration`, whose forward pass and caches it drives.
    """

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        logits_processor: LogitsProcessorList | None = None,
        **kwargs,
    ) -> GenerateOutput | torch.LongTensor:
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
                `length_penalty_type`, `max_length_a`, ...), and `glossary_ids` (see below).

        Beam search that returns the sequences alone (what `translate`, the pipeline and `evaluate`
        ask for), or in a dict without per-step outputs (`return_dict_in_generate=True` alone), from the
        decoder start alone, with any `early_stopping` (the paper's True, transformers' default False, or
        "never"), runs `beam_search`, which gives HF's hypotheses faster; its dict is a
        `beam_search_vaswani.BeamSearchOutput`, with transformers' `sequences_scores` and each sequence's
        `sequences_confidence` (its tokens' mean log-probability). Anything else (per-step scores, sampling,
        a longer decoder prompt) runs HF's own loop. As in transformers, a given `generation_config` takes what it
        leaves unset from the model's, and an explicit `max_length` bounds the output even where the model's config
        sets `max_new_tokens`.

        `glossary_ids` (terminology), one list per sentence of the batch, holds the terms that sentence's
        translation must contain, each a list of target token ids (`[]` for a sentence without): beam search then
        runs as `constraints_vaswani.ConstrainedBeamSearch` (Post & Vilar 2018's dynamic beam allocation), and a
        hypothesis ends only once it holds all its sentence's terms, or at the length limit. A sentence without
        terms is decoded as without `glossary_ids`; a call whose sentences have none is that call. transformers 5
        moved its own `constraints` and `force_words_ids` to a Hub repository; this argument is per sentence.
        `glossary_suffix_ids`, the ids of the tokens that continue a word (subword pieces that no word boundary
        precedes), may not follow a term: it then stands as a whole word.

        Returns:
            What `GenerationMixin.generate` returns: `(batch * num_return_sequences, output_len)` ids,
            or a `GenerateOutput` holding them (and scores) with `return_dict_in_generate=True`.

        Raises:
            ValueError: the source is an empty batch or of length 0, `length_penalty_type` is neither "gnmt" nor
                "hf", `num_beams` is below 1, `length_penalty` is not a finite number, or `glossary_ids` is not one
                list of terms per sentence, holds a term that is empty or not of the vocabulary's ids, or comes
                with greedy search, sampling or an option that only transformers' loop serves.
        """
        source = inputs if inputs is not None else kwargs.get("input_ids")
        _refuse_an_empty_source(source)
        glossary_ids, suffix_ids = kwargs.pop("glossary_ids", None), kwargs.pop("glossary_suffix_ids", None)
        # What transformers will decode with: the given config, its unset fields and custom entries from the model's.
        config = prepare_generation_config(self, generation_config)
        passed = set(kwargs)
        num_beams = check_num_beams(kwargs.get("num_beams", config.num_beams))
        if glossary_ids is not None and (
            constraints := _lexical_constraints(
                glossary_ids, suffix_ids, source, config, kwargs, self.config.vocab_size
            )
        ):
            logits_processor = LogitsProcessorList([*(logits_processor or []), constraints])
        given = generation_config or GenerationConfig()
        prompt_len = 1 if kwargs.get("decoder_input_ids") is None else kwargs["decoder_input_ids"].shape[1]
        max_length = kwargs.pop("max_length", None) or given.max_length
        if max_length is not None and (kwargs.get("max_new_tokens") or given.max_new_tokens) is None:
            # The caller's max_length, which the model's max_new_tokens would otherwise overrule.
            kwargs["max_new_tokens"] = max_length - prompt_len
        penalty_type = kwargs.pop("length_penalty_type", getattr(config, "length_penalty_type", None)) or "hf"
        check_length_penalty_type(penalty_type)
        a = kwargs.pop("max_length_a", getattr(config, "max_length_a", None))
        b = kwargs.pop("max_length_b", getattr(config, "max_length_b", None))
        if a is not None and b is not None and source is not None:
            limit = _source_length_limit(kwargs, config, source, a, b)
            logits_processor = LogitsProcessorList([*(logits_processor or []), limit])
        if self.config.position_embedding_type == "learned":
            # Learned positions end at max_position_embeddings (Table 3, row E): stop there instead of failing in
            # the middle of a batch. The prompt takes prompt_len of them; the last generated token is never fed back.
            _cap_new_tokens(kwargs, config, self.config.max_position_embeddings + 1 - prompt_len)
        _set_length_penalty(kwargs, config, num_beams or 1, penalty_type)
        if generation_config is not None:
            generation_config = _with_what_this_call_added(generation_config, kwargs, passed)
        return super().generate(
            inputs, generation_config=generation_config, logits_processor=logits_processor, **kwargs
        )

    def adjust_generation_fn(
        self, generation_config: GenerationConfig | None, from_auto_class: bool, from_pipeline: str | None,
        pretrained_model_name_or_path: str | None, *args, **kwargs,
    ) -> None:  # fmt: skip
        """`from_pretrained`'s step that reads the model's `generation_config.json`, which is then checked.

        It failed only in `generate()`, with a TypeError for a value of the wrong type, or a message that did not
        say which file held the value.

        Raises:
            ValueError: a value of `generation_config.json` that transformers refuses (`max_new_tokens` 0, ...) or
                `check_generation_config` does; the message names the file, the field and the values it takes.
        """
        reads_the_file = generation_config is None and pretrained_model_name_or_path is not None
        try:
            super().adjust_generation_fn(
                generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path, *args, **kwargs
            )
            if reads_the_file:
                check_generation_config(self.generation_config)
        except (ValueError, TypeError) as error:  # TypeError: transformers compares a value of the wrong type
            if not reads_the_file:
                raise
            reason = " ".join(str(error).split())
            raise ValueError(
                f"{pretrained_model_name_or_path}/generation_config.json: {reason} Correct the file."
            ) from None

    def _beam_search(
        self,
        input_ids: torch.LongTensor,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        synced_gpus: bool = False,
        **model_kwargs,
    ) -> torch.LongTensor | GenerateOutput:
        # By now `generate` has merged the generation config, encoded the source once, copied it to
        # every beam and built the logits processors; only the search loop is replaced, and only for
        # the plain beam search of §6.1. Scores, attentions, sampling and the like stay with HF's loop.
        constrained = any(isinstance(p, LexicalConstraints) for p in logits_processor)
        if plain_beam_search(input_ids, generation_config, stopping_criteria, synced_gpus, model_kwargs):
            search = ConstrainedBeamSearch if constrained else BeamSearch
            return beam_search(self, input_ids, logits_processor, generation_config, search, **model_kwargs)
        if constrained:
            raise ValueError(
                "glossary_ids need this model's own beam search, which returns sequences (alone, or in a dict "
                "without per-step scores, logits, attentions or hidden states), from the decoder start, with the "
                "default cache and stopping criteria: leave out the option that asks for more."
            )
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


def _lexical_constraints(
    glossary_ids: object,
    suffix_ids: object,
    source: torch.Tensor | None,
    config: GenerationConfig,
    kwargs: dict,
    vocab_size: int,
) -> LexicalConstraints | None:
    # `generate`'s glossary_ids, checked, as the processor that carries them to `_beam_search`; None where no
    # sentence has a term (the call is then the call without them).
    if source is None:
        raise ValueError("glossary_ids need the source as input_ids (token ids), not as inputs_embeds.")
    batch = source.shape[0]
    if not isinstance(glossary_ids, (list, tuple)) or len(glossary_ids) != batch:
        got = f"{len(glossary_ids)} lists" if isinstance(glossary_ids, (list, tuple)) else repr(glossary_ids)
        raise ValueError(
            f"glossary_ids must hold one list of terms per sentence of the batch of {batch} (input_ids), [] for "
            f"a sentence without; got {got}."
        )
    eos = kwargs.get("eos_token_id", config.eos_token_id)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    for sentence, terms in enumerate(glossary_ids):
        if not isinstance(terms, (list, tuple)):
            raise ValueError(f"glossary_ids[{sentence}] = {terms!r}: give a list of terms ([] for none).")
        for number, term in enumerate(terms):
            if not (isinstance(term, (list, tuple)) and term) or not all(
                not _not_a(int, t) and 0 <= t < vocab_size and t not in eos for t in term
            ):
                raise ValueError(
                    f"glossary_ids[{sentence}][{number}] = {term!r}: a term is a non-empty list of token ids "
                    f"below the vocabulary size {vocab_size}, without </s> ({eos})."
                )
    if not any(glossary_ids):
        return None
    if suffix_ids is not None and not (
        isinstance(suffix_ids, (list, tuple)) and all(not _not_a(int, t) and 0 <= t < vocab_size for t in suffix_ids)
    ):
        raise ValueError(
            f"glossary_suffix_ids must be a list of token ids below the vocabulary size {vocab_size}; got "
            f"{suffix_ids!r:.80}."
        )
    num_beams, sampling = kwargs.get("num_beams", config.num_beams) or 1, kwargs.get("do_sample", config.do_sample)
    if num_beams < 2 or sampling:
        raise ValueError(
            "glossary_ids need beam search, with num_beams of at least 2 and no sampling; got "
            f"num_beams={num_beams} and do_sample={sampling}."
        )
    return LexicalConstraints.from_ids(
        [[list(term) for term in terms] for terms in glossary_ids], torch.tensor(eos), source.device, suffix_ids
    )


def _refuse_an_empty_source(source: torch.Tensor | None) -> None:
    # transformers fails deep inside on an empty batch or a source of length 0.
    if source is not None and source.numel() == 0:
        what = "an empty batch" if source.shape[0] == 0 else "a source of length 0"
        raise ValueError(
            f"generate() got {what} (input_ids of shape {tuple(source.shape)}): give at least one sentence, each "
            "of at least one token (the model's tokenizer ends every sentence with </s>)."
        )


def _source_length_limit(
    kwargs: dict, config: GenerationConfig, source: torch.Tensor, a: float, b: float
) -> SourceLengthLimit:
    # §6.1's input length + 50: each sentence's limit, a * its non-padding tokens + b, as a logits processor; the
    # call's max_new_tokens lowered to the longest, with room for the final </s>.
    mask = kwargs.get("attention_mask")
    pad = kwargs.get("pad_token_id", config.pad_token_id)
    source_lengths = mask.sum(-1) if mask is not None else source.ne(pad).sum(-1)
    limits = (a * source_lengths + b).long()
    eos = kwargs.get("eos_token_id", config.eos_token_id)
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos  # the first of several ends a sentence
    _cap_new_tokens(kwargs, config, int(limits.max()) + 1)
    return SourceLengthLimit(limits, eos)


def _set_length_penalty(kwargs: dict, config: GenerationConfig, num_beams: int, penalty_type: str) -> None:
    # The call's length penalty (§6.1), checked; GNMT's form travels with this call, in the alpha that its
    # generation config gets.
    if (alpha := kwargs.get("length_penalty", config.length_penalty)) is not None:
        check_length_penalty(alpha)
    if num_beams == 1:
        # Greedy search and sampling ignore the beam search's flags that the model's config sets; some
        # releases (5.4) warn about them on every call unless the call gives their neutral values.
        kwargs.setdefault("early_stopping", False)
        kwargs.setdefault("length_penalty", 1.0)
    if penalty_type == "gnmt" and num_beams > 1:  # greedy search has no use for a penalty
        if alpha is None:  # unset: transformers' default
            alpha = default_length_penalty()
        kwargs["length_penalty"] = GNMTLengthPenalty(alpha)


def _with_what_this_call_added(generation_config: GenerationConfig, kwargs: dict, passed: set) -> GenerationConfig:
    # What this call added to `kwargs` goes into a copy of the given config, where transformers asks for it, not
    # beside it.
    generation_config = copy.deepcopy(generation_config)
    for key in (added := kwargs.keys() - passed):
        setattr(generation_config, key, kwargs.pop(key))
    if "max_new_tokens" in added:  # it holds the config's max_length now, which would only clash with it
        generation_config.max_length = None
    return generation_config


def _cap_new_tokens(kwargs: dict, config: GenerationConfig, cap: int) -> None:
    # Lower this call's limit on new tokens to `cap`, never raise it: the limit is the call's
    # max_new_tokens, else the config's, else what the config's max_length leaves after the prompt.
    current = kwargs["max_new_tokens"] if kwargs.get("max_new_tokens") is not None else config.max_new_tokens
    if current is None and config.max_length is not None:
        prompt = kwargs.get("decoder_input_ids")
        current = config.max_length - (1 if prompt is None else prompt.shape[1])
    kwargs["max_new_tokens"] = cap if current is None else min(cap, current)
