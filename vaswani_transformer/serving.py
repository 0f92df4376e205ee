"""Serve a trained translator over HTTP: the LibreTranslate API, a page to try it, micro-batched decoding.

`vaswani-transformer serve MODEL` runs a FastAPI app under uvicorn (the `serve` extra):

- `POST /translate` and `GET /languages` speak the LibreTranslate API
  (https://docs.libretranslate.com/guides/api_usage/), so its clients work unchanged; `GET /health`
  says the server is up; `GET /` is a page to type a sentence and see its translation.
- One worker thread owns the model. Request handlers put their sentences on a queue and await;
  the worker takes the oldest request, keeps collecting for `batch_wait_ms` or until a sentence or
  token budget is full, translates the union with one `generate()` (beam search of §6.1, through
  `translation.translate`) or one CTranslate2 batch, and answers each request with its own
  sentences, in order (`MicroBatcher`).
- Bad input gets HTTP 400 (413 for a body too large to read) and `{"error": "<message naming
  the field>"}`, LibreTranslate's error shape; the server keeps serving.
- SIGTERM (or Ctrl+C) stops accepting connections, answers every request already received, then
  exits with status 0.
"""

import asyncio
import contextlib
import copy
import errno
import json
import logging
import queue
import re
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import HTMLResponse, JSONResponse
    from starlette.exceptions import HTTPException
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


@dataclass
class _Job:
    sentences: list[str]
    tokens: int
    future: Future


_STOP = object()


class MicroBatcher:
    """Translates the sentences of requests that arrive together in one batch, on one worker thread.

    The worker takes the oldest waiting request, then keeps taking requests for up to
    `batch_wait_ms` milliseconds, or until the next one would bring the batch over
    `max_batch_sentences` sentences or `max_batch_tokens` source tokens (a request is never
    split: one bigger than a budget is a batch of its own). It translates the union with one call
    of `translate_fn` and answers each request with its own sentences, in order. If that call
    fails, each request of the batch is translated alone, so that one bad request fails alone.

    A request's data travels in its own job on the queue; the batcher holds no other state of a
    request. One request at a time (no micro-batching): `batch_wait_ms=0, max_batch_sentences=1`.

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
        self._lock = threading.Lock()  # orders `submit` against `close`, and guards the count
        self._closed = False
        self._in_flight = 0
        self._worker = threading.Thread(target=self._run, name="micro-batcher", daemon=True)
        self._worker.start()

    @property
    def sentences_in_flight(self) -> int:
        """Sentences submitted and not yet answered.

        See docs/serving.md, "The API".
        """
        return self._in_flight

    def submit(self, sentences: list[str], tokens: int) -> Future:
        """Queue one request's sentences (`tokens`: their source tokens); the future gives their translations.

        See docs/serving.md, "Micro-batching".

        Raises:
            RuntimeError: the batcher is closed.
        """
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            self._in_flight += len(sentences)
            self._queue.put(_Job(list(sentences), tokens, future))
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

    def _take(self, job) -> bool:
        # A request whose handler was cancelled (its client gone at a forced shutdown) needs no work.
        if job is _STOP or job.future.set_running_or_notify_cancel():
            return True
        self._done(job)
        return False

    def _done(self, job: _Job) -> None:
        with self._lock:
            self._in_flight -= len(job.sentences)

    def _run(self) -> None:
        carried = None
        while True:
            first = carried if carried is not None else self._queue.get()
            carried = None
            if first is _STOP:
                return
            if not self._take(first):
                continue
            batch, sentences, tokens = [first], len(first.sentences), first.tokens
            deadline = time.monotonic() + self.batch_wait_ms / 1000
            while sentences < self.max_batch_sentences and tokens < self.max_batch_tokens:
                try:
                    job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if (
                    job is _STOP
                    or sentences + len(job.sentences) > self.max_batch_sentences
                    or tokens + job.tokens > self.max_batch_tokens
                ):
                    carried = job  # the first of the next batch (or the end, after this batch)
                    break
                if self._take(job):
                    batch.append(job)
                    sentences, tokens = sentences + len(job.sentences), tokens + job.tokens
            self._translate(batch)

    def _translate(self, batch: list[_Job]) -> None:
        try:
            translations = self.translate_fn([sentence for job in batch for sentence in job.sentences])
        except Exception as error:
            if len(batch) > 1:
                for job in batch:
                    self._translate([job])
                return
            logger.exception("Translating a request failed")
            self._done(batch[0])
            batch[0].future.set_exception(error)
            return
        start = 0
        for job in batch:
            self._done(job)
            job.future.set_result(translations[start : start + len(job.sentences)])
            start += len(job.sentences)


class RequestError(ValueError):
    """A request the server refuses: HTTP `status` (400, or 413) with the body `{"error": message}`.

    See docs/serving.md, "Bad input".
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    """What one `POST /translate` may ask for (LibreTranslate's `--char-limit` and `--batch-limit`).

    Attributes:
        char_limit: characters of `q`, all texts together.
        batch_limit: texts in a list `q`.
        source_limit: tokens (with `</s>`) of one source sentence, the model's limit; None for none.
        long_inputs: "error" refuses a sentence over `source_limit`, "truncate" cuts it there.
    """

    char_limit: int
    batch_limit: int
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
    """The fields of a JSON, form-encoded or multipart body (LibreTranslate takes all three), over the query's."""
    fields: dict = {key: values if len(values) > 1 else values[0] for key, values in _multi(request.query_params)}
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(f"Invalid request: the body has {declared} bytes, more than {max_bytes}", 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise RequestError(f"Invalid request: the body has more than {max_bytes} bytes", 413)
    if kind == "multipart/form-data":
        # Parsed from the bytes read under the cap: a chunked body declares no length, and Starlette's parser
        # caps each part, not their sum.
        async def receive() -> dict:
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        form = await Request(request.scope, receive).form(max_files=0, max_part_size=max_bytes)
        return fields | {key: values if len(values) > 1 else values[0] for key, values in _multi(form)}
    if kind == "application/x-www-form-urlencoded":
        try:
            form = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=10_000, errors="strict")
        except ValueError as error:  # not UTF-8 (raw or percent-encoded), or too many fields
            raise RequestError(f"Invalid request: malformed form body ({error})") from None
        return fields | {key: values if len(values) > 1 else values[0] for key, values in form.items()}
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


def _multi(items) -> list[tuple[str, list]]:
    grouped: dict[str, list] = {}
    for key, value in items.multi_items():
        grouped.setdefault(key, []).append(value)
    return list(grouped.items())


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

    app = FastAPI(title="vaswani_transformer", lifespan=lifespan, docs_url=None, redoc_url=None)
    # LibreTranslate answers browsers from any origin; so do we, for its web clients.
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["GET", "POST"], allow_headers=["*"])

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return JSONResponse({"error": str(error.detail)}, status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:
        logger.error("Request failed: %r", error)
        return JSONResponse({"error": f"internal error: {type(error).__name__}"}, status_code=500)

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "source": languages[0],
            "target": languages[1],
            "sentences_in_flight": batcher.sentences_in_flight,
            **(info or {}),
        }

    @app.get("/languages")
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
            future = batcher.submit(sentences, sum(lengths))
        except RuntimeError as error:
            return JSONResponse({"error": str(error)}, status_code=503)
        try:
            translations = await asyncio.wrap_future(future)
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
        limits = Limits(config.char_limit, config.batch_limit, runner.source_limit, config.long_inputs)
        batching = ("batch_wait_ms", "max_batch_tokens", "max_batch_sentences")
        info = {"model": model, "engine": runner.name, **{name: getattr(config, name) for name in batching}}
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
