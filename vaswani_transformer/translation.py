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
from safetensors import SafetensorError
from tqdm.auto import tqdm
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .compat_vaswani import VERY_LARGE_INTEGER
from .export import CTranslate2Engine, _pickled_code_refused
from .generation_vaswani import check_num_beams
from .hub import check_model_exists
from .serving_config import BATCH_SIZE, LONG_INPUTS
from .tokenization import check_tokenizer_matches, tokenizer_lock

SACREBLEU_SCRIPT = str(Path(__file__).parent / "metrics" / "sacrebleu.py")
logger = logging.getLogger(__name__)


def load_translator(model_dir: str, device: str | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a saved model (in eval mode) and its tokenizer from a directory or Hub id, and check that they fit.

    See docs/robustness.md, "Bad input".

    Args:
        model_dir: what `from_pretrained` accepts.
        device: "cpu", "cuda", "cuda:1", ...; None picks CUDA when available.

    Raises:
        OSError: the directory does not exist or holds no tokenizer, its weights file is damaged or a pickle of
            more than tensors (refused, never run), or neither a directory nor the Hub holds such a model.
        ValueError: `device` is no torch device or CUDA on a machine without it, `config.json` holds impossible values
            (from `VaswaniConfig`), or the tokenizer does not match the model (see `check_tokenizer_matches`).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"device {device!r} is no torch device; give e.g. cpu, cuda or cuda:0.") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {device!r}: this PyTorch sees no CUDA GPU; use --device cpu, or a CUDA build of torch."
        )
    local = Path(model_dir).expanduser()
    if local.is_dir() and not any((local / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise OSError(f"{model_dir} holds no tokenizer (tokenizer.json); save one beside the model, as `train` does.")
    check_model_exists(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    except SafetensorError as error:
        raise OSError(f"{model_dir}: model.safetensors is damaged ({error}); copy or download it again.") from error
    except pickle.UnpicklingError as error:
        raise _pickled_code_refused(model_dir) from error
    except OSError as error:
        if local.is_dir():
            raise
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise OSError(
            f"{model_dir} is not a directory here, and loading it from the Hub failed: {first_line}"
        ) from error
    check_tokenizer_matches(model.config, tokenizer, model_dir)
    return model.to(device).eval(), tokenizer


def source_length_limit(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The longest source, in tokens with `</s>`, that `translate` gives the model, or None for no limit.

    The tokenizer's `model_max_length` (training sets it to the longest training sentence,
    `--max-length`) and, for learned positions (Table 3 row E), `max_position_embeddings`, beyond
    which the model has no position vector. Sinusoidal positions (§3.5) set no limit of their own.
    """
    limits = [tokenizer.model_max_length] if tokenizer.model_max_length < VERY_LARGE_INTEGER else []
    if getattr(model.config, "position_embedding_type", None) == "learned":
        limits.append(model.config.max_position_embeddings)
    return min(limits, default=None)


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


def _check_num_workers(model: PreTrainedModel | CTranslate2Engine, num_workers: int) -> None:
    if num_workers > 1 and (isinstance(model, CTranslate2Engine) or model.device.type != "cpu"):
        raise ValueError(
            f"num_workers={num_workers} (--num-workers) translates with the model in that many CPU processes of one "
            "thread each: use 1 for a model on a GPU or a CTranslate2 engine (which has its own inter_threads)."
        )


class _Translator:
    """Translates batches of sentences with `generate()`, or a `CTranslate2Engine`, applying the user's choice for
    too-long sources.

    Sources longer than `source_length_limit` (the engine's `source_limit`) are truncated to it with one warning
    per instance (one per `translate` call or stream), or raise, as `long_inputs` says.
    """

    def __init__(
        self,
        model: PreTrainedModel | CTranslate2Engine,
        tokenizer: PreTrainedTokenizerBase,
        batch_size: int,
        long_inputs: str,
        generate_kwargs: dict,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1 sentence, got {batch_size}.")
        if long_inputs not in LONG_INPUTS:
            raise ValueError(f"long_inputs must be one of {', '.join(LONG_INPUTS)}, got {long_inputs!r}.")
        if isinstance(model, CTranslate2Engine) and generate_kwargs:
            raise ValueError(
                f"A CTranslate2 engine takes no generate() arguments ({', '.join(generate_kwargs)}): pass num_beams "
                "or length_penalty to export.load_ctranslate2_engine, or translate with the model from load_translator."
            )
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.long_inputs, self.generate_kwargs = long_inputs, generate_kwargs
        if isinstance(model, CTranslate2Engine):
            self.limit, self.limit_name = model.source_limit, "the CTranslate2 export's limit"
        else:
            self.limit = source_length_limit(model, tokenizer)
            learned = self.limit is not None and self.limit < tokenizer.model_max_length
            self.limit_name = "max_position_embeddings" if learned else "the tokenizer's model_max_length"
        self.warned = False

    def check_lengths(self, sentences: list[str], first_number: int) -> None:
        """Raise or warn (once) for sentences over the limit; `first_number` is the 1-based number of `sentences[0]`."""
        if self.limit is None or self.warned or not sentences:  # the tokenizer fails on an empty list
            return
        # verbose=False: transformers would add its own warning about the length to ours.
        with tokenizer_lock(self.tokenizer):
            lengths = [len(ids) for ids in self.tokenizer(sentences, verbose=False)["input_ids"]]
        too_long = next((i for i, length in enumerate(lengths) if length > self.limit), None)
        if too_long is None:
            return
        problem = (
            f"Sentence {first_number + too_long} has {lengths[too_long]} tokens, more than the model's limit of "
            f"{self.limit} ({self.limit_name})"
        )
        if self.long_inputs == "error":
            raise ValueError(f"{problem}; shorten or split it, or pass long_inputs='truncate' (--long-inputs).")
        logger.warning(
            f"{problem}: it and any other sentence that long are truncated to {self.limit} tokens "
            "(warned once); pass long_inputs='error' (--long-inputs error) to fail instead."
        )
        self.warned = True

    @torch.inference_mode()
    def translate_batch(self, sentences: list[str]) -> list[str]:
        """Translate non-blank `sentences` (already checked) with one `generate()` call or CTranslate2 batch."""
        if not sentences:
            return []
        if isinstance(self.model, CTranslate2Engine):
            return self.model.translate(sentences)
        with tokenizer_lock(self.tokenizer):
            inputs = self.tokenizer(
                sentences, return_tensors="pt", padding=True, truncation=self.limit is not None, max_length=self.limit
            ).to(self.model.device)
        output_ids = self.model.generate(**inputs, **self.generate_kwargs)
        return [text.strip() for text in self.tokenizer.batch_decode(output_ids, skip_special_tokens=True)]

    def translate(self, sentences: list[str], num_workers: int = 1, progress: tqdm | None = None) -> list[str]:
        """Translate `sentences` (already checked) in batches of similar length; the output keeps their order.

        `progress` (a bar counting sentences) is updated here, never in a worker: a bar takes tqdm's lock,
        which a worker forked while tqdm's monitor thread held it would wait on forever.
        """
        # Sorting by length keeps padding, and so wasted work, small.
        order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
        chunks = [order[start : start + self.batch_size] for start in range(0, len(order), self.batch_size)]
        batches = [[i for i in chunk if sentences[i].strip()] for chunk in chunks]  # blank lines stay blank
        translated = map_in_workers(self.translate_batch, ([sentences[i] for i in b] for b in batches), num_workers)
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


def translate(
    model: PreTrainedModel | CTranslate2Engine,
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
        model, tokenizer: from `load_translator`, or from `export.load_ctranslate2_engine` (CTranslate2's beam
            search, nearly always the same translations: see `export.CTranslate2Engine`; then no `generate_kwargs`).
        sentences: source sentences; an empty (or blank) string translates to an empty string, an
            empty list to an empty list, without calling the model.
        batch_size: sentences per `generate()` call.
        progress: show a progress bar (in sentences).
        long_inputs: for sources longer than `source_length_limit` (tokens): "truncate" them to
            it with one warning (logged), or "error".
        num_workers: CPU processes that translate batches side by side, one thread each
            (`map_in_workers`; Linux and other Unixes, not macOS or Windows); 1 (the default)
            translates here with PyTorch's threads.
        **generate_kwargs: e.g. `num_beams=1` for greedy decoding.

    Returns:
        One translation per sentence, detokenized, in the input's order. Non-blank sentences that translate to an
        empty string are counted in one warning (logged) per call.

    Raises:
        TypeError: `sentences` is one string, not a list of them.
        ValueError: `batch_size` < 1, an unknown `long_inputs`, `generate_kwargs` with a CTranslate2 engine,
            `num_workers` below 1 or above 1 for a model off the CPU or a CTranslate2 engine, or (with "error") a
            source over the limit; the message names the sentence (1-based) and its length.
    """
    if isinstance(sentences, str):  # else each character would be translated as a sentence of its own
        raise TypeError("translate() takes a list of sentences: write translate(model, tokenizer, [sentence]).")
    _check_num_workers(model, num_workers)
    translator = _Translator(model, tokenizer, batch_size, long_inputs, generate_kwargs)
    translator.check_lengths(sentences, first_number=1)
    with tqdm(total=len(sentences), unit="sent", desc="Translating", disable=not progress) as bar:
        translations = translator.translate(sentences, num_workers, bar)
    _warn_of_empty_translations(_empty_translations(sentences, translations), sum(bool(s.strip()) for s in sentences))
    return translations


def translate_stream(
    model: PreTrainedModel | CTranslate2Engine,
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
    _check_num_workers(model, num_workers)
    translator = _Translator(model, tokenizer, batch_size, long_inputs, generate_kwargs)
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
        hypotheses = translate(model, tokenizer, sources, BATCH_SIZE)
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
        model, tokenizer: from `load_translator`, or a model being trained (in eval mode).
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
            hypotheses = translate(model, tokenizer, sources, batch_size, num_beams=beams, **penalty)
            bleu = round(corpus_bleu(hypotheses, references)["score"], 2)
            tried.append({"num_beams": beams, "length_penalty": alpha, "bleu": bleu})
    best = max(tried, key=lambda t: t["bleu"])  # max keeps the first of equal scores
    return {**best, "sentences": len(sources), "tried": tried}
