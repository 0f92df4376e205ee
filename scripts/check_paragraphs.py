"""Paragraphs against lines with a trained model: five paragraphs of 40 test_2016_flickr sentences (the first 40 that
end with a stop), through `translation.translate` (what `translate` runs) and `serve`'s POST /translate, compared with
the same sentences translated line by line; sacreBLEU of each, scored by sentence and by paragraph.

    python scripts/check_paragraphs.py outputs/multi30k-en-de benchmarks/results/DATE_DEVICE_COMMIT_paragraphs.json

The corpus is ../shared/data/multi30k, or $MULTI30K_DIR.
"""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import vaswani_transformer  # noqa: F401  (registers the Auto classes)
from vaswani_transformer.inference.translation import corpus_bleu, translate

model_dir, out = sys.argv[1], Path(sys.argv[2])
data = Path(os.environ.get("MULTI30K_DIR", Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"))
en = (data / "test_2016_flickr.en").read_text().splitlines()
de = (data / "test_2016_flickr.de").read_text().splitlines()
pairs = [(e, d) for e, d in zip(en, de, strict=True) if e.rstrip().endswith((".", "!", "?"))][:40]
src, ref = [p[0] for p in pairs], [p[1] for p in pairs]
model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
tok = AutoTokenizer.from_pretrained(model_dir)
lines = translate(model, tok, src, batch_size=32, split_sentences=False)
paragraphs = [" ".join(src[i : i + 8]) for i in range(0, 40, 8)]
text = "\n\n".join(paragraphs) + "\n"
joined = translate(model, tok, [text], batch_size=32)[0]
expected = "\n\n".join(" ".join(lines[i : i + 8]) for i in range(0, 40, 8)) + "\n"
server = subprocess.Popen(
    [sys.executable, "-m", "vaswani_transformer.cli", "serve", model_dir, "--port", "0"],
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    text=True,
)
url = server.stdout.readline().rsplit(" on ", 1)[1].strip()
request = urllib.request.Request(
    f"{url}/translate",
    json.dumps({"q": text, "source": "en", "target": "de"}).encode(),
    {"Content-Type": "application/json"},
)
served = json.loads(urllib.request.urlopen(request, timeout=300).read())["translatedText"]
server.terminate()
server.wait()
refs = [" ".join(ref[i : i + 8]) for i in range(0, 40, 8)]
result = {
    "model": model_dir,
    "sentences": 40,
    "paragraphs": 5,
    "translate_equals_line_by_line": joined == expected,
    "serve_equals_line_by_line": served == expected,
    "bleu_line_by_line": round(corpus_bleu(lines, ref)["score"], 2),
    "bleu_line_by_line_joined_as_paragraphs": round(
        corpus_bleu([p for p in expected.split("\n") if p], refs)["score"], 2
    ),
    "bleu_paragraphs_translate": round(corpus_bleu([p for p in joined.split("\n") if p], refs)["score"], 2),
    "bleu_paragraphs_serve": round(corpus_bleu([p for p in served.split("\n") if p], refs)["score"], 2),
    "paragraphs_in_place": joined.count("\n\n") == 4 and served.count("\n\n") == 4,
}
print(json.dumps(result, indent=1))
out.write_text(json.dumps(result, indent=1) + "\n")
