"""MicroBatcher: many requests' sentences in shared batches, requests taking turns (fair queueing)."""

import math
import threading
import time
from collections import deque
from concurrent.futures import Future

import pytest

from vaswani_transformer.inference.glossary import Glossary
from vaswani_transformer.serving.batcher import MicroBatcher, _Job, take_turns


class _Blocking:
    """A stand-in for an engine: records each batch it gets; the first call waits until released."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.batches: list[list[str]] = []
        self.counts: list[int] = []  # hypotheses asked for, per call
        self.glossaries: list = []  # the glossaries of each call
        self.release, self.started = threading.Event(), threading.Event()
        self.fail_on = fail_on

    def __call__(self, sentences: list[str], count: int, glossaries=None) -> list[list[str]]:
        self.batches.append(list(sentences))
        self.counts.append(count)
        self.glossaries.append(glossaries)
        if len(self.batches) == 1:
            self.started.set()
            self.release.wait(30)
        if self.fail_on in sentences:
            raise RuntimeError(f"cannot translate {self.fail_on}")
        return [[s.upper(), s.title(), s + "!"][:count] for s in sentences]


def best(future: Future, timeout: float | None = None) -> list[str]:
    """The best translation of each sentence of a request."""
    return [found[0] for found in future.result(timeout)]


def _submit_while_busy(batcher: MicroBatcher, engine: _Blocking, requests: list[list[str]], **options) -> list:
    first = batcher.submit(["first"], [1])
    assert engine.started.wait(30)  # the worker is inside its first call: the others queue up behind it
    futures = [first] + [batcher.submit(request, [1] * len(request), **options) for request in requests]
    engine.release.set()
    return futures


def test_micro_batcher_translates_waiting_requests_together_and_answers_each_its_own():
    engine = _Blocking()
    batcher = MicroBatcher(engine, batch_wait_ms=0, max_batch_tokens=1000, batch_size=100)
    requests = [["a", "b"], ["c"], ["d", "e", "f"]]
    futures = _submit_while_busy(batcher, engine, requests)
    assert [best(future, 30) for future in futures] == [["FIRST"], ["A", "B"], ["C"], ["D", "E", "F"]]
    assert engine.batches == [["first"], ["a", "c", "d", "b", "e", "f"]]  # a sentence of each request in turn
    batcher.close()


def test_micro_batcher_requests_take_turns_so_a_small_one_behind_a_big_one_is_answered_first():
    engine = _Blocking()
    batcher = MicroBatcher(engine, batch_wait_ms=0, max_batch_tokens=1000, batch_size=3)
    big, small = [f"b{i}" for i in range(9)], ["s"]
    futures = _submit_while_busy(batcher, engine, [big, small])
    answered: list[str] = []
    futures[1].add_done_callback(lambda _: answered.append("big"))
    futures[2].add_done_callback(lambda _: answered.append("small"))
    batcher.close()
    assert answered == ["small", "big"]
    assert engine.batches == [["first"], ["b0", "s", "b1"], ["b2", "b3", "b4"], ["b5", "b6", "b7"], ["b8"]]
    assert best(futures[1]) == [sentence.upper() for sentence in big] and best(futures[2]) == ["S"]


def test_micro_batcher_budgets_hold_and_one_at_a_time_means_one_sentence_per_call():
    engine = _Blocking()
    batcher = MicroBatcher(engine, batch_wait_ms=0, max_batch_tokens=5, batch_size=100)
    first = batcher.submit(["first"], [1])
    assert engine.started.wait(30)
    futures = [batcher.submit(["a", "b"], [3, 1]), batcher.submit(["c", "d"], [2, 9])]
    engine.release.set()
    batcher.close()
    # Tokens: a (3) and c (2) fill the budget of 5; d alone is over it, a batch of its own.
    assert engine.batches == [["first"], ["a", "c"], ["b"], ["d"]]
    assert [best(future) for future in [first, *futures]] == [["FIRST"], ["A", "B"], ["C", "D"]]

    engine = _Blocking()
    batcher = MicroBatcher(engine, batch_wait_ms=0, batch_size=1)
    _submit_while_busy(batcher, engine, [["a", "b"], ["c"]])
    batcher.close()
    assert engine.batches == [["first"], ["a"], ["c"], ["b"]]


def test_micro_batcher_refuses_a_request_past_its_deadline_and_translates_no_more_of_it():
    engine = _Blocking()
    batcher = MicroBatcher(engine, batch_wait_ms=0)
    first = batcher.submit(["first"], [1])
    assert engine.started.wait(30)
    late = batcher.submit(["a", "b"], [1, 1], timeout=0.001)
    timely = batcher.submit(["c"], [1], timeout=600)
    time.sleep(0.01)  # not a measurement: the 1 ms deadline must have passed before the worker is free
    engine.release.set()
    batcher.close()
    with pytest.raises(TimeoutError, match="0.001 s"):
        late.result()
    assert best(first) == ["FIRST"] and best(timely) == ["C"]
    assert engine.batches == [["first"], ["c"]]
    assert batcher.sentences_in_flight == 0
    with pytest.raises(ValueError, match="timeout"):
        batcher.submit(["d"], [1], timeout=0)


def test_a_request_for_alternatives_shares_a_batch_and_each_request_gets_the_hypotheses_it_asked_for():
    engine = _Blocking()
    batcher = MicroBatcher(engine, batch_wait_ms=0, max_batch_tokens=1000, batch_size=100)
    first = batcher.submit(["first"], [1])
    assert engine.started.wait(30)
    plain, three = batcher.submit(["a dog"], [2]), batcher.submit(["a cat", "x"], [2, 1], hypotheses=3)
    engine.release.set()
    batcher.close()
    assert engine.batches == [["first"], ["a dog", "a cat", "x"]] and engine.counts == [1, 3]
    assert plain.result() == [["A DOG"]] and first.result() == [["FIRST"]]
    assert three.result() == [["A CAT", "A Cat", "a cat!"], ["X", "X", "x!"]]
    with pytest.raises(ValueError, match="hypotheses must be at least 1"):
        batcher.submit(["y"], [1], hypotheses=0)


def test_a_request_with_a_glossary_shares_a_batch_and_only_its_own_sentences_get_its_terms():
    engine = _Blocking()
    batcher = MicroBatcher(engine, batch_wait_ms=0, max_batch_tokens=1000, batch_size=100)
    terms = Glossary([("dog", "Hund")])
    first = batcher.submit(["first"], [1])
    assert engine.started.wait(30)
    plain, termed = batcher.submit(["a cat"], [2]), batcher.submit(["a dog", "x"], [2, 1], glossary=terms)
    engine.release.set()
    batcher.close()
    # One call for both requests; each sentence with its own request's glossary; none at all for a call without.
    assert engine.batches == [["first"], ["a cat", "a dog", "x"]]
    assert engine.glossaries == [None, [None, terms, terms]]
    assert first.result() == [["FIRST"]] and plain.result() == [["A CAT"]] and termed.result() == [["A DOG"], ["X"]]


def test_micro_batcher_fails_only_the_request_that_fails_and_close_finishes_the_queue():
    engine = _Blocking(fail_on="bad")
    batcher = MicroBatcher(engine, batch_wait_ms=0)
    futures = _submit_while_busy(batcher, engine, [["a"], ["bad", "b"], ["c"]])
    batcher.close()  # returns once everything queued before it is answered
    assert all(future.done() for future in futures)
    assert best(futures[1]) == ["A"] and best(futures[3]) == ["C"]
    with pytest.raises(RuntimeError, match="cannot translate bad"):
        futures[2].result()
    assert batcher.sentences_in_flight == 0
    with pytest.raises(RuntimeError, match="shutting down"):
        batcher.submit(["late"], [1])


def test_take_turns_gives_each_request_one_sentence_in_turn_within_the_budgets():
    def job(lengths: list[int]) -> _Job:
        sentences = [f"s{i}" for i in range(len(lengths))]
        return _Job(sentences, lengths, Future(), None, math.inf, [None] * len(lengths))

    big, small = job([1, 1, 1, 1, 1]), job([1])
    turns = deque([big, small])
    assert take_turns(turns, 4, 100) == [(big, 0), (small, 0), (big, 1), (big, 2)]  # the small one is not held up
    assert list(turns) == [big] and big.taken == 3 and small.taken == 1
    assert take_turns(turns, 4, 1) == [(big, 3)]  # the token budget closes the batch
    long = job([10, 1])
    turns = deque([long])
    assert take_turns(turns, 4, 5) == [(long, 0)]  # a sentence over the budget is a batch of its own
    assert take_turns(turns, 4, 5) == [(long, 1)] and not turns
    assert take_turns(turns, 4, 5) == []
