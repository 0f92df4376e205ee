"""`vaswani-transformer serve`: the real server on a loopback port, spoken to as LibreTranslate clients do.

The server runs as a subprocess (`python -m vaswani_transformer.cli serve MODEL --port 0`) on the
small model trained on Multi30k (`trained_model_dir`); its translations are compared with
`generate()`'s for the same real test sentences.
"""

import http.client
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from vaswani_transformer.cli import main  # noqa: E402
from vaswani_transformer.inference.engines import Hypothesis  # noqa: E402
from vaswani_transformer.inference.translation import translate  # noqa: E402
from vaswani_transformer.serving.app import model_languages  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# Screenshots of the page, kept for a person to look at (outputs/ is not committed).
ARTIFACTS = Path(os.environ.get("VASWANI_TEST_ARTIFACTS", ROOT / "outputs" / "test-artifacts"))


class Server:
    """`vaswani-transformer serve` in a subprocess on a port the system chooses; its log goes to a file."""

    def __init__(self, models: Path | list[str], log_path: Path, *options: str) -> None:
        # models: one model's directory, or serve's MODEL arguments (["en-de=DIR1", "fr-de=DIR2"])
        self.log_path = log_path
        self.log = open(log_path, "w")
        models = [str(models)] if isinstance(models, Path) else models
        command = [sys.executable, "-m", "vaswani_transformer.cli", "serve", *models, "--port", "0", *options]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT)
        self.url = self._wait_for_banner(timeout=180)

    def _wait_for_banner(self, timeout: float) -> str:
        # The server prints one line once it accepts connections: "Serving MODEL (en -> de, torch) on http://...".
        found: list[str] = []
        reader = threading.Thread(target=lambda: found.append(self.process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        line = found[0] if found else ""
        if " on http://" not in line:
            self.process.kill()
            pytest.fail(f"the server did not start: {line!r}\n{self.log_path.read_text()[-3000:]}")
        return line.rsplit(" on ", 1)[1].strip()

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM, then the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        finally:
            self.log.close()


def call(url: str, body=None, content_type: str = "application/json", method: str | None = None) -> tuple[int, object]:
    """One HTTP request: (status, the JSON body). `body`: bytes as they are, or an object sent as JSON."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": content_type} if data is not None else {}
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def translated(answer: tuple[int, object]) -> tuple[int, object]:
    """(status, the translatedText) of an answer that has one, else (status, the body): the confidence aside."""
    status, body = answer
    return status, body["translatedText"] if isinstance(body, dict) and "translatedText" in body else body


def call_from(
    source: str,
    url: str,
    body: dict | bytes,
    headers: dict[str, str] | None = None,
    content_type: str = "application/json",
) -> tuple[int, object]:
    """POST `body` (bytes as they are, or an object as JSON) from the loopback address `source` (127.0.0.2: another
    client than 127.0.0.1): (status, the JSON body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120, source_address=(source, 0))
    try:
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        connection.request("POST", target, data, {"Content-Type": content_type, **(headers or {})})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def generate_translations(model_dir: Path, sentences: list[str], **generate_kwargs) -> list[str]:
    """`generate()` on the sentences as one padded batch, decoded: what the server must answer."""
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    output = model.generate(**tokenizer(sentences, padding=True, return_tensors="pt"), **generate_kwargs)
    return [text.strip() for text in tokenizer.batch_decode(output, skip_special_tokens=True)]


@pytest.fixture(scope="module")
def sentences(corpus) -> list[str]:
    """24 real English sentences of Multi30k's test set."""
    return corpus["test_2016_flickr"]["en"][:24]


@pytest.fixture(scope="module")
def references(trained_model_dir, sentences) -> dict[str, str]:
    return dict(zip(sentences, generate_translations(trained_model_dir, sentences), strict=True))


@pytest.fixture(scope="module")
def server(trained_model_dir, tmp_path_factory):
    running = Server(
        trained_model_dir,
        tmp_path_factory.mktemp("serve") / "server.log",
        "--batch-wait-ms", "20", "--batch-limit", "4", "--char-limit", "1000",
    )  # fmt: skip
    yield running
    assert running.stop() == 0


def test_translations_equal_generate_for_the_same_sentences(server, sentences, references):
    batch = sentences[:8]
    # Concurrent requests of one sentence each: the micro-batcher translates them together.
    with ThreadPoolExecutor(len(batch)) as pool:
        answers = list(
            pool.map(lambda s: call(f"{server.url}/translate", {"q": s, "source": "en", "target": "de"}), batch)
        )
    assert [status for status, _ in answers] == [200] * len(batch)
    assert [body["translatedText"] for _, body in answers] == [references[s] for s in batch]
    assert sum(len(references[s].split()) for s in batch) > 3 * len(batch)  # real translations, not empty ones

    status, body = call(f"{server.url}/translate", {"q": sentences[8:12], "source": "en", "target": "de"})
    assert status == 200
    assert body["translatedText"] == [references[s] for s in sentences[8:12]]
    assert set(body) == {"translatedText", "confidence"}


def test_libretranslate_request_and_response_shapes(server, sentences, references):
    status, languages = call(f"{server.url}/languages")
    assert status == 200
    assert languages == [
        {"code": "en", "name": "English", "targets": ["de"]},
        {"code": "de", "name": "German", "targets": []},
    ]
    first, second = sentences[0], sentences[1]
    # libretranslatepy and LibreTranslate's own page send form-encoded bodies.
    form = urllib.parse.urlencode({"q": first, "source": "en", "target": "de", "api_key": "ignored"}).encode()
    assert translated(call(f"{server.url}/translate", form, FORM)) == (200, references[first])
    status, body = call(f"{server.url}/translate", {"q": [first, second], "source": "auto", "target": "de"})
    assert status == 200
    assert body["translatedText"] == [references[first], references[second]]
    detected = body["detectedLanguage"]  # one language for the request, Lingua's confidence in percent
    assert detected[0] == detected[1] and detected[0]["language"] == "en" and 90 < detected[0]["confidence"] <= 100
    status, body = call(f"{server.url}/translate", {"q": first, "source": "en", "target": "de", "alternatives": 3})
    assert (status, body["translatedText"]) == (200, references[first])  # the plain call's, from the same search
    assert len(body["alternatives"]) == 3 and len({references[first], *body["alternatives"]}) == 4
    assert call(f"{server.url}/translate", {"q": first, "source": "en", "target": "de", "alternatives": 4}) == (
        400,
        {"error": "Invalid request: alternatives parameter must be <= 3"},
    )
    # One sentence per line, line breaks kept; HTML: text nodes translated, markup kept.
    status, body = call(f"{server.url}/translate", {"q": f"{first}\n\n{second}", "source": "en", "target": "de"})
    assert (status, body["translatedText"]) == (200, f"{references[first]}\n\n{references[second]}")
    html = f'<p class="x">{first}</p><script>if (a < b) {{}}</script>'
    status, body = call(f"{server.url}/translate", {"q": html, "source": "en", "target": "de", "format": "html"})
    assert (status, body["translatedText"]) == (
        200,
        f'<p class="x">{references[first]}</p><script>if (a < b) {{}}</script>',
    )
    status, health = call(f"{server.url}/health")
    assert status == 200 and health["status"] == "ok" and health["engine"] == "torch"


def test_inline_markup_is_carried_by_alignment_and_alignments_and_confidences_answered(
    server, sentences, references, trained_model_dir
):
    from lxml import etree

    # The tags placed by the word alignment, as `translate --input page.html` places them (not by word order).
    pages = [f"<p>{' '.join([*s.split()[:2], f'<b>{s.split()[2]}</b>', *s.split()[3:]])}</p>" for s in sentences[4:8]]
    model = AutoModelForSeq2SeqLM.from_pretrained(trained_model_dir).eval()
    expected = translate(model, AutoTokenizer.from_pretrained(trained_model_dir), pages, text_format="html")
    status, body = call(f"{server.url}/translate", {"q": pages, "source": "en", "target": "de", "format": "html"})
    assert (status, body["translatedText"]) == (200, expected)
    assert all(c <= 0 for c in body["confidence"])

    first, second = sentences[0], sentences[1]
    words = first.split()
    marked = " ".join([words[0], f'<b class="k">{words[1]}</b>', *words[2:]])
    status, body = call(f"{server.url}/translate", {"q": f"<p>{marked}</p>", "source": "en", "target": "de",
                                                   "format": "html"})  # fmt: skip
    assert status == 200, body
    tree = etree.fromstring(body["translatedText"])  # well formed: lxml's XML parser reads it
    # The sentence translated whole, as plain text, the tag put back once, its attribute as written.
    assert "".join(tree.itertext()) == references[first] and len(tree.findall("b")) == 1
    assert tree.find("b").get("class") == "k" and tree.find("b").text
    assert body["confidence"] <= 0
    assert call(f"{server.url}/translate", {"q": marked, "source": "en", "target": "de", "format": "html",
                                            "alignments": True}) == (  # fmt: skip
        400,
        {"error": "Invalid request: alignments count the words of text, not of HTML (whose markup they place): "
                  "ask for them with format text"},
    )  # fmt: skip

    status, body = call(
        f"{server.url}/translate",
        {"q": [first, f"{first} {second}"], "source": "en", "target": "de", "alignments": True, "alternatives": 2},
    )
    assert status == 200, body
    assert body["translatedText"] == [references[first], f"{references[first]} {references[second]}"]
    one, two = (re.findall(r"\w+|[^\w\s]", text) for text in (first, f"{first} {second}"))
    for pairs, source, target in zip(body["alignments"], (one, two), body["translatedText"], strict=True):
        found = [tuple(map(int, pair.split("-"))) for pair in pairs.split()]  # Pharaoh's i-j
        targets = re.findall(r"\w+|[^\w\s]", target)
        assert found and all(0 <= i < len(source) and 0 <= j < len(targets) for i, j in found)
    # The two-sentence text's second sentence is aligned after the first's words, on both sides.
    assert max(i for i, _ in (map(int, p.split("-")) for p in body["alignments"][1].split())) >= len(one)
    assert all(c <= 0 for c in body["confidence"]) and len(set(body["confidence"])) == 2
    assert [len(c) for c in body["alternativesConfidence"]] == [len(a) for a in body["alternatives"]] == [2, 2]
    assert all(c <= 0 for each in body["alternativesConfidence"] for c in each)
    # A text's confidence is over all its tokens, as `translate --scores` gives a line's: its sentences' weighted by
    # their translations' tokens (`</s>` included).
    alone = call(f"{server.url}/translate", {"q": second, "source": "en", "target": "de"})[1]
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    tokens = [len(tokenizer(text).input_ids) for text in (body["translatedText"][0], alone["translatedText"])]
    mean = (body["confidence"][0] * tokens[0] + alone["confidence"] * tokens[1]) / sum(tokens)
    assert body["confidence"][1] == pytest.approx(mean, abs=1e-4)


def test_a_glossary_puts_its_target_terms_in_the_sentences_that_hold_its_source_terms(server, sentences, references):
    with_term = next(s for s in sentences if re.search(r"\bman\b", s, re.IGNORECASE))
    without = next(s for s in sentences if not re.search(r"\bman\b", s, re.IGNORECASE))
    assert "Zebra" not in references[with_term]  # the model's own translation differs
    for glossary in ([["Man", "Zebra"]], {"man": "Zebra"}):
        status, body = call(
            f"{server.url}/translate",
            {"q": [with_term, without], "source": "en", "target": "de", "glossary": glossary},
        )
        assert status == 200, body
        termed, free = body["translatedText"]
        assert "Zebra" in re.findall(r"\w+", termed) and termed != references[with_term]
        assert free == references[without]  # a sentence without terms, batched beside one with, as without
    form = urllib.parse.urlencode({"q": with_term, "source": "en", "target": "de", "glossary": '{"man": "Zebra"}'})
    assert "Zebra" in re.findall(r"\w+", call(f"{server.url}/translate", form.encode(), FORM)[1]["translatedText"])
    for glossary, error in (
        ([["man"]], "glossary must be a list of [source, target] pairs of strings, or an object {source: target}, "
                    'got [["man"]]'),
        ({"man": " "}, "glossary term 1: the target term is empty; give source TAB target."),
        ([["man", "a"], ["MAN", "b"]], "glossary term 2: the source term 'MAN' repeats that of glossary term 1 (in "
                                       "any case); give each source term one target."),
    ):  # fmt: skip
        request = {"q": with_term, "source": "en", "target": "de", "glossary": glossary}
        assert call(f"{server.url}/translate", request) == (400, {"error": f"Invalid request: {error}"})


def test_a_paragraph_is_translated_sentence_by_sentence_with_its_layout_kept(server, sentences, references):
    # Two paragraphs of real test sentences, joined with spaces and a blank line, as people paste them.
    text = "  " + " ".join(sentences[:3]) + "\n\n" + sentences[3] + "   " + sentences[4] + "\n"
    status, body = call(f"{server.url}/translate", {"q": text, "source": "en", "target": "de"})
    expected = "  " + " ".join(references[s] for s in sentences[:3]) + "\n\n"
    assert (status, body["translatedText"]) == (
        200,
        expected + references[sentences[3]] + "   " + references[sentences[4]] + "\n",
    )
    status, body = call(f"{server.url}/translate", {"q": f"<p>{sentences[0]} {sentences[1]}</p>", "source": "en",
                                                    "target": "de", "format": "html"})  # fmt: skip
    assert (status, body["translatedText"]) == (200, f"<p>{references[sentences[0]]} {references[sentences[1]]}</p>")


def test_detect_and_source_auto_find_the_language_and_metrics_are_scraped(server, corpus):
    test = corpus["test_2016_flickr"]
    checked = [(sentence, "en") for sentence in test["en"][:20]] + [(sentence, "de") for sentence in test["de"][:20]]
    found = [call(f"{server.url}/detect", {"q": sentence})[1][0]["language"] for sentence, _ in checked]
    assert sum(f == language for f, (_, language) in zip(found, checked, strict=True)) >= 0.97 * len(checked)
    status, body = call(f"{server.url}/translate", {"q": test["de"][0], "source": "auto", "target": "de"})
    assert status == 400 and "detected as 'de'" in body["error"]  # this server translates en -> de only
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=60) as response:
        scraped = response.read().decode()
    assert response.headers["Content-Type"].startswith("text/plain")
    assert 'vaswani_requests_total{endpoint="/detect",status="200"} 40.0' in scraped
    assert (
        'vaswani_sentences_total{pair="en-de"}' in scraped
        and 'vaswani_batch_sentences_bucket{le="1.0",pair="en-de"}' in scraped
    )
    assert 'vaswani_request_duration_seconds_count{endpoint="/detect"} 40.0' in scraped


def test_keys_and_request_limits_answer_403_and_429_as_libretranslate_does(trained_model_dir, tmp_path, sentences):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"good": {"req_limit": 2}, "small": {"char_limit": 20}}))
    running = Server(trained_model_dir, tmp_path / "server.log", "--api-keys", str(keys), "--req-limit", "3")
    try:
        ask = {"q": "A dog.", "source": "en", "target": "de"}
        assert call(f"{running.url}/translate", {**ask, "api_key": "wrong"}) == (403, {"error": "Invalid API key"})
        assert [call(f"{running.url}/translate", {**ask, "api_key": "good"})[0] for _ in range(3)] == [200, 200, 429]
        assert call(f"{running.url}/translate", {**ask, "api_key": "good"}) == (
            429,
            {"error": "Slowdown: 2 per 1 minute"},
        )
        status, body = call(f"{running.url}/translate", {**ask, "q": sentences[0], "api_key": "small"})
        assert (status, body["error"]) == (400, f"Invalid request: q has {len(sentences[0])} characters, more than "
                                                "the limit of 20")  # fmt: skip
        # Without a key, the address has the server's 3 a minute, of which the refused key took one (LibreTranslate's
        # limiter counts it too); a known key's requests count apart.
        assert [call(f"{running.url}/detect", {"q": "A dog."})[0] for _ in range(3)] == [200, 200, 429]
    finally:
        assert running.stop() == 0


def test_proxy_headers_are_not_trusted_by_default_and_a_key_in_the_url_is_refused_and_never_logged(
    trained_model_dir, tmp_path
):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"SECRET-KEY-4f2a": {}}))
    log_path = tmp_path / "server.log"
    running = Server(trained_model_dir, log_path, "--api-keys", str(keys), "--req-limit", "5")
    try:
        ask = {"q": "A dog.", "source": "en", "target": "de"}
        # Each request names another client in X-Forwarded-For: all from 127.0.0.1 (the proxy uvicorn trusted by
        # default), they are one client, held to 5.
        statuses = [call_from("127.0.0.1", f"{running.url}/translate", ask, {"X-Forwarded-For": f"10.0.0.{i}"})[0]
                    for i in range(7)]  # fmt: skip
        assert statuses == [200] * 5 + [429] * 2
        # A key in the URL, which logs and proxies keep: refused, naming where to send it; in the body it is served.
        status, answer = call_from("127.0.0.3", f"{running.url}/translate?api_key=SECRET-KEY-4f2a", ask)
        assert status == 400 and "api_key" in answer["error"] and "body" in answer["error"], answer
        assert call_from("127.0.0.3", f"{running.url}/translate", {**ask, "api_key": "SECRET-KEY-4f2a"})[0] == 200
    finally:
        assert running.stop() == 0
    logged = running.process.stdout.read() + log_path.read_text()
    assert '"POST /translate?api_key=' in logged and "SECRET-KEY-4f2a" not in logged, logged[-3000:]


def test_a_key_can_be_required_and_proxy_headers_trusted_from_the_addresses_named(trained_model_dir, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"good": {}}))
    running = Server(
        trained_model_dir, tmp_path / "server.log", "--api-keys", str(keys), "--req-limit", "5",
        "--require-api-key-origin", r"^https://ours\.example$", "--forwarded-allow-ips", "127.0.0.2",
    )  # fmt: skip
    try:
        ask, ours = {"q": "A dog.", "source": "en", "target": "de"}, {"Origin": "https://ours.example"}
        # From the proxy named, each client it forwards has a limit of its own.
        forwarded = [{"X-Forwarded-For": f"10.0.0.{i}", **ours} for i in range(7)]
        statuses = [call_from("127.0.0.2", f"{running.url}/translate", ask, headers)[0] for headers in forwarded]
        assert statuses == [200] * 7
        # Without a key, only a page of the origin named is served (LibreTranslate's --require-api-key-origin).
        status, answer = call_from("127.0.0.3", f"{running.url}/translate", ask)
        assert status == 400 and "requires an API key" in answer["error"], answer
        assert call_from("127.0.0.3", f"{running.url}/translate", {**ask, "api_key": "good"})[0] == 200
        assert call_from("127.0.0.3", f"{running.url}/detect", {"q": "A dog."}, ours)[0] == 200
    finally:
        assert running.stop() == 0


def test_an_existing_libretranslate_client_works_unchanged(server, sentences, references):
    libretranslatepy = pytest.importorskip("libretranslatepy")
    client = libretranslatepy.LibreTranslateAPI(server.url)
    assert client.translate(sentences[2], "en", "de") == references[sentences[2]]
    assert [language["code"] for language in client.languages()] == ["en", "de"]


def _too_long_sentence(trained_model_dir: Path) -> str:
    tokenizer = AutoTokenizer.from_pretrained(trained_model_dir)
    sentence = "".join(chr(0x4E00 + i) for i in range(300))  # 300 characters, several byte tokens each
    assert len(tokenizer(sentence)["input_ids"]) > tokenizer.model_max_length
    return sentence


def _multipart_parts(fields: list[tuple[str, str | bytes]], boundary: str = "vaswani-boundary") -> list[bytes]:
    """The parts of a multipart/form-data body, one a field (its value as given: bytes are sent as they are)."""
    parts = []
    for name, value in fields:
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
        parts.append(head + (value if isinstance(value, bytes) else value.encode()) + b"\r\n")
    return parts + [f"--{boundary}--\r\n".encode()]


GOOD = {"q": "A dog runs.", "source": "en", "target": "de"}
JSON, FORM = "application/json", "application/x-www-form-urlencoded"
MULTIPART = "multipart/form-data; boundary=vaswani-boundary"
# Latin-1 bytes where UTF-8 is due: 0xff is never UTF-8, 0xe9 ("é" in Latin-1) starts a sequence that does not go on.
MULTIPART_BAD_Q = b"".join(_multipart_parts([("q", b"A \xff man."), ("source", "en"), ("target", "de")]))
MULTIPART_BAD_SOURCE = b"".join(_multipart_parts([("q", "A man."), ("source", b"\xe9n"), ("target", "de")]))
BAD_REQUESTS = [
    # (what, body, content type, status, words the message must hold)
    ("missing q", {"source": "en", "target": "de"}, JSON, 400, ["q"]),
    ("empty q", {**GOOD, "q": ""}, JSON, 400, ["q"]),
    ("blank q", {**GOOD, "q": "   "}, JSON, 400, ["q", "empty"]),
    ("empty list q", {**GOOD, "q": []}, JSON, 400, ["q"]),
    ("q not a string", {**GOOD, "q": 7}, JSON, 400, ["q", "string"]),
    ("q[1] not a string", {**GOOD, "q": ["A dog.", None]}, JSON, 400, ["q[1]", "string"]),
    ("missing source", {"q": "A dog."}, JSON, 400, ["source"]),
    ("missing target", {"q": "A dog.", "source": "en"}, JSON, 400, ["target"]),
    ("unknown source", {**GOOD, "source": "fr"}, JSON, 400, ["source", "'fr'", "en -> de"]),
    ("unknown target", {**GOOD, "target": "fr"}, JSON, 400, ["target", "'fr'", "en -> de"]),
    ("reversed pair", {**GOOD, "source": "de", "target": "en"}, JSON, 400, ["source", "en -> de"]),
    ("bad format", {**GOOD, "format": "pdf"}, JSON, 400, ["format"]),
    ("bad alternatives", {**GOOD, "alternatives": -1}, JSON, 400, ["alternatives"]),
    ("alternatives a superscript", {**GOOD, "alternatives": "\u00b2"}, JSON, 400, ["alternatives"]),
    ("alternatives of 5,000 digits", {**GOOD, "alternatives": "1" * 5000}, JSON, 400, ["alternatives"]),
    ("HTML the parser cannot read", {**GOOD, "q": "Price <![ x", "format": "html"}, JSON, 400, ["HTML"]),
    ("too many texts", {**GOOD, "q": ["A dog."] * 5}, JSON, 400, ["q", "5 texts", "batch limit of 4"]),
    ("too many characters", {**GOOD, "q": "A dog runs. " * 100}, JSON, 400, ["q", "1200 characters", "limit of 1000"]),
    ("malformed JSON", b'{"q": "A dog.", "source": "en"', JSON, 400, ["malformed JSON"]),
    ("JSON not an object", b'["A dog.", "en", "de"]', JSON, 400, ["JSON body", "object"]),
    ("nested too deeply", b"[" * 50_000, JSON, 400, ["malformed JSON"]),
    ("not UTF-8", b'{"q": "\xff\xfe\xfa"}', JSON, 400, ["malformed JSON"]),
    ("half a UTF-16 pair", b'{"q": ["A dog.", "\\ud800"], "source": "en", "target": "de"}', JSON, 400, ["q[1]"]),
    ("form without q", b"source=en&target=de", FORM, 400, ["q"]),
    ("form q not UTF-8", b"q=A+%FF+man&source=en&target=de", FORM, 400, ["q", "not UTF-8", "0xff"]),
    ("multipart q not UTF-8", MULTIPART_BAD_Q, MULTIPART, 400, ["q", "not UTF-8", "0xff"]),
    ("multipart source not UTF-8", MULTIPART_BAD_SOURCE, MULTIPART, 400, ["source", "not UTF-8", "0xe9"]),
    ("body too large", b"x" * 200_000, JSON, 413, ["body", "bytes"]),
]


@pytest.mark.parametrize(("body", "content_type", "status", "words"), [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])  # fmt: skip
def test_bad_input_is_answered_4xx_with_a_message_naming_the_field_and_the_server_stays_up(
    server, body, content_type, status, words
):
    answer_status, answer = call(f"{server.url}/translate", body, content_type)
    assert answer_status == status
    assert set(answer) == {"error"}
    assert all(word in answer["error"] for word in words), answer["error"]
    assert server.process.poll() is None
    assert call(f"{server.url}/health")[0] == 200


def test_invalid_utf8_in_the_query_string_is_refused_naming_the_field(server):
    # LibreTranslate reads the query's fields too; percent-encoding can spell any byte.
    for query, field in (("q=A+%FF+man&source=en&target=de", "q"), ("q=A+man&source=en&target=d%E9", "target")):
        status, answer = call(f"{server.url}/translate?{query}", b"", FORM)
        assert status == 400 and f"{field} in the query string is not UTF-8" in answer["error"], answer
    assert call(f"{server.url}/translate?q=A+%C3%BC+man&source=en&target=de", b"", FORM)[0] == 200  # "ü" is UTF-8


def test_health_names_the_model_not_its_path_head_answers_as_get_and_openapi_is_off_with_the_docs(
    server, trained_model_dir
):
    status, health = call(f"{server.url}/health")
    assert status == 200 and health["model"] == trained_model_dir.name
    assert str(trained_model_dir.parent) not in json.dumps(health)  # no absolute path shown to any origin
    parts = urllib.parse.urlsplit(server.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        for path in ("/", "/health", "/languages"):
            connection.request("HEAD", path)
            response = connection.getresponse()
            assert (response.status, response.read()) == (200, b""), path
    finally:
        connection.close()
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert call(f"{server.url}{path}") == (404, {"error": "Not Found"}), path


def _chunked_multipart(url: str, fields: list[tuple[str, str]]) -> tuple[int, object]:
    """POST `fields` as multipart/form-data with no Content-Length (Transfer-Encoding: chunked), one chunk a field."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        chunks = iter(_multipart_parts(fields))
        connection.request("POST", parts.path, chunks, {"Content-Type": MULTIPART}, encode_chunked=True)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_a_chunked_multipart_body_is_held_to_the_body_limit(server, sentences, references):
    fields = [("q", sentences[0]), ("source", "en"), ("target", "de")]
    assert translated(_chunked_multipart(f"{server.url}/translate", fields)) == (200, references[sentences[0]])
    # Four parts of 30,000 bytes: each under the server's 77,536-byte limit (--char-limit 1000), together over it.
    status, answer = _chunked_multipart(f"{server.url}/translate", fields + [("padding", "x" * 30_000)] * 4)
    assert status == 413 and "bytes" in answer["error"], answer
    assert call(f"{server.url}/health")[0] == 200


def test_a_sentence_over_the_models_length_limit_is_refused(server, trained_model_dir):
    body = {"q": ["A dog.", _too_long_sentence(trained_model_dir)], "source": "en", "target": "de"}
    status, answer = call(f"{server.url}/translate", body)
    assert status == 400
    limit = AutoTokenizer.from_pretrained(trained_model_dir).model_max_length
    assert "q[1]" in answer["error"] and f"limit of {limit}" in answer["error"]


def test_unknown_paths_and_methods_answer_json_errors(server):
    assert call(f"{server.url}/no-such-page") == (404, {"error": "Not Found"})
    assert call(f"{server.url}/translate", method="GET") == (405, {"error": "Method Not Allowed"})


def test_a_big_request_takes_turns_with_a_small_one_behind_it_and_too_many_sentences_are_refused(
    trained_model_dir, tmp_path, sentences, references
):
    # 72 lines in 9 batches of 8: a one-sentence request sent while they are translated joins the next batch.
    server = Server(trained_model_dir, tmp_path / "server.log", "--batch-size", "8", "--sentence-limit", "100")
    lines = sentences * 3
    finished: list[str] = []

    def send(name: str, q: str) -> tuple[int, object]:
        answer = call(f"{server.url}/translate", {"q": q, "source": "en", "target": "de"})
        finished.append(name)
        return answer

    try:
        with ThreadPoolExecutor(2) as pool:
            big = pool.submit(send, "big", "\n".join(lines))
            deadline = time.monotonic() + 120
            while call(f"{server.url}/health")[1]["sentences_in_flight"] < len(lines):
                assert time.monotonic() < deadline and not big.done(), "the big request never was in the server"
                time.sleep(0.01)
            small = pool.submit(send, "small", sentences[0])
            assert translated(small.result(120)) == (200, references[sentences[0]])
            # Its sentences spread over batches, the big request is still answered in order, as generate() does.
            assert translated(big.result(120)) == (200, "\n".join(references[s] for s in lines))
        assert finished == ["small", "big"]
        # Blank lines are not sentences: 100 sentences and 50 blank lines are within the limit, 101 are not.
        assert call(f"{server.url}/translate", {**GOOD, "q": "\n\n".join(["A dog."] * 100)})[0] == 200
        status, answer = call(f"{server.url}/translate", {**GOOD, "q": ["A dog.\n\nA cat."] * 50 + ["A bird."]})
        assert status == 400 and "101 sentences" in answer["error"] and "limit of 100" in answer["error"], answer
        assert "--sentence-limit" in answer["error"]
    finally:
        assert server.stop() == 0


def test_a_request_past_its_deadline_or_whose_client_left_mid_body_is_dropped_without_a_traceback(
    trained_model_dir, tmp_path, sentences
):
    # One sentence a batch and a deadline of 1 ms: a request of two sentences is past it after its first batch.
    log_path = tmp_path / "server.log"
    server = Server(trained_model_dir, log_path, "--batch-size", "1", "--request-timeout", "0.001")
    try:
        request = urllib.request.Request(
            f"{server.url}/translate", json.dumps({**GOOD, "q": sentences[:2]}).encode(), {"Content-Type": JSON}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=120)
        assert refused.value.code == 503 and refused.value.headers["Retry-After"]
        answer = json.loads(refused.value.read())
        assert "--request-timeout" in answer["error"] and "0.001" in answer["error"], answer
        # A client that promises 1,000 bytes, sends 10 and leaves.
        parts = urllib.parse.urlsplit(server.url)
        with socket.create_connection((parts.hostname, parts.port), timeout=30) as client:
            client.sendall(
                b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"q": "A d'
            )
        status, health = call(f"{server.url}/health")
        assert status == 200 and health["sentences_in_flight"] == 0
    finally:
        assert server.stop() == 0  # answers what it holds, the dropped request included, then exits
    log = log_path.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


def test_sigterm_with_requests_in_flight_loses_none_of_them(trained_model_dir, tmp_path, sentences, references):
    # A long collection window keeps all 16 requests inside the server when SIGTERM arrives.
    server = Server(trained_model_dir, tmp_path / "server.log", "--batch-wait-ms", "5000")
    batch = sentences[8:24]
    with ThreadPoolExecutor(len(batch)) as pool:
        futures = [
            pool.submit(call, f"{server.url}/translate", {"q": s, "source": "en", "target": "de"}) for s in batch
        ]
        deadline = time.monotonic() + 120
        while call(f"{server.url}/health")[1]["sentences_in_flight"] < len(batch):
            assert time.monotonic() < deadline, "the 16 requests never were in the server together"
            time.sleep(0.05)
        server.process.send_signal(signal.SIGTERM)
        answers = [future.result(timeout=120) for future in futures]
    assert server.stop() == 0
    assert [translated(answer) for answer in answers] == [(200, references[s]) for s in batch]
    assert "Traceback" not in server.log_path.read_text()


def test_serve_decodes_with_the_beam_and_length_penalty_asked_for(trained_model_dir, tmp_path, sentences, references):
    server = Server(trained_model_dir, tmp_path / "server.log", "--num-beams", "3", "--length-penalty", "3.0")
    try:
        status, body = call(f"{server.url}/translate", {"q": sentences, "source": "en", "target": "de"})
    finally:
        assert server.stop() == 0
    expected = generate_translations(trained_model_dir, sentences, num_beams=3, length_penalty=3.0)
    # Each option changes these translations: a server that dropped either would answer otherwise.
    assert expected != [references[sentence] for sentence in sentences]
    assert expected != generate_translations(trained_model_dir, sentences, num_beams=3)
    assert translated((status, body)) == (200, expected)


def test_ctranslate2_engine_exports_beside_the_model_and_translates(trained_model_dir, tmp_path, sentences):
    pytest.importorskip("ctranslate2")
    model_dir = tmp_path / "model"
    shutil.copytree(trained_model_dir, model_dir, ignore=shutil.ignore_patterns("checkpoints"))
    server = Server(model_dir, tmp_path / "server.log", "--engine", "ctranslate2")
    try:
        status, body = call(f"{server.url}/translate", {"q": sentences[:8], "source": "en", "target": "de"})
        assert call(f"{server.url}/health")[1]["engine"] == "ctranslate2"
    finally:
        assert server.stop() == 0
    assert (model_dir / "ctranslate2" / "model.bin").is_file()
    # CTranslate2 normalises by |Y|^alpha (HF's form), not the GNMT penalty; otherwise our beam search.
    expected = generate_translations(trained_model_dir, sentences[:8], length_penalty_type="hf")
    assert translated((status, body)) == (200, expected)


def test_the_models_languages_come_from_its_files_or_the_options(trained_model_dir, tmp_path):
    assert model_languages(str(trained_model_dir)) == ("en", "de")  # config.json (VaswaniConfig.source_lang, ...)
    bare = tmp_path / "bare"
    shutil.copytree(trained_model_dir, bare, ignore=shutil.ignore_patterns("checkpoints"))
    config = json.loads((bare / "config.json").read_text())
    assert (config["source_lang"], config["target_lang"]) == ("en", "de")  # written by `train`
    (bare / "config.json").write_text(json.dumps({**config, "source_lang": None, "target_lang": None}))
    assert model_languages(str(bare)) == ("en", "de")  # training_config.json
    (bare / "training_config.json").unlink()
    assert model_languages(str(bare)) == ("en", "de")  # the model card's `language:`
    (bare / "README.md").unlink()
    with pytest.raises(ValueError, match="--source-lang and --target-lang"):
        model_languages(str(bare))
    assert model_languages(str(bare), "en", "de") == ("en", "de")


def test_serve_fails_in_one_line_without_languages_or_on_a_busy_port(trained_model_dir, tmp_path, capsys):
    # A model path that does not exist is named as such (not as a malformed Hub id, nor as a model without languages).
    for missing in (str(tmp_path / "typo"), "./typo"):
        assert main(["serve", missing]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f"{missing} does not exist" in error, error
    # An address this machine does not have is the host's fault, not the port's.
    assert main(["serve", str(trained_model_dir), "--host", "999.1.1.1"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "check --host" in error, error
    bare = tmp_path / "bare"
    shutil.copytree(trained_model_dir, bare, ignore=shutil.ignore_patterns("checkpoints", "*.json", "README.md"))
    assert main(["serve", str(bare)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--source-lang" in error
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["serve", str(trained_model_dir), "--port", str(busy.getsockname()[1])]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--port" in error


def test_the_page_translates_paragraphs_alternatives_and_files_in_headless_chromium(
    server, sentences, references, tmp_path
):
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no Chromium; scripts/test.sh installs Debian's chromium package")
    paragraph = f"{sentences[3]} {sentences[4]}\n\n{sentences[5]}"
    upload = tmp_path / "page.html"
    upload.write_text(f"<p>{sentences[6]}</p><script>document.title = '{sentences[7]}';</script>")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        try:
            page = browser.new_page(viewport={"width": 900, "height": 720})
            page.goto(server.url + "/")
            page.wait_for_selector("body[data-ready=true]", timeout=30_000)
            assert page.inner_text("#pair") == "English → German"
            # A pasted paragraph comes back with its layout, its language detected when asked.
            page.select_option("#from", "auto")
            page.fill("#source", paragraph)
            page.click("#translate")
            page.wait_for_function("document.getElementById('detected').textContent.length > 0", timeout=60_000)
            shown, detected = page.eval_on_selector("#translation", "e => e.textContent"), page.inner_text("#detected")
            page.screenshot(path=str(tmp_path / "serving_page.png"))
            # Alternatives of one sentence: the first is the translation.
            page.select_option("#from", "en")
            page.fill("#source", sentences[3])
            page.fill("#count", "3")
            page.click("#translate")
            page.wait_for_function("document.querySelectorAll('#alternatives li').length > 0", timeout=60_000)
            alternatives = page.eval_on_selector_all("#alternatives li", "items => items.map(i => i.textContent)")
            single = page.inner_text("#translation")
            scores = page.eval_on_selector_all("#alternatives li", "items => items.map(i => i.dataset.confidence)")
            # The alignments asked for, and the confidence, shown beside the translation.
            page.fill("#count", "0")
            page.check("#align")
            page.click("#translate")
            page.wait_for_function("document.getElementById('alignments').textContent.length > 0", timeout=60_000)
            confidence, aligned = page.inner_text("#confidence"), page.inner_text("#alignments")
            # A file: uploaded, translated, linked for download from this server.
            page.set_input_files("#file", str(upload))
            page.click("#translate-file")
            page.wait_for_selector("#download:not([hidden])", timeout=60_000)
            link, error = page.get_attribute("#download", "href"), page.inner_text("#error")
        finally:
            browser.close()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(tmp_path / "serving_page.png", ARTIFACTS / "serving_page.png")
    assert error == ""
    expected = f"{references[sentences[3]]} {references[sentences[4]]}\n\n{references[sentences[5]]}"
    assert shown == expected and detected.startswith("Detected: English")
    plain = call(f"{server.url}/translate", {"q": sentences[3], "source": "en", "target": "de", "alternatives": 3})[1]
    assert single == references[sentences[3]] and alternatives == plain["alternatives"]
    assert scores == [f"{c:.2f}" for c in plain["alternativesConfidence"]]
    asked = {"q": sentences[3], "source": "en", "target": "de", "alignments": True}
    answer = call(f"{server.url}/translate", asked)[1]
    assert confidence == f"Confidence: {answer['confidence']:.2f}"
    assert aligned == f"Alignments (source-target word): {answer['alignments']}" and answer["alignments"]
    assert link.startswith("/download_file/")
    with urllib.request.urlopen(server.url + link, timeout=60) as response:
        downloaded = response.read().decode()
    assert downloaded == f"<p>{references[sentences[6]]}</p><script>document.title = '{sentences[7]}';</script>"


def test_serve_logs_the_sentences_an_engine_translates_to_nothing(caplog):
    from vaswani_transformer.serving.app import _logging_empty

    class Ending:  # an engine whose beam search ends one sentence at its first step
        def scored_hypotheses(self, sentences: list[str], count: int, glossary=None) -> list[list[Hypothesis]]:
            return [[Hypothesis("" if "<script>" in s else s.upper(), -1.0)] * count for s in sentences]

    def texts(sentences: list[str], count: int) -> list[list[str]]:
        return [[h.text for h in each] for each in _logging_empty(Ending())(sentences, count)]

    with caplog.at_level(logging.WARNING, logger="vaswani_transformer.inference.translation"):
        assert texts(["a dog.", "Two <script>alert(2)</script> men."], 1) == [["A DOG."], [""]]
        assert texts(["a cat."], 2) == [["A CAT.", "A CAT."]]
    warnings = [r.getMessage() for r in caplog.records if r.name == "vaswani_transformer.inference.translation"]
    assert len(warnings) == 1 and warnings[0].startswith("1 of 2 non-blank sentences translated to an empty string")
