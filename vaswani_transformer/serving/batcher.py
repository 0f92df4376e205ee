"""`MicroBatcher`: the sentences of many requests translated in shared batches, requests taking turns.

`serve` puts each request's sentences here and awaits its answer; one worker thread owns the engine. A batch
holds one sentence of each waiting request in turn (fair queueing), so a big request shares every batch with
those behind it instead of holding the model until it is done. See docs/serving.md, "Micro-batching".
"""

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from ..inference.config import BATCH_SIZE
from ..inference.glossary import Glossary
from .config import ServingConfig

logger = logging.getLogger(__name__)


@dataclass(eq=False)  # compared and hashed by identity: one request is one job
class _Job:
    """One request in the batcher: its sentences, their source tokens, and how far its translation has got."""

    sentences: list[str]
    lengths: list[int]
    future: Future
    timeout: float | None
    deadline: float  # time.monotonic() past which its sentences not yet in a batch are dropped
    translations: list[list | None]  # each sentence's hypotheses, as `translate_fn` gives them
    hypotheses: int = 1  # translations of each sentence, best first
    glossary: Glossary | None = None  # the request's terms, for its sentences alone
    taken: int = 0  # sentences put in a batch so far, in order
    answered: int = 0


_STOP = object()


def fills_a_batch(turns: deque[_Job], batch_size: int, max_batch_tokens: int) -> bool:
    """Whether the sentences waiting in `turns` fill a batch of `batch_size` sentences or `max_batch_tokens` source
    tokens; it stops counting once they do."""
    sentences = tokens = 0
    for job in turns:
        sentences += len(job.sentences) - job.taken
        tokens += sum(job.lengths[job.taken : job.taken + batch_size])
        if sentences >= batch_size or tokens >= max_batch_tokens:
            return True
    return False


def take_turns(turns: deque[_Job], batch_size: int, max_batch_tokens: int) -> list[tuple[_Job, int]]:
    """The next batch, one sentence of each waiting request in turn (fair queueing: round-robin over requests).

    Takes the next sentence of the request at the head of `turns`, sends that request to the back if it has
    sentences left, and so on, until the batch holds `batch_size` sentences or the next sentence would bring it
    over `max_batch_tokens` source tokens (a sentence over the budget is a batch of its own).

    See docs/serving.md, "Micro-batching".

    Args:
        turns: the requests with sentences not yet in a batch, in their turn's order; updated in place.
        batch_size: sentences per batch, at least 1.
        max_batch_tokens: source tokens per batch, all sentences together.

    Returns:
        (request, index of its sentence) pairs, in the order taken; empty when no request waits.
    """
    batch: list[tuple[_Job, int]] = []
    tokens = 0
    while turns and len(batch) < batch_size:
        job = turns[0]
        length = job.lengths[job.taken]
        if batch and tokens + length > max_batch_tokens:
            break
        turns.popleft()
        batch.append((job, job.taken))
        job.taken, tokens = job.taken + 1, tokens + length
        if job.taken < len(job.sentences):
            turns.append(job)
    return batch


class MicroBatcher:
    """Translates the sentences of many requests in shared batches, on one worker thread; requests take turns.

    Requests wait in turn, oldest first. For each batch the worker takes one sentence of each
    request in turn, up to `batch_size` sentences and `max_batch_tokens` source tokens (`take_turns`).
    A request of 2,500 sentences thus shares every batch with the requests that come after
    it, instead of holding the model until it is done (fair queueing: round-robin over requests).
    While the waiting sentences do not fill a batch, the worker first collects new requests for
    up to `batch_wait_ms` milliseconds. It translates a batch with one call of `translate_fn`, keeping as many
    hypotheses of each sentence as the batch's most demanding request asks for (`Engine.scored_hypotheses`: the best
    is the same whatever the count), with each sentence's request's glossary (one per sentence, None for none; None
    for the whole call where no request of the batch has one, the call without glossaries), and
    answers a request once all its sentences are translated, in order. If that call fails, each
    request of the batch is translated alone, so that one bad request fails alone. A request
    still waiting after its `timeout` fails with `TimeoutError`; none of its remaining sentences
    is translated.

    A request's data travels in its own job; the batcher holds no other state of a request. One
    sentence at a time (no micro-batching): `batch_wait_ms=0, batch_size=1`.

    See docs/serving.md, "Micro-batching".

    Args:
        translate_fn: (sentences, count, glossaries) -> the `count` best translations of each sentence, in order, as
            `Engine.scored_hypotheses` gives them; `glossaries` one `Glossary` or None per sentence, or None.
        batch_wait_ms: how long to collect after the first request, in milliseconds (0: take only
            what is already waiting).
        max_batch_tokens: source tokens per batch, all sentences together.
        batch_size: sentences per batch.

    Raises:
        ValueError: a negative wait, or a budget below 1.
    """

    def __init__(
        self,
        translate_fn: Callable[[list[str], int, list[Glossary | None] | None], list[list]],
        batch_wait_ms: float = ServingConfig.batch_wait_ms,
        max_batch_tokens: int = ServingConfig.max_batch_tokens,
        batch_size: int = BATCH_SIZE,
    ) -> None:
        if batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be 0 or more milliseconds, got {batch_wait_ms}.")
        if max_batch_tokens < 1 or batch_size < 1:
            raise ValueError(
                f"max_batch_tokens and batch_size must be at least 1, got {max_batch_tokens} and {batch_size}."
            )
        self.translate_fn = translate_fn
        self.batch_wait_ms = batch_wait_ms
        self.max_batch_tokens = max_batch_tokens
        self.batch_size = batch_size
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._turns: deque[_Job] = deque()  # requests with sentences not yet in a batch; the worker's alone
        self._lock = threading.Lock()  # orders `submit` against `close`, and guards the count
        self._closed = False
        self._in_flight = 0
        self._worker = threading.Thread(target=self._run, name="micro-batcher", daemon=True)
        self._worker.start()

    @property
    def sentences_in_flight(self) -> int:
        """Sentences submitted and not yet answered (nor dropped).

        See docs/serving.md, "The API".
        """
        return self._in_flight

    def submit(
        self,
        sentences: list[str],
        lengths: list[int],
        timeout: float | None = None,
        hypotheses: int = 1,
        glossary: Glossary | None = None,
    ) -> Future:
        """Queue one request's sentences; the future gives their translations, in order: a list of each one's
        `hypotheses` best, best first (what `translate_fn` gives).

        See docs/serving.md, "Micro-batching".

        Args:
            sentences: the request's sentences.
            lengths: the source tokens of each sentence (for `max_batch_tokens`).
            timeout: seconds from now after which the sentences not yet in a batch are dropped and
                the future fails with `TimeoutError`; None for no limit.
            hypotheses: translations of each sentence (n-best), at least 1.
            glossary: the terms of the request's sentences (`translate_fn`'s glossaries), None for none.

        Raises:
            ValueError: `lengths` does not match `sentences`, a timeout that is not above 0, or `hypotheses` below 1.
            RuntimeError: the batcher is closed.
        """
        if len(lengths) != len(sentences):
            raise ValueError(f"give one length per sentence: {len(lengths)} lengths for {len(sentences)} sentences.")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be above 0 seconds (or None for none), got {timeout}.")
        if hypotheses < 1:
            raise ValueError(f"hypotheses must be at least 1, got {hypotheses}.")
        future: Future = Future()
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        translations: list[list | None] = [None] * len(sentences)
        job = _Job(list(sentences), list(lengths), future, timeout, deadline, translations, hypotheses, glossary)
        with self._lock:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            self._in_flight += len(sentences)
            self._queue.put(job)
        return future

    def close(self, timeout: float | None = None) -> None:
        """Translate every request submitted so far, then stop the worker (waits up to `timeout` seconds).

        See docs/serving.md, "Shutdown".
        """
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
        self._worker.join(timeout)

    def _settle(self, sentences: int) -> None:
        with self._lock:
            self._in_flight -= sentences

    def _admit(self, job: _Job) -> None:
        # A request whose handler was cancelled (its client gone at a forced shutdown) needs no work.
        if not job.future.set_running_or_notify_cancel():
            self._settle(len(job.sentences))
        elif not job.sentences:
            job.future.set_result([])
        else:
            self._turns.append(job)

    def _fail(self, job: _Job, error: Exception) -> None:
        if job in self._turns:
            self._turns.remove(job)
        self._settle(len(job.sentences) - job.answered)
        job.future.set_exception(error)

    def _collect(self) -> bool:
        # Take every request waiting, and more for up to batch_wait_ms while they do not fill a batch.
        # True once the queue's end (`close`) was taken.
        until = time.monotonic() + self.batch_wait_ms / 1000
        while True:
            full = fills_a_batch(self._turns, self.batch_size, self.max_batch_tokens)
            wait = 0.0 if full else max(0.0, until - time.monotonic())
            try:
                job = self._queue.get(timeout=wait)
            except queue.Empty:
                return False
            if job is _STOP:
                return True
            self._admit(job)

    def _next_batch(self) -> list[tuple[_Job, int]]:
        # (request, index of its sentence): one sentence of each request in turn, up to the budgets.
        now = time.monotonic()
        for job in [job for job in self._turns if job.deadline < now]:
            done = f"{job.answered} of its {len(job.sentences)} sentences were"
            self._fail(job, TimeoutError(f"the request was not translated within {job.timeout:g} s ({done})"))
        return take_turns(self._turns, self.batch_size, self.max_batch_tokens)

    def _run(self) -> None:
        stopping = False
        while True:
            if not self._turns:
                if stopping:
                    return
                job = self._queue.get()
                if job is _STOP:
                    return
                self._admit(job)
            if not stopping:
                stopping = self._collect()
            if batch := self._next_batch():
                self._translate(batch)

    def _translate(self, batch: list[tuple[_Job, int]]) -> None:
        jobs = list(dict.fromkeys(job for job, _ in batch))
        try:
            count = max(job.hypotheses for job in jobs)
            glossaries = [job.glossary for job, _ in batch]
            per_sentence = glossaries if any(g is not None for g in glossaries) else None
            translations = self.translate_fn([job.sentences[i] for job, i in batch], count, per_sentence)
        except Exception as error:
            if len(jobs) > 1:
                for job in jobs:
                    self._translate([(each, i) for each, i in batch if each is job])
                return
            logger.exception("Translating a request failed")
            self._fail(jobs[0], error)
            return
        for (job, i), found in zip(batch, translations, strict=True):
            job.translations[i] = found[: job.hypotheses]
            job.answered += 1
        self._settle(len(batch))
        for job in jobs:
            if job.answered == len(job.sentences):
                job.future.set_result(job.translations)
