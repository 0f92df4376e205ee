"""`ServingConfig`: the settings of the HTTP server, and the one place where each is defined.

The options `vaswani-transformer serve` adds to the inference options it shares with `translate` and `evaluate`
(`InferenceConfig`): where it listens, how long it gathers a batch and what one request may ask for. They are
generated from these fields (`cli.py`), as `train`'s are from `TrainingConfig`; `serving.serve` takes the config.
This module imports neither FastAPI nor uvicorn, so that the command line knows the options without the `serve`
extra.
"""

import math
import re
from dataclasses import dataclass

from ..inference.config import cpu_threads
from ..utils.options import option

# The sections of `serve --help`.
BATCHING = "micro-batching (one sentence at a time: --batch-wait-ms 0 --batch-size 1)"
LIMITS = "limits of one request (HTTP 400 beyond them; 503 past --request-timeout)"
ACCESS = (
    "keys, request limits (403 for a wrong key, 429 past a limit, 400 without a required key) and language detection"
)


@dataclass(frozen=True)
class ServingConfig:
    """How `vaswani-transformer serve` listens, batches and limits requests.

    Each field's meaning and unit is its `help` metadata, which `vaswani-transformer serve --help`
    prints. The engine, decoding and batch size are `InferenceConfig`'s; the model and its languages are `serve`'s
    arguments.

    See docs/serving.md, "Serving a translator over HTTP".

    Raises:
        ValueError: a wait outside 0 to 60,000 ms, a budget, limit or thread count below 1, a port outside 0
            to 65535, a request timeout that is no finite number above 0, a key required without `--api-keys`, or
            a `--require-api-key-origin` that is no regular expression.
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
        help="log each request (uvicorn's access log, any api_key in a URL hidden); the flag turns it off",
        group="server",
        flag="--no-access-log",
    )
    forwarded_allow_ips: str | None = option(
        None,
        help="addresses of the proxies whose X-Forwarded-For and X-Forwarded-Proto headers are trusted, "
        "comma-separated (uvicorn's --forwarded-allow-ips; '*' for any): the limits and files then count the client "
        "a proxy names (default: none; every request counts by the address it came from)",
        group="server",
    )
    batch_wait_ms: float = option(
        5.0, help="after the first waiting request, collect others this many milliseconds", group=BATCHING
    )
    max_batch_tokens: int = option(4096, help="source tokens per generate() call", group=BATCHING)
    char_limit: int = option(5000, help="characters of q, all texts together", group=LIMITS)
    batch_limit: int = option(64, help="texts in a list q", group=LIMITS)
    sentence_limit: int = option(
        500, help="sentences of q, all texts together: the sentences of its lines, or of its HTML blocks", group=LIMITS
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
        "with another key is refused (403); one without a key is still served, under the server's limits, unless "
        "--require-api-key",
        group=ACCESS,
    )
    require_api_key: bool = option(
        False,
        help="refuse every request without a key of --api-keys (400) to /translate, /translate_file and /detect; the "
        "page at / sends none",
        group=ACCESS,
    )
    require_api_key_origin: str | None = option(
        None,
        help="refuse requests without a key of --api-keys (400), except those whose Origin header matches this "
        "regular expression (LibreTranslate's option; a browser sends its page's origin, but any other client may "
        "write any: no lock)",
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
        cpu_threads(self.threads)  # refuses a count below 1
        for name in ("require_api_key", "require_api_key_origin"):
            if getattr(self, name) not in (None, False) and self.api_keys is None:
                raise ValueError(f"--{name.replace('_', '-')} requires keys: give them with --api-keys FILE.")
        if self.require_api_key_origin is not None:
            try:
                re.compile(self.require_api_key_origin)
            except re.error as error:
                raise ValueError(
                    f"--require-api-key-origin must be a regular expression, got {self.require_api_key_origin!r} "
                    f"({error})."
                ) from None

    def cpu_threads(self) -> int:
        """The CPU threads of one `generate()`: `threads`, or `inference.config.cpu_threads`'s default.

        The core left over answers HTTP and lets another process run beside the server (docs/serving.md, "Threads").
        """
        return cpu_threads(self.threads)
