"""Decoding as the paper decodes (§6.1), for `VaswaniForConditionalGeneration.generate()`.

"We used beam search with a beam size of 4 and length penalty alpha = 0.6 [Wu et al., 2016]. [...]
We set the maximum output length during inference to input length + 50, but terminate early when
possible." This module holds that decoding as `VaswaniGenerationMixin`, which the model class
inherits (as transformers' Whisper inherits `WhisperGenerationMixin`): the paper's generation
config, the GNMT length penalty, the per-sentence length limit, and a beam search that gives
transformers' hypotheses with less work per step, with the key/value cache it needs. Everything
else (greedy search, sampling, scores, streaming) is transformers' `GenerationMixin`.

The state of one `generate()` call lives in that call's generation config and arguments, never
on the model: one model serves many threads at once.
"""

import copy
import math
import numbers

import torch
from torch import Tensor
from transformers import GenerationConfig, GenerationMixin
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache
from transformers.generation import (
    EosTokenCriteria,
    LogitsProcessor,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
    logits_process,
)
from transformers.generation.utils import GenerateOutput
from transformers.modeling_outputs import BaseModelOutput

from .compat_vaswani import cache_of, default_length_penalty, prepare_generation_config
from .configuration_vaswani import VaswaniConfig

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
                `length_penalty_type`, `max_length_a`, ...).

        Beam search that returns only the sequences (what `translate`, the pipeline and `evaluate`
        ask for), from the decoder start alone, with any `early_stopping` (the paper's True,
        transformers' default False, or "never"), runs `beam_search`, which gives HF's hypotheses
        faster; anything else (scores, sampling, constraints, a longer decoder prompt) runs HF's own
        loop. As in transformers, a given `generation_config` takes what it leaves unset from the
        model's, and an explicit `max_length` bounds the output even where the model's config sets
        `max_new_tokens`.

        Returns:
            What `GenerationMixin.generate` returns: `(batch * num_return_sequences, output_len)` ids,
            or a `GenerateOutput` holding them (and scores) with `return_dict_in_generate=True`.

        Raises:
            ValueError: the source is an empty batch or of length 0, `length_penalty_type` is neither "gnmt" nor
                "hf", `num_beams` is below 1, or `length_penalty` is not a finite number.
        """
        source = inputs if inputs is not None else kwargs.get("input_ids")
        if source is not None and source.numel() == 0:  # transformers fails deep inside on either
            what = "an empty batch" if source.shape[0] == 0 else "a source of length 0"
            raise ValueError(
                f"generate() got {what} (input_ids of shape {tuple(source.shape)}): give at least one sentence, each "
                "of at least one token (the model's tokenizer ends every sentence with </s>)."
            )
        # What transformers will decode with: the given config, its unset fields and custom entries from the model's.
        config = prepare_generation_config(self, generation_config)
        passed = set(kwargs)
        num_beams = check_num_beams(kwargs.get("num_beams", config.num_beams))
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
            mask = kwargs.get("attention_mask")
            pad = kwargs.get("pad_token_id", config.pad_token_id)
            source_lengths = mask.sum(-1) if mask is not None else source.ne(pad).sum(-1)
            limits = (a * source_lengths + b).long()
            eos = kwargs.get("eos_token_id", config.eos_token_id)
            eos = eos[0] if isinstance(eos, (list, tuple)) else eos  # the first of several ends a sentence
            logits_processor = LogitsProcessorList([*(logits_processor or []), SourceLengthLimit(limits, eos)])
            _cap_new_tokens(kwargs, config, int(limits.max()) + 1)  # room for the final </s>
        if self.config.position_embedding_type == "learned":
            # Learned positions end at max_position_embeddings (Table 3, row E): stop there instead of failing in
            # the middle of a batch. The prompt takes prompt_len of them; the last generated token is never fed back.
            _cap_new_tokens(kwargs, config, self.config.max_position_embeddings + 1 - prompt_len)
        if (alpha := kwargs.get("length_penalty", config.length_penalty)) is not None:
            check_length_penalty(alpha)
        if (num_beams or 1) == 1:
            # Greedy search and sampling ignore the beam search's flags that the model's config sets; some
            # releases (5.4) warn about them on every call unless the call gives their neutral values.
            kwargs.setdefault("early_stopping", False)
            kwargs.setdefault("length_penalty", 1.0)
        if penalty_type == "gnmt" and (num_beams or 1) > 1:  # greedy search has no use for a penalty
            # The penalty's form travels with this call, in the alpha that its generation config gets.
            if alpha is None:  # unset: transformers' default
                alpha = default_length_penalty()
            kwargs["length_penalty"] = GNMTLengthPenalty(alpha)
        if generation_config is not None:  # what this call added goes into a copy of the given config, where
            generation_config = copy.deepcopy(generation_config)  # transformers asks for it, not beside it
            for key in (added := kwargs.keys() - passed):
                setattr(generation_config, key, kwargs.pop(key))
            if "max_new_tokens" in added:  # it holds the config's max_length now, which would only clash with it
                generation_config.max_length = None
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
    ) -> torch.LongTensor:
        # By now `generate` has merged the generation config, encoded the source once, copied it to
        # every beam and built the logits processors; only the search loop is replaced, and only for
        # the plain beam search of §6.1. Scores, attentions, sampling and the like stay with HF's loop.
        if _plain_beam_search(input_ids, generation_config, stopping_criteria, synced_gpus, model_kwargs):
            return beam_search(self, input_ids, logits_processor, generation_config, **model_kwargs)
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


def _cap_new_tokens(kwargs: dict, config: GenerationConfig, cap: int) -> None:
    # Lower this call's limit on new tokens to `cap`, never raise it: the limit is the call's
    # max_new_tokens, else the config's, else what the config's max_length leaves after the prompt.
    current = kwargs["max_new_tokens"] if kwargs.get("max_new_tokens") is not None else config.max_new_tokens
    if current is None and config.max_length is not None:
        prompt = kwargs.get("decoder_input_ids")
        current = config.max_length - (1 if prompt is None else prompt.shape[1])
    kwargs["max_new_tokens"] = cap if current is None else min(cap, current)


# The fast beam search and its cache ---------------------------------------------------------------


def _default_criterion(criterion: StoppingCriteria, config: GenerationConfig) -> bool:
    # `beam_search` stops at the config's max_length and </s>; a user's criterion of the same kind
    # replaces transformers' own, and is then honoured only by HF's loop.
    if isinstance(criterion, MaxLengthCriteria):
        return criterion.max_length == config.max_length
    if isinstance(criterion, EosTokenCriteria):
        ours = torch.as_tensor(criterion.eos_token_id).view(-1).cpu()
        return torch.equal(ours, config._eos_token_tensor.view(-1).cpu())
    return False


def _plain_beam_search(
    input_ids: torch.Tensor,
    generation_config: GenerationConfig,
    stopping_criteria: StoppingCriteriaList,
    synced_gpus: bool,
    model_kwargs: dict,
) -> bool:
    # What `beam_search` does exactly as HF's loop does: deterministic search that stops a sentence as
    # `early_stopping` says, ends on </s> or the length limit, returns only sequences.
    config, cache = generation_config, cache_of(model_kwargs)
    return (
        input_ids.shape[1] == 1 < config.max_length  # the decoder start alone: a prompt needs its keys and values first
        and not config.do_sample
        and not config.low_memory  # transformers' loop refuses it
        and config.early_stopping in (True, False, "never")
        and not config.return_dict_in_generate
        and config._eos_token_tensor is not None
        and not synced_gpus
        and all(_default_criterion(c, config) for c in stopping_criteria)
        and isinstance(cache, EncoderDecoderCache)
        # `beam_search` replaces the self-attention cache and fills the cross-attention one: both must be
        # empty, and the first the default dynamic cache (not a static or offloaded one the user asked for).
        and type(cache.self_attention_cache) is DynamicCache
        and not cache.self_attention_cache.offloading
        and cache.self_attention_cache.get_seq_length() == 0
        and cache.cross_attention_cache.get_seq_length() == 0
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
# min_new_tokens and suppress_tokens, more than the output projection in beam search over a small
# model on the CPU (docs/performance.md, "Beam search"; the paper's configuration has only suppress_tokens).
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
    CPU, `torch.topk` costs several passes over such a row, which with a small model rivals the output
    projection (docs/performance.md, "Beam search"). The k largest scores lie in the k chunks with the largest
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
    buffers laid out `(batch, heads, capacity * num_beams, d_k)`, position-major, which grow to twice the
    length needed when full. `keys` and `values` are `(batch, heads, length * num_beams, d_k)` views of them, every slot
    of every position of a sentence, to which its beams attend as one query sequence, each masked to its
    own ancestors by `BeamSearchCache.mask`. Reordering the beams thus moves no keys or values, where
    gathering the surviving beams' copies after every step would read and write the whole cache
    (docs/performance.md, "Beam search"). They are copied only when the buffers grow
    and when sentences leave the batch. Made for `BeamSearchCache`, which appends and drops sentences:
    reordering, cropping and repeating rows, and building masks from the layer, raise NotImplementedError.
    """

    is_croppable = False

    def __init__(self, num_beams: int) -> None:
        super().__init__()
        self.num_beams = num_beams

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate buffers for 32 positions, shaped after the first `(batch, heads, beams, d_k)` keys and values.

        See docs/performance.md, "The beam-search cache".
        """
        self.dtype, self.device = key_states.dtype, key_states.device
        self.length = 0
        self._buffers = tuple(self._allocate(states, capacity=32) for states in (key_states, value_states))
        self.is_initialized = True

    def _allocate(self, states: torch.Tensor, capacity: int) -> torch.Tensor:
        # states: `(batch, heads, ..., d)`, giving the batch, heads and d of the new buffer
        return states.new_empty(states.shape[0], states.shape[1], capacity * self.num_beams, states.shape[-1])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one position, `(batch, heads, num_beams, d_k)` keys and values (one per slot, or one for all).

        Returns:
            All keys and values, `(batch, heads, length * num_beams, d_k)`, position-major.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length * self.num_beams, (self.length + 1) * self.num_beams
        if end > self._buffers[0].shape[2]:
            grown = tuple(self._allocate(buffer, capacity=2 * self.length) for buffer in self._buffers)
            for new, old in zip(grown, self._buffers, strict=True):
                new[:, :, :start] = old
            self._buffers = grown
        for buffer, states in zip(self._buffers, (key_states, value_states), strict=True):
            buffer[:, :, start:end] = states
        self.length += 1
        self.keys, self.values = (buffer[:, :, :end] for buffer in self._buffers)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Positions held, not slots: `keys` has `num_beams` slots per position (docs/performance.md)."""
        return self.length if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sentences `indices` `(new_batch,)`, in that order.

        See docs/performance.md, "Finished sentences leave the batch".
        """
        if self.is_initialized:
            indices = indices.to(self.device)
            self._buffers = tuple(buffer.index_select(0, indices) for buffer in self._buffers)
            self.keys, self.values = (buffer[:, :, : self.length * self.num_beams] for buffer in self._buffers)

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
        """Sentences still in the batch (docs/performance.md, "Finished sentences leave the batch")."""
        return self.ancestry.shape[0]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one position to layer `layer_idx`: `(batch, heads, beams, d_k)` keys and values.

        See docs/performance.md, "The beam-search cache".

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

        See docs/performance.md, "The beam-search cache".
        """
        batch, beams, length = self.ancestry.shape
        sentences = beam_idx[:: self.num_beams] // beams
        if sentences.shape[0] != batch:
            for layer in self.layers:
                layer.batch_select_indices(sentences)
        self.ancestry = self.ancestry.view(batch * beams, length)[beam_idx].view(-1, self.num_beams, length)

    reset = crop = batch_repeat_interleave = batch_select_indices = _beam_search_cache_unsupported


class FinishedHypotheses:
    """The best num_beams finished hypotheses of every sentence of a batch, best first (§6.1).

    Args:
        batch: sentences.
        num_beams: hypotheses kept per sentence.
        max_length: tokens per hypothesis, the decoder prompt included.
        fill: the id after a hypothesis' `</s>`.
        device: where the hypotheses are kept.
    """

    def __init__(self, batch: int, num_beams: int, max_length: int, fill: int, device: torch.device) -> None:
        self.sequences = torch.full((batch, num_beams, max_length), fill, dtype=torch.long, device=device)
        self.scores = torch.full((batch, num_beams), -1.0e9, device=device)
        self.lengths = torch.zeros(batch, num_beams, dtype=torch.long, device=device)
        self.is_finished = torch.zeros(batch, num_beams, dtype=torch.bool, device=device)

    def done(self, sentences: torch.Tensor) -> torch.Tensor:
        """Whether each of `sentences` `(n,)` has num_beams finished hypotheses (§6.1): `(n,)` bool."""
        return self.is_finished[sentences].all(dim=1)

    def add(
        self,
        sentences: torch.Tensor,
        sequences: torch.Tensor,
        scores: torch.Tensor,
        generated: int,
        ended: torch.Tensor,
    ) -> None:
        """Merge the hypotheses that `ended`, keeping the best num_beams of each sentence (§6.1).

        Args:
            sentences: `(n,)` the sentences' indices in the batch.
            sequences: `(n, num_beams, max_length)` candidate hypotheses.
            scores: `(n, num_beams)` their penalised scores.
            generated: tokens they generated, `</s>` included.
            ended: `(n, num_beams)` which of them ended (the others are left out).
        """
        rows = torch.arange(len(sentences), device=sentences.device)[:, None]
        scores = scores - 1.0e9 * ~ended
        merged_scores, best = torch.cat((self.scores[sentences], scores), dim=1).topk(scores.shape[1])
        self.sequences[sentences] = torch.cat((self.sequences[sentences], sequences), dim=1)[rows, best]
        lengths = self.lengths.new_full(scores.shape, generated)
        self.lengths[sentences] = torch.cat((self.lengths[sentences], lengths), dim=1).gather(1, best)
        self.is_finished[sentences] = torch.cat((self.is_finished[sentences], ended), dim=1).gather(1, best)
        self.scores[sentences] = merged_scores

    def best(self, count: int, prompt_len: int) -> torch.LongTensor:
        """The `count` best of each sentence, `(batch * count, output_len)`, padded to the longest of them (§6.1)."""
        output_length = prompt_len + int(self.lengths[:, :count].max())
        return self.sequences[:, :count, :output_length].reshape(-1, output_length)


class BeamSearch:
    """Beam search with a key/value cache, stopping each sentence as `early_stopping` says (§6.1).

    `run()` chooses the candidates that `GenerationMixin._beam_search` chooses, with less work per step
    (docs/performance.md, "Beam search"): the first step decodes one row per sentence, not num_beams identical ones;
    the beams of a sentence share one copy of its encoder output and of the cross-attention keys and values; a
    sentence that is done (see below) leaves the batch (its rows of the caches, the encoder output and the
    mask go); the self-attention keys and values stay where they were written, each beam attending to its ancestors'
    (`BeamSearchCache`); token masks among the logits processors fill the columns they forbid; a candidate's
    sequence is built only when it ends, and finished hypotheses are merged only on steps where some end. A
    hypothesis Y that ends scores log P(Y|X) / |Y| ** length_penalty, |Y| counting the generated tokens with `</s>`:
    transformers' penalty, or the paper's when `length_penalty` is a `GNMTLengthPenalty`. A sentence is done, as in
    HF's loop, once it has num_beams finished hypotheses (`early_stopping=True`, the paper's "terminate early when
    possible") and, with False or "never", once its best running beam, penalised at the current length (at the
    length limit for "never" with a positive penalty), can no longer beat the worst of them; a done sentence takes
    no more hypotheses. Sentences stay in the batch, and the first step runs every row, as in HF's loop, when a
    logits processor keeps state per sentence that this function cannot narrow.

    Args:
        model: gives the forward pass and the cache reordering.
        input_ids: `(batch * num_beams, prompt_len)` decoder prompt, the decoder start token in each row.
        logits_processor: applied to the log-probabilities of every step, as HF's loop applies them.
        generation_config: gives `num_beams`, `length_penalty` (alpha, a float or a `GNMTLengthPenalty`),
            `early_stopping`, `max_length` (prompt included), `num_return_sequences` and the `</s>` and
            `<pad>` ids.
        **model_kwargs: `encoder_outputs` and `attention_mask` expanded to the beams, and
            the cache (`cache`, or `past_key_values` before transformers 5.24), an empty
            `EncoderDecoderCache` whose cross-attention cache is used, as `generate` prepares them.

    `run()` returns `(batch * num_return_sequences, output_len)` token ids, the best hypotheses first,
    padded after `</s>` to the longest one returned.
    """

    def __init__(
        self,
        model: VaswaniGenerationMixin,
        input_ids: torch.LongTensor,
        logits_processor: LogitsProcessorList,
        generation_config: GenerationConfig,
        **model_kwargs,
    ) -> None:
        config = generation_config
        self.model, self.num_beams, self.length_penalty = model, config.num_beams, config.length_penalty
        self.max_length, self.num_return_sequences = config.max_length, config.num_return_sequences
        self.early_stopping, self.eos = config.early_stopping, config._eos_token_tensor
        rows, self.prompt_len = input_ids.shape
        batch, device = rows // self.num_beams, input_ids.device
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)  # no better hypothesis to expect
        # Keep enough candidates that num_beams survive even if every end-of-sentence token is among them.
        self.num_candidates = max(2, 1 + self.eos.numel()) * self.num_beams
        self.can_drop = all(isinstance(p, (*_ROW_WISE_PROCESSORS, SourceLengthLimit)) for p in logits_processor)
        self.token_masks, self.logits_processor = _hoist_token_masks(logits_processor)
        fill = int(config._pad_token_tensor or self.eos[0])  # as HF fills, a pad id of 0 included
        self.finished = FinishedHypotheses(batch, self.num_beams, self.max_length, fill, device)

        # The running beams of the sentences still in the batch (`active`, by their index in the batch).
        # All beams of a sentence start alike. Where every processor reads each row alone, the first step
        # runs one row per sentence, whose best continuations become its beams; otherwise it runs them all,
        # and only the first of each sentence may expand.
        self.active = torch.arange(batch, device=device)
        first_rows = input_ids[:: self.num_beams] if self.can_drop else input_ids
        self.sequences = input_ids.new_full((first_rows.shape[0], self.max_length), fill)
        self.sequences[:, : self.prompt_len] = first_rows
        rows_per_sentence = first_rows.shape[0] // batch
        self.scores = torch.zeros(batch, rows_per_sentence, device=device)
        self.scores[:, 1:] = -1.0e9
        layers = model.config.decoder_layers
        self_attention = BeamSearchCache(layers, batch, self.num_beams, rows_per_sentence, device)
        self.cache = EncoderDecoderCache(self_attention, cache_of(model_kwargs).cross_attention_cache)
        # `generate` copied the encoder output to every beam; all beams of a sentence attend to the same,
        # so the decoder gets one row per sentence, and its keys and values are computed once.
        self.encoder_states = model_kwargs["encoder_outputs"].last_hidden_state[:: self.num_beams]
        attention_mask = model_kwargs.get("attention_mask")
        self.attention_mask = attention_mask[:: self.num_beams] if attention_mask is not None else None
        # The encoder-decoder attention mask of num_beams rows a sentence: built once, again only when sentences leave.
        self.encoder_mask: torch.Tensor | None = None

    def run(self) -> torch.LongTensor:
        """Search until every sentence has num_beams finished hypotheses or the length limit is reached (§6.1)."""
        for length in range(self.prompt_len, self.max_length):
            scores, rows, tokens = self._candidates(length)
            ends = torch.isin(tokens, self.eos) | (length + 1 >= self.max_length)
            done = self._finish(length, scores, rows, tokens, ends)
            if bool(done.all()) or length + 1 >= self.max_length:
                break
            self._advance(length, done, scores, rows, tokens, ends)
        return self.finished.best(self.num_return_sequences, self.prompt_len)

    def _log_probs(self, length: int) -> torch.Tensor:
        # The next token's log-probabilities of every running beam, `(rows, vocab)`, processed.
        attention_mask = self.attention_mask
        if attention_mask is not None and self.scores.shape[1] == self.num_beams:
            if self.encoder_mask is None:
                decoder = self.model.get_decoder()
                self.encoder_mask = decoder.cross_attention_mask(self.num_beams, self.encoder_states, attention_mask)
            attention_mask = self.encoder_mask
        logits = self.model(
            decoder_input_ids=self.sequences[:, length - 1 : length],
            encoder_outputs=BaseModelOutput(last_hidden_state=self.encoder_states),
            attention_mask=attention_mask,
            cache=self.cache,
            use_cache=True,
        ).logits[:, -1]
        log_probs = logits.float().log_softmax(dim=-1)
        if self.token_masks:
            # A handful of forbidden tokens: filling their columns spares a pass over all the scores.
            mask = self.token_masks(self.sequences[:1, :length], log_probs.new_zeros(1, log_probs.shape[-1]))[0]
            log_probs.index_fill_(1, (mask == float("-inf")).nonzero().squeeze(1), float("-inf"))
        return self.logits_processor(self.sequences[:, :length], log_probs)

    def _candidates(self, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The best continuations of each sentence: scores, the running rows they extend and their tokens,
        # each `(sentences, num_candidates)`, best first.
        log_probs = self._log_probs(length)
        sentences, (beams, vocab_size) = len(self.active), (self.scores.shape[1], log_probs.shape[-1])
        # reshape: a processor may return a strided view, which `view` cannot regroup (RepetitionPenaltyLogitsProcessor)
        candidates = log_probs.reshape(sentences, beams, vocab_size).add_(self.scores[..., None]).reshape(sentences, -1)
        scores, ids = top_k(candidates, min(self.num_candidates, candidates.shape[1]))
        sentence_rows = torch.arange(sentences, device=ids.device)[:, None]
        return scores, ids // vocab_size + sentence_rows * beams, ids % vocab_size

    def _finish(self, length: int, scores: Tensor, rows: Tensor, tokens: Tensor, ends: Tensor) -> Tensor:
        # A candidate among the best num_beams that ends joins its sentence's finished hypotheses, of which
        # the best num_beams are kept, until the sentence is done. Returns which are done.
        k, generated = self.num_beams, length + 1 - self.prompt_len
        just_finished = ends[:, :k] & ~self.done[self.active, None]
        if just_finished.any():
            hypotheses = self.sequences[rows[:, :k]]
            hypotheses[..., length] = tokens[:, :k]
            penalised = scores[:, :k] / generated**self.length_penalty
            self.finished.add(self.active, hypotheses, penalised, generated, just_finished)
        full = self.finished.done(self.active)
        if self.early_stopping is not True:  # HF's `_check_early_stop_heuristic`
            longest = self.early_stopping == "never" and self.length_penalty > 0.0
            best_length = self.max_length - self.prompt_len if longest else generated
            best_running = (scores - 1.0e9 * ends).max(dim=1).values / best_length**self.length_penalty
            full &= best_running <= self.finished.scores[self.active].min(dim=1).values
        self.done[self.active] |= full
        return self.done[self.active]

    def _advance(self, length: int, done: Tensor, scores: Tensor, rows: Tensor, tokens: Tensor, ends: Tensor) -> None:
        # The best num_beams candidates that go on become the beams of the next step; sentences that are
        # done leave the batch where every processor allows it.
        running = (scores - 1.0e9 * ends).topk(self.num_beams).indices
        self.scores = scores.gather(1, running) - 1.0e9 * ends.gather(1, running)
        rows, tokens = rows.gather(1, running), tokens.gather(1, running)
        if self.can_drop and bool(done.any()):
            kept = (~done).nonzero().squeeze(1)
            self.active, self.scores, rows, tokens = self.active[kept], self.scores[kept], rows[kept], tokens[kept]
            self.encoder_states = self.encoder_states[kept]
            self.attention_mask = self.attention_mask[kept] if self.attention_mask is not None else None
            self.encoder_mask = None
            self.cache.cross_attention_cache.reorder_cache(kept)  # the self-attention cache finds `kept` in rows
            self.logits_processor = LogitsProcessorList(
                p.select(kept) if isinstance(p, SourceLengthLimit) else p for p in self.logits_processor
            )
        self.sequences = self.sequences[rows.view(-1)]
        self.sequences[:, length] = tokens.view(-1)
        self.cache = self.model._reorder_cache(self.cache, rows.view(-1))


def beam_search(
    model: VaswaniGenerationMixin,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    generation_config: GenerationConfig,
    **model_kwargs,
) -> torch.LongTensor:
    """`BeamSearch(model, input_ids, logits_processor, generation_config, **model_kwargs).run()` (§6.1), in
    inference mode: no version counters or views kept for a step's hundreds of operators (docs/performance.md).

    Returns:
        `(batch * num_return_sequences, output_len)` token ids, best first (inference tensors only in inference mode).
    """
    with torch.inference_mode():
        sequences = BeamSearch(model, input_ids, logits_processor, generation_config, **model_kwargs).run()
    return sequences.clone()
