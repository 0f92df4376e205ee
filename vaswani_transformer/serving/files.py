"""LibreTranslate's `POST /translate_file` and `GET /download_file/NAME`: a .txt or .html file translated whole.

A file comes in a multipart body (`file`, `source`, `target`, `api_key`, LibreTranslate's fields), is held to the
same key, requests per minute and limits as `POST /translate`'s text (`--char-limit` counting its text, not its
markup; `--sentence-limit`; the model's length limit; `--request-timeout`) and to `--file-size-limit`, and its
sentences take their turns in the pair's own `MicroBatcher` with every other request's. A .txt file keeps its
lines, blank lines and spacing, an .html file its markup, scripts and styles (`text_format.split_text`). The
translation is kept in the server's own temporary directory (`FileStore`) under a fresh id, and the answer is
`{"translatedFileUrl": "<base url>/download_file/<id>.<name>"}`, as LibreTranslate answers. A client's file name
is reduced to a plain name: no directory in it is honoured. One client address keeps only its latest files, so
that it cannot push out another's. See docs/serving.md, "Files".
"""

import asyncio
import codecs
import math
import re
import tempfile
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from ..data.text_format import FILE_FORMATS, file_format, split_text
from .access import Access
from .detection import LanguageDetector
from .metrics import ServingMetrics
from .models import ServedModel, choose_model
from .requests import RequestError, client_address, parse_languages, request_fields

# LibreTranslate deletes a translated file 30 minutes after it was written (its remove_translated_files.py).
FILE_LIFETIME_S = 1800.0
# Files kept at once: a burst of uploads within the lifetime cannot fill the disk (with the default
# --file-size-limit, a few hundred MB at most). A store this full refuses new files until one expires.
MAX_STORED_FILES = 256
# Files one client address keeps at once, its oldest deleted first: one client alone cannot fill the store, so it
# cannot push out anyone else's files (before, 256 uploads in 23 s did), nor keep others from storing theirs.
MAX_FILES_PER_CLIENT = 16
# Bytes of a multipart body besides its file: the other fields and the parts' headers.
_FIELD_BYTES = 65536
# Characters a stored name keeps of the client's: ASCII, so that it is the same in a URL, a header and a file system.
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_LONGEST_NAME = 100
_MEDIA_TYPES = {"text": "text/plain; charset=utf-8", "html": "text/html; charset=utf-8"}


def safe_file_name(name: str) -> str:
    """The plain file name kept of a client's `name`: its last part (after any `/` or `\\`), each run of characters
    other than ASCII letters, digits, `.`, `_` and `-` replaced by `_`, its leading dots and underscores dropped, at
    most 100 characters with its suffix kept; "file" plus the suffix where nothing else is left.

    `../../etc/passwd.txt` gives `passwd.txt`, `C:\\Users\\a b.html` `a_b.html`: no directory a client names is
    honoured, as LibreTranslate's `secure_filename` honours none (source: LibreTranslate API, its app.py).
    """
    base = PurePosixPath(name.replace("\\", "/")).name
    suffix = _UNSAFE.sub("_", PurePath(base).suffix)
    stem = _UNSAFE.sub("_", base[: len(base) - len(suffix)] if suffix else base).lstrip("._")
    return (stem[: _LONGEST_NAME - len(suffix)] or "file") + suffix


@dataclass(frozen=True)
class _Stored:
    # One translated file of the store: when it was written (monotonic seconds), its media type, its client's address.
    written: float
    media_type: str
    owner: str


class FileStore:
    """The translated files of one server, in a temporary directory of its own, each named `<id>.<name>`: 32 hex
    digits of a random UUID, a dot, and the client's name made safe (`safe_file_name`).

    Only the names it gave are served (`load`): never a path, nor a file it did not write. A file is deleted
    `lifetime` seconds after it was written, and a client address's oldest once it has more than `per_client`; a
    store of `max_files` other clients' files refuses a new one (503) until one expires, so that no client's file is
    deleted before its time by another's. The directory and all in it are deleted by `close` (the app's shutdown), or
    at the latest when the process exits.

    See docs/serving.md, "Files".

    Args:
        size_limit: the most bytes of one uploaded file (`--file-size-limit`).
        lifetime: seconds a translated file is kept (LibreTranslate's 30 minutes).
        max_files: translated files kept at once.
        per_client: translated files kept at once of one client address.

    Raises:
        OSError: the temporary directory cannot be made (at construction).
    """

    def __init__(
        self,
        size_limit: int,
        lifetime: float = FILE_LIFETIME_S,
        max_files: int = MAX_STORED_FILES,
        per_client: int = MAX_FILES_PER_CLIENT,
    ) -> None:
        self.size_limit, self.lifetime, self.max_files, self.per_client = size_limit, lifetime, max_files, per_client
        self._directory = tempfile.TemporaryDirectory(prefix="vaswani-files-")
        self.directory = Path(self._directory.name)
        # Each stored name, oldest first. Touched on the event loop's thread alone.
        self._files: OrderedDict[str, _Stored] = OrderedDict()

    def expire(self) -> None:
        """Delete the files past their lifetime."""
        now = time.monotonic()
        while self._files and now - next(iter(self._files.values())).written > self.lifetime:
            self._delete(next(iter(self._files)))

    def _delete(self, name: str) -> None:
        self._files.pop(name, None)
        (self.directory / name).unlink(missing_ok=True)

    def check_room(self, owner: str) -> None:
        """Refuse a file of the client address `owner` where the store holds `max_files` files and none of them is
        one of `owner`'s oldest to replace (its quota is not reached).

        Raises:
            RequestError: the store is full (503, with Retry-After: the seconds until its oldest file expires).
        """
        self.expire()
        if len(self._files) < self.max_files or self._count(owner) >= self.per_client:
            return
        wait = max(1, math.ceil(self.lifetime - (time.monotonic() - next(iter(self._files.values())).written)))
        raise RequestError(
            f"the server keeps {self.max_files} translated files at most, each {self.lifetime / 60:g} minutes, and "
            f"holds that many: retry in {wait} s",
            503,
            {"Retry-After": str(wait)},
        )

    def _count(self, owner: str) -> int:
        return sum(stored.owner == owner for stored in self._files.values())

    async def save(self, name: str, data: bytes, media_type: str, owner: str) -> str:
        """Keep `data`, a translated file the client at address `owner` named `name` (already safe), served as
        `media_type`; its stored name, for `/download_file/<stored name>`. Beyond `per_client` files of `owner`, its
        oldest is deleted.

        Raises:
            RequestError: the store is full (`check_room`).
            OSError: the file cannot be written (a full disk).
        """
        self.check_room(owner)
        stored = f"{uuid.uuid4().hex}.{name}"
        # Counted before it is written, so that saves awaiting their writes cannot overfill the store together; no
        # one has its name yet to load it.
        self._files[stored] = _Stored(time.monotonic(), media_type, owner)
        try:
            await asyncio.to_thread((self.directory / stored).write_bytes, data)  # a big file must not stall the loop
        except BaseException:
            self._delete(stored)
            raise
        if stored not in self._files:  # pushed out by its client's later files while it was written
            self._delete(stored)
        while self._count(owner) > self.per_client:
            self._delete(next(each for each, kept in self._files.items() if kept.owner == owner))
        return stored

    async def load(self, stored: str) -> tuple[bytes, str] | None:
        """The bytes and media type of the file stored as `stored`; None for a name this store did not give, or
        whose file was deleted (expired, or pushed out by its client's later files)."""
        self.expire()
        if stored not in self._files:
            return None
        media_type = self._files[stored].media_type  # before the read, while which another request may delete it
        try:
            data = await asyncio.to_thread((self.directory / stored).read_bytes)
        except FileNotFoundError:  # deleted by another request while this one read it
            return None
        return data, media_type

    def close(self) -> None:
        """Delete the directory and every file in it."""
        self._files.clear()
        self._directory.cleanup()


def file_routes(
    store: FileStore,
    models: dict[tuple[str, str], ServedModel],
    access: Access,
    detector: LanguageDetector,
    metrics: ServingMetrics,
) -> APIRouter:
    """LibreTranslate's `POST /translate_file` and `GET /download_file/{name}` (source: LibreTranslate API), for the
    app to include.

    `/translate_file` answers `{"translatedFileUrl": "<base url>/download_file/<id>.<name>"}`, or 503 where the store
    is full (`FileStore.check_room`); `/download_file` answers the file (`text/plain` or `text/html`, UTF-8, as an
    attachment named as the client named it), and 404 for a name not given, expired, or pushed out by its client's
    later files. See docs/serving.md, "Files".

    Args:
        store: where the translated files are kept.
        models: the served models by (source, target).
        access: checks `api_key` and counts the request, as for `/translate`; `/download_file` is not counted (its
            names are random: knowing one is the key to it).
        detector: the language of `source=auto`, from the file's text.
        metrics: counts the sentences translated.
    """
    router = APIRouter()

    @router.post("/translate_file")
    async def translate_file(request: Request) -> JSONResponse:
        fields = await _file_fields(request, store.size_limit)
        client = client_address(request)
        char_limit = access.check(fields.get("api_key"), client, request.headers.get("origin"))
        store.check_room(client)  # before the work of translating, which a full store could not keep
        name, text_format, text = await _read_file(fields.get("file"), store.size_limit)
        source, target = parse_languages(fields, list(models))
        nodes = _checked_text(name, text_format, text, char_limit)
        model, _ = choose_model(models, detector, source, target, "\n".join(nodes) if source == "auto" else "")
        translated = await model.translate([text], text_format, 0, False, "file")
        metrics.sentences.labels(f"{model.source}-{model.target}").inc(translated.sentences)
        stored = await store.save(name, translated.texts[0].encode("utf-8"), _MEDIA_TYPES[text_format], client)
        return JSONResponse({"translatedFileUrl": str(request.url_for("download_file", name=stored))})

    @router.api_route("/download_file/{name}", methods=["GET", "HEAD"], name="download_file")
    async def download_file(name: str) -> Response:
        found = await store.load(name)
        if found is None:
            raise RequestError(
                f"Not Found: no translated file of that name: a translation is kept {store.lifetime / 60:g} minutes, "
                f"and of one client address only its {store.per_client} latest (POST /translate_file again)",
                404,
            )
        data, media_type = found
        # The name without its id, as LibreTranslate names the download; ASCII alone (safe_file_name), so quotable.
        disposition = f'attachment; filename="{name.split(".", 1)[1]}"'
        return Response(data, media_type=media_type, headers={"Content-Disposition": disposition})

    return router


async def _file_fields(request: Request, size_limit: int) -> dict:
    # The multipart fields, the file among them, read under the file's limit and room for the others.
    try:
        return await request_fields(request, size_limit + _FIELD_BYTES, max_files=1)
    except RequestError as error:
        if error.status != 413:
            raise
        raise RequestError(
            f"Invalid request: the file is over the limit of {size_limit} bytes (--file-size-limit); split it into "
            "smaller files",
            413,
        ) from None


def _checked_text(name: str, text_format: str, text: str, char_limit: int) -> list[str]:
    # The text nodes of a file, or the refusal of a file over the character limit, or of text with nothing to
    # translate. HTML's nodes, unsplit, are what the limit counts (not the markup), and detection reads.
    try:
        nodes = split_text(text, text_format, None, False)[0]
    except ValueError as error:
        raise RequestError(f"Invalid request: file {name}: {error}") from None
    characters = len(text) if text_format == "text" else sum(map(len, nodes))
    if characters > char_limit:
        raise RequestError(
            f"Invalid request: file has {characters} characters of text, more than the limit of {char_limit} "
            "(--char-limit); split it into smaller files"
        )
    if text_format == "text" and not text.strip():
        raise RequestError("Invalid request: file has no text to translate")
    return nodes


async def _read_file(upload: object, size_limit: int) -> tuple[str, str, str]:
    # The uploaded file's safe name, format and text, or the refusal that names what is wrong with it.
    if upload is None or upload == "":
        raise RequestError(
            "Invalid request: missing file parameter; send the file as multipart/form-data (curl -F file=@page.html)"
        )
    if not isinstance(upload, UploadFile):  # a form field of text, or several files
        raise RequestError("Invalid request: file must be one uploaded file (a multipart part with a filename)")
    base = PurePosixPath((upload.filename or "").replace("\\", "/")).name
    text_format = file_format(base)
    if text_format is None:
        suffix = PurePath(base).suffix or "no suffix"
        raise RequestError(
            f"Invalid request: file format not supported ({suffix}): this server translates "
            f"{', '.join(FILE_FORMATS)} files"
        )
    data = await upload.read()
    if len(data) > size_limit:  # the body's limit leaves room for the other fields
        raise RequestError(
            f"Invalid request: the file has {len(data)} bytes, over the limit of {size_limit} bytes "
            "(--file-size-limit); split it into smaller files",
            413,
        )
    if not data:
        raise RequestError("Invalid request: empty file")
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # a byte-order mark is no text
    try:
        text = data[start:].decode("utf-8")
    except UnicodeDecodeError as error:
        offset = start + error.start
        raise RequestError(
            f"Invalid request: file is not UTF-8 (byte 0x{data[offset]:02x} at offset {offset}); save it as UTF-8"
        ) from None
    return safe_file_name(base), text_format, text
