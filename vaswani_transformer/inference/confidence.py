"""A confidence for every translated text: the mean log-probability of its tokens, over all its sentences.

The engines score each sentence's translation (`engines.Hypothesis.confidence`: log P(Y|X) / |Y|, in nats, `</s>`
included, without the length penalty). A text of several sentences (a line, a paragraph; a long sentence split into
pieces) gets the mean over all its tokens: the sum of its sentences' log-probabilities divided by the sum of their
tokens, which is the same definition applied to the text's translation as one sequence, and weighs a sentence of
thirty tokens thirty times a sentence of one. `translate --scores` prints it (`format_confidence`).

See docs/translating-documents.md, "Confidence".
"""

from dataclasses import dataclass
from typing import NamedTuple

from ..data.text_format import Prepared, TranslatedText
from .engines import Hypothesis

# What `translate --scores` writes between a translation (and its alignment) and its confidence, as Marian's
# `--n-best` ends each line with its score, and as `--alignments` separates its pairs.
SCORE_SEPARATOR = " ||| "


class Score(NamedTuple):
    """One piece's translation as the engine scored it: log P(Y|X) in nats, and |Y|, its tokens with `</s>`."""

    log_probability: float
    tokens: int


@dataclass(frozen=True)
class ScoredText(TranslatedText):
    """A `TranslatedText` with its `confidence`: the mean token log-probability over the text's sentences (nats, at
    most 0), None for a text with nothing to translate (blank)."""

    confidence: float | None = None


def piece_scores(best: list[Hypothesis], tokens: list[int]) -> list[Score | None]:
    """Each piece's `Score`, from its best hypothesis and its translation's tokens (`</s>` included); None where the
    engine gave no confidence (a blank piece)."""
    return [
        None if hypothesis.confidence is None else Score(hypothesis.confidence * count, count)
        for hypothesis, count in zip(best, tokens, strict=True)
    ]


def scored_texts(prepared: Prepared, texts: list[TranslatedText], scores: list[Score | None]) -> list[ScoredText]:
    """`texts`, the translations of `prepared`'s texts, each with its confidence from its pieces' `scores`.

    A text's confidence is the sum of its pieces' log-probabilities over the sum of their tokens (the module
    docstring); pieces without a score (blank) count for nothing, and a text of none has None.
    """
    text_of_sentence = [n for n, count in enumerate(prepared.sentences) for _ in range(count)]
    log_probability, tokens = [0.0] * len(texts), [0] * len(texts)
    for owner, score in zip(prepared.pieces.owners, scores, strict=True):
        if score is not None:
            log_probability[text_of_sentence[owner]] += score.log_probability
            tokens[text_of_sentence[owner]] += score.tokens
    return [
        ScoredText(text.text, text.alignment, log_probability[n] / tokens[n] if tokens[n] else None)
        for n, text in enumerate(texts)
    ]


def format_confidence(confidence: float | None) -> str:
    """The confidence as `translate --scores` writes it: four decimals ("-0.2731"), empty for a blank line."""
    return "" if confidence is None else f"{confidence:.4f}"
