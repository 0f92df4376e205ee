"""Serve a trained translator over HTTP: the LibreTranslate API, a page to try it, micro-batched decoding.

`vaswani-transformer serve MODEL` runs a FastAPI app under uvicorn (the `serve` extra):

- `POST /translate` and `GET /languages` speak the LibreTranslate API
  (https://docs.libretranslate.com/guides/api_usage/), so its clients work unchanged; `GET /health`
  says the server is up; `GET /` is a page to type a sentence and see its translation.
- One worker thread owns the model. Request handlers put their sentences on a queue and await;
  the worker fills each batch with one sentence of each waiting request in turn (fair queueing:
  a big request shares every batch with those behind it) up to a sentence or token budget,
  collecting new requests for `batch_wait_ms` while the batch is not full, translates it with one
  `generate()` (beam search of §6.1, through `translation.translate`) or one CTranslate2 batch,
  and answers each request with its own sentences, in order, once all are translated (`MicroBatcher`).
- Bad input gets HTTP 400 (413 for a body too large to read) and `{"error": "<message naming
  the field>"}`, LibreTranslate's error shape; a request not translated within its deadline gets
  503 with `Retry-After`; the server keeps serving.
- SIGTERM (or Ctrl+C) stops accepting connections, answers every request already received, then
  exits with status 0.
"""

import asyncio
import contextlib
import copy
import errno
import json
import logging
import math
import queue
import re
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import HTMLResponse, JSONResponse
    from starlette.exceptions import HTTPException
    from starlette.formparsers import MultiPartException, MultiPartParser
    from starlette.requests import ClientDisconnect
except ImportError as error:
    raise ImportError(
        "`vaswani-transformer serve` needs FastAPI and uvicorn: pip install 'vaswani-transformer[serve]'."
    ) from error

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .generation_vaswani import check_length_penalty, check_num_beams
from .hub import check_model_exists
from .serving_config import ENGINES, ServingConfig
from .text_format import split_text

if TYPE_CHECKING:
    from .export import CTranslate2Engine

logger = logging.getLogger(__name__)

# English names of the languages a model card may list (ISO 639-1); others are shown by their code.
LANGUAGE_NAMES = {
    "ar": "Arabic", "bg": "Bulgarian", "cs": "Czech", "da": "Danish", "de": "German", "el": "Greek",
    "en": "English", "es": "Spanish", "et": "Estonian", "fi": "Finnish", "fr": "French", "he": "Hebrew",
    "hi": "Hindi", "hu": "Hungarian", "id": "Indonesian", "it": "Italian", "ja": "Japanese", "ko": "Korean",
    "lt": "Lithuanian", "lv": "Latvian", "nl": "Dutch", "no": "Norwegian", "pl": "Polish", "pt": "Portuguese",
    "ro": "Romanian", "ru": "Russian", "sk": "Slovak", "sl": "Slovenian", "sv": "Swedish", "tr": "Turkish",
    "uk": "Ukrainian", "vi": "Vietnamese", "zh": "Chinese",
}  # fmt: skip


def _model_file(model: str, filename: str) -> Path | None:
    """`filename` of a local model directory or Hub repository, or None where it has none."""
    if Path(model).is_dir():
        path = Path(model) / filename
        return path if path.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(model, filename))
    except (OSError, EntryNotFoundError):  # no such file, or no Hub and no cached copy
        return None


def model_languages(model: str, source_lang: str | None = None, target_lang: str | None = None) -> tuple[str, str]:
    """The language pair a model translates: (source, target), ISO 639-1 codes such as ("en", "de").

    Read from `training_config.json` (`source_lang`, `target_lang`, written by `train`), else from
    the model card's `language: [source, target]` (`hub.write_model_card`); `source_lang` and
    `target_lang`, when given, override what the files say (e.g. for a converted Marian model,
    which has neither file).

    See docs/serving.md, "Serving a translator over HTTP".

    Args:
        model: a model directory or Hub id.
        source_lang, target_lang: codes that take precedence over the files.

    Raises:
        OSError: `model` is a local path that does not exist (`hub.check_model_exists`).
        ValueError: a language is given by neither the arguments nor the files.
    """
    check_model_exists(model)
    if source_lang and target_lang:
        return source_lang, target_lang
    found: tuple[str | None, str | None] = (None, None)
    config_file = _model_file(model, "training_config.json")
    if config_file is not None:
        training = json.loads(config_file.read_text(encoding="utf-8"))
        found = (training.get("source_lang"), training.get("target_lang"))
    if None in found and (card_file := _model_file(model, "README.md")) is not None:
        from huggingface_hub import ModelCard

        language = ModelCard.load(card_file).data.language
        if isinstance(language, list) and len(language) == 2:  # a pair; more would be ambiguous
            found = (language[0], language[1])
    source, target = source_lang or found[0], target_lang or found[1]
    if not source or not target:
        raise ValueError(
            f"the languages of {model} are unknown: it has no training_config.json with source_lang and "
            "target_lang and no model card with `language: [source, target]`; pass --source-lang and --target-lang."
        )
    return source, target


def languages_response(source: str, target: str) -> list[dict]:
    """The body of LibreTranslate's `GET /languages` for a model that translates `source` into `target`.

    One entry per language, `{"code", "name", "targets"}`: the source with `[target]`, the target
    with no targets of its own (the model translates one way).
    """
    return [
        {"code": source, "name": LANGUAGE_NAMES.get(source, source), "targets": [target]},
        {"code": target, "name": LANGUAGE_NAMES.get(target, target), "targets": []},
    ]


class TorchEngine:
    """Translates with the model's own `generate()` (§6.1: beam 4, GNMT length penalty 0.6, input length + 50).

    Args:
        model, tokenizer: from `translation.load_translator`.
        generate_kwargs: overrides of the generation config, e.g. `{"num_beams": 1}`.
    """

    name = "torch"

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, generate_kwargs: dict | None = None
    ) -> None:
        from .translation import source_length_limit

        self.model, self.tokenizer, self.generate_kwargs = model, tokenizer, dict(generate_kwargs or {})
        self.source_limit = source_length_limit(model, tokenizer)

    def translate(self, sentences: list[str]) -> list[str]:
        """One translation per sentence, in order, from one `generate()` call (sentences sorted by length).

        See docs/serving.md, "Engines".
        """
        from .translation import translate

        # Sources over the limit were refused (or are truncated, as the server was told) before they got here.
        batch_size = max(1, len(sentences))
        return translate(
            self.model, self.tokenizer, sentences, batch_size, long_inputs="truncate", **self.generate_kwargs
        )


@dataclass(eq=False)  # compared and hashed by identity: one request is one job
class _Job:
    """One request in the batcher: its sentences, their source tokens, and how far its translation has got."""

    sentences: list[str]
    lengths: list[int]
    future: Future
    timeout: float | None
    deadline: float  # time.monotonic() past which its sentences not yet in a batch are dropped
    translations: list[str | None]
    taken: int = 0  # sentences put in a batch so far, in order
    answered: int = 0


_STOP = object()


class MicroBatcher:
    """Translates the sentences of many requests in shared batches, on one worker thread; requests take turns.

    Requests wait in turn, oldest first. For each batch the worker takes one sentence of each
    request in turn, again and again, until the batch holds `max_batch_sentences` sentences or
    the next sentence would bring it over `max_batch_tokens` source tokens (a sentence over the
    budget is a batch of its own); a request with sentences left goes back to the end of the
    turns. A request of 2,500 sentences thus shares every batch with the requests that come after
    it, instead of holding the model until it is done (fair queueing: round-robin over requests).
    While the waiting sentences do not fill a batch, the worker first collects new requests for
    up to `batch_wait_ms` milliseconds. It translates a batch with one call of `translate_fn` and
    answers a request once all its sentences are translated, in order. If that call fails, each
    request of the batch is translated alone, so that one bad request fails alone. A request
    still waiting after its `timeout` fails with `TimeoutError`; none of its remaining sentences
    is translated.

    A request's data travels in its own job; the batcher holds no other state of a request. One
    sentence at a time (no micro-batching): `batch_wait_ms=0, max_batch_sentences=1`.

    See docs/serving.md, "Micro-batching".

    Args:
        translate_fn: sentences -> their translations, in order (an engine's `translate`).
        batch_wait_ms: how long to collect after the first request, in milliseconds (0: take only
            what is already waiting).
        max_batch_tokens: source tokens per batch, all sentences together.
        max_batch_sentences: sentences per batch.

    Raises:
        ValueError: a negative wait, or a budget below 1.
    """

    def __init__(
        self,
        translate_fn: Callable[[list[str]], list[str]],
        batch_wait_ms: float = ServingConfig.batch_wait_ms,
        max_batch_tokens: int = ServingConfig.max_batch_tokens,
        max_batch_sentences: int = ServingConfig.max_batch_sentences,
    ) -> None:
        if batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be 0 or more milliseconds, got {batch_wait_ms}.")
        if max_batch_tokens < 1 or max_batch_sentences < 1:
            raise ValueError(
                f"max_batch_tokens and max_batch_sentences must be at least 1, got {max_batch_tokens} and "
                f"{max_batch_sentences}."
            )
        self.translate_fn = translate_fn
        self.batch_wait_ms = batch_wait_ms
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_sentences = max_batch_sentences
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

    def submit(self, sentences: list[str], lengths: list[int], timeout: float | None = None) -> Future:
        """Queue one request's sentences; the future gives their translations, in order.

        See docs/serving.md, "Micro-batching".

        Args:
            sentences: the request's sentences.
            lengths: the source tokens of each sentence (for `max_batch_tokens`).
            timeout: seconds from now after which the sentences not yet in a batch are dropped and
                the future fails with `TimeoutError`; None for no limit.

        Raises:
            ValueError: `lengths` does not match `sentences`, or a timeout that is not above 0.
            RuntimeError: the batcher is closed.
        """
        if len(lengths) != len(sentences):
            raise ValueError(f"give one length per sentence: {len(lengths)} lengths for {len(sentences)} sentences.")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be above 0 seconds (or None for none), got {timeout}.")
        future: Future = Future()
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        job = _Job(list(sentences), list(lengths), future, timeout, deadline, [None] * len(sentences))
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

    def _full(self) -> bool:
        # Whether the sentences waiting fill a batch; stops counting once they do.
        sentences = tokens = 0
        for job in self._turns:
            sentences += len(job.sentences) - job.taken
            tokens += sum(job.lengths[job.taken : job.taken + self.max_batch_sentences])
            if sentences >= self.max_batch_sentences or tokens >= self.max_batch_tokens:
                return True
        return False

    def _collect(self) -> bool:
        # Take every request waiting, and more for up to batch_wait_ms while they do not fill a batch.
        # True once the queue's end (`close`) was taken.
        until = time.monotonic() + self.batch_wait_ms / 1000
        while True:
            wait = 0.0 if self._full() else max(0.0, until - time.monotonic())
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
        batch: list[tuple[_Job, int]] = []
        tokens = 0
        while self._turns and len(batch) < self.max_batch_sentences:
            job = self._turns[0]
            length = job.lengths[job.taken]
            if batch and tokens + length > self.max_batch_tokens:
                break
            self._turns.popleft()
            batch.append((job, job.taken))
            job.taken, tokens = job.taken + 1, tokens + length
            if job.taken < len(job.sentences):
                self._turns.append(job)
        return batch

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
            translations = self.translate_fn([job.sentences[i] for job, i in batch])
        except Exception as error:
            if len(jobs) > 1:
                for job in jobs:
                    self._translate([(each, i) for each, i in batch if each is job])
                return
            logger.exception("Translating a request failed")
            self._fail(jobs[0], error)
            return
        for (job, i), translation in zip(batch, translations, strict=True):
            job.translations[i] = translation
            job.answered += 1
        self._settle(len(batch))
        for job in jobs:
            if job.answered == len(job.sentences):
                job.future.set_result(job.translations)


class RequestError(ValueError):
    """A request the server refuses: HTTP `status` (400; 413, 503) with the body `{"error": message}` and `headers`.

    See docs/serving.md, "Bad input".
    """

    def __init__(self, message: str, status: int = 400, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers


@dataclass(frozen=True)
class Limits:
    """What one `POST /translate` may ask for (LibreTranslate's `--char-limit` and `--batch-limit`, and ours).

    Attributes:
        char_limit: characters of `q`, all texts together.
        batch_limit: texts in a list `q`.
        sentence_limit: sentences of `q`, all texts together: lines with text, or HTML text nodes.
        request_timeout: seconds a request's sentences may wait and be translated (`MicroBatcher.submit`).
        source_limit: tokens (with `</s>`) of one source sentence, the model's limit; None for none.
        long_inputs: "error" refuses a sentence over `source_limit`, "truncate" cuts it there.
    """

    char_limit: int
    batch_limit: int
    sentence_limit: int
    request_timeout: float
    source_limit: int | None
    long_inputs: str

    def body_bytes(self) -> int:
        """The largest body read: `char_limit` characters as escaped JSON (up to 12 bytes each) and the other fields.

        See docs/serving.md, "Bad input".
        """
        return 12 * self.char_limit + 65536


@dataclass(frozen=True)
class TranslateRequest:
    """A checked `POST /translate`: `texts` (one, or the list `q` was), the language pair, `format`, `alternatives`.

    See docs/serving.md, "The API".
    """

    texts: list[str]
    is_list: bool
    source: str
    target: str
    auto: bool
    format: str
    alternatives: int


def parse_translate_request(fields: dict, languages: tuple[str, str], limits: Limits) -> TranslateRequest:
    """Check the fields of a LibreTranslate `POST /translate` request.

    Fields: `q` (a string or a list of strings), `source` (a code, or "auto"), `target`, `format`
    ("text", the default, or "html"), `alternatives` (a whole number; this server has none to
    give, and answers empty lists), `api_key` (ignored).

    Args:
        fields: the parsed body (JSON object, or form fields; a repeated form field is a list).
        languages: the model's (source, target).
        limits: the server's `Limits`.

    Raises:
        RequestError: a field is missing, of the wrong type, empty, over a limit, or names a
            language pair the model does not translate; the message names the field.
    """
    q = fields.get("q")
    if q is None:
        raise RequestError("Invalid request: missing q parameter")
    is_list = isinstance(q, list)
    texts = q if is_list else [q]
    for i, text in enumerate(texts):
        where = f"q[{i}]" if is_list else "q"
        if not isinstance(text, str):
            raise RequestError(f"Invalid request: {where} must be a string, got {type(text).__name__}")
        if not text.isascii():
            try:  # JSON's escapes can spell half of a UTF-16 pair, which is no character
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                raise RequestError(f"Invalid request: {where} is not Unicode text ({error.reason})") from None
    if not texts or not any(text.strip() for text in texts):
        raise RequestError("Invalid request: q is empty; give the text to translate")
    if len(texts) > limits.batch_limit:
        raise RequestError(
            f"Invalid request: q has {len(texts)} texts, more than the batch limit of {limits.batch_limit}"
        )
    characters = sum(map(len, texts))
    if characters > limits.char_limit:
        raise RequestError(
            f"Invalid request: q has {characters} characters, more than the limit of {limits.char_limit}"
        )

    source, target = fields.get("source"), fields.get("target")
    for name, value in (("source", source), ("target", target)):
        if value is None or value == "":
            raise RequestError(f"Invalid request: missing {name} parameter")
        if not isinstance(value, str):
            raise RequestError(f"Invalid request: {name} must be a language code string, got {type(value).__name__}")
    model_source, model_target = languages
    pair = f"{model_source} -> {model_target}"
    auto = source == "auto"
    if not auto and source != model_source:
        raise RequestError(f"source {source!r} is not supported: this model translates {pair} (GET /languages)")
    if target != model_target:
        raise RequestError(f"target {target!r} is not supported: this model translates {pair} (GET /languages)")

    text_format = fields.get("format") or "text"
    if text_format not in ("text", "html"):
        raise RequestError(f"Invalid request: format must be 'text' or 'html', got {text_format!r}")
    alternatives = fields.get("alternatives")
    if alternatives is None or alternatives == "":
        alternatives = 0
    elif isinstance(alternatives, str) and re.fullmatch(r"\s*[0-9]{1,9}\s*", alternatives):  # form fields: strings
        alternatives = int(alternatives)
    elif not isinstance(alternatives, int) or isinstance(alternatives, bool) or alternatives < 0:
        raise RequestError(f"Invalid request: alternatives must be a whole number, 0 or more, got {alternatives!r}")
    return TranslateRequest(texts, is_list, model_source, model_target, auto, text_format, alternatives)


async def _request_fields(request: Request, max_bytes: int) -> dict:
    """The fields of a JSON, form-encoded or multipart body (LibreTranslate takes all three), over the query's.

    Raises:
        RequestError: a body over `max_bytes` (413); a malformed body, a field of the query string or
            of a form that is not UTF-8 (named), or a client gone before the body ended (400).
    """
    fields = _urlencoded_fields(request.scope["query_string"], "query string")
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(f"Invalid request: the body has {declared} bytes, more than {max_bytes}", 413)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise RequestError(f"Invalid request: the body has more than {max_bytes} bytes", 413)
    except ClientDisconnect:
        # Nobody reads the answer; any other exception Starlette re-raises, and uvicorn logs its traceback.
        raise RequestError("Invalid request: the client left before the body ended") from None
    if kind == "multipart/form-data":
        # Parsed from the bytes read under the cap: a chunked body declares no length, and Starlette's parser
        # caps each part, not their sum.
        async def stream() -> AsyncIterator[bytes]:
            yield bytes(body)

        try:
            form = await _MultiPartParser(request.headers, stream(), max_files=0, max_part_size=max_bytes).parse()
        except MultiPartException as error:
            raise RequestError(f"Invalid request: malformed multipart body ({error.message})") from None
        return fields | _utf8_fields(form.multi_items(), "multipart body")
    if kind == "application/x-www-form-urlencoded":
        return fields | _urlencoded_fields(bytes(body), "form body")
    if not body.strip():
        return fields
    try:
        parsed = json.loads(body)
    except ValueError as error:  # JSONDecodeError, or bytes that are no Unicode
        raise RequestError(f"Invalid request: malformed JSON body ({error})") from None
    except RecursionError:
        raise RequestError("Invalid request: malformed JSON body (nested too deeply)") from None
    if not isinstance(parsed, dict):
        raise RequestError(
            f"Invalid request: the JSON body must be an object with q, source and target, not {type(parsed).__name__}"
        )
    return fields | parsed


class _MultiPartParser(MultiPartParser):
    """Starlette's multipart parser, which decodes a field's bytes that are not in the body's charset
    (UTF-8 unless it says otherwise) to lone surrogates, for `_utf8_fields` to refuse, instead of as Latin-1."""

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is not None:
            super().on_part_end()
        else:
            self.items.append((part.field_name, part.data.decode(self._charset, "surrogateescape")))


def _urlencoded_fields(raw: bytes, where: str) -> dict:
    # A query string or a form-encoded body; bytes that are not UTF-8, raw or percent-encoded, become lone
    # surrogates, for `_utf8_fields` to refuse.
    try:
        text = raw.decode("utf-8", "surrogateescape")
        pairs = parse_qsl(text, keep_blank_values=True, max_num_fields=10_000, errors="surrogateescape")
    except ValueError as error:  # too many fields
        raise RequestError(f"Invalid request: malformed {where} ({error})") from None
    return _utf8_fields(pairs, where)


def _utf8_fields(pairs: Iterable[tuple[str, object]], where: str) -> dict:
    # The fields by name, a repeated one as a list, each refused if it holds a byte that was not UTF-8.
    grouped: dict[str, list] = {}
    for name, value in pairs:
        for text in (name, value):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                shown = name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
                byte = ord(text[error.start]) - 0xDC00  # surrogateescape put byte b at U+DC00 + b
                raise RequestError(
                    f"Invalid request: {shown} in the {where} is not UTF-8 (byte 0x{byte:02x}); send text in UTF-8"
                ) from None
        grouped.setdefault(name, []).append(value)
    return {name: values if len(values) > 1 else values[0] for name, values in grouped.items()}


def create_app(
    batcher: MicroBatcher,
    tokenizer: PreTrainedTokenizerBase,
    languages: tuple[str, str],
    limits: Limits,
    info: dict | None = None,
) -> FastAPI:
    """The FastAPI app: `POST /translate`, `GET /languages`, `GET /health`, and the page at `/`.

    See docs/serving.md, "The API".

    Args:
        batcher: translates the sentences; closed (its queue drained) when the app shuts down.
        tokenizer: the model's tokenizer, to measure sentences against `limits` (the app uses a
            copy: a fast tokenizer must not be called by two threads at once).
        languages: the model's (source, target).
        limits: what one request may ask for.
        info: extra fields for `GET /health` (model, engine).
    """
    counter = copy.deepcopy(tokenizer)  # called only on the event loop's thread
    page = (resources.files("vaswani_transformer") / "static" / "index.html").read_text(encoding="utf-8")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn calls this after the requests in flight were answered; the queue is empty by then.
        await asyncio.to_thread(batcher.close)

    app = FastAPI(title="vaswani_transformer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # LibreTranslate answers browsers from any origin; so do we, for its web clients.
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["GET", "POST"], allow_headers=["*"])
    # HEAD answers as GET without the body (uvicorn drops it), as HTTP asks and monitors expect.
    read = ["GET", "HEAD"]

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse({"error": str(error.detail)}, status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:
        logger.error("Request failed: %r", error)
        return JSONResponse({"error": f"internal error: {type(error).__name__}"}, status_code=500)

    @app.api_route("/", methods=read, response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.api_route("/health", methods=read)
    async def health() -> dict:
        return {
            "status": "ok",
            "source": languages[0],
            "target": languages[1],
            "sentences_in_flight": batcher.sentences_in_flight,
            **(info or {}),
        }

    @app.api_route("/languages", methods=read)
    async def get_languages() -> list[dict]:
        return languages_response(*languages)

    @app.post("/translate")
    async def post_translate(request: Request) -> JSONResponse:
        fields = await _request_fields(request, limits.body_bytes())
        checked = parse_translate_request(fields, languages, limits)
        try:
            splits = [split_text(text, checked.format) for text in checked.texts]
        except ValueError as error:  # markup the HTML parser cannot read
            raise RequestError(f"Invalid request: {error}") from error
        sentences = [sentence for found, _ in splits for sentence in found]
        work = [i for i, sentence in enumerate(sentences) if sentence.strip()]  # a blank line stays blank
        if len(work) > limits.sentence_limit:
            raise RequestError(
                f"Invalid request: q has {len(work)} sentences (lines with text, or HTML text nodes), more than the "
                f"limit of {limits.sentence_limit} (--sentence-limit); send them in several requests"
            )
        lengths = [len(ids) for ids in counter(sentences, verbose=False)["input_ids"]] if sentences else []
        if limits.source_limit is not None and limits.long_inputs == "error":
            start = 0
            for i, (found, _) in enumerate(splits):
                longest, start = max(lengths[start : start + len(found)], default=0), start + len(found)
                if longest > limits.source_limit:
                    where = f"q[{i}]" if checked.is_list else "q"
                    raise RequestError(
                        f"Invalid request: {where} has a sentence of {longest} tokens, more than the model's limit "
                        f"of {limits.source_limit}; split it into shorter sentences"
                    )
        try:
            future = batcher.submit([sentences[i] for i in work], [lengths[i] for i in work], limits.request_timeout)
        except RuntimeError as error:
            return JSONResponse({"error": str(error)}, status_code=503)
        translations = [""] * len(sentences)
        try:
            for i, translation in zip(work, await asyncio.wrap_future(future), strict=True):
                translations[i] = translation
        except TimeoutError as error:  # the server is busier than one request's deadline allows: 503, as overload
            raise RequestError(
                f"{error}: the server's limit (--request-timeout); send fewer sentences, or retry later",
                503,
                {"Retry-After": str(math.ceil(limits.request_timeout))},
            ) from None
        except Exception as error:
            return JSONResponse({"error": f"translation failed: {error}"}, status_code=500)
        texts, start = [], 0
        for found, rebuild in splits:
            texts.append(rebuild(translations[start : start + len(found)]))
            start += len(found)
        body: dict = {"translatedText": texts if checked.is_list else texts[0]}
        if checked.auto:
            detected = {"confidence": 100.0, "language": checked.source}  # the model's only source language
            body["detectedLanguage"] = [detected] * len(texts) if checked.is_list else detected
        if checked.alternatives:
            body["alternatives"] = [[] for _ in texts] if checked.is_list else []
        return JSONResponse(body)

    return app


def load_engine(
    model: str,
    engine: str = "torch",
    device: str | None = None,
    num_beams: int | None = None,
    ctranslate2_dir: str | None = None,
    length_penalty: float | None = None,
) -> tuple["TorchEngine | CTranslate2Engine", PreTrainedTokenizerBase]:
    """Load a translator for serving: the engine and the model's tokenizer.

    Args:
        model: a model directory or Hub id.
        engine: "torch" (`generate()`) or "ctranslate2" (the export, made on first use in
            `ctranslate2_dir`, default `MODEL_DIR/ctranslate2/`; see `ctranslate2_export`).
        device: torch device (default: CUDA if available), or CTranslate2's "cpu"/"cuda" (default "cpu").
        num_beams: beam size; default the model's generation config (4, §6.1).
        length_penalty: alpha (§6.1) in the generation config's form; default the config's.

    Raises:
        ImportError: ctranslate2 is missing (engine "ctranslate2").
        OSError, ValueError: from `translation.load_translator` or `export.export_ctranslate2`;
            an unknown engine, a beam size below 1 or a length penalty that is not finite.
    """
    from .translation import load_translator

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}.")
    check_num_beams(num_beams)
    if engine == "torch":
        if length_penalty is not None:  # the CTranslate2 engine checks its own, before any export
            check_length_penalty(length_penalty)
        translator, tokenizer = load_translator(model, device)
        options = {"num_beams": num_beams, "length_penalty": length_penalty}
        return TorchEngine(translator, tokenizer, {k: v for k, v in options.items() if v is not None}), tokenizer
    from .export import load_ctranslate2_engine

    return load_ctranslate2_engine(model, device, num_beams, ctranslate2_dir, length_penalty)


class _Server(uvicorn.Server):
    """uvicorn's server, which prints one line with the address once it accepts connections."""

    def __init__(self, config: uvicorn.Config, banner: str) -> None:
        super().__init__(config)
        self.banner = banner

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.banner, flush=True)


def serve(
    model: str,
    config: ServingConfig | None = None,
    engine: str = ENGINES[0],
    device: str | None = None,
    num_beams: int | None = None,
    source_lang: str | None = None,
    target_lang: str | None = None,
    ctranslate2_dir: str | None = None,
    length_penalty: float | None = None,
) -> None:
    """`vaswani-transformer serve`: load a translator and serve it over HTTP until SIGTERM or Ctrl+C.

    The port is bound before the model loads, so a port in use fails at once; `port=0` lets the
    system choose one. Once it accepts requests, the server prints one line on stdout: "Serving
    MODEL (SRC -> TGT, ENGINE) on http://HOST:PORT". On SIGTERM or SIGINT it stops accepting
    connections, answers every request it has received (the batcher translates all it holds),
    and returns, so that the command exits with status 0.

    Args:
        model, engine, device, num_beams, ctranslate2_dir, length_penalty: what to load (`load_engine`).
        config: where to listen, how to batch (`MicroBatcher`) and what one request may ask for
            (`Limits`); default `ServingConfig()`. `config.threads` sets the CPU threads of one
            `generate()` (`torch.set_num_threads`; CTranslate2's `intra_threads`); default: torch's,
            one per core. Fewer leave cores to the HTTP side and to other processes, whose competition
            slows a parallel region that waits for every one of its threads.
        source_lang, target_lang: the model's languages, where its files do not say them (`model_languages`).

    Raises:
        ImportError: the engine's package is missing.
        OSError: the address cannot be bound, or the model cannot be loaded.
        ValueError: a model whose languages are unknown, an unknown engine, a beam size below 1 or a
            length penalty that is no finite number (`ServingConfig` checks its own settings when it is made).
    """
    languages = model_languages(model, source_lang, target_lang)
    config = config or ServingConfig()
    host, port, threads = config.host, config.port, config.threads
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))  # not listening yet: clients are refused until the model is loaded
        except OSError as error:
            host_error = isinstance(error, socket.gaierror) or error.errno == errno.EADDRNOTAVAIL
            advice = "check --host" if host_error else "choose another --port"
            raise OSError(f"cannot listen on {host}:{port}: {error.strerror}; {advice}") from error
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        runner, tokenizer = load_engine(model, engine, device, num_beams, ctranslate2_dir, length_penalty)
        batcher = MicroBatcher(
            runner.translate, config.batch_wait_ms, config.max_batch_tokens, config.max_batch_sentences
        )
        limits = Limits(
            config.char_limit,
            config.batch_limit,
            config.sentence_limit,
            config.request_timeout,
            runner.source_limit,
            config.long_inputs,
        )
        batching = ("batch_wait_ms", "max_batch_tokens", "max_batch_sentences")
        # The model's name, not its local path, which any origin may read.
        model_name = Path(model).resolve().name if Path(model).is_dir() else model
        info = {"model": model_name, "engine": runner.name, **{name: getattr(config, name) for name in batching}}
        app = create_app(batcher, tokenizer, languages, limits, info)
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
        banner = f"Serving {model} ({languages[0]} -> {languages[1]}, {runner.name}) on http://{shown}:{bound_port}"
        server_config = uvicorn.Config(
            app, log_level="info", access_log=config.access_log, timeout_graceful_shutdown=None
        )
        if threading.current_thread() is threading.main_thread():
            # uvicorn catches SIGTERM and SIGINT, shuts down gracefully, then raises the signal again
            # under the handler it found: one that does nothing lets that graceful end exit with 0.
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, lambda *_: None)
        try:
            _Server(server_config, banner).run(sockets=[sock])
        finally:
            batcher.close()  # after a failed start too; a no-op after the app's own shutdown
