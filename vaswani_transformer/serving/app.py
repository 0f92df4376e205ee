"""Serve a trained translator over HTTP: the LibreTranslate API, a page to try it, micro-batched decoding.

`vaswani-transformer serve MODEL` runs a FastAPI app under uvicorn (the `serve` extra):

- `POST /translate`, `POST /translate_file` and `GET /languages` speak the LibreTranslate API
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
import dataclasses
import errno
import logging
import signal
import socket
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from importlib import resources
from pathlib import Path

try:
    import uvicorn
    from fastapi import APIRouter, FastAPI, Request
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import HTMLResponse, JSONResponse, Response
    from starlette.exceptions import HTTPException
except ImportError as error:
    raise ImportError(
        "`vaswani-transformer serve` needs FastAPI and uvicorn: pip install 'vaswani-transformer[serve]'."
    ) from error

from ..exchange.hub import check_model_exists
from ..inference.alignment import aligner_for
from ..inference.config import BATCH_SIZE, InferenceConfig
from ..inference.engines import Engine, Glossaries, Hypothesis, load_engine, model_languages
from ..inference.translation import warn_of_empty_translations
from .access import Access, load_api_keys
from .batcher import MicroBatcher
from .config import ServingConfig
from .detection import LanguageDetector
from .files import FileStore, file_routes
from .metrics import ServingMetrics
from .models import ServedModel, choose_model
from .requests import Limits, RequestError, client_address, parse_translate_request, request_fields

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


def languages_response(pairs: list[tuple[str, str]]) -> list[dict]:
    """The body of LibreTranslate's `GET /languages` for the (source, target) pairs a server translates.

    One entry per language, in the order the pairs name them, `{"code", "name", "targets"}`: the targets it is
    translated into, sorted, or none (a language the server only translates into).
    """
    targets: dict[str, list[str]] = {}
    for source, target in pairs:
        targets.setdefault(source, []).append(target)
        targets.setdefault(target, [])
    return [
        {"code": code, "name": LANGUAGE_NAMES.get(code, code), "targets": sorted(found)}
        for code, found in targets.items()
    ]


def create_app(
    models: list[ServedModel],
    access: Access,
    detector: LanguageDetector,
    metrics: ServingMetrics,
    alternatives_limit: int = ServingConfig.alternatives_limit,
    file_size_limit: int = ServingConfig.file_size_limit,
) -> FastAPI:
    """The FastAPI app: LibreTranslate's `POST /translate`, `/translate_file` and `/detect`, `GET /languages` and
    `/download_file/NAME`; `GET /health`, `GET /metrics` and the page at `/`.

    See docs/serving.md, "The API".

    Args:
        models: one per language pair, each with its own batcher, closed (its queue drained) when the app shuts down.
        access: checks API keys and counts requests (`/translate`, `/translate_file`, `/detect`).
        detector: detects the language of `source=auto` and of `/detect`.
        metrics: what `GET /metrics` answers; the app counts requests, latency and sentences.
        alternatives_limit: the most alternatives one text may ask for.
        file_size_limit: the most bytes of one file of `/translate_file`, kept in a temporary directory of the app's
            own (`serving_files.FileStore`), deleted when the app shuts down.

    Raises:
        OSError: the page cannot be read, or the temporary directory of the translated files cannot be made
            (`FileStore`).
    """
    page = (resources.files("vaswani_transformer.serving") / "static" / "index.html").read_text(encoding="utf-8")
    by_pair = {(model.source, model.target): model for model in models}
    limits = models[0].limits  # the server's: every model is served with the same limits
    store = FileStore(file_size_limit)
    app = FastAPI(
        title="vaswani_transformer", lifespan=_lifespan(models, store), docs_url=None, redoc_url=None, openapi_url=None
    )
    _add_middleware(app, metrics)
    _add_error_handlers(app)
    app.include_router(_page_routes(page))
    app.include_router(_model_routes(models, list(by_pair)))
    app.include_router(_metrics_routes(metrics))
    app.include_router(_detect_routes(limits, access, detector))
    app.include_router(_translate_routes(by_pair, limits, access, detector, metrics, alternatives_limit))
    app.include_router(file_routes(store, by_pair, access, detector, metrics))
    return app


# The paths `/metrics` labels by name (and `/download_file` for every file's).
_MEASURED = frozenset({"/", "/health", "/languages", "/metrics", "/detect", "/translate", "/translate_file"})
# HEAD answers as GET without the body (uvicorn drops it), as HTTP asks and monitors expect.
_READ = ("GET", "HEAD")


def _lifespan(models: list[ServedModel], store: FileStore) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    # The app's lifespan: at shutdown, each model's batcher closed and the translated files deleted.
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn calls this after the requests in flight were answered; the queues are empty by then.
        for model in models:
            await asyncio.to_thread(model.batcher.close)
        store.close()

    return lifespan


def _add_middleware(app: FastAPI, metrics: ServingMetrics) -> None:
    # LibreTranslate answers browsers from any origin; so do we, for its web clients.
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["GET", "POST"], allow_headers=["*"])

    # Added last, so outermost: it counts the answers CORS gives itself (preflights) too.
    @app.middleware("http")
    async def measure(request: Request, call_next: Callable) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        # Known routes only: a label per unknown path would let any client grow the registry without end.
        path = request.url.path
        endpoint = path if path in _MEASURED else "/download_file" if path.startswith("/download_file/") else "other"
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
        return response


def _add_error_handlers(app: FastAPI) -> None:
    # Every error answered in LibreTranslate's shape, `{"error": message}`; an unexpected one logged, as a 500.
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


def _page_routes(page: str) -> APIRouter:
    # The page at `/`, to type a sentence and see its translation.
    router = APIRouter()

    @router.api_route("/", methods=_READ, response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    return router


def _model_routes(models: list[ServedModel], pairs: list[tuple[str, str]]) -> APIRouter:
    # What the server serves: `/health` (each model and its batching) and LibreTranslate's `/languages`.
    router = APIRouter()

    @router.api_route("/health", methods=_READ)
    async def health() -> dict:
        first = models[0]
        return {
            "status": "ok",
            "source": first.source,
            "target": first.target,
            "sentences_in_flight": sum(model.batcher.sentences_in_flight for model in models),
            **first.info,
            "models": [{"source": m.source, "target": m.target, **m.info} for m in models],
        }

    @router.api_route("/languages", methods=_READ)
    async def get_languages() -> list[dict]:
        return languages_response(pairs)

    return router


def _metrics_routes(metrics: ServingMetrics) -> APIRouter:
    # `/metrics`, in Prometheus' text format.
    router = APIRouter()

    @router.api_route("/metrics", methods=_READ)
    async def get_metrics() -> Response:
        return Response(metrics.exposition(), media_type=metrics.content_type)

    return router


async def _checked_fields(request: Request, limits: Limits, access: Access) -> tuple[dict, int]:
    # The fields of a request, its key checked and its request counted; the character limit of its key.
    fields = await request_fields(request, limits.body_bytes())
    return fields, access.check(fields.get("api_key"), client_address(request), request.headers.get("origin"))


def _detect_routes(limits: Limits, access: Access, detector: LanguageDetector) -> APIRouter:
    # LibreTranslate's `POST /detect`: the languages a text may be in, the likeliest first.
    router = APIRouter()

    @router.post("/detect")
    async def post_detect(request: Request) -> JSONResponse:
        fields, char_limit = await _checked_fields(request, limits, access)
        q = fields.get("q")
        if not isinstance(q, str) or not q.strip():
            raise RequestError("Invalid request: missing q parameter (a string of text)")
        if len(q) > char_limit:
            raise RequestError(f"Invalid request: q has {len(q)} characters, more than the limit of {char_limit}")
        return JSONResponse(detector.detect(q))

    return router


def _translate_routes(
    by_pair: dict[tuple[str, str], ServedModel],
    limits: Limits,
    access: Access,
    detector: LanguageDetector,
    metrics: ServingMetrics,
    alternatives_limit: int,
) -> APIRouter:
    # LibreTranslate's `POST /translate`: one text or a list, with its alternatives and the language detected.
    router = APIRouter()

    @router.post("/translate")
    async def post_translate(request: Request) -> JSONResponse:
        fields, char_limit = await _checked_fields(request, limits, access)
        checked = parse_translate_request(
            fields, list(by_pair), dataclasses.replace(limits, char_limit=char_limit), alternatives_limit
        )
        text = "\n".join(checked.texts) if checked.auto else ""  # all its texts say the request's language
        model, detected = choose_model(by_pair, detector, checked.source, checked.target, text)
        translated = await model.translate(
            checked.texts,
            checked.format,
            checked.alternatives,
            checked.is_list,
            glossary=checked.glossary,
            alignments=checked.alignments,
        )
        metrics.sentences.labels(f"{model.source}-{model.target}").inc(translated.sentences)

        def each(values: list) -> object:  # a value per text for a list q, the one text's for a string
            return values if checked.is_list else values[0]

        texts = translated.texts
        body: dict = {"translatedText": each(texts), "confidence": each(translated.confidences)}
        if detected is not None:
            body["detectedLanguage"] = each([detected] * len(texts))
        if checked.alternatives:
            body["alternatives"] = each(translated.alternatives)
            body["alternativesConfidence"] = each(translated.alternative_confidences)
        if translated.alignments is not None:
            body["alignments"] = each(translated.alignments)
        return JSONResponse(body)

    return router


def _logging_empty(engine: Engine) -> Callable[[list[str], int, Glossaries], list[list[Hypothesis]]]:
    # The engine's scored hypotheses, logging the batches' non-blank sentences translated to "" (one warning a batch).
    def translate(sentences: list[str], count: int, glossary: Glossaries = None) -> list[list[Hypothesis]]:
        found = engine.scored_hypotheses(sentences, count, glossary)
        warn_of_empty_translations(sentences, [each[0].text for each in found])
        return found

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


def parse_models(models: Sequence[str], source_lang: str | None, target_lang: str | None) -> list[tuple[str, str, str]]:
    """The (source, target, model) of each of `serve`'s MODEL arguments: `DIR`, or `SRC-TGT=DIR` (`en-de=DIR`).

    A model named alone takes its languages from its files (`inference.model_languages`), or from `source_lang` and
    `target_lang` where only one model is served.

    See docs/serving.md, "Several models".

    Raises:
        OSError: a model directory that does not exist.
        ValueError: no model, a malformed pair, languages given for several models, a model whose languages are
            unknown, or two models of one pair.
    """
    if not models:
        raise ValueError("give at least one model to serve: MODEL, or SRC-TGT=MODEL (e.g. en-de=outputs/run)")
    if len(models) > 1 and (source_lang or target_lang):
        raise ValueError("--source-lang and --target-lang name the languages of one model: write SRC-TGT=MODEL")
    found = []
    for argument in models:
        pair, sep, path = argument.partition("=")
        if sep and not Path(argument).exists():
            source, dash, target = pair.partition("-")
            if not (dash and source and target) or not path:
                raise ValueError(f"{argument!r}: write a model as MODEL or SRC-TGT=MODEL, e.g. en-de=outputs/run")
            check_model_exists(path)
            found.append((source, target, path))
        else:
            found.append((*model_languages(argument, source_lang, target_lang), argument))
    pairs = [(source, target) for source, target, _ in found]
    if len(set(pairs)) < len(pairs):
        raise ValueError(f"two models translate one pair ({', '.join(f'{s}-{t}' for s, t in pairs)}): serve one each")
    return found


def serve(
    models: Sequence[str] | str,
    config: ServingConfig | None = None,
    inference: InferenceConfig | None = None,
    source_lang: str | None = None,
    target_lang: str | None = None,
) -> None:
    """`vaswani-transformer serve`: load translators and serve them over HTTP until SIGTERM or Ctrl+C.

    The port is bound before the models load, so a port in use fails at once; `port=0` lets the
    system choose one. Once it accepts requests, the server prints one line on stdout: "Serving
    MODEL (SRC -> TGT, ENGINE) on http://HOST:PORT" (the models joined with " and "). On SIGTERM or SIGINT it stops
    accepting connections, answers every request it has received (the batchers translate all they hold),
    and returns, so that the command exits with status 0.

    Args:
        models: model directories or Hub ids, each alone or as `SRC-TGT=MODEL` (`parse_models`); each language pair
            is batched on its own (`MicroBatcher`).
        config: where to listen and which proxies' headers uvicorn trusts (none by default), how to batch
            (`MicroBatcher`), what one request may ask for (`Limits`), keys (required or not), request limits and the
            languages to detect; default `ServingConfig()`.
            `config.cpu_threads()` sets the CPU threads of one `generate()` (`torch.set_num_threads`; CTranslate2's
            `intra_threads`): `--threads`, or one per core less one, leaving a core to the HTTP side and to other
            processes, whose competition slows a parallel region that waits for every one of its threads.
        inference: the engine, its decoding and device (`inference.load_engine`), the sentences of one batch
            (`MicroBatcher`), sentence splitting and what a sentence over the model's limit gets (`Limits`); default
            `InferenceConfig()`.
        source_lang, target_lang: the languages of a single model, where its files do not say them.

    Raises:
        ImportError: the engine's package is missing.
        OSError: the address cannot be bound, a model or the API keys file cannot be read.
        ValueError: from `parse_models`, `access.load_api_keys`, `LanguageDetector` or `inference.load_engine` (the
            configs check their own settings when they are made).
    """
    pairs = parse_models([models] if isinstance(models, str) else list(models), source_lang, target_lang)
    config, inference = config or ServingConfig(), inference or InferenceConfig()
    keys = load_api_keys(config.api_keys) if config.api_keys else None
    languages = [code for source, target, _ in pairs for code in (source, target)]
    detector = LanguageDetector([*languages, *config.detect_language])
    host, port, threads = config.host, config.port, config.cpu_threads()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    served: list[ServedModel] = []
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        _bind(sock, host, port)  # not listening yet: clients are refused until the models are loaded
        import torch

        torch.set_num_threads(threads)
        metrics = ServingMetrics()
        try:
            for source, target, model in pairs:
                served.append(_served_model(source, target, model, config, inference, metrics))
            access = Access(
                keys, config.req_limit, config.char_limit, config.require_api_key, config.require_api_key_origin
            )
            app = create_app(served, access, detector, metrics, config.alternatives_limit, config.file_size_limit)
            _run(app, sock, _banner(pairs, served, sock), config)
        finally:
            for each in served:
                each.batcher.close()  # after a failed start too; a no-op after the app's own shutdown


def _bind(sock: socket.socket, host: str, port: int) -> None:
    # The socket bound to the address, or an error that says which of --host and --port to change.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        host_error = isinstance(error, socket.gaierror) or error.errno == errno.EADDRNOTAVAIL
        advice = "check --host" if host_error else "choose another --port"
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror}; {advice}") from error


def _banner(pairs: list[tuple[str, str, str]], served: list[ServedModel], sock: socket.socket) -> str:
    # The line printed once the server accepts connections: each model, its pair and engine, and the bound address
    # (the port the system chose for `port=0`).
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if sock.family == socket.AF_INET6 else bound_host
    names = " and ".join(
        f"{m} ({s} -> {t}, {each.info['engine']})" for (s, t, m), each in zip(pairs, served, strict=True)
    )
    return f"Serving {names} on http://{shown}:{bound_port}"


class _HiddenKeys(logging.Filter):
    """uvicorn's access log with the value of each `api_key` of a request's query string replaced by `***`: the
    server refuses a key there, but the request is logged all the same, and no key may reach a log."""

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access records: (client, method, path with query string, HTTP version, status).
        if isinstance(record.args, tuple) and len(record.args) == 5 and isinstance(record.args[2], str):
            client, method, path, version, status = record.args
            head, sep, query = path.partition("?")
            parts = query.split("&") if sep else []
            hidden = [
                "api_key=***" if urllib.parse.unquote_plus(p.partition("=")[0]) == "api_key" else p for p in parts
            ]
            record.args = (client, method, head + sep + "&".join(hidden), version, status)
        return True


def _run(app: FastAPI, sock: socket.socket, banner: str, config: ServingConfig) -> None:
    # uvicorn serving `app` on the bound socket until SIGTERM or SIGINT, then answering what it received. Proxy
    # headers are uvicorn's to read, from the addresses named alone: uvicorn's default trusts 127.0.0.1, which lets
    # any client on the machine, or a proxy that passes the header on, name itself another client.
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["filters"] = {"hidden_keys": {"()": _HiddenKeys}}
    log_config["loggers"]["uvicorn.access"]["filters"] = ["hidden_keys"]
    server_config = uvicorn.Config(
        app,
        log_level="info",
        log_config=log_config,
        access_log=config.access_log,
        proxy_headers=config.forwarded_allow_ips is not None,
        forwarded_allow_ips=config.forwarded_allow_ips,
        timeout_graceful_shutdown=None,
    )
    if threading.current_thread() is threading.main_thread():
        # uvicorn catches SIGTERM and SIGINT, shuts down gracefully, then raises the signal again
        # under the handler it found: one that does nothing lets that graceful end exit with 0.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: None)
    _Server(server_config, banner).run(sockets=[sock])


def _served_model(
    source: str, target: str, model: str, config: ServingConfig, inference: InferenceConfig, metrics: ServingMetrics
) -> ServedModel:
    # One model loaded, with its own batcher, whose batch sizes go to the metrics.
    engine = load_engine(model, inference)
    batch_size = inference.batch_size or BATCH_SIZE
    translate, observe = _logging_empty(engine), metrics.batch_sizes.labels(f"{source}-{target}").observe

    def measured(sentences: list[str], count: int, glossary: Glossaries) -> list[list[Hypothesis]]:
        observe(len(sentences))
        return translate(sentences, count, glossary)

    batcher = MicroBatcher(measured, config.batch_wait_ms, config.max_batch_tokens, batch_size)
    limits = Limits(
        config.char_limit,
        config.batch_limit,
        config.sentence_limit,
        config.request_timeout,
        engine.source_limit,
        inference.long_inputs,
    )
    info = {
        # The model's name, not its local path, which any origin may read.
        "model": Path(model).resolve().name if Path(model).is_dir() else model,
        "engine": engine.name,
        "batch_wait_ms": config.batch_wait_ms,
        "max_batch_tokens": config.max_batch_tokens,
        "batch_size": batch_size,
    }
    beams = engine.beam_size or engine.generation_config.num_beams or 1
    # The CTranslate2 engine keeps no attention: its translations are aligned by the torch model beside its export.
    aligner = aligner_for(engine, model, inference.device)
    return ServedModel(
        source, target, batcher, engine.tokenizer, limits, inference.split_sentences, beams, aligner, info
    )
