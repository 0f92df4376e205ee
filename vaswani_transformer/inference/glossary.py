"""Glossaries (terminology): source terms and the target terms their translations must use.

A glossary is a TSV file, one pair a line: the source term, a tab, the target term (`translate --glossary
terms.tsv`), or the same pairs from a request. A sentence holds a source term where it appears on word boundaries,
in any case; its translation is then decoded with the target terms as lexical constraints (constrained beam
search: `model.constraints_vaswani.ConstrainedBeamSearch`, Post & Vilar 2018), which `target_ids` gives as the
model's token ids, and `suffix_ids` the tokens that may not follow them (so that "Herr" does not become "Herrin").
A sentence that holds no source term is translated as without a glossary.
"""

import csv
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from ..data.corpora import iter_lines
from ..data.tokenizer import tokenizer_lock


@dataclass(frozen=True)
class Term:
    """A source term and the target term its translation must use, as written (the source matched in any case)."""

    source: str
    target: str


class Glossary:
    """Terms to translate as given: which of them a sentence holds, and the target terms' token ids.

    Source terms match whole words (a term's first and last characters may not continue a word of the sentence:
    "man" is not found in "woman" or "mans"), in any case (Unicode case folding), the longest first where two
    overlap ("young woman" before "woman"), each at most once a sentence.

    Args:
        terms: (source, target) pairs; spaces around each term are dropped.
        where: how error messages name the n-th pair, a format with `{}` (e.g. "terms.tsv:{}", a file and its line).
        numbers: the pairs' numbers in messages (default 1, 2, ...).

    Raises:
        ValueError: a term is empty, or a source term comes twice (in any case); the message names the pair.
    """

    def __init__(
        self, terms: Iterable[tuple[str, str]], where: str = "glossary term {}", numbers: Iterable[int] | None = None
    ) -> None:
        found: dict[str, tuple[int, Term]] = {}
        pairs = list(terms)
        for number, (source, target) in zip(numbers or range(1, len(pairs) + 1), pairs, strict=True):
            source, target = source.strip(), target.strip()
            if not source or not target:
                side = "source" if not source else "target"
                raise ValueError(f"{where.format(number)}: the {side} term is empty; give source TAB target.")
            key = source.casefold()
            if key in found:
                raise ValueError(
                    f"{where.format(number)}: the source term {source!r} repeats that of {where.format(found[key][0])} "
                    "(in any case); give each source term one target."
                )
            found[key] = (number, Term(source, target))
        self.terms = tuple(term for _, term in found.values())
        # One alternation, the longest terms first: at each position the longest that matches wins; the group that
        # matched names the term.
        self._ordered = sorted(self.terms, key=lambda term: -len(term.source))
        alternatives = "|".join(f"({re.escape(term.source)})" for term in self._ordered)
        self._pattern = re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE) if self.terms else None

    @classmethod
    def read(cls, path: str | Path) -> "Glossary":
        """The glossary of a TSV file: source term, tab, target term on each line (UTF-8; blank lines skipped).

        Fields are read as written (no quoting: a `"` is part of a term).

        Raises:
            FileNotFoundError, IsADirectoryError: no such file.
            ValueError: a line is not UTF-8, has other than two fields, or an empty term, or repeats a source term;
                the message names the file and the line.
        """
        pairs, numbers = [], []
        reader = csv.reader(iter_lines(path), delimiter="\t", quoting=csv.QUOTE_NONE)
        for row in reader:
            if not any(field.strip() for field in row):
                continue
            if len(row) != 2:
                raise ValueError(
                    f"{path}:{reader.line_num}: {len(row)} fields; a glossary line is a source term, one tab, and "
                    "its target term."
                )
            pairs.append((row[0], row[1]))
            numbers.append(reader.line_num)
        return cls(pairs, where=f"{path}:{{}}", numbers=numbers)

    def __len__(self) -> int:
        return len(self.terms)

    def matches(self, sentence: str) -> list[Term]:
        """The terms whose source `sentence` holds, in the order they first appear there, each once."""
        if self._pattern is None:
            return []
        found = (self._ordered[match.lastindex - 1] for match in self._pattern.finditer(sentence))
        return list(dict.fromkeys(found))

    def target_ids(self, sentences: list[str], tokenizer: PreTrainedTokenizerBase) -> list[list[list[int]]]:
        """Per sentence, the token ids of the target terms of the source terms it holds (`generate`'s `glossary_ids`).

        A target term is tokenized as a word inside a sentence (after a space: byte-level BPE's "ĠDame", not
        "D", "ame"), which the translation must then hold as these tokens.

        Raises:
            ValueError: a target term has a special token (`</s>`, `<pad>`, ...) among its tokens.
        """
        found = [self.matches(sentence) for sentence in sentences]
        targets = sorted({term.target for terms in found for term in terms})
        if not targets:
            return [[] for _ in sentences]
        with tokenizer_lock(tokenizer):
            encoded = tokenizer([" " + target for target in targets], add_special_tokens=False)["input_ids"]
        special = set(tokenizer.all_special_ids)
        ids = dict(zip(targets, encoded, strict=True))
        for target, tokens in ids.items():
            if special.intersection(tokens):
                raise ValueError(
                    f"glossary target term {target!r} holds a special token of the tokenizer; write it as plain text."
                )
        unique = (dict.fromkeys(tuple(ids[term.target]) for term in terms) for terms in found)
        return [[list(tokens) for tokens in each] for each in unique]


def suffix_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids of the tokens that continue the word before them: a letter or digit with no space before it.

    Decoded after a one-letter word ("a"), such a token joins it ("aeln", where "ĠDame" gives "a Dame" and "." gives
    "a."), whatever the tokenizer marks word boundaries with (byte-level BPE's "Ġ", SentencePiece's "▁"). Special
    tokens are none of them. Constrained beam search forbids them right after a target term
    (`generate(..., glossary_suffix_ids=...)`), which then ends a word.
    """
    with tokenizer_lock(tokenizer):
        word = tokenizer(" a", add_special_tokens=False)["input_ids"][-1:]
        special = set(tokenizer.all_special_ids)
        ids = [i for i in range(len(tokenizer)) if i not in special]
        prefix = tokenizer.decode(word)
        texts = tokenizer.batch_decode([word + [i] for i in ids], clean_up_tokenization_spaces=False)
    return [
        i
        for i, text in zip(ids, texts, strict=True)
        if text.startswith(prefix) and text[len(prefix) : len(prefix) + 1].isalnum()
    ]
