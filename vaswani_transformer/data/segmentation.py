"""Sentences of real text: a line split into sentences (Wikimedia's `sentencex`), a sentence too long for the model
split at its clauses, and the words that word alignments count.

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
# A word of a word alignment: a run of letters, digits and underscores, or one other character that is not whitespace
# (a punctuation mark is a word of its own, as Moses' tokenizer splits it off).
_WORD = re.compile(r"\w+|[^\w\s]")
# A piece of a split sentence whose translation has fewer words than this share of its own was likely cut short.
_SHORT_TRANSLATION = 1 / 3

# Pharaoh-format pairs (source word, target word), as word alignments are written: "0-0 1-2 2-1".
Alignment = list[tuple[int, int]]


def word_spans(text: str) -> list[tuple[int, int]]:
    """The words of `text` as (start, end) character offsets: runs of letters, digits and underscores (`\\w+`), and
    each other character that is not whitespace, so that punctuation is a word of its own.

    The words that `translate --alignments` counts (Pharaoh "i-j" pairs index them from 0) and that inline markup
    is carried over by (`markup.py`). Tokenized words, as fairseq and Marian count them after Moses' tokenizer.
    """
    return [match.span() for match in _WORD.finditer(text)]


def join_alignments(parts: list[tuple[Alignment | None, int, int]]) -> Alignment | None:
    """The alignment of texts laid end to end, from each part's: its pairs shifted by the words before them.

    Args:
        parts: (alignment, source words, target words) of each part, in order; a part of no words (a blank line)
            has (None or [], 0, 0).

    Returns:
        The pairs of the whole, sorted; None where a part with words has no alignment.
    """
    joined, sources, targets = [], 0, 0
    for pairs, source_words, target_words in parts:
        if pairs is None and (source_words or target_words):
            return None
        joined += [(i + sources, j + targets) for i, j in pairs or ()]
        sources, targets = sources + source_words, targets + target_words
    return sorted(joined)


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
    """`sentence` cut into its clauses, each of at most `limit` tokens: after every clause's punctuation ("," ";" ":"
    dashes, closing brackets), and a clause still over the limit at the space nearest its middle, else between
    characters, until it fits.

    A model trained on sentences translates a clause as a short sentence: cut only where the limit forces it, a run-on
    sentence of 32 clauses in two pieces of 160 tokens came back as two short sentences, most clauses lost. The
    pieces keep every character but the whitespace at a cut.

    Args:
        sentence: one sentence, stripped.
        count_tokens: a text's length in the model's tokens, `</s>` included.
        limit: the model's longest source, in tokens; at least 2 (one token and `</s>`).

    Returns:
        The pieces, in order; `[sentence]` where it fits.
    """
    if count_tokens(sentence) <= limit or len(sentence) < 2:
        return [sentence]
    # A clause keeps its punctuation; the whitespace at a cut goes.
    cuts = [match for match in _CLAUSE_END.finditer(sentence) if 0 < match.start() and match.end() < len(sentence)]
    if cuts:
        starts = [0] + [match.end() for match in cuts]
        ends = [match.start() + 1 for match in cuts] + [len(sentence)]
        clauses = [sentence[start:end].strip() for start, end in zip(starts, ends, strict=True)]
        return [piece for clause in clauses for piece in _split_at_space(clause, count_tokens, limit)]
    return _split_at_space(sentence, count_tokens, limit)


def _split_at_space(text: str, count_tokens: Callable[[str], int], limit: int) -> list[str]:
    # `text` cut at the space nearest its middle, else between characters, until each piece fits.
    if count_tokens(text) <= limit or len(text) < 2:
        return [text]
    middle = len(text) / 2
    spaces = [match.span() for match in _SPACE.finditer(text) if 0 < match.start() and match.end() < len(text)]
    start, end = min(spaces, key=lambda cut: abs(cut[0] - middle)) if spaces else (int(middle), int(middle))
    head, tail = text[:start].rstrip(), text[end:].lstrip()
    return _split_at_space(head, count_tokens, limit) + _split_at_space(tail, count_tokens, limit)


def text_alignment(
    sentences: list[str], translations: list[str], alignments: list[Alignment | None]
) -> Alignment | None:
    """A text's word alignment from its sentences': laid end to end (`join_alignments`), as the layout between a
    text's sentences is whitespace, so that its words are theirs in order."""
    parts = zip(sentences, translations, alignments, strict=True)
    return join_alignments([(pairs, len(word_spans(s)), len(word_spans(t))) for s, t, pairs in parts])


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

        The pieces of a split sentence whose translation has fewer than a third of their own words
        (`word_spans`) are counted in one warning (logged): the model, which learnt sentences, ends a long piece
        early and drops the rest of it.

        Args:
            translations: one per piece, in order.
            sentences: how many sentences the pieces came from.
        """
        joined: list[list[str]] = [[] for _ in range(sentences)]
        for owner, translation in zip(self.owners, translations, strict=True):
            if translation:
                joined[owner].append(translation)
        split = set(self.split)
        short = [
            owner
            for owner, source, translation in zip(self.owners, self.texts, translations, strict=True)
            if owner in split and len(word_spans(translation)) < _SHORT_TRANSLATION * len(word_spans(source))
        ]
        if short:
            shown = ", ".join(str(i + 1) for i in sorted(set(short))[:5]) + (", ..." if len(set(short)) > 5 else "")
            logger.warning(
                f"{len(short)} of {sum(owner in split for owner in self.owners)} pieces of long sentences (sentence "
                f"{shown}) translated to less than a third of their words: part of them is likely missing from the "
                "translation; split those sentences into shorter ones."
            )
        return [" ".join(parts) for parts in joined]

    def join_alignments(
        self, alignments: list[Alignment | None], translations: list[str], sentences: int
    ) -> list[Alignment | None]:
        """One word alignment per sentence, from its pieces': as `join` lays their translations end to end.

        Args:
            alignments: one per piece, in order (`join_alignments`' pairs), None where a piece has none.
            translations: the pieces' translations, as given to `join`.
            sentences: how many sentences the pieces came from.
        """
        parts: list[list[tuple[Alignment | None, int, int]]] = [[] for _ in range(sentences)]
        for owner, source, translation, pairs in zip(self.owners, self.texts, translations, alignments, strict=True):
            parts[owner].append((pairs, len(word_spans(source)), len(word_spans(translation))))
        return [join_alignments(each) for each in parts]


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
