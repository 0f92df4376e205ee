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
from pathlib import Path

import evaluate
import torch
from tqdm.auto import tqdm
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .generation_vaswani import check_num_beams
from .inference import Engine, TorchEngine
from .inference_config import BATCH_SIZE, LONG_INPUTS
from .tokenization import tokenizer_lock

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


class _Translator:
    """Translates batches of sentences with an engine, applying the user's choice for too-long sources.

    Sources longer than the engine's `source_limit` are truncated to it with one warning per instance (one per
    `translate` call or stream), or raise, as `long_inputs` says.
    """

    def __init__(self, engine: Engine, batch_size: int, long_inputs: str) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1 sentence, got {batch_size}.")
        if long_inputs not in LONG_INPUTS:
            raise ValueError(f"long_inputs must be one of {', '.join(LONG_INPUTS)}, got {long_inputs!r}.")
        self.engine, self.batch_size, self.long_inputs = engine, batch_size, long_inputs
        self.warned = False

    def check_lengths(self, sentences: list[str], first_number: int) -> None:
        """Raise or warn (once) for sentences over the limit; `first_number` is the 1-based number of `sentences[0]`."""
        limit, tokenizer = self.engine.source_limit, self.engine.tokenizer
        if limit is None or self.warned or not sentences:  # the tokenizer fails on an empty list
            return
        # verbose=False: transformers would add its own warning about the length to ours.
        with tokenizer_lock(tokenizer):
            lengths = [len(ids) for ids in tokenizer(sentences, verbose=False)["input_ids"]]
        too_long = next((i for i, length in enumerate(lengths) if length > limit), None)
        if too_long is None:
            return
        problem = (
            f"Sentence {first_number + too_long} has {lengths[too_long]} tokens, more than the model's limit of "
            f"{limit} ({self.engine.limit_name})"
        )
        if self.long_inputs == "error":
            raise ValueError(f"{problem}; shorten or split it, or pass long_inputs='truncate' (--long-inputs).")
        logger.warning(
            f"{problem}: it and any other sentence that long are truncated to {limit} tokens "
            "(warned once); pass long_inputs='error' (--long-inputs error) to fail instead."
        )
        self.warned = True

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
    batch_size: int = BATCH_SIZE,
    progress: bool = False,
    long_inputs: str = LONG_INPUTS[0],
    num_workers: int = 1,
    **generate_kwargs,
) -> list[str]:
    """Translate sentences in batches of similar length with `model.generate()`.

    Decoding follows the model's generation config (beam 4 and length penalty 0.6 for models
    trained here, §6.1) unless `generate_kwargs` say otherwise. Every sentence is measured before
    any is translated, so `long_inputs="error"` fails before doing work.

    Args:
        model, tokenizer: from `inference.load_translator`, or an engine from `inference.load_engine` (with
            `engine="ctranslate2"`, CTranslate2's beam search, nearly always the same translations: see
            `inference.CTranslate2Engine`; an engine takes no `generate_kwargs`) and its tokenizer.
        sentences: source sentences; an empty (or blank) string translates to an empty string, an
            empty list to an empty list, without calling the model.
        batch_size: sentences per `generate()` call.
        progress: show a progress bar (in sentences).
        long_inputs: for sources longer than the engine's `source_limit` (tokens): "error" (the default:
            `InferenceConfig`'s), or "truncate" them to it with one warning (logged).
        num_workers: CPU processes that translate batches side by side, one thread each
            (`map_in_workers`; Linux and other Unixes, not macOS or Windows); 1 (the default)
            translates here with PyTorch's threads.
        **generate_kwargs: e.g. `num_beams=1` for greedy decoding.

    Returns:
        One translation per sentence, detokenized, in the input's order. Non-blank sentences that translate to an
        empty string are counted in one warning (logged) per call.

    Raises:
        TypeError: `sentences` is one string, not a list of them.
        ValueError: `batch_size` < 1, an unknown `long_inputs`, `generate_kwargs` with an engine,
            `num_workers` below 1 or above 1 for a model off the CPU or a CTranslate2 engine, or (with "error") a
            source over the limit; the message names the sentence (1-based) and its length.
    """
    if isinstance(sentences, str):  # else each character would be translated as a sentence of its own
        raise TypeError("translate() takes a list of sentences: write translate(model, tokenizer, [sentence]).")
    engine = as_engine(model, tokenizer, generate_kwargs)
    _check_num_workers(engine, num_workers)
    translator = _Translator(engine, batch_size, long_inputs)
    translator.check_lengths(sentences, first_number=1)
    with tqdm(total=len(sentences), unit="sent", desc="Translating", disable=not progress) as bar:
        translations = translator.translate(sentences, num_workers, bar)
    warn_of_empty_translations(sentences, translations)
    return translations


def translate_stream(
    model: PreTrainedModel | Engine,
    tokenizer: PreTrainedTokenizerBase,
    lines: Iterable[str],
    batch_size: int = BATCH_SIZE,
    long_inputs: str = LONG_INPUTS[0],
    num_workers: int = 1,
    **generate_kwargs,
) -> Iterator[str]:
    """Translate lines as they arrive (e.g. from stdin), `batch_size` at a time, in order.

    A line is translated as soon as its batch is full or the input ends; pass `batch_size=1` to
    answer every line at once in an interactive session. With `num_workers` above 1 the workers
    take up to two batches each ahead of the output, for files rather than a terminal. Lines lose a
    trailing newline; an empty line gives an empty line, and no lines give no output. Arguments and
    errors are those of `translate` (sentence numbers count from the first line of the stream); a
    too-long line raises only when its batch is reached, and a line that is not UTF-8 when it is
    read, both after the lines before them were yielded. Non-blank lines that translate to an empty
    string are counted in one warning when the stream ends.

    See docs/performance.md, "Translating in worker processes".
    """
    if isinstance(lines, str):  # else each character would be translated as a line of its own
        raise TypeError("translate_stream() takes lines of text (a file, a list of strings): write [text] for one.")
    engine = as_engine(model, tokenizer, generate_kwargs)
    _check_num_workers(engine, num_workers)
    translator = _Translator(engine, batch_size, long_inputs)
    handed_out: deque[list[str]] = deque()  # the batches given to the workers, whose translations come back in order

    def checked_batches(lines: Iterator[str]) -> Iterator[list[str]]:
        first_number, unreadable = 1, None
        while unreadable is None:
            batch = []
            try:
                for line in itertools.islice(lines, batch_size):
                    batch.append(line.rstrip("\n"))
            except ValueError as error:  # a line that is not UTF-8: the lines before it are translated first
                unreadable = error
            if not batch:
                break
            translator.check_lengths(batch, first_number)
            handed_out.append(batch)
            yield batch
            first_number += len(batch)
        if unreadable is not None:
            raise unreadable

    empty, non_blank, first_number = [], 0, 1
    try:
        for translations in map_in_workers(translator.translate, checked_batches(iter(lines)), num_workers):
            batch = handed_out.popleft()
            empty += _empty_translations(batch, translations, first_number)
            non_blank += sum(bool(line.strip()) for line in batch)
            first_number += len(batch)
            yield from translations
    finally:  # also when the stream stops at an error, or its reader stops
        _warn_of_empty_translations(empty, non_blank)


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
        hypotheses = translate(model, tokenizer, sources, BATCH_SIZE, long_inputs="truncate")
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
        model, tokenizer: from `inference.load_translator`, or a model being trained (in eval mode).
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
                model, tokenizer, sources, batch_size, long_inputs="truncate", num_beams=beams, **penalty
            )
            bleu = round(corpus_bleu(hypotheses, references)["score"], 2)
            tried.append({"num_beams": beams, "length_penalty": alpha, "bleu": bleu})
    best = max(tried, key=lambda t: t["bleu"])  # max keeps the first of equal scores
    return {**best, "sentences": len(sources), "tried": tried}
