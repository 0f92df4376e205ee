"""Serve a trained translator over HTTP: the LibreTranslate API, a page to try it, micro-batched decoding.

`vaswani-transformer serve MODEL` runs a FastAPI app under uvicorn (the `serve` extra):

- `POST /translate` and `GET /languages` speak the LibreTranslate API
  (https://docs.libretranslate.com/guides/api_usage/), so its clients work unchanged; `GET /health`
  says the server is up; `GET /` is a page to type a sentence and see its translation.
- One worker thread owns the model. Request handlers put their sentences on a queue and await;
  the worker fills each batch with one sentence of each waiting request in turn (fair queueing:
  a big request shares every batch with those behind it) up to a sentence or token budget,
  collecting new requests for `batch_wait_ms` while the batch is not full, translates it with one
  `generate()` (beam search of §6.1) or one CTranslate2 batch through the engine (`inference.py`),
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
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable
from importlib import resources
from pathlib import Path

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

from transformers import PreTrainedTokenizerBase

from .hub import check_model_exists
from .inference import Engine, load_engine
from .inference_config import BATCH_SIZE, InferenceConfig
from .micro_batching import MicroBatcher
from .serving_config import ServingConfig
from .serving_requests import Limits, RequestError, parse_translate_request, request_fields
from .text_format import split_text
from .translation import warn_of_empty_translations

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
        fields = await request_fields(request, limits.body_bytes())
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


def _logging_empty(engine: Engine) -> Callable[[list[str]], list[str]]:
    # The engine's translate, logging the batches' non-blank sentences translated to "" (one warning a batch).
    def translate(sentences: list[str]) -> list[str]:
        translations = engine.translate(sentences)
        warn_of_empty_translations(sentences, translations)
        return translations

    return translate


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
    inference: InferenceConfig | None = None,
    source_lang: str | None = None,
    target_lang: str | None = None,
) -> None:
    """`vaswani-transformer serve`: load a translator and serve it over HTTP until SIGTERM or Ctrl+C.

    The port is bound before the model loads, so a port in use fails at once; `port=0` lets the
    system choose one. Once it accepts requests, the server prints one line on stdout: "Serving
    MODEL (SRC -> TGT, ENGINE) on http://HOST:PORT". On SIGTERM or SIGINT it stops accepting
    connections, answers every request it has received (the batcher translates all it holds),
    and returns, so that the command exits with status 0.

    Args:
        model: a model directory or Hub id.
        config: where to listen, how to batch (`MicroBatcher`) and what one request may ask for
            (`Limits`); default `ServingConfig()`. `config.threads` sets the CPU threads of one
            `generate()` (`torch.set_num_threads`; CTranslate2's `intra_threads`); default: torch's,
            one per core. Fewer leave cores to the HTTP side and to other processes, whose competition
            slows a parallel region that waits for every one of its threads.
        inference: the engine, its decoding and device (`inference.load_engine`), the sentences of one batch
            (`MicroBatcher`) and what a sentence over the model's limit gets (`Limits`); default
            `InferenceConfig()`.
        source_lang, target_lang: the model's languages, where its files do not say them (`model_languages`).

    Raises:
        ImportError: the engine's package is missing.
        OSError: the address cannot be bound, or the model cannot be loaded.
        ValueError: a model whose languages are unknown, or from `inference.load_engine` (the configs check their
            own settings when they are made).
    """
    languages = model_languages(model, source_lang, target_lang)
    config, inference = config or ServingConfig(), inference or InferenceConfig()
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
        engine = load_engine(model, inference)
        batch_size = inference.batch_size or BATCH_SIZE
        batcher = MicroBatcher(_logging_empty(engine), config.batch_wait_ms, config.max_batch_tokens, batch_size)
        limits = Limits(
            config.char_limit,
            config.batch_limit,
            config.sentence_limit,
            config.request_timeout,
            engine.source_limit,
            inference.long_inputs,
        )
        # The model's name, not its local path, which any origin may read.
        model_name = Path(model).resolve().name if Path(model).is_dir() else model
        info = {
            "model": model_name,
            "engine": engine.name,
            "batch_wait_ms": config.batch_wait_ms,
            "max_batch_tokens": config.max_batch_tokens,
            "batch_size": batch_size,
        }
        app = create_app(batcher, engine.tokenizer, languages, limits, info)
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
        banner = f"Serving {model} ({languages[0]} -> {languages[1]}, {engine.name}) on http://{shown}:{bound_port}"
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
