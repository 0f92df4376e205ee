"""What one `POST /translate` may ask for, and how its fields are read: LibreTranslate's API, checked.

JSON, form and multipart bodies and the query string give the same fields, but for `api_key`, which only a body
may carry (logs and proxies keep a URL); each is checked against the server's `Limits` (characters, texts,
sentences, the model's length limit) before any sentence is queued, and a refusal is a `RequestError` that names the
field (HTTP 400, LibreTranslate's `{"error": ...}`). See docs/serving.md, "Bad input".
"""

import json
import re
from collections.abc import AsyncIterator, Collection, Iterable
from dataclasses import dataclass
from urllib.parse import parse_qsl

from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request

from ..data.text_format import TEXT_FORMATS
from ..inference.glossary import Glossary


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
        sentence_limit: sentences of `q`, all texts together: the sentences of its lines, or of its HTML blocks.
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
    """A checked `POST /translate`: `texts` (one, or the list `q` was), the language pair (`source` "auto" where it is
    to be detected), `format`, `alternatives`, the request's `glossary` (None for none) and whether it asks for
    word `alignments`.

    See docs/serving.md, "The API".
    """

    texts: list[str]
    is_list: bool
    source: str
    target: str
    auto: bool
    format: str
    alternatives: int
    glossary: Glossary | None = None
    alignments: bool = False


def parse_translate_request(
    fields: dict, pairs: Collection[tuple[str, str]], limits: Limits, alternatives_limit: int = 3
) -> TranslateRequest:
    """Check the fields of a LibreTranslate `POST /translate` request.

    Fields: `q` (a string or a list of strings), `source` (a code, or "auto"), `target`, `format`
    ("text", the default, or "html"), `alternatives` (a whole number, at most `alternatives_limit`, LibreTranslate's
    `--alternatives-limit`), `api_key` (checked by `access.Access`); and ours: `glossary` (`parse_glossary`),
    `alignments` (true or false; text only: HTML's markup takes them).

    Args:
        fields: the parsed body (JSON object, or form fields; a repeated form field is a list).
        pairs: the (source, target) pairs the server translates.
        limits: the server's `Limits` (its `char_limit` the request's key's, where it has one).
        alternatives_limit: the most alternatives one text may ask for.

    Raises:
        RequestError: a field is missing, of the wrong type, empty, over a limit, or names a
            language pair the server does not translate; the message names the field.
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

    source, target = parse_languages(fields, pairs)
    auto = source == "auto"
    text_format = fields.get("format") or "text"
    if text_format not in TEXT_FORMATS:
        raise RequestError(f"Invalid request: format must be 'text' or 'html', got {text_format!r}")
    alternatives = fields.get("alternatives")
    if alternatives is None or alternatives == "":
        alternatives = 0
    elif isinstance(alternatives, str) and re.fullmatch(r"\s*[0-9]{1,9}\s*", alternatives):  # form fields: strings
        alternatives = int(alternatives)
    elif not isinstance(alternatives, int) or isinstance(alternatives, bool) or alternatives < 0:
        raise RequestError(f"Invalid request: alternatives must be a whole number, 0 or more, got {alternatives!r}")
    if alternatives > alternatives_limit:
        raise RequestError(f"Invalid request: alternatives parameter must be <= {alternatives_limit}")
    alignments = _flag(fields.get("alignments"), "alignments")
    if alignments and text_format == "html":
        raise RequestError(
            "Invalid request: alignments count the words of text, not of HTML (whose markup they place): "
            "ask for them with format text"
        )
    glossary = parse_glossary(fields.get("glossary"))
    return TranslateRequest(texts, is_list, source, target, auto, text_format, alternatives, glossary, alignments)


def parse_glossary(value: object) -> Glossary | None:
    """A request's `glossary`: a list of [source, target] pairs or an object {source: target} (in a form, that JSON
    as a string), as `inference.glossary.Glossary` reads terms; None where there is none or it is empty.

    See docs/serving.md, "Glossaries".

    Raises:
        RequestError: another shape, a term that is not a string or is empty, or a source term given twice.
    """
    if value is None or value == "":
        return None
    shape = "a list of [source, target] pairs of strings, or an object {source: target}"
    if isinstance(value, str):  # a form field
        try:
            value = json.loads(value)
        except ValueError:
            raise RequestError(f"Invalid request: glossary must be {shape} (as JSON in a form)") from None
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, list) or not all(
        isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(term, str) for term in pair)
        for pair in pairs
    ):
        raise RequestError(f"Invalid request: glossary must be {shape}, got {json.dumps(value)[:80]}")
    try:
        glossary = Glossary(pairs, where="glossary term {}")
    except ValueError as error:
        raise RequestError(f"Invalid request: {error}") from None
    return glossary if len(glossary) else None


def _flag(value: object, name: str) -> bool:
    # A boolean field: JSON's true or false, or a form's "true", "false", "1", "0" (any case); absent is false.
    if value is None or value == "":
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise RequestError(f"Invalid request: {name} must be true or false, got {value!r}")


def parse_languages(fields: dict, pairs: Collection[tuple[str, str]]) -> tuple[str, str]:
    """The `source` ("auto" where it is to be detected) and `target` of a request, LibreTranslate's fields, checked.

    Raises:
        RequestError: a field missing, not a string, or a language (or pair) the server does not translate; the
            message names the field and the pairs served.
    """
    source, target = fields.get("source"), fields.get("target")
    for name, value in (("source", source), ("target", target)):
        if value is None or value == "":
            raise RequestError(f"Invalid request: missing {name} parameter")
        if not isinstance(value, str):
            raise RequestError(f"Invalid request: {name} must be a language code string, got {type(value).__name__}")
    served = ", ".join(f"{s} -> {t}" for s, t in pairs)
    auto = source == "auto"
    if not auto and source not in {s for s, _ in pairs}:
        raise RequestError(f"source {source!r} is not supported: this server translates {served} (GET /languages)")
    if target not in {t for s, t in pairs if auto or s == source}:
        raise RequestError(f"target {target!r} is not supported: this server translates {served} (GET /languages)")
    return source, target


async def request_fields(request: Request, max_bytes: int, max_files: int = 0) -> dict:
    """The fields of a JSON, form-encoded or multipart body (LibreTranslate takes all three), over the query's.

    A multipart body may hold up to `max_files` files (`POST /translate_file`'s one), each an `UploadFile` field.

    Raises:
        RequestError: a body over `max_bytes` (413); an `api_key` in the query string, a malformed body, a field of
            the query string or of a form that is not UTF-8 (named), or a client gone before the body ended (400).
    """
    fields = _urlencoded_fields(request.scope["query_string"], "query string")
    if "api_key" in fields:  # LibreTranslate's clients send it in the body, where no access log prints it
        raise RequestError(
            "Invalid request: api_key in the URL, which logs and proxies keep: send it in the body (the api_key field "
            "of the JSON or form)"
        )
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
            parser = _MultiPartParser(request.headers, stream(), max_files=max_files, max_part_size=max_bytes)
            form = await parser.parse()
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


def client_address(request: Request) -> str:
    """The address of the client that sent `request`, which the limits and the files' quota count: its socket's
    peer, or the client a trusted proxy names (`--forwarded-allow-ips`, uvicorn's); "unknown" where there is none.
    """
    return request.client.host if request.client else "unknown"


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
    # The fields by name, a repeated one as a list, each refused if it holds a byte that was not UTF-8 (a file's
    # bytes are its endpoint's to read).
    grouped: dict[str, list] = {}
    for name, value in pairs:
        for text in (name, value) if isinstance(value, str) else (name,):
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
