"""Translate with a trained model (beam search, §6.1) and score the translations with sacreBLEU through `evaluate`."""

import itertools
import logging
import multiprocessing
import os
import pickle
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import evaluate
import torch
from tqdm.auto import tqdm
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..data.segmentation import Pieces, fit_to_limit
from ..data.text_format import TEXT_FORMATS, split_text
from ..data.tokenizer import tokenizer_lock
from ..model.generation_vaswani import check_num_beams
from .config import BATCH_SIZE, LONG_INPUTS, SPLIT_SENTENCES
from .engines import Engine, TorchEngine

SACREBLEU_SCRIPT = str(Path(__file__).parent / "metrics" / "sacrebleu.py")
logger = logging.getLogger(__name__)


# In a worker process of `map_in_workers`: the function it serves. The process belongs to one call, which set it.
_worker_function: Callable | None = None


def _start_worker(function: Callable) -> None:
    # A forked process cannot start the OpenMP threads of its parent again (GNU OpenMP hangs), so each worker computes
    # on one thread, and its tokenizer too (tokenizers would warn about its own threads).
    global _worker_function
    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_function = function


def _run_in_worker(item):
    try:
        return _worker_function(item)
    except Exception as error:
        # An exception that does not survive pickling would reach the caller as BrokenProcessPool instead.
        try:
            pickle.loads(pickle.dumps(error))
        except Exception:
            raise RuntimeError(f"{type(error).__name__}: {error}") from None
        raise


def can_fork_workers() -> bool:
    """Whether this platform runs `map_in_workers` with more than one worker: Linux and the other Unixes.

    Windows cannot fork; macOS can, but its system libraries are not safe in a forked child (Python
    starts processes there by spawning since 3.8).

    See docs/performance.md, "Translating in worker processes".
    """
    return "fork" in multiprocessing.get_all_start_methods() and sys.platform != "darwin"


def map_in_workers(function: Callable, items: Iterable, num_workers: int = 1) -> Iterator:
    """`function(item)` for each item, in order, computed by `num_workers` processes of one thread each.

    The model's decoding step is many small operators, and one Python thread issues them in turn:
    on a CPU, worker processes that each translate whole batches on one thread keep every core busy
    where one process with a thread per core waits on its interpreter (docs/performance.md,
    "Translating in worker processes"). The workers are forked from this process when the first
    item comes, so they share its model (copy-on-write) and may run a closure; they end with the
    iteration. A fork copies only the calling thread: call it where no other thread of this process
    is computing (a server's threads hold locks that would stay held in the workers). Items are read
    as the results are taken, at most two per worker ahead, so a result waits for later items (or
    the end of `items`): for files, not for lines typed one by one. An error from `items` comes
    after the results of the items before it.

    Args:
        function: item -> result; run in the worker processes (in this process for `num_workers=1`).
        items: its arguments, sent to the workers by pickling (a batch of sentences, say).
        num_workers: processes, each with one intra-op thread; 1 computes here, with this process's threads.

    Returns:
        An iterator of `function(item)` for each item, in the order of `items`.

    Raises:
        ValueError (at the call): `num_workers` below 1, or above 1 where `can_fork_workers()` is False.
        concurrent.futures.process.BrokenProcessPool: a worker died (killed for memory, say).
        Whatever `function` raises in a worker (as RuntimeError with its type and message where the exception
        cannot be pickled), and whatever `items` raises.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1 process, got {num_workers}.")
    if num_workers == 1:
        return map(function, items)
    if not can_fork_workers():
        raise ValueError(
            f"num_workers above 1 forks worker processes, which {sys.platform} cannot do safely: use num_workers=1."
        )
    return _mapped_in_workers(function, iter(items), num_workers)


def _mapped_in_workers(function: Callable, items: Iterator, num_workers: int) -> Iterator:
    pending, error = deque(), None
    pool = ProcessPoolExecutor(num_workers, multiprocessing.get_context("fork"), _start_worker, (function,))
    try:
        while True:
            try:
                item = next(items)
            except StopIteration:
                break
            except Exception as exception:  # the items before it are still translated and yielded first
                error = exception
                break
            pending.append(pool.submit(_run_in_worker, item))
            if len(pending) == 2 * num_workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
        if error is not None:
            raise error
    finally:
        pool.shutdown(cancel_futures=True)


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


def _blank(translations: list[str]) -> str:
    return ""


@dataclass(frozen=True)
class _Prepared:
    """Texts ready to translate: the pieces the engine is given, and how their translations become the texts'."""

    pieces: Pieces
    sentences: list[int]  # how many sentences each text holds
    rebuilds: list[Callable[[list[str]], str]]

    def finish(self, translations: list[str]) -> list[str]:
        """One translated text per text, from one translation per piece."""
        per_sentence = self.pieces.join(translations, sum(self.sentences))
        texts, start = [], 0
        for count, rebuild in zip(self.sentences, self.rebuilds, strict=True):
            texts.append(rebuild(per_sentence[start : start + count]))
            start += count
        return texts


class _Translator:
    """Translates batches of texts with an engine: their sentences, and the user's choice for too-long ones.

    Each text (in `text_format`, "text" or "html") is split into sentences (`text_format.split_text`) unless
    `split_sentences` is False. Sentences longer
    than the engine's `source_limit` raise, are split at a clause or word boundary (`segmentation.fit_to_limit`,
    one warning per batch), or are truncated to it with one warning per instance (one per `translate` call or
    stream), as `long_inputs` says.
    """

    def __init__(
        self,
        engine: Engine,
        batch_size: int,
        long_inputs: str,
        split_sentences: bool = False,
        source_lang: str | None = None,
        text_format: str = "text",
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
        self.warned = False

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Each text's source tokens, `</s>` included."""
        if not texts:  # the tokenizer fails on an empty list
            return []
        tokenizer = self.engine.tokenizer
        # verbose=False: transformers would add its own warning about the length to ours.
        with tokenizer_lock(tokenizer):
            return [len(ids) for ids in tokenizer(texts, verbose=False)["input_ids"]]

    def prepare(self, texts: list[str], first_number: int) -> _Prepared:
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
            return _Prepared(pieces, counts, rebuilds)
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
        return _Prepared(Pieces(sentences, lengths, list(range(len(sentences))), []), counts, rebuilds)

    def translate(self, sentences: list[str], num_workers: int = 1, progress: tqdm | None = None) -> list[str]:
        """Translate `sentences` (already checked) in batches of similar length; the output keeps their order.

        `progress` (a bar counting sentences) is updated here, never in a worker: a bar takes tqdm's lock,
        which a worker forked while tqdm's monitor thread held it would wait on forever.
        """
        # Sorting by length keeps padding, and so wasted work, small.
        order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
        chunks = [order[start : start + self.batch_size] for start in range(0, len(order), self.batch_size)]
        batches = [[i for i in chunk if sentences[i].strip()] for chunk in chunks]  # blank lines stay blank
        translated = map_in_workers(self.engine.translate, ([sentences[i] for i in b] for b in batches), num_workers)
        translations = [""] * len(sentences)
        for chunk, batch, texts in zip(chunks, batches, translated, strict=True):
            for i, text in zip(batch, texts, strict=True):
                translations[i] = text
            if progress is not None:
                progress.update(len(chunk))
        return translations


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
    **generate_kwargs,
) -> list[str]:
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
        text_format: "text" (the default), or "html": each text a document whose text nodes are translated and
            whose markup is kept as written (`text_format.split_text`), LibreTranslate's `format`.
        progress: show a progress bar (in sentences).
        **generate_kwargs: e.g. `num_beams=1` for greedy decoding.

    Returns:
        One translation per text, detokenized, in the input's order. Non-blank sentences that translate to an
        empty string are counted in one warning (logged) per call.

    Raises:
        TypeError: `sentences` is one string, not a list of them.
        ValueError: `batch_size` < 1, an unknown `long_inputs` or `text_format`, `generate_kwargs` with an engine,
            `num_workers` below 1 or above 1 for a model off the CPU or a CTranslate2 engine, HTML that Python's
            parser cannot read, or (with "error") a source over the limit; the message names the sentence (1-based)
            and its length.
    """
    if isinstance(sentences, str):  # else each character would be translated as a sentence of its own
        raise TypeError("translate() takes a list of sentences: write translate(model, tokenizer, [sentence]).")
    engine = as_engine(model, tokenizer, generate_kwargs)
    _check_num_workers(engine, num_workers)
    translator = _Translator(engine, batch_size, long_inputs, split_sentences, source_lang, text_format)
    prepared = translator.prepare(sentences, first_number=1)
    pieces = prepared.pieces.texts
    with tqdm(total=len(pieces), unit="sent", desc="Translating", disable=not progress) as bar:
        translations = prepared.finish(translator.translate(pieces, num_workers, bar))
    warn_of_empty_translations(sentences, translations)
    return translations


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
    **generate_kwargs,
) -> Iterator[str]:
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
    document, translated whole (`translate`'s `text_format`).

    See docs/performance.md, "Translating in worker processes".
    """
    if isinstance(lines, str):  # else each character would be translated as a line of its own
        raise TypeError("translate_stream() takes lines of text (a file, a list of strings): write [text] for one.")
    engine = as_engine(model, tokenizer, generate_kwargs)
    _check_num_workers(engine, num_workers)
    translator = _Translator(engine, batch_size, long_inputs, split_sentences, source_lang, text_format)
    # The batches given to the workers, whose translations come back in order.
    handed_out: deque[tuple[list[str], _Prepared]] = deque()
    batches = _checked_batches(translator, iter(lines), handed_out)
    empty, non_blank, first_number = [], 0, 1
    try:
        for translated in map_in_workers(translator.translate, batches, num_workers):
            batch, prepared = handed_out.popleft()
            translations = prepared.finish(translated)
            empty += _empty_translations(batch, translations, first_number)
            non_blank += sum(bool(line.strip()) for line in batch)
            first_number += len(batch)
            yield from translations
    finally:  # also when the stream stops at an error, or its reader stops
        _warn_of_empty_translations(empty, non_blank)


def _checked_batches(
    translator: _Translator, lines: Iterator[str], handed_out: deque[tuple[list[str], _Prepared]]
) -> Iterator[list[str]]:
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
        yield prepared.pieces.texts
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
