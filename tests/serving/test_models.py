"""`serving_models.py`: several models in one server, each pair batched on its own, and real text in paragraphs.

One server serves `en-de=MODEL fr-de=MODEL` (the small Multi30k model, `trained_model_dir`, stands for both: what is
tested is which model a request reaches, which `/metrics` counts per pair). The paragraph test is issue 66's
acceptance: five paragraphs of 40 test_2016_flickr sentences, through `translate` and through `POST /translate`.
"""

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_app import Server, call  # noqa: E402

from vaswani_transformer.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def server(trained_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-models") / "server.log"
    running = Server([f"en-de={trained_model_dir}", f"fr-de={trained_model_dir}"], log, "--batch-wait-ms", "20")
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def test_set(corpus, multi30k_dir) -> dict[str, list[str]]:
    """test_2016_flickr's sentences by language: English, German and French, aligned."""
    french = (multi30k_dir / "test_2016_flickr.fr").read_text(encoding="utf-8").splitlines()
    return {"en": corpus["test_2016_flickr"]["en"], "de": corpus["test_2016_flickr"]["de"], "fr": french}


def sentences_per_pair(url: str) -> dict[str, float]:
    """`/metrics`' count of sentences translated, by language pair."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
        scraped = response.read().decode()
    return {pair: float(count) for pair, count in re.findall(r'vaswani_sentences_total\{pair="(.+?)"\} (\S+)', scraped)}


def test_languages_list_every_pair_and_each_pair_is_translated_by_its_own_model(server, test_set):
    assert call(f"{server.url}/languages")[1] == [
        {"code": "en", "name": "English", "targets": ["de"]},
        {"code": "de", "name": "German", "targets": []},
        {"code": "fr", "name": "French", "targets": ["de"]},
    ]
    test = test_set
    before = sentences_per_pair(server.url)
    asks = [("en", sentence) for sentence in test["en"][:12]] + [("fr", sentence) for sentence in test["fr"][:7]]
    with ThreadPoolExecutor(8) as pool:  # at once: each pair's batcher takes only its own sentences
        answers = list(pool.map(lambda ask: call(f"{server.url}/translate", {"q": ask[1], "source": ask[0],
                                                                             "target": "de"}), asks))  # fmt: skip
    assert all(status == 200 and body["translatedText"] for status, body in answers)
    after = sentences_per_pair(server.url)
    assert after["en-de"] - before.get("en-de", 0) == 12 and after["fr-de"] - before.get("fr-de", 0) == 7
    status, body = call(f"{server.url}/translate", {"q": "Bonjour.", "source": "en", "target": "fr"})
    assert status == 400 and "fr" in body["error"]


def test_detect_finds_english_german_and_french_and_source_auto_routes_to_that_languages_model(server, test_set):
    test = test_set
    checked = [(s, "en") for s in test["en"][100:134]] + [(s, "de") for s in test["de"][200:233]]
    checked += [(s, "fr") for s in test["fr"][300:333]]
    found = [call(f"{server.url}/detect", {"q": sentence})[1][0]["language"] for sentence, _ in checked]
    assert len(checked) == 100 and sum(f == language for f, (_, language) in zip(found, checked, strict=True)) >= 97
    for language in ("en", "fr"):
        sentence = test[language][0]
        before = sentences_per_pair(server.url)
        status, body = call(f"{server.url}/translate", {"q": sentence, "source": "auto", "target": "de"})
        assert status == 200 and body["detectedLanguage"]["language"] == language
        counted = sentences_per_pair(server.url)
        assert {pair: counted[pair] - before.get(pair, 0) for pair in counted} == {
            "en-de": float(language == "en"),
            "fr-de": float(language == "fr"),
        }
        told = call(f"{server.url}/translate", {"q": sentence, "source": language, "target": "de"})[1]
        assert body["translatedText"] == told["translatedText"]


def test_five_paragraphs_come_back_in_place_each_sentence_translated_as_alone(
    server, corpus, trained_model_dir, tmp_path, capsys
):
    # Issue 66: 40 test sentences joined with spaces into five paragraphs, separated by blank lines, as people paste
    # them; `translate` and `POST /translate` must give what line-by-line translation gives for each sentence (so
    # the joined output scores as line-by-line translation does, but for BLEU's n-grams across sentences). The
    # first 40 that end as written sentences do: 51 of the 1,000 have no final stop, and joined to the next sentence
    # they would make one sentence to any segmenter, as they would to a reader.
    test = corpus["test_2016_flickr"].filter(lambda pair: pair["en"].rstrip().endswith((".", "!", "?")))
    test = test.select(range(40))
    paragraphs = [test["en"][i : i + 8] for i in range(0, 40, 8)]

    def translate(path: Path, *options: str) -> str:
        capsys.readouterr()
        assert main(["translate", "--model", str(trained_model_dir), "--input", str(path), *options]) == 0
        return capsys.readouterr().out

    lines, text = tmp_path / "lines.en", tmp_path / "text.en"
    lines.write_text("\n".join(test["en"]) + "\n")
    translated = dict(zip(test["en"], translate(lines, "--no-split-sentences").splitlines(), strict=True))
    expected = "\n\n".join(" ".join(translated[s] for s in paragraph) for paragraph in paragraphs) + "\n"
    text.write_text("\n\n".join(" ".join(paragraph) for paragraph in paragraphs) + "\n")
    assert translate(text) == expected
    status, body = call(f"{server.url}/translate", {"q": text.read_text(), "source": "en", "target": "de"})
    assert (status, body["translatedText"]) == (200, expected)
