"""`ServingConfig`: the settings of the HTTP server, and the one place where each is defined.

The options `vaswani-transformer serve` adds to the inference options it shares with `translate` and `evaluate`
(`InferenceConfig`): where it listens, how long it gathers a batch and what one request may ask for. They are
generated from these fields (`cli.py`), as `train`'s are from `TrainingConfig`; `serving.serve` takes the config.
This module imports neither FastAPI nor uvicorn, so that the command line knows the options without the `serve`
extra.
"""

import math
import os
from dataclasses import dataclass

from ..utils.options import option

# The sections of `serve --help`.
BATCHING = "micro-batching (one sentence at a time: --batch-wait-ms 0 --batch-size 1)"
LIMITS = "limits of one request (HTTP 400 beyond them; 503 past --request-timeout)"
ACCESS = "keys, request limits (403 for a wrong key, 429 past a limit) and language detection"


@dataclass(frozen=True)
class ServingConfig:
    """How `vaswani-transformer serve` listens, batches and limits requests.

    Each field's meaning and unit is its `help` metadata, which `vaswani-transformer serve --help`
    prints. The engine, decoding and batch size are `InferenceConfig`'s; the model and its languages are `serve`'s
    arguments.

    See docs/serving.md, "Serving a translator over HTTP".

    Raises:
        ValueError: a wait outside 0 to 60,000 ms, a budget, limit or thread count below 1, a port outside 0
            to 65535, or a request timeout that is no finite number above 0.
    """

    host: str = option("127.0.0.1", help="address to listen on", group="server")
    port: int = option(5000, help="TCP port; 0 lets the system choose", group="server")
    threads: int | None = option(
        None,
        help="CPU threads of one generate() call (default: one per core this process may use, less one)",
        group="server",
    )
    access_log: bool = option(
        True,
        help="log each request (uvicorn's access log); the flag turns it off",
        group="server",
        flag="--no-access-log",
    )
    batch_wait_ms: float = option(
        5.0, help="after the first waiting request, collect others this many milliseconds", group=BATCHING
    )
    max_batch_tokens: int = option(4096, help="source tokens per generate() call", group=BATCHING)
    char_limit: int = option(5000, help="characters of q, all texts together", group=LIMITS)
    batch_limit: int = option(64, help="texts in a list q", group=LIMITS)
    sentence_limit: int = option(
        500, help="sentences of q, all texts together: lines with text, or HTML text nodes", group=LIMITS
    )
    request_timeout: float = option(
        60.0,
        help="seconds a request may wait and be translated; past them, its untranslated sentences are dropped (503)",
        group=LIMITS,
    )

    alternatives_limit: int = option(
        3, help="alternatives one text may ask for (LibreTranslate's --alternatives-limit)", group=LIMITS
    )
    file_size_limit: int = option(
        1_000_000,
        help="bytes of a file of POST /translate_file (413 beyond them); its text is also held to --char-limit, an "
        "HTML file's text nodes without their markup",
        group=LIMITS,
    )
    api_keys: str | None = option(
        None,
        help='JSON file of API keys and their limits, {"KEY": {"req_limit": 60, "char_limit": 5000}}: a request '
        "with another key is refused (403); one without a key has the server's limits",
        group=ACCESS,
    )
    req_limit: int | None = option(
        None,
        help="requests per minute of one client (its key's, or its address's), 429 past it (default: none)",
        group=ACCESS,
    )
    detect_language: list[str] = option(
        [],
        help="a language POST /detect and source=auto may find besides the models' own (ISO 639-1; repeatable)",
        group=ACCESS,
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be a TCP port from 0 (the system chooses) to 65535, got {self.port}.")
        if not 0 <= self.batch_wait_ms <= 60_000:  # a wait the queue can time (inf would never answer)
            raise ValueError(f"--batch-wait-ms must be 0 to 60,000 milliseconds, got {self.batch_wait_ms}.")
        if self.req_limit is not None and self.req_limit < 1:
            raise ValueError(f"--req-limit must be at least 1 request a minute, got {self.req_limit}.")
        if self.alternatives_limit < 0:
            raise ValueError(f"--alternatives-limit must be 0 or more, got {self.alternatives_limit}.")
        for name in ("max_batch_tokens", "char_limit", "batch_limit", "sentence_limit", "file_size_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}.")
        if not (self.request_timeout > 0 and math.isfinite(self.request_timeout)):
            raise ValueError(f"--request-timeout must be finite seconds above 0, got {self.request_timeout}.")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {self.threads}.")

    def cpu_threads(self) -> int:
        """The CPU threads of one `generate()`: `threads`, or one per core this process may use less one, at least one.

        The core left over answers HTTP and lets another process run beside the server: a parallel region waits for
        its last thread, so a thread that another process pushes off its core stalls every operator of the model
        (docs/serving.md, "Threads").
        """
        if self.threads is not None:
            return self.threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, cores - 1)
