"""Inline markup through word alignment, measured: test_2016_flickr sentences with one word in <b>, translated as HTML.

For each test sentence whose plain translation holds exactly one German word of `en_de_words.tsv` for an English word
of the sentence (that word once in the source, one of its German forms once in the translation), the sentence is
translated as `<p>...<b>word</b>...</p>` (`translate(..., text_format="html")`) and measured:

- text: the HTML translation's text equals the plain translation of the sentence;
- well formed: lxml's XML parser reads it, and it holds one <b> and one </b>;
- aligned: the <b> holds exactly one of the word's German forms (and, "holds", one of them among other words).

The plain translations are made once; every aligner (each decoder layer's encoder-decoder attention, and none: words
taken in order) then goes through the same `translate` call with those translations. Run from the repository's root:

    python benchmarks/markup.py --model /work/main_job_model

It writes benchmarks/results/DATE_DEVICE_COMMIT_markup.{json,md} (scripts/benchmark_common.py's names). See
docs/translating-documents.md. The code before this change (7bed685) has no `inference.alignment`: run there (its
package first on PYTHONPATH) the script measures its HTML path alone.
"""

import argparse
import json
import re
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from benchmark_common import commit_measured, load_average, machine, report_stem, write_report  # noqa: E402
from lxml import etree  # noqa: E402

from vaswani_transformer.inference.engines import Engine, Glossaries, TorchEngine, load_translator  # noqa: E402
from vaswani_transformer.inference.translation import translate  # noqa: E402

try:
    from vaswani_transformer.inference.alignment import ALIGNMENT_LAYER, Aligner
except ImportError:  # the code before inline markup was carried over (7bed685)
    Aligner = None

WORD_LIST = Path(__file__).with_name("en_de_words.tsv")


def word_list(path: Path) -> dict[str, set[str]]:
    """English word -> its German forms, lowercased."""
    words = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            english, german = line.split("\t")
            words[english.lower()] = {form.strip().lower() for form in german.split(",")}
    return words


def _tokens(text: str) -> list[str]:
    return [token.lower() for token in re.findall(r"[\w-]+", text)]


def test_items(sources: list[str], plain: list[str], words: dict[str, set[str]]) -> list[dict]:
    """The sentences the word list can judge: an English word once in the source, one of its forms once in the
    translation; the first such word of each, in <b>."""
    items = []
    for k, (source, target) in enumerate(zip(sources, plain, strict=True)):
        source_tokens, target_tokens = _tokens(source), _tokens(target)
        for match in re.finditer(r"[\w-]+", source):
            english = match.group().lower()
            forms = words.get(english)
            if not forms or source_tokens.count(english) != 1:
                continue
            found = [form for form in forms if target_tokens.count(form) == 1]
            if len(found) == 1 and sum(target_tokens.count(form) for form in forms) == 1:
                marked = source[: match.start()] + f"<b>{match.group()}</b>" + source[match.end() :]
                items.append({"index": k, "english": match.group(), "german": found[0], "html": f"<p>{marked}</p>"})
                break
    return items


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_data(self, data):
        self.parts.append(data)


def html_text(document: str) -> str:
    parser = _Text()
    parser.feed(document)
    parser.close()
    return "".join(parser.parts)


def measure(items: list[dict], outputs: list[str], plain: list[str]) -> dict:
    """The three figures (percent of the items) and each item's output."""
    text = well_formed = aligned = holds = 0
    for item, output in zip(items, outputs, strict=True):
        text += html_text(output) == plain[item["index"]]
        try:
            root = etree.fromstring(output)
        except etree.XMLSyntaxError:
            continue
        bold = root.findall(".//b")
        if len(bold) != 1 or output.count("<b>") != 1 or output.count("</b>") != 1:
            continue
        well_formed += 1
        inside = _tokens("".join(bold[0].itertext()))
        aligned += inside == [item["german"]]
        holds += item["german"] in inside
    share = lambda count: round(100 * count / len(items), 1)  # noqa: E731
    return {
        "text_equals_plain": share(text),
        "well_formed": share(well_formed),
        "b_around_aligned_word": share(aligned),
        "b_holds_aligned_word": share(holds),
    }


class _Remembered(Engine):
    """Gives the translations a first pass made, so that each aligner is measured on the same ones."""

    name = "remembered"

    def __init__(self, engine: Engine, memory: dict[str, str]) -> None:
        self.tokenizer, self.generation_config = engine.tokenizer, engine.generation_config
        self.source_limit, self.limit_name = engine.source_limit, engine.limit_name
        self.engine, self.memory = engine, memory

    def translate(self, sentences: list[str], glossary: Glossaries = None) -> list[str]:
        if glossary is not None:  # the memory holds translations without terms
            return self.engine.translate(sentences, glossary)
        missing = [s for s in sentences if s not in self.memory and s.strip()]
        self.memory.update(zip(missing, self.engine.translate(missing), strict=True))
        return [self.memory.get(s, "") for s in sentences]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/work/main_job_model", help="model directory (the main job's)")
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "multi30k"))
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--sentences", type=int, default=1000, help="test sentences considered")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    sources = Path(args.data_dir, f"{args.split}.en").read_text(encoding="utf-8").splitlines()[: args.sentences]
    model, tokenizer = load_translator(args.model, args.device)
    engine = TorchEngine(model, tokenizer)
    started = time.perf_counter()
    memory: dict[str, str] = {}
    plain = translate(_Remembered(engine, memory), tokenizer, sources)
    plain_seconds = time.perf_counter() - started
    items = test_items(sources, plain, word_list(WORD_LIST))
    documents = [item["html"] for item in items]
    runs = {}
    if Aligner is None:  # the code before: its own HTML path
        runs["before (text nodes)"] = measure(items, translate(model, tokenizer, documents, text_format="html"), plain)
    else:
        layers = model.config.decoder_layers
        for name, aligner in [("none (words in order)", None)] + [
            (f"layer {layer}", Aligner(model, tokenizer, layer)) for layer in range(layers)
        ]:
            remembered = _Remembered(engine, memory)
            started = time.perf_counter()
            outputs = translate(remembered, tokenizer, documents, text_format="html", aligner=aligner)
            runs[name] = {**measure(items, outputs, plain), "seconds": round(time.perf_counter() - started, 2)}
            runs[name]["examples"] = [
                {"source": item["html"], "output": output} for item, output in zip(items[:5], outputs[:5], strict=True)
            ]
        # The whole path with the default aligner, the translations made anew: the engine's own, as a user runs it.
        started = time.perf_counter()
        outputs = translate(model, tokenizer, documents, text_format="html")
        default = f"layer {ALIGNMENT_LAYER % layers}"
        runs[f"translate(text_format='html'), {default}"] = {
            **measure(items, outputs, plain),
            "seconds": round(time.perf_counter() - started, 2),
        }
    report = {
        "task": "markup",
        "device": args.device,
        "dtype": "float32",
        "model": args.model,
        "split": args.split,
        "sentences_considered": len(sources),
        "items": len(items),
        "plain_translation_seconds": round(plain_seconds, 2),
        "load_average": load_average(),
        "machine": {**machine(args.device), "commit": commit_measured()},
        "runs": runs,
    }
    table = [
        f"# Inline markup through word alignment: {len(items)} {args.split} sentences, one word in <b>",
        "",
        f"Model {args.model}; {report['machine']['cpu'] or args.device}; commit {report['machine']['commit']}; "
        f"load {report['load_average']}.",
        "",
        "| aligner | text = plain | well formed | <b> around the aligned word | <b> holds it |",
        "|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        table.append(
            f"| {name} | {run['text_equals_plain']}% | {run['well_formed']}% | {run['b_around_aligned_word']}% | "
            f"{run['b_holds_aligned_word']}% |"
        )
    name = report_stem(report, "markup")
    stem = write_report(Path(args.output), name, json.dumps(report, indent=2), "\n".join(table))
    print("\n".join(table))
    print(f"\n{stem}.json, .md", file=sys.stderr)


if __name__ == "__main__":
    main()
