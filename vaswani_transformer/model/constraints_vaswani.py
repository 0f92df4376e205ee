"""Lexically constrained beam search: translations that hold given terms (a glossary's), for `generate(glossary_ids=)`.

Post & Vilar (2018), "Fast Lexically Constrained Decoding with Dynamic Beam Allocation for Neural Machine
Translation": `LexicalConstraints` says which terms a hypothesis holds and forbids it to end before it holds them all;
`ConstrainedBeamSearch`, the beam search of `beam_search_vaswani` with the beam shared among hypotheses by how much of
their terms they hold (dynamic beam allocation), vectorised over the batch as Hu et al. (2019), "Improved Lexically
Constrained Decoding for Translation and Monolingual Rewriting", do it.
"""

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.generation import LogitsProcessor

from .beam_search_vaswani import BeamSearch, top_k

# What a hypothesis that ends without all its terms loses from its score (`ConstrainedBeamSearch`), in nats as the
# scores are: more than any log-probability of a translation, less than the -1e9 that marks no hypothesis.
UNMET_TERMS_PENALTY = 1.0e4


class LexicalConstraints(LogitsProcessor):
    """Terms each sentence's translation must contain; `</s>` is forbidden to a hypothesis until it holds them all.

    Post & Vilar (2018), "Fast Lexically Constrained Decoding with Dynamic Beam Allocation": a hypothesis may
    end only once it has met every constraint. A term is a sequence of token ids, met where the output holds it
    anywhere (once is enough), in any order; each term is matched on its own (two may share tokens). As a
    processor it forbids `</s>` to the rows whose output lacks a term of its sentence (a processor after it may
    still force `</s>`: the length limit ends a hypothesis that never met its terms); `ConstrainedBeamSearch` reads
    `state` to give the beams to hypotheses that meet more. Given the tokens that continue a word (`suffix_ids`:
    subword pieces without a word boundary before them), it also forbids them right after a term, so that a term
    stands as a whole word ("Herr", not "Herrin"). One object serves one `generate()` call (see
    `generation_vaswani.VaswaniGenerationMixin.generate`, `glossary_ids`).

    Args:
        tokens: `(batch, terms, longest)` each sentence's terms, left-aligned, -1 after a term's last token.
        lengths: `(batch, terms)` their lengths, 0 for no term.
        eos_token_id: `(n,)` the ids that end a hypothesis.
        suffix_ids: `(n,)` the ids that may not follow a term, or None.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        eos_token_id: torch.Tensor,
        suffix_ids: torch.Tensor | None = None,
    ) -> None:
        self.tokens, self.lengths, self.eos_token_id, self.suffix_ids = tokens, lengths, eos_token_id, suffix_ids
        self.step_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # `__call__`'s last `state`

    @classmethod
    def from_ids(
        cls,
        terms: list[list[list[int]]],
        eos_token_id: torch.Tensor,
        device: torch.device | None = None,
        suffix_ids: list[int] | None = None,
    ) -> "LexicalConstraints":
        """The constraints of a batch: `terms[i]`, sentence i's terms, each a non-empty list of token ids, kept on
        `device` (the decoder's); `eos_token_id` an id or `(n,)` ids; `suffix_ids` as the class takes them."""
        count = max(1, max(map(len, terms), default=0))
        longest = max(1, max((len(term) for each in terms for term in each), default=0))
        tokens = torch.full((len(terms), count, longest), -1, dtype=torch.long)
        lengths = torch.zeros(len(terms), count, dtype=torch.long)
        for sentence, each in enumerate(terms):
            for number, term in enumerate(each):
                tokens[sentence, number, : len(term)] = torch.tensor(term)
                lengths[sentence, number] = len(term)
        eos = torch.as_tensor(eos_token_id, device=device).view(-1)
        suffixes = None if suffix_ids is None else torch.tensor(suffix_ids, dtype=torch.long, device=device)
        return cls(tokens.to(device), lengths.to(device), eos, suffixes)

    def select(self, sentences: torch.Tensor) -> "LexicalConstraints":
        """The constraints of the sentences left in a batch: `sentences` `(kept,)` indexes this batch.

        See docs/performance.md, "Finished sentences leave the batch".
        """
        sentences = sentences.to(self.tokens.device)
        return LexicalConstraints(self.tokens[sentences], self.lengths[sentences], self.eos_token_id, self.suffix_ids)

    def per_row(self, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`tokens` and `lengths` for `rows` rows, the rows of a sentence side by side (`(rows, terms, longest)`,
        `(rows, terms)`)."""
        repeats = rows // self.tokens.shape[0]
        tokens, lengths = (values.to(device).repeat_interleave(repeats, 0) for values in (self.tokens, self.lengths))
        return tokens, lengths

    def state(self, input_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Which terms each row's output holds, and how much of each it ends with (Post & Vilar 2018).

        Args:
            input_ids: `(batch * beams, length)` the hypotheses (the decoder start first, which no term holds).

        Returns:
            `met`, `(rows, terms)`: True where the row holds the term (or there is no term); `begun`,
            `(rows, terms, longest)`: True at `[row, term, p]` where the row ends with the term's first p tokens
            (p = 0 always, p below the term's length); `closing`, `(rows,)`: True where the row ends with a whole term.
        """
        rows, length = input_ids.shape
        tokens, lengths = self.per_row(rows, input_ids.device)
        longest = tokens.shape[-1]
        # Every position's next `longest` tokens (-2 past the end, which matches no token and no padding), and how
        # many of a term's first tokens they match, `(rows, length, terms)`.
        windows = F.pad(input_ids, (0, longest - 1), value=-2).unfold(1, longest, 1)
        matched = (windows[:, :, None, :] == tokens[:, None]).long().cumprod(dim=-1).sum(dim=-1)
        met = (matched >= lengths[:, None]).any(dim=1)
        # The row ends with a term's first p tokens where the p tokens from position length - p match all p.
        parts = torch.arange(1, longest, device=input_ids.device)
        starts = length - parts
        ends_with = (matched[:, starts.clamp(min=0)] == parts[:, None]) & (starts >= 0)[:, None]
        begun = torch.cat((torch.ones_like(met)[..., None], ends_with.transpose(1, 2)), dim=2)
        last = (length - lengths).clamp(0, length - 1)  # where a term that ends the row starts
        closing = ((matched.gather(1, last[:, None]).squeeze(1) == lengths) & (lengths > 0) & (last > 0)).any(dim=1)
        return met, begun & (torch.arange(longest, device=input_ids.device) < lengths[..., None]), closing

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        """`scores` `(batch * beams, vocab)` with `</s>` at -inf in the rows of `input_ids` that lack a term, and the
        `suffix_ids` in those that end with one."""
        self.step_state = self.state(input_ids)  # kept for `ConstrainedBeamSearch`, which reads this step's too
        met, _, closing = self.step_state
        unmet = (~met.all(dim=1)).nonzero()
        closing = closing.nonzero() if self.suffix_ids is not None else closing[:0, None]
        if not len(unmet) and not len(closing):
            return scores
        scores = scores.clone()  # not in place: beam search keeps the model's own log-probabilities
        scores[unmet, self.eos_token_id.to(scores.device)] = float("-inf")
        if len(closing):
            scores[closing, self.suffix_ids.to(scores.device)] = float("-inf")
        return scores


class ConstrainedBeamSearch(BeamSearch):
    """`BeamSearch` whose hypotheses hold every term of their sentence (`LexicalConstraints`): dynamic beam allocation.

    Post & Vilar (2018), in the vectorised form of Hu et al. (2019), "Improved Lexically Constrained Decoding
    for Translation and Monolingual Rewriting" (as fairseq and Sockeye implement it). A sentence's candidates at each
    step are `BeamSearch`'s (the best num_candidates continuations of all its beams), for each beam the next token of
    every term it has not met (its first, or the one after the part the beam ends with), and each beam's best token,
    each once; `</s>` only for beams that met every term. A candidate's bank is the number of its sentence's term
    tokens it has met (of whole terms, and of the part of others it ends with). The candidates are taken bank by bank
    in turn, from the highest, and by score within a bank: each bank gets an equal share of the beam, and a bank
    that has too few candidates leaves its share to the others (Post & Vilar's allocation, as Hu et al.'s round
    robin over the banks gives it). Of these, those among the first num_beams that end finish (only hypotheses that
    met every term, or any at the length limit), and the first num_beams that go on are the next step's beams.
    A hypothesis that ends at the length limit without all its terms scores `UNMET_TERMS_PENALTY` less, so that one
    that holds them is preferred (its `sequences_scores` shows it; its confidence does not).

    A sentence without terms has one bank, in which its candidates rank by score as `BeamSearch` ranks them: it is
    decoded as `BeamSearch` decodes it.
    """

    def _candidates(self, length: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        # Scores, log P(Y|X), running rows and tokens of each sentence's candidates, `(sentences, pool)`, in the order
        # the beams take them (invalid ones last, at -inf).
        processed, model_log_probs = self._log_probs(length)
        (sentences, beams), vocab_size = self.scores.shape, processed.shape[-1]
        constraints = next((p for p in self.logits_processor if isinstance(p, LexicalConstraints)), None)
        if constraints is None:
            raise ValueError("ConstrainedBeamSearch needs a LexicalConstraints among its logits processors.")
        met, begun, _ = constraints.step_state  # of `self.sequences[:, :length]`, as `_log_probs` just processed them
        terms, lengths = constraints.per_row(processed.shape[0], processed.device)
        positions = torch.arange(terms.shape[-1], device=terms.device)
        device = processed.device

        best_tokens = processed.argmax(dim=1).view(sentences, -1)
        candidates = processed.reshape(sentences, beams, vocab_size).add_(self.scores[..., None]).reshape(sentences, -1)
        ids = top_k(candidates, min(self.num_candidates, candidates.shape[1]))[1]
        next_of_terms = terms.gather(2, (begun * positions).amax(dim=2, keepdim=True)).squeeze(2)  # (rows, terms)
        beam_ids = torch.arange(beams, device=device)[None, :].expand(sentences, beams)
        term_beams = beam_ids[..., None].expand(sentences, beams, terms.shape[1]).reshape(sentences, -1)
        pool_beams = torch.cat((ids // vocab_size, term_beams, beam_ids), dim=1)
        pool_tokens = torch.cat(
            (
                ids % vocab_size,
                next_of_terms.clamp(min=0).view(sentences, -1),
                best_tokens,
            ),
            dim=1,
        )
        allowed = torch.cat(
            (torch.ones_like(ids, dtype=torch.bool), (~met & (lengths > 0)).view(sentences, -1), beam_ids >= 0), dim=1
        )
        rows = pool_beams + torch.arange(sentences, device=device)[:, None] * beams
        scores = candidates.gather(1, pool_beams * vocab_size + pool_tokens)
        log_probs = self._path_log_probs(processed, model_log_probs, scores, rows, pool_tokens)
        # A candidate counts once, its first copy kept (a continuation among the best before a term's token).
        keys = torch.where(
            allowed, pool_beams * vocab_size + pool_tokens, -1 - torch.arange(rows.shape[1], device=device)
        )
        order = keys.argsort(dim=1, stable=True)
        ordered = keys.gather(1, order)
        repeated = torch.zeros_like(allowed).scatter_(1, order[:, 1:], ordered[:, 1:] == ordered[:, :-1])
        # -1e9: no hypothesis (a first step's copies of the decoder start); -inf: forbidden.
        valid = allowed & ~repeated & (scores > -1.0e8)

        # The bank of each candidate: its sentence's term tokens met once it is appended.
        extended = begun[rows] & (terms[rows] == pool_tokens[..., None, None])  # ends with the first p + 1 tokens
        term_lengths = lengths[rows]
        completes = extended.gather(3, (term_lengths - 1).clamp(min=0)[..., None]).squeeze(3) & (term_lengths > 0)
        part = ((positions + 1) * extended).amax(dim=3)
        banks = torch.where(met[rows] | completes, term_lengths, part).sum(dim=2)
        taken = _allocate(scores, banks, valid)
        # A hypothesis that ends without all its terms (at the length limit) ranks below every one that holds them.
        ending = torch.isin(pool_tokens, self.eos) | (length + 1 >= self.max_length)
        lacking = ending & (banks < term_lengths.sum(dim=2))
        scores = (scores - UNMET_TERMS_PENALTY * lacking).masked_fill(~valid, float("-inf"))
        return tuple(values.gather(1, taken) for values in (scores, log_probs, rows, pool_tokens))

    def _running(self, scores: Tensor, ends: Tensor) -> Tensor:
        # The first num_beams candidates that go on, in the order of the allocation.
        position = torch.arange(scores.shape[1], device=scores.device).expand_as(scores)
        return (position + scores.shape[1] * ends).topk(self.num_beams, largest=False).indices


def _allocate(scores: Tensor, banks: Tensor, valid: Tensor) -> Tensor:
    # The order in which beams go to candidates, `(sentences, pool)` indices: the best of each bank, highest bank first,
    # then the second best of each, and so on (Hu et al. 2019's round robin); invalid candidates last.
    pool = scores.shape[1]
    by_score = scores.masked_fill(~valid, float("-inf")).argsort(dim=1, descending=True, stable=True)
    ranked_banks = banks.masked_fill(~valid, -1).gather(1, by_score)
    by_bank = ranked_banks.argsort(dim=1, descending=True, stable=True)
    order, ranked_banks = by_score.gather(1, by_bank), ranked_banks.gather(1, by_bank)
    position = torch.arange(pool, device=scores.device).expand_as(order)
    starts = torch.ones_like(valid)
    starts[:, 1:] = ranked_banks[:, 1:] != ranked_banks[:, :-1]
    rank_in_bank = position - (position * starts).cummax(dim=1).values
    key = rank_in_bank * (1 << 20) + (ranked_banks[:, :1] - ranked_banks)  # then the higher bank first
    key = key.masked_fill(ranked_banks < 0, 1 << 62)
    return order.gather(1, key.argsort(dim=1, stable=True))
