"""The beam search of §6.1 ("beam search with a beam size of 4"), faster than transformers' own loop.

`generation_vaswani.VaswaniGenerationMixin._beam_search` hands it the plain beam search that translation asks for
(sequences only, from the decoder start); it gives transformers' hypotheses with less work per
step: one decoder row per sentence at the first step, the cache of `cache_vaswani`, token masks
applied once, and finished sentences leaving the batch. Everything else stays with transformers' loop.

`constraints_vaswani.ConstrainedBeamSearch` is the same search with lexical constraints (terms every translation of a
sentence must contain).
"""

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.generation import (
    EosTokenCriteria,
    GenerateBeamEncoderDecoderOutput,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
    logits_process,
)
from transformers.modeling_outputs import BaseModelOutput

from .cache_vaswani import BeamSearchCache
from .compat_vaswani import cache_of

# What transformers' loop alone returns: every step's scores, logits, attentions or hidden states.
_PER_STEP_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def _default_criterion(criterion: StoppingCriteria, config: GenerationConfig) -> bool:
    # `beam_search` stops at the config's max_length and </s>; a user's criterion of the same kind
    # replaces transformers' own, and is then honoured only by HF's loop.
    if isinstance(criterion, MaxLengthCriteria):
        return criterion.max_length == config.max_length
    if isinstance(criterion, EosTokenCriteria):
        ours = torch.as_tensor(criterion.eos_token_id).view(-1).cpu()
        return torch.equal(ours, config._eos_token_tensor.view(-1).cpu())
    return False


def plain_beam_search(
    input_ids: torch.Tensor,
    generation_config: GenerationConfig,
    stopping_criteria: StoppingCriteriaList,
    synced_gpus: bool,
    model_kwargs: dict,
) -> bool:
    """Whether `beam_search` decodes this call exactly as transformers' beam search loop would (§6.1).

    True for deterministic search from the decoder start alone that stops a sentence as `early_stopping` says,
    ends on `</s>` or the length limit, and returns sequences, alone or in a dict without per-step outputs (scores,
    logits, attentions, hidden states: `BeamSearchOutput`); the arguments are those transformers gives
    `GenerationMixin._beam_search` (`input_ids` of shape `(batch * num_beams, prompt_len)`).
    """
    config, cache = generation_config, cache_of(model_kwargs)
    return (
        input_ids.shape[1] == 1 < config.max_length  # the decoder start alone: a prompt needs its keys and values first
        and not config.do_sample
        and not config.low_memory  # transformers' loop refuses it
        and config.early_stopping in (True, False, "never")
        and not any(getattr(config, flag, False) for flag in _PER_STEP_OUTPUTS)
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


def _follows_the_batch(processor: object) -> bool:
    # A processor with per-sentence state (`generation_vaswani.SourceLengthLimit`) offers `select(sentences)`, which
    # keeps the state of the sentences still in the batch: beam search may then drop finished ones under it.
    return callable(getattr(processor, "select", None))


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


class FinishedHypotheses:
    """The best num_beams finished hypotheses of every sentence of a batch, best first (§6.1).

    Each keeps the score it is ranked by (penalised), its log-probability log P(Y|X) and its length |Y| (the
    generated tokens, `</s>` included), which give its confidence.

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
        self.log_probs = torch.zeros(batch, num_beams, device=device)
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
        log_probs: torch.Tensor,
        generated: int,
        ended: torch.Tensor,
    ) -> None:
        """Merge the hypotheses that `ended`, keeping the best num_beams of each sentence (§6.1).

        Args:
            sentences: `(n,)` the sentences' indices in the batch.
            sequences: `(n, num_beams, max_length)` candidate hypotheses.
            scores: `(n, num_beams)` their penalised scores.
            log_probs: `(n, num_beams)` their log-probabilities log P(Y|X), not penalised.
            generated: tokens they generated, `</s>` included.
            ended: `(n, num_beams)` which of them ended (the others are left out).
        """
        rows = torch.arange(len(sentences), device=sentences.device)[:, None]
        scores = scores - 1.0e9 * ~ended
        merged_scores, best = torch.cat((self.scores[sentences], scores), dim=1).topk(scores.shape[1])
        self.sequences[sentences] = torch.cat((self.sequences[sentences], sequences), dim=1)[rows, best]
        self.log_probs[sentences] = torch.cat((self.log_probs[sentences], log_probs), dim=1).gather(1, best)
        lengths = self.lengths.new_full(scores.shape, generated)
        self.lengths[sentences] = torch.cat((self.lengths[sentences], lengths), dim=1).gather(1, best)
        self.is_finished[sentences] = torch.cat((self.is_finished[sentences], ended), dim=1).gather(1, best)
        self.scores[sentences] = merged_scores

    def best(self, count: int, prompt_len: int) -> torch.LongTensor:
        """The `count` best of each sentence, `(batch * count, output_len)`, padded to the longest of them (§6.1)."""
        output_length = prompt_len + int(self.lengths[:, :count].max())
        return self.sequences[:, :count, :output_length].reshape(-1, output_length)

    def confidence(self, count: int) -> torch.Tensor:
        """log P(Y|X) / |Y| of the `count` best of each sentence, `(batch * count,)`: the mean log-probability of
        their tokens (natural log, `</s>` included), without the length penalty."""
        return (self.log_probs[:, :count] / self.lengths[:, :count].clamp(min=1)).reshape(-1)


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

    Beside each beam's score (the sum of its tokens' processed log-probabilities, as HF's loop sums them) the search
    keeps log P(Y|X), the sum of the model's own log-probabilities of its tokens before the logits processors (they
    differ where a processor changed the score of a chosen token: the `</s>` that `SourceLengthLimit` forces scores
    0); `FinishedHypotheses.confidence` divides it by |Y|.

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
    padded after `</s>` to the longest one returned; `finished` then holds their scores.
    """

    def __init__(
        self,
        model: PreTrainedModel,
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
        self.can_drop = all(isinstance(p, _ROW_WISE_PROCESSORS) or _follows_the_batch(p) for p in logits_processor)
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
        self.log_probs = torch.zeros(batch, rows_per_sentence, device=device)  # log P(Y|X) of each beam
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
            scores, log_probs, rows, tokens = self._candidates(length)
            ends = torch.isin(tokens, self.eos) | (length + 1 >= self.max_length)
            done = self._finish(length, scores, log_probs, rows, tokens, ends)
            if bool(done.all()) or length + 1 >= self.max_length:
                break
            self._advance(length, done, scores, log_probs, rows, tokens, ends)
        return self.finished.best(self.num_return_sequences, self.prompt_len)

    def _log_probs(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The next token's log-probabilities of every running beam, `(rows, vocab)`: processed, and the model's own
        # (the same tensor where no processor changed them; token masks count as the model's, their tokens are never
        # chosen). A sentence's beams are one decoder row: `beams` queries at one position, attending each to its own
        # ancestors' keys and values (`BeamSearchCache.append_position`) and all to the sentence's one encoder output.
        sentences, beams = self.scores.shape
        attention_mask = self.attention_mask
        if attention_mask is not None and beams == self.num_beams:
            if self.encoder_mask is None:
                decoder = self.model.get_decoder()
                self.encoder_mask = decoder.cross_attention_mask(self.num_beams, self.encoder_states, attention_mask)
            attention_mask = self.encoder_mask
        logits = self.model(
            decoder_input_ids=self.sequences[:, length - 1 : length].view(sentences, beams),
            decoder_attention_mask=self.cache.self_attention_cache.append_position(),
            decoder_position_ids=torch.full((1, 1), length - 1, device=self.sequences.device),
            encoder_outputs=BaseModelOutput(last_hidden_state=self.encoder_states),
            attention_mask=attention_mask,
            cache=self.cache,
            use_cache=True,
        ).logits.flatten(0, 1)
        log_probs = logits.float().log_softmax(dim=-1)
        if self.token_masks:
            # A handful of forbidden tokens: filling their columns spares a pass over all the scores.
            mask = self.token_masks(self.sequences[:1, :length], log_probs.new_zeros(1, log_probs.shape[-1]))[0]
            log_probs.index_fill_(1, (mask == float("-inf")).nonzero().squeeze(1), float("-inf"))
        return self.logits_processor(self.sequences[:, :length], log_probs), log_probs

    def _candidates(self, length: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        # The best continuations of each sentence: scores, log P(Y|X), the running rows they extend and their tokens,
        # each `(sentences, num_candidates)`, best first.
        processed, model_log_probs = self._log_probs(length)
        sentences, (beams, vocab_size) = len(self.active), (self.scores.shape[1], processed.shape[-1])
        # reshape: a processor may return a strided view, which `view` cannot regroup (RepetitionPenaltyLogitsProcessor)
        candidates = processed.reshape(sentences, beams, vocab_size).add_(self.scores[..., None]).reshape(sentences, -1)
        scores, ids = top_k(candidates, min(self.num_candidates, candidates.shape[1]))
        sentence_rows = torch.arange(sentences, device=ids.device)[:, None]
        rows, tokens = ids // vocab_size + sentence_rows * beams, ids % vocab_size
        return scores, self._path_log_probs(processed, model_log_probs, scores, rows, tokens), rows, tokens

    def _path_log_probs(
        self, processed: Tensor, model_log_probs: Tensor, scores: Tensor, rows: Tensor, tokens: Tensor
    ) -> Tensor:
        # log P(Y|X) of the candidates that extend running `rows` by `tokens`, scored `scores` (`processed` plus their
        # beams' scores). Where no processor changed the log-probabilities, `processed` was added to in place and the
        # scores' own increments are the model's; processors therefore never change their input in place.
        if processed is model_log_probs:
            return scores + (self.log_probs - self.scores).view(-1)[rows]
        return self.log_probs.view(-1)[rows] + model_log_probs[rows, tokens]

    def _finish(
        self, length: int, scores: Tensor, log_probs: Tensor, rows: Tensor, tokens: Tensor, ends: Tensor
    ) -> Tensor:
        # A candidate among the first num_beams that ends joins its sentence's finished hypotheses, of which
        # the best num_beams are kept, until the sentence is done. Returns which are done.
        k, generated = self.num_beams, length + 1 - self.prompt_len
        just_finished = ends[:, :k] & ~self.done[self.active, None]
        if just_finished.any():
            hypotheses = self.sequences[rows[:, :k]]
            hypotheses[..., length] = tokens[:, :k]
            penalised = scores[:, :k] / generated**self.length_penalty
            self.finished.add(self.active, hypotheses, penalised, log_probs[:, :k], generated, just_finished)
        full = self.finished.done(self.active)
        if self.early_stopping is not True:  # HF's `_check_early_stop_heuristic`
            longest = self.early_stopping == "never" and self.length_penalty > 0.0
            best_length = self.max_length - self.prompt_len if longest else generated
            best_running = (scores - 1.0e9 * ends).max(dim=1).values / best_length**self.length_penalty
            full &= best_running <= self.finished.scores[self.active].min(dim=1).values
        self.done[self.active] |= full
        return self.done[self.active]

    def _running(self, scores: Tensor, ends: Tensor) -> Tensor:
        # Which candidates become the beams of the next step, `(sentences, num_beams)`: the best that go on.
        return (scores - 1.0e9 * ends).topk(self.num_beams).indices

    def _advance(
        self, length: int, done: Tensor, scores: Tensor, log_probs: Tensor, rows: Tensor, tokens: Tensor, ends: Tensor
    ) -> None:
        # The chosen candidates become the beams of the next step; sentences that are done leave the batch where
        # every processor allows it.
        running = self._running(scores, ends)
        self.scores = scores.gather(1, running) - 1.0e9 * ends.gather(1, running)
        self.log_probs = log_probs.gather(1, running)
        rows, tokens = rows.gather(1, running), tokens.gather(1, running)
        if self.can_drop and bool(done.any()):
            kept = (~done).nonzero().squeeze(1)
            self.active, self.scores, rows, tokens = self.active[kept], self.scores[kept], rows[kept], tokens[kept]
            self.log_probs = self.log_probs[kept]
            self.encoder_states = self.encoder_states[kept]
            self.attention_mask = self.attention_mask[kept] if self.attention_mask is not None else None
            self.encoder_mask = None
            self.cache.cross_attention_cache.reorder_cache(kept)  # the self-attention cache finds `kept` in rows
            self.logits_processor = LogitsProcessorList(
                p.select(kept) if _follows_the_batch(p) else p for p in self.logits_processor
            )
        self.sequences = self.sequences[rows.view(-1)]
        self.sequences[:, length] = tokens.view(-1)
        self.cache = self.model._reorder_cache(self.cache, rows.view(-1))


@dataclass
class BeamSearchOutput(GenerateBeamEncoderDecoderOutput):
    """What `generate(..., return_dict_in_generate=True)` gets from `beam_search`: transformers' beam-search output
    without the per-step fields, and each sequence's confidence.

    Attributes:
        sequences: `(batch * num_return_sequences, output_len)` token ids, best first.
        sequences_scores: `(batch * num_return_sequences,)` the score each was ranked by, log P(Y|X) / lp(|Y|):
            transformers' `sequences_scores`.
        sequences_confidence: `(batch * num_return_sequences,)` log P(Y|X) / |Y|: the mean log-probability (natural
            log) of its generated tokens, `</s>` included, without the length penalty, from the model's
            log-probabilities before the logits processors (`BeamSearch`).
    """

    sequences_confidence: torch.Tensor | None = None


def beam_search(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    generation_config: GenerationConfig,
    search: type[BeamSearch] = BeamSearch,
    **model_kwargs,
) -> torch.LongTensor | BeamSearchOutput:
    """`search(model, input_ids, logits_processor, generation_config, **model_kwargs).run()` (§6.1), in
    inference mode: no version counters or views kept for a step's hundreds of operators (docs/performance.md).

    Args:
        search: `BeamSearch`, or a subclass (`constraints_vaswani.ConstrainedBeamSearch`).

    Returns:
        `(batch * num_return_sequences, output_len)` token ids, best first, or with `return_dict_in_generate` a
        `BeamSearchOutput` of them (ordinary tensors outside inference mode, whose changes in place are allowed).
    """
    with torch.inference_mode():
        search = search(model, input_ids, logits_processor, generation_config, **model_kwargs)
        sequences = search.run()
        count = search.num_return_sequences
        scores = search.finished.scores[:, :count].reshape(-1)
        confidence = search.finished.confidence(count)
    if not generation_config.return_dict_in_generate:
        return sequences.clone()
    return BeamSearchOutput(
        sequences=sequences.clone(), sequences_scores=scores.clone(), sequences_confidence=confidence.clone()
    )
