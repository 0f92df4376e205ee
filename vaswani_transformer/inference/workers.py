"""Worker processes that translate batches side by side on a CPU, one thread each (`map_in_workers`).

See docs/performance.md, "Translating in worker processes".
"""

import multiprocessing
import os
import pickle
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor

import torch

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
