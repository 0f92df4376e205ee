"""Sentences of real text: a line split into sentences (Wikimedia's `sentencex`), and a sentence too long for the model
split at a clause or word boundary.

The model was trained on one sentence per line (§5.1), so a paragraph is translated sentence by sentence and put
back together with the spaces between its sentences as they were (`text_format.split_text`). See docs/serving.md,
"Sentences and paragraphs".
"""

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import sentencex

logger = logging.getLogger(__name__)

# Where a sentence too long for the model is best cut: after a clause's punctuation, then between words.
_CLAUSE_END = re.compile(r"[,;:\u2013\u2014)\]]\s+")
_SPACE = re.compile(r"\s+")


def split_sentences(line: str, language: str | None = None) -> list[str]:
    """The sentences of one line of text, each with the whitespace around it, so that they join back to `line`.

    Follows `sentencex.segment` (https://github.com/wikimedia/sentencex): rules for the language's abbreviations and
    punctuation, English's where it has none of its own. A sentence that ends without punctuation runs on into the
    next: no segmenter can tell where it ended.

    Args:
        line: text without line breaks (a line of a paragraph, or an HTML text node).
        language: ISO 639-1 code of the text, e.g. "en"; None for English's rules.

    Returns:
        The pieces of `line`, in order, whose concatenation is `line`; `[line]` for a blank line.
    """
    if not line.strip():
        return [line]
    pieces = [piece for piece in sentencex.segment(language or "en", line) if piece]
    if "".join(pieces) != line:  # sentencex keeps every character today; a release that did not must not lose text
        return [line]
    return pieces


def split_at_limit(sentence: str, count_tokens: Callable[[str], int], limit: int) -> list[str]:
    """`sentence` cut into pieces of at most `limit` tokens each: after the clause punctuation nearest its middle
    ("," ";" ":" dashes, closing brackets), else at the space nearest its middle, else between characters.

    Each piece is cut again until it fits; the pieces keep every character but the whitespace at a cut.

    Args:
        sentence: one sentence, stripped.
        count_tokens: a text's length in the model's tokens, `</s>` included.
        limit: the model's longest source, in tokens; at least 2 (one token and `</s>`).

    Returns:
        The pieces, in order; `[sentence]` where it fits.
    """
    if count_tokens(sentence) <= limit or len(sentence) < 2:
        return [sentence]
    middle = len(sentence) / 2
    for boundary in (_CLAUSE_END, _SPACE):
        cuts = [(match.start(), match.end()) for match in boundary.finditer(sentence) if 0 < match.start()]
        cuts = [(start, end) for start, end in cuts if end < len(sentence)]
        if cuts:
            start, end = min(cuts, key=lambda cut: abs(cut[0] - middle))
            # A clause keeps its punctuation; the whitespace at a cut goes.
            start = start + 1 if boundary is _CLAUSE_END else start
            break
    else:
        start = end = int(middle)
    head, tail = sentence[:start].rstrip(), sentence[end:].lstrip()
    return split_at_limit(head, count_tokens, limit) + split_at_limit(tail, count_tokens, limit)


@dataclass(frozen=True)
class Pieces:
    """Sentences cut to the model's limit (`fit_to_limit`): what to translate, and how to join the translations back.

    Attributes:
        texts: the pieces to translate, in order.
        lengths: each piece's tokens, `</s>` included.
        owners: for each piece, the index of the sentence it came from.
        split: the indices of the sentences that were cut.
    """

    texts: list[str]
    lengths: list[int]
    owners: list[int]
    split: list[int]

    def join(self, translations: list[str], sentences: int) -> list[str]:
        """One translation per sentence: its pieces' translations joined with a space.

        Args:
            translations: one per piece, in order.
            sentences: how many sentences the pieces came from.
        """
        joined: list[list[str]] = [[] for _ in range(sentences)]
        for owner, translation in zip(self.owners, translations, strict=True):
            if translation:
                joined[owner].append(translation)
        return [" ".join(parts) for parts in joined]


def fit_to_limit(
    sentences: list[str], lengths: list[int], limit: int | None, count_tokens: Callable[[str], int]
) -> Pieces:
    """The sentences, those over `limit` tokens cut with `split_at_limit`; one warning (logged) says which were cut.

    See docs/serving.md, "Sentences and paragraphs".

    Args:
        sentences: the sentences to translate.
        lengths: their tokens, `</s>` included.
        limit: the model's longest source in tokens; None for none.
        count_tokens: a text's length in tokens, `</s>` included.

    Returns:
        The `Pieces`, sentences within the limit as they are.
    """
    texts, piece_lengths, owners, split = [], [], [], []
    for i, (sentence, length) in enumerate(zip(sentences, lengths, strict=True)):
        if limit is None or length <= limit:
            texts.append(sentence)
            piece_lengths.append(length)
            owners.append(i)
            continue
        split.append(i)
        for piece in split_at_limit(sentence.strip(), count_tokens, limit):
            texts.append(piece)
            piece_lengths.append(count_tokens(piece))
            owners.append(i)
    if split:
        shown = ", ".join(str(i + 1) for i in split[:5]) + (", ..." if len(split) > 5 else "")
        logger.warning(
            f"{len(split)} sentence(s) longer than the model's limit of {limit} tokens (sentence {shown}) were split "
            "at a clause or word boundary and their pieces translated one by one; pass long_inputs='error' "
            "(--long-inputs error) to refuse them instead."
        )
    return Pieces(texts, piece_lengths, owners, split)
