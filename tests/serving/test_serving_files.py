"""`serving_files.py`: LibreTranslate's `POST /translate_file` and `GET /download_file/NAME` on the real server.

The server runs as a subprocess on the small model trained on Multi30k (`trained_model_dir`), as in
tests/test_serving.py, with its temporary directory in one of the test's own; a file's translation is compared
with what `POST /translate` answers for the same sentences.
"""

import asyncio
import html
import http.client
import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from email.message import Message
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_app import Server, call, call_from  # noqa: E402

from vaswani_transformer.serving.files import (  # noqa: E402
    MAX_FILES_PER_CLIENT,
    MAX_STORED_FILES,
    FileStore,
    safe_file_name,
)
from vaswani_transformer.serving.requests import RequestError  # noqa: E402

FILE_SIZE_LIMIT, CHAR_LIMIT = 6000, 1000


@pytest.fixture(scope="module")
def sentences(corpus) -> list[str]:
    """Eight real English sentences of Multi30k's test set."""
    return corpus["test_2016_flickr"]["en"][:8]


@pytest.fixture(scope="module")
def temporary(tmp_path_factory) -> Path:
    """The server's TMPDIR: where its own temporary directory of files is made."""
    return tmp_path_factory.mktemp("server-tmp")


@pytest.fixture(scope="module")
def server(trained_model_dir, tmp_path_factory, temporary):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"small": {"char_limit": 20}}))
    with pytest.MonkeyPatch.context() as patch:  # the subprocess's temporary files, where the test can see them
        patch.setenv("TMPDIR", str(temporary))
        running = Server(
            trained_model_dir,
            tmp_path_factory.mktemp("serve-files") / "server.log",
            "--batch-wait-ms", "20", "--char-limit", str(CHAR_LIMIT), "--file-size-limit", str(FILE_SIZE_LIMIT),
            "--api-keys", str(keys),
        )  # fmt: skip
    yield running
    assert running.stop() == 0
    # The server's directory of files went with it.
    assert not list(temporary.glob("vaswani-files-*"))


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> tuple[bytes, str]:
    """A multipart/form-data body, as `curl -F` sends it, and its content type: text fields and (name, bytes) files."""
    boundary = "vaswani-file-boundary"
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields.items()
    ]
    for field, (filename, data) in files.items():
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="{filename}"\r\n'
        parts.append(f"{head}Content-Type: application/octet-stream\r\n\r\n".encode() + data + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def translate_file(url: str, filename: str, data: bytes, **fields: str) -> tuple[int, dict]:
    """`POST /translate_file` of one file, en -> de unless `fields` say otherwise: (status, the JSON body)."""
    body, content_type = multipart({"source": "en", "target": "de", **fields}, {"file": (filename, data)})
    return call(f"{url}/translate_file", body, content_type)


def download(url: str) -> tuple[int, Message, bytes]:
    """GET a URL: (status, headers (their names in any case), body)."""
    try:
        with urllib.request.urlopen(url, timeout=120) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def translations(url: str, texts: list[str]) -> list[str]:
    """What `POST /translate` answers for each text."""
    status, body = call(f"{url}/translate", {"q": texts, "source": "en", "target": "de"})
    assert status == 200, body
    return body["translatedText"]


def test_an_html_page_comes_back_with_its_markup_and_its_text_nodes_translated(server, sentences):
    first, second, third, title = sentences[0], sentences[1], sentences[2], sentences[3]
    script = '<script>if (a < b) { say("A dog runs in the park."); }</script>'
    page = (
        f'<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8"><title>{title}</title>\n{script}\n'
        f"<style>p {{ color: red; }}</style></head>\n<body>\n<!-- {first} -->\n"
        f'<p class="lead" title="{first}">{first} {second}</p>\n<ul><li>{third}</li></ul>\n</body>\n</html>\n'
    )
    status, answer = translate_file(server.url, "page.html", page.encode())
    assert status == 200, answer
    url = answer["translatedFileUrl"]
    assert re.fullmatch(re.escape(server.url) + r"/download_file/[0-9a-f]{32}\.page\.html", url), url
    status, headers, body = download(url)
    t_first, t_second, t_third, t_title = (html.escape(t, quote=False) for t in translations(server.url, sentences[:4]))
    assert all(len(t.split()) > 2 for t in (t_first, t_second, t_third, t_title))  # real translations
    # The tags, attributes, comment, script and style as they were; each text node translated, sentence by sentence.
    assert body.decode() == page.replace(f"<title>{title}", f"<title>{t_title}").replace(
        f">{first} {second}</p>", f">{t_first} {t_second}</p>"
    ).replace(f"<li>{third}", f"<li>{t_third}")
    assert script in body.decode() and f'title="{first}"' in body.decode() and f"<!-- {first} -->" in body.decode()
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    assert headers["Content-Disposition"] == 'attachment; filename="page.html"'


def test_a_text_file_keeps_its_paragraphs_blank_lines_and_spacing(server, sentences):
    text = "  " + " ".join(sentences[:2]) + "\r\n\n\n" + sentences[2] + "   " + sentences[3] + "\n\n"
    status, answer = translate_file(server.url, "notes.TXT", text.encode("utf-8-sig"))  # a BOM is no text
    assert status == 200, answer
    status, headers, body = download(answer["translatedFileUrl"])
    t = translations(server.url, sentences[:4])
    assert body.decode() == "  " + f"{t[0]} {t[1]}" + "\r\n\n\n" + t[2] + "   " + t[3] + "\n\n"  # CRLF kept
    assert body.decode() == translations(server.url, [text])[0]  # as /translate answers the same text
    assert status == 200 and headers["Content-Type"] == "text/plain; charset=utf-8"
    # A Windows file: its four CRLF line ends come back as they came.
    status, answer = translate_file(server.url, "windows.txt", "\r\n".join([*sentences[:4], ""]).encode())
    assert status == 200 and download(answer["translatedFileUrl"])[2].decode() == "\r\n".join([*t, ""])
    # source=auto: the language detected from the file's text.
    status, answer = translate_file(server.url, "notes.txt", text.encode(), source="auto")
    assert status == 200 and download(answer["translatedFileUrl"])[2] == body


def test_a_file_over_the_size_or_character_limit_is_refused_and_markup_is_not_counted(server, sentences):
    # Over the limit by a line, and by so much that the body is not read.
    for data in (b"A dog runs.\n" * (FILE_SIZE_LIMIT // 12 + 1), b"A dog runs.\n" * 10_000):
        status, answer = translate_file(server.url, "big.txt", data)
        assert status == 413 and f"limit of {FILE_SIZE_LIMIT} bytes (--file-size-limit)" in answer["error"], answer
    status, answer = translate_file(server.url, "long.txt", b"A dog runs. " * 100)
    assert status == 400 and answer["error"] == (
        f"Invalid request: file has 1200 characters of text, more than the limit of {CHAR_LIMIT} (--char-limit); "
        "split it into smaller files"
    )
    # 5,000 bytes, most of them markup: the text is what the character limit counts.
    page = f'<div class="{"x" * 4000}"><p>{sentences[0]}</p></div>'
    assert len(page) > CHAR_LIMIT and translate_file(server.url, "page.htm", page.encode())[0] == 200
    # An API key's own character limit, and a wrong key, as for /translate.
    status, answer = translate_file(server.url, "a.txt", sentences[0].encode(), api_key="small")
    assert status == 400 and "more than the limit of 20 (--char-limit)" in answer["error"]
    assert translate_file(server.url, "a.txt", b"A dog.", api_key="wrong") == (403, {"error": "Invalid API key"})


def test_no_path_in_a_file_name_is_honoured(server, temporary):
    status, answer = translate_file(server.url, "../../etc/passwd.txt", b"A dog runs.\n")
    assert status == 200, answer
    name = answer["translatedFileUrl"].rsplit("/", 1)[1]
    assert re.fullmatch(r"[0-9a-f]{32}\.passwd\.txt", name)
    (directory,) = temporary.glob("vaswani-files-*")  # the server's own, where the file is kept under that name
    assert (directory / name).is_file() and not (temporary / "etc").exists()
    assert download(answer["translatedFileUrl"])[0] == 200
    # Only the names the server gave are served: no path, no other file of its directory, no name it did not give.
    host, port = urllib.parse.urlsplit(server.url).netloc.rsplit(":", 1)
    refused = ["..%2F..%2Fetc%2Fpasswd", "..%2Fserver.log", "..", f"{'0' * 32}.passwd.txt",
               f"%2E%2E%2F{directory.name}%2F{name}"]  # fmt: skip
    for path in (f"/download_file/{each}" for each in refused):
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            connection.request("GET", path)  # as written: urllib would resolve the dots first
            response = connection.getresponse()
            assert response.status == 404, (path, response.status)
            assert set(json.loads(response.read())) == {"error"}
        finally:
            connection.close()


FILE_REFUSALS = [
    # (what, file name, bytes, other fields, words the message must hold)
    ("a PDF", "paper.pdf", b"%PDF-1.4", {}, ["file format not supported (.pdf)", ".txt, .html, .htm"]),
    ("no suffix", "README", b"A dog.", {}, ["file format not supported (no suffix)"]),
    ("an empty file", "empty.txt", b"", {}, ["empty file"]),
    ("a blank file", "blank.txt", b"  \n\n", {}, ["file has no text"]),
    ("Latin-1", "latin.txt", "Caf\u00e9.".encode("latin-1"), {}, ["file is not UTF-8", "0xe9", "offset 3"]),
    ("HTML the parser cannot read", "bad.html", b"<p>Price <![ x", {}, ["file bad.html", "HTML"]),
    ("an unknown target", "a.txt", b"A dog.", {"target": "fr"}, ["target", "'fr'", "en -> de"]),
]


@pytest.mark.parametrize(("filename", "data", "fields", "words"), [case[1:] for case in FILE_REFUSALS],
                         ids=[case[0] for case in FILE_REFUSALS])  # fmt: skip
def test_a_file_of_another_format_or_unreadable_is_refused_naming_what_is_wrong(server, filename, data, fields, words):
    status, answer = translate_file(server.url, filename, data, **fields)
    assert status == 400 and set(answer) == {"error"}
    assert all(word in answer["error"] for word in words), answer["error"]


def test_a_request_without_a_file_is_refused_and_the_endpoints_are_measured(server):
    body, content_type = multipart({"source": "en", "target": "de", "file": "A dog."}, {})
    status, answer = call(f"{server.url}/translate_file", body, content_type)
    assert status == 400 and "file must be one uploaded file" in answer["error"]
    status, answer = call(f"{server.url}/translate_file", {"source": "en", "target": "de"})
    assert status == 400 and "missing file parameter" in answer["error"]
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=60) as response:
        scraped = response.read().decode()
    assert 'vaswani_requests_total{endpoint="/translate_file",status="400"}' in scraped
    assert 'vaswani_request_duration_seconds_count{endpoint="/translate_file"}' in scraped


def test_one_client_cannot_push_anothers_files_out_and_the_404_says_what_is_kept(server):
    def upload(source: str, i: int) -> tuple[int, dict]:
        body, content_type = multipart({"source": "en", "target": "de"}, {"file": (f"n{i}.txt", b"A dog runs.\n")})
        return call_from(source, f"{server.url}/translate_file", body, content_type=content_type)

    status, kept = upload("127.0.0.2", 0)
    assert status == 200, kept
    # One client uploads more files than the server keeps in all.
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: upload("127.0.0.3", i), range(MAX_STORED_FILES + 1)))
    assert [status for status, _ in answers] == [200] * (MAX_STORED_FILES + 1)
    assert download(kept["translatedFileUrl"])[0] == 200  # the other client's file is still there
    found = [download(answer["translatedFileUrl"]) for _, answer in answers]
    assert sum(status == 200 for status, _, _ in found) == MAX_FILES_PER_CLIENT  # its own latest
    status, _, body = next(each for each in found if each[0] == 404)
    assert json.loads(body)["error"] == (
        f"Not Found: no translated file of that name: a translation is kept 30 minutes, and of one client address "
        f"only its {MAX_FILES_PER_CLIENT} latest (POST /translate_file again)"
    )


def test_safe_file_name_keeps_a_plain_ascii_name_and_its_suffix():
    assert safe_file_name("../../etc/passwd.txt") == "passwd.txt"
    assert safe_file_name("C:\\Users\\me\\My page (2).html") == "My_page_2_.html"
    assert safe_file_name("été.txt") == "t_.txt" and safe_file_name("....txt") == "file.txt"
    assert safe_file_name("/") == "file" and safe_file_name("") == "file"
    long = safe_file_name("a" * 300 + ".html")
    assert len(long) == 100 and long.endswith("a.html")


def test_the_store_serves_only_its_own_names_expires_old_files_and_deletes_its_directory():
    async def scenario() -> None:
        store = FileStore(size_limit=100, lifetime=60, max_files=3)
        directory = store.directory
        assert directory.name.startswith("vaswani-files-") and not os.listdir(directory)
        first = await store.save("a.txt", b"Ein Hund.", "text/plain; charset=utf-8", "10.0.0.1")
        assert await store.load(first) == (b"Ein Hund.", "text/plain; charset=utf-8")
        (directory / "other.txt").write_bytes(b"not the store's")
        assert await store.load("other.txt") is None and await store.load(f"../{directory.name}/{first}") is None
        second = await store.save("b.txt", b"2", "text/plain", "10.0.0.1")
        # Past the lifetime, every file goes.
        store.lifetime = -1.0
        assert await store.load(second) is None and not (directory / first).exists()
        assert not (directory / second).exists()
        store.close()
        assert not directory.exists()

    asyncio.run(scenario())


def test_a_client_beyond_its_quota_loses_its_own_oldest_and_a_full_store_refuses_until_one_expires():
    async def scenario() -> None:
        store = FileStore(size_limit=100, lifetime=60, max_files=3, per_client=2)
        other = await store.save("a.txt", b"1", "text/plain", "10.0.0.1")
        mine = [await store.save(f"{i}.txt", b"2", "text/plain", "10.0.0.2") for i in range(3)]
        assert [await store.load(name) is not None for name in (other, *mine)] == [True, False, True, True]
        assert not (store.directory / mine[0]).exists()
        # Full of other clients' files, within their lifetime: a third client is asked to come back, nothing is lost.
        with pytest.raises(RequestError) as refused:
            await store.save("c.txt", b"3", "text/plain", "10.0.0.3")
        assert refused.value.status == 503 and 0 < int(refused.value.headers["Retry-After"]) <= 60
        assert str(refused.value).startswith("the server keeps 3 translated files at most")
        assert len(os.listdir(store.directory)) == 3
        # A client at its quota still replaces its own oldest.
        assert await store.load(await store.save("3.txt", b"4", "text/plain", "10.0.0.2")) == (b"4", "text/plain")
        assert await store.load(mine[1]) is None and await store.load(other) is not None
        store.close()

    asyncio.run(scenario())
