"""Translate with a trained model (beam search, §6.1) and score the translations with sacreBLEU through `evaluate`."""

import collections
import itertools
import logging
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import NamedTuple

import evaluate
from tqdm.auto import tqdm
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..data.segmentation import Alignment, Pieces, fit_to_limit
from ..data.text_format import TEXT_FORMATS, Prepared, TranslatedText, split_text
from ..data.tokenizer import tokenizer_lock
from ..model.generation_vaswani import check_num_beams
from .alignment import Aligner, needed_aligner
from .confidence import Score, piece_scores, scored_texts
from .config import BATCH_SIZE, LONG_INPUTS, SPLIT_SENTENCES
from .engines import Engine, TorchEngine
from .glossary import Glossary

# Re-exported: callers (tests/conftest.py) import it from here, where it lived.
from .workers import can_fork_workers as can_fork_workers
from .workers import map_in_workers

SACREBLEU_SCRIPT = str(Path(__file__).parent / "metrics" / "sacrebleu.py")
logger = logging.getLogger(__name__)


def as_engine(model: PreTrainedModel | Engine, tokenizer: PreTrainedTokenizerBase, generate_kwargs: dict) -> Engine:
    """`model` as the engine `translate` drives: an `Engine` as it is, a model as a `TorchEngine`.

    Raises:
        ValueError: `generate_kwargs` with an engine, which took its decoding when it was made.
    """
    if not isinstance(model, Engine):
        return TorchEngine(model, tokenizer, generate_kwargs)
    if generate_kwargs:
        raise ValueError(
            f"An engine takes no generate() arguments ({', '.join(generate_kwargs)}): give num_beams or "
            "length_penalty to inference.load_engine (its InferenceConfig), or translate with the model itself."
        )
    return model


def _check_num_workers(engine: Engine, num_workers: int) -> None:
    if num_workers > 1 and not engine.runs_in_cpu_workers:
        raise ValueError(
            f"num_workers={num_workers} (--num-workers) translates with the model in that many CPU processes of one "
            "thread each: use 1 for a model on a GPU or a CTranslate2 engine (which has its own inter_threads)."
        )


def _blank(translations: list[str], alignments: list[Alignment | None] | None = None) -> str:
    return ""


class _Batch(NamedTuple):
    """What the engine gave for a batch of pieces: a translation each and, with an aligner, a word alignment each;
    with `scores`, each one's `confidence.Score` (None for a blank piece)."""

    translations: list[str]
    alignments: list[Alignment] | None = None
    scores: list[Score | None] | None = None


class _Translator:
    """Translates batches of texts with an engine: their sentences, and the user's choice for too-long ones.

    Each text (in `text_format`, "text" or "html") is split into sentences (`text_format.split_text`) unless
    `split_sentences` is False. Sentences longer
    than the engine's `source_limit` raise, are split at a clause or word boundary (`segmentation.fit_to_limit`,
    one warning per batch), or are truncated to it with one warning per instance (one per `translate` call or
    stream), as `long_inputs` says. With an `aligner`, each batch's translations are aligned to their sources in
    the same process (`alignment.Aligner`): HTML's markup and `alignments=True` take them. A `glossary` goes to the
    engine with every batch (`Engine.scored_hypotheses`); with `scores`, each piece's translation is scored.
    """

    def __init__(
        self,
        engine: Engine,
        batch_size: int,
        long_inputs: str,
        split_sentences: bool = False,
        source_lang: str | None = None,
        text_format: str = "text",
        aligner: Aligner | None = None,
        glossary: Glossary | None = None,
        scores: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1 sentence, got {batch_size}.")
        if long_inputs not in LONG_INPUTS:
            raise ValueError(f"long_inputs must be one of {', '.join(LONG_INPUTS)}, got {long_inputs!r}.")
        if text_format not in TEXT_FORMATS:
            raise ValueError(f"text_format must be 'text' or 'html', got {text_format!r}.")
        self.engine, self.batch_size, self.long_inputs = engine, batch_size, long_inputs
        self.text_format = text_format
        self.split_sentences, self.source_lang = split_sentences, source_lang
        self.aligner, self.glossary, self.scores = aligner, glossary, scores
        self.warned = False

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Each text's source tokens, `</s>` included."""
        if not texts:  # the tokenizer fails on an empty list
            return []
        tokenizer = self.engine.tokenizer
        # verbose=False: transformers would add its own warning about the length to ours.
        with tokenizer_lock(tokenizer):
            return [len(ids) for ids in tokenizer(texts, verbose=False)["input_ids"]]

    def prepare(self, texts: list[str], first_number: int) -> Prepared:
        """Split `texts` into sentences and check them against the limit; `first_number` is `texts[0]`'s (1-based).

        Raises:
            ValueError: with long_inputs="error", a sentence over the limit, named by its text's number.
        """
        splits = [split_text(text, self.text_format, self.source_lang, self.split_sentences) for text in texts]
        sentences = [sentence for found, _ in splits for sentence in found]
        counts = [len(found) for found, _ in splits]
        # A blank text translates to "", as `translate` promises, not to the whitespace of its layout.
        rebuilds = [rebuild if text.strip() else _blank for text, (_, rebuild) in zip(texts, splits, strict=True)]
        limit = self.engine.source_limit
        lengths = self.count_tokens(sentences) if limit is not None else [0] * len(sentences)
        too_long = next((i for i, length in enumerate(lengths) if length > limit), None) if limit else None
        if too_long is not None and self.long_inputs == "split":
            pieces = fit_to_limit(sentences, lengths, limit, lambda text: self.count_tokens([text])[0])
            return Prepared(pieces, counts, rebuilds, sentences)
        if too_long is not None and not self.warned:
            line = next(t for t in range(len(counts)) if sum(counts[: t + 1]) > too_long)
            where = f"Sentence {first_number + line}"
            if counts[line] > 1:  # an HTML document is one text, whose lines are no unit of its sentences
                unit = "line" if self.text_format == "text" else "HTML text"
                where = f"Sentence {too_long - sum(counts[:line]) + 1} of {unit} {first_number + line}"
            problem = (
                f"{where} has {lengths[too_long]} tokens, more than the model's limit of {limit} "
                f"({self.engine.limit_name})"
            )
            if self.long_inputs == "error":
                raise ValueError(
                    f"{problem}; shorten or split it, or pass long_inputs='split' or 'truncate' (--long-inputs)."
                )
            logger.warning(
                f"{problem}: it and any other sentence that long are truncated to {limit} tokens "
                "(warned once); pass long_inputs='error' (--long-inputs error) to fail instead."
            )
            self.warned = True
        pieces = Pieces(sentences, lengths, list(range(len(sentences))), [])
        return Prepared(pieces, counts, rebuilds, sentences)

    def _translate_batch(self, sentences: list[str]) -> _Batch:
        # One batch of the engine, its alignments and scores: in a worker process where there are workers.
        scores = None
        if self.scores:
            best = [found[0] for found in self.engine.scored_hypotheses(sentences, 1, self.glossary)]
            translations = [hypothesis.text for hypothesis in best]
            scores = piece_scores(best, self.count_tokens(translations))
        else:
            translations = self.engine.translate(sentences, self.glossary)
        alignments = self.aligner.align(sentences, translations) if self.aligner is not None else None
        return _Batch(translations, alignments, scores)

    def translate(self, pieces: Pieces, num_workers: int = 1, progress: tqdm | None = None) -> _Batch:
        """Translate `pieces` (already checked) in batches of similar length; the output keeps their order.

        `progress` (a bar counting sentences: a split one when its last piece is done) is updated here, never in a
        worker: a bar takes tqdm's lock, which a worker forked while tqdm's monitor thread held it would wait on
        forever.
        """
        sentences = pieces.texts
        # Sorting by length keeps padding, and so wasted work, small.
        order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
        chunks = [order[start : start + self.batch_size] for start in range(0, len(order), self.batch_size)]
        batches = [[i for i in chunk if sentences[i].strip()] for chunk in chunks]  # blank lines stay blank
        translated = map_in_workers(self._translate_batch, ([sentences[i] for i in b] for b in batches), num_workers)
        translations = [""] * len(sentences)
        alignments: list[Alignment] | None = [[] for _ in sentences] if self.aligner is not None else None
        scores: list[Score | None] | None = [None] * len(sentences) if self.scores else None
        left = collections.Counter(pieces.owners)  # pieces still to translate, by sentence
        for chunk, batch, done in zip(chunks, batches, translated, strict=True):
            for k, i in enumerate(batch):
                translations[i] = done.translations[k]
                if alignments is not None:
                    alignments[i] = done.alignments[k]
                if scores is not None:
                    scores[i] = done.scores[k]
            if progress is not None:
                left.subtract(pieces.owners[i] for i in chunk)
                progress.update(len({pieces.owners[i] for i in chunk if not left[pieces.owners[i]]}))
        return _Batch(translations, alignments, scores)

    def finish(self, prepared: Prepared, translated: _Batch) -> list[TranslatedText]:
        """The translated texts of `prepared` (`Prepared.finish`), each a `confidence.ScoredText` with `scores`."""
        texts = prepared.finish(translated.translations, translated.alignments)
        return scored_texts(prepared, texts, translated.scores) if self.scores else texts


def _empty_translations(sentences: list[str], translations: list[str], first_number: int = 1) -> list[int]:
    # The numbers (1-based, from `first_number`) of the non-blank sentences whose translation is empty.
    pairs = zip(sentences, translations, strict=True)
    return [first_number + i for i, (sentence, translation) in enumerate(pairs) if sentence.strip() and not translation]


def _warn_of_empty_translations(numbers: list[int], non_blank: int) -> None:
    # Beam search can end a sentence at its first step ("Two <script>alert(2)</script> men." on the main job's
    # model): an empty line among the output is easy to miss, so each call says how many, once.
    if numbers:
        shown = ", ".join(map(str, numbers[:5])) + (", ..." if len(numbers) > 5 else "")
        logger.warning(
            f"{len(numbers)} of {non_blank} non-blank sentences translated to an empty string (sentence {shown}): "
            "the model ended them at once; check those sources, or decode with a larger length penalty "
            "(--length-penalty, length_penalty=), which favours longer outputs."
        )


def warn_of_empty_translations(sentences: list[str], translations: list[str]) -> None:
    """Log one warning counting the non-blank `sentences` whose translation is empty, if any.

    Beam search can end a sentence at its first step; `translate`, `translate_stream` and `serve` (per batch)
    say so, because an empty line among the output is easy to miss. See docs/robustness.md, "Bad input".
    """
    _warn_of_empty_translations(_empty_translations(sentences, translations), sum(bool(s.strip()) for s in sentences))


def translate(
    model: PreTrainedModel | Engine,
    tokenizer: PreTrainedTokenizerBase,
    sentences: list[str],
    *,
    batch_size: int = BATCH_SIZE,
    long_inputs: str = LONG_INPUTS[0],
    num_workers: int = 1,
    split_sentences: bool = SPLIT_SENTENCES,
    source_lang: str | None = None,
    text_format: str = "text",
    progress: bool = False,
    aligner: Aligner | None = None,
    alignments: bool = False,
    glossary: Glossary | None = None,
    scores: bool = False,
    **generate_kwargs,
) -> list[str] | list[TranslatedText]:
    """Translate texts sentence by sentence, in batches of similar length, with `model.generate()`.

    Each text is split into sentences (`text_format.split_text`: a paragraph's sentences, its line breaks and spaces
    kept), unless `split_sentences` is False; all the sentences of the call are sorted by length into batches, and
    each text is put back together from its sentences' translations. Decoding follows the model's generation config
    (beam 4 and length penalty 0.6 for models trained here, §6.1) unless `generate_kwargs` say otherwise. Every
    sentence is measured before any is translated, so `long_inputs="error"` fails before doing work.

    Args:
        model, tokenizer: from `engines.load_translator`, or an engine from `engines.load_engine` (with
            `engine="ctranslate2"`, CTranslate2's beam search, nearly always the same translations: see
            `engines.CTranslate2Engine`; an engine takes no `generate_kwargs`) and its tokenizer.
        sentences: source texts (a sentence, a line, a paragraph); an empty (or blank) string translates to an
            empty string, an empty list to an empty list, without calling the model.
        batch_size: sentences per `generate()` call.
        long_inputs: for sentences longer than the engine's `source_limit` (tokens): "error" (the default:
            `InferenceConfig`'s), "truncate" them to it with one warning (logged), or "split" them at a clause or
            word boundary with one warning (`segmentation.fit_to_limit`).
        num_workers: CPU processes that translate batches side by side, one thread each
            (`map_in_workers`; Linux and other Unixes, not macOS or Windows); 1 (the default)
            translates here with PyTorch's threads.
        split_sentences: split each text into sentences (the default, `InferenceConfig`'s); False translates each
            text whole, for one sentence per line (`evaluate`, validation BLEU).
        source_lang: ISO 639-1 code of the texts, for the segmenter's rules (`segmentation.split_sentences`).
        text_format: "text" (the default), or "html": each text a document whose sentences are translated across
            its inline tags, the markup carried over by word alignment and kept as written
            (`text_format.split_text`, `markup.py`), LibreTranslate's `format`.
        progress: show a progress bar (in sentences).
        aligner: aligns the translations to their sources for HTML's markup and `alignments` (`alignment.Aligner`);
            default: the torch engine's model; for CTranslate2's, `alignment.aligner_for(engine, model_dir)`.
        alignments: give each text's word alignment too (`TranslatedText`), for text only.
        glossary: terms whose target a sentence holding the source term must use (`glossary.Glossary`, constrained
            beam search: `Engine.scored_hypotheses`); a sentence without terms translates as without it.
        scores: give each text's confidence too (`confidence.ScoredText`): the mean log-probability of its
            translation's tokens over all its sentences, in nats (`confidence`); None for a blank text.
        **generate_kwargs: e.g. `num_beams=1` for greedy decoding.

    Returns:
        One translation per text, detokenized, in the input's order (a `TranslatedText` each with `alignments`, a
        `confidence.ScoredText` with `scores`).
        Non-blank sentences that translate to an empty string are counted in one warning (logged) per call.

    Raises:
        TypeError: `sentences` is one string, not a list of them.
        ValueError: `batch_size` < 1, an unknown `long_inputs` or `text_format`, `generate_kwargs` with an engine,
            `num_workers` below 1 or above 1 for a model off the CPU or a CTranslate2 engine, HTML that Python's
            parser cannot read, `alignments` for HTML or without an aligner, or (with "error") a source over the
            limit; the message names the sentence (1-based) and its length; a sentence with a glossary term and
            greedy search, or from `glossary.Glossary.target_ids`.
    """
    if isinstance(sentences, str):  # else each character would be translated as a sentence of its own
        raise TypeError("translate() takes a list of sentences: write translate(model, tokenizer, [sentence]).")
    engine = as_engine(model, tokenizer, generate_kwargs)
    _check_num_workers(engine, num_workers)
    aligner = needed_aligner(engine, aligner, text_format, alignments)
    translator = _Translator(
        engine, batch_size, long_inputs, split_sentences, source_lang, text_format, aligner, glossary, scores
    )
    prepared = translator.prepare(sentences, first_number=1)
    with tqdm(total=len(prepared.found), unit="sent", desc="Translating", disable=not progress) as bar:
        translated = translator.finish(prepared, translator.translate(prepared.pieces, num_workers, bar))
    texts = [each.text for each in translated]
    warn_of_empty_translations(sentences, texts)
    return translated if alignments or scores else texts


def translate_stream(
    model: PreTrainedModel | Engine,
    tokenizer: PreTrainedTokenizerBase,
    lines: Iterable[str],
    *,
    batch_size: int = BATCH_SIZE,
    long_inputs: str = LONG_INPUTS[0],
    num_workers: int = 1,
    split_sentences: bool = SPLIT_SENTENCES,
    source_lang: str | None = None,
    text_format: str = "text",
    progress_bar: tqdm | None = None,
    aligner: Aligner | None = None,
    alignments: bool = False,
    glossary: Glossary | None = None,
    scores: bool = False,
    **generate_kwargs,
) -> Iterator[str] | Iterator[TranslatedText]:
    """Translate lines as they arrive (e.g. from stdin), `batch_size` at a time, in order.

    A line is translated as soon as its batch is full or the input ends; pass `batch_size=1` to
    answer every line at once in an interactive session. Each line is split into sentences, as `translate` splits
    a text, unless `split_sentences` is False; `batch_size` counts lines. With `num_workers` above 1 the workers
    take up to two batches each ahead of the output, for files rather than a terminal. Lines lose a
    trailing newline; an empty line gives an empty line, and no lines give no output. Arguments (in
    `translate`'s order, without `progress`) and errors are those of `translate` (sentence numbers count from the
    first line of the stream); a
    too-long line raises only when its batch is reached, and a line that is not UTF-8 when it is
    read, both after the lines before them were yielded. Non-blank lines that translate to an empty
    string are counted in one warning when the stream ends. With `text_format="html"`, each item is an HTML
    document, translated whole (`translate`'s `text_format`). `progress_bar`, a tqdm bar, counts the sentences as
    they are translated (batch by batch of the engine in one process; line batch by line batch with workers).
    `aligner`, `alignments`, `glossary` and `scores` are `translate`'s: with `alignments` or `scores`, each item is a
    `TranslatedText` (a `confidence.ScoredText` with `scores`).

    See docs/performance.md, "Translating in worker processes".
    """
    if isinstance(lines, str):  # else each character would be translated as a line of its own
        raise TypeError("translate_stream() takes lines of text (a file, a list of strings): write [text] for one.")
    engine = as_engine(model, tokenizer, generate_kwargs)
    _check_num_workers(engine, num_workers)
    aligner = needed_aligner(engine, aligner, text_format, alignments)
    translator = _Translator(
        engine, batch_size, long_inputs, split_sentences, source_lang, text_format, aligner, glossary, scores
    )
    # The batches given to the workers, whose translations come back in order.
    handed_out: deque[tuple[list[str], Prepared]] = deque()
    batches = _checked_batches(translator, iter(lines), handed_out)
    empty, non_blank, first_number = [], 0, 1
    # In one process the bar moves with every batch of the engine; a worker must not touch it (`_Translator`).
    in_process = progress_bar if num_workers == 1 else None
    try:
        for translated in map_in_workers(partial(translator.translate, progress=in_process), batches, num_workers):
            batch, prepared = handed_out.popleft()
            finished = translator.finish(prepared, translated)
            texts = [each.text for each in finished]
            if progress_bar is not None and in_process is None:
                progress_bar.update(len(prepared.found))
            empty += _empty_translations(batch, texts, first_number)
            non_blank += sum(bool(line.strip()) for line in batch)
            first_number += len(batch)
            yield from finished if alignments or scores else texts
    finally:  # also when the stream stops at an error, or its reader stops
        _warn_of_empty_translations(empty, non_blank)


def _checked_batches(
    translator: _Translator, lines: Iterator[str], handed_out: deque[tuple[list[str], Prepared]]
) -> Iterator[Pieces]:
    # The pieces of each batch of `translator.batch_size` lines, checked against the limit as the batch is reached;
    # each batch and its preparation join `handed_out`, for the translations that come back in order.
    first_number, unreadable = 1, None
    while unreadable is None:
        batch = []
        try:
            for line in itertools.islice(lines, translator.batch_size):
                batch.append(line.rstrip("\n"))
        except ValueError as error:  # a line that is not UTF-8: the lines before it are translated first
            unreadable = error
        if not batch:
            break
        prepared = translator.prepare(batch, first_number)
        handed_out.append((batch, prepared))
        yield prepared.pieces
        first_number += len(batch)
    if unreadable is not None:
        raise unreadable


def corpus_bleu(hypotheses: list[str], references: list[str], lowercase: bool = False, tokenize: str = "13a") -> dict:
    """sacreBLEU corpus BLEU through `evaluate`: cased, detokenized, 13a tokenization by default.

    See README.md, "Command line".

    Args:
        hypotheses: one translation per sentence.
        references: one reference per sentence, aligned with `hypotheses`.
        lowercase, tokenize: sacreBLEU options (e.g. `tokenize="intl"`).

    Returns:
        `{"score": BLEU (0-100), "signature": sacreBLEU signature, ...}`.

    Raises:
        ValueError: the lists differ in length or are empty.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references: they must be aligned.")
    if not hypotheses:
        raise ValueError("No sentences to score: BLEU of an empty test set is undefined; give a non-empty test set.")
    metric = evaluate.load(SACREBLEU_SCRIPT)
    return metric.compute(
        predictions=hypotheses, references=[[r] for r in references], lowercase=lowercase, tokenize=tokenize
    )


def validation_bleu(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sources: list[str],
    references: list[str],
) -> float:
    """sacreBLEU (cased, 13a) of the model's beam-search translations of `sources` (§6.1 decoding).

    Args:
        model: the unwrapped model; it translates `BATCH_SIZE` sentences per `generate` call with its generation
            config (beam 4, length penalty 0.6), and is left in training mode.
        tokenizer: the run's tokenizer.
        sources, references: aligned sentences, one string each.

    Returns:
        The corpus BLEU score, 0 to 100, rounded to two decimals.

    Raises:
        ValueError: `sources` and `references` differ in length or are empty (from `corpus_bleu`).
    """
    model.eval()
    try:
        # A development set's long sentence is truncated, as it was in training, not fatal to the run.
        hypotheses = translate(
            model, tokenizer, sources, batch_size=BATCH_SIZE, long_inputs="truncate", split_sentences=False
        )
    finally:  # a failed validation must not leave the run training without dropout
        model.train()
    return round(corpus_bleu(hypotheses, references)["score"], 2)


def choose_decoding(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sources: list[str],
    references: list[str],
    num_beams: Sequence[int],
    length_penalties: Sequence[float],
    batch_size: int = BATCH_SIZE,
) -> dict:
    """Choose the beam size and length penalty by BLEU on a development set, as §6.1 chose 4 and 0.6.

    "We used beam search with a beam size of 4 and length penalty alpha = 0.6. These hyperparameters
    were chosen after experimentation on the development set." Every pair of `num_beams` x
    `length_penalties` translates `sources` once (greedy search, a beam of 1, once with no penalty);
    the pair with the highest sacreBLEU (cased, 13a) wins, the earlier pair on a tie. The model's
    generation config is left as it was.

    Args:
        model, tokenizer: from `engines.load_translator`, or a model being trained (in eval mode).
        sources, references: the development set, aligned, one sentence each (never the test set).
        num_beams: beam sizes to try, each at least 1.
        length_penalties: GNMT length-penalty alphas to try (§6.1; the model's `length_penalty_type`).
        batch_size: sentences per `generate()` call.

    Returns:
        `{"num_beams": int, "length_penalty": float or None (greedy), "bleu": float, "sentences": int, "tried":
        [{"num_beams", "length_penalty", "bleu"}, ...]}`, BLEU 0 to 100, rounded to two decimals.

    Raises:
        ValueError: an empty list of beam sizes or penalties, a beam size below 1, or unaligned or empty sentences.
    """
    if not num_beams or not length_penalties:
        raise ValueError("Give at least one beam size and one length penalty to choose from.")
    for beams in num_beams:
        check_num_beams(beams)
    tried = []
    for beams in num_beams:
        # Greedy search (1 beam) has no length penalty: it is tried once, recorded with None.
        for alpha in length_penalties if beams > 1 else [None]:
            penalty = {} if alpha is None else {"length_penalty": alpha}
            hypotheses = translate(
                model,
                tokenizer,
                sources,
                batch_size=batch_size,
                long_inputs="truncate",
                split_sentences=False,
                num_beams=beams,
                **penalty,
            )
            bleu = round(corpus_bleu(hypotheses, references)["score"], 2)
            tried.append({"num_beams": beams, "length_penalty": alpha, "bleu": bleu})
    best = max(tried, key=lambda t: t["bleu"])  # max keeps the first of equal scores
    return {**best, "sentences": len(sources), "tried": tried}
