"""Glossaries and confidence (issue 75, items 3 and 4), measured on a trained model with both engines.

For `--model` (the main job's Multi30k en-de model) and the 1,000 sentences of test_2016_flickr in `--data-dir`,
each engine (torch, and CTranslate2 through the model's export, `ensure_ctranslate2_export`) translates them in
batches of `--batch-size` sorted by length, as `translate` batches them, each batch without and with a glossary of
`TERMS` (twenty en-de terms whose targets are not the words the model chooses itself: "woman" -> "Dame" where it
writes "Frau"), `--rounds` times, and the report gives:

- glossary: the sentences that hold a source term (`Glossary.matches`), the share whose translation holds every
  target term as a whole word (and the share that held them without the glossary), the sentences without a term
  whose translation is byte-identical with and without it, sacreBLEU of the sentences with terms against their
  references, with and without the glossary, and each term's counts;
- speed: the median seconds of the 1,000 sentences without and with the glossary, and of the sentences with terms
  alone (their batches), each engine;
- confidence (`Hypothesis.confidence`, the mean token log-probability): its Spearman rank correlation with each
  translation's sentence-level chrF (sacreBLEU) against its reference, without the glossary, each engine, and
  Pearson's beside it.

    python benchmarks/glossary_confidence.py --model /work/main_job_model --data-dir ../shared/data/multi30k

The report goes to benchmarks/results/DATE_DEVICE_COMMIT_glossary-confidence.{json,md} (`scripts/benchmark_common`).
"""

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from benchmark_common import commit_measured, load_average, machine, report_stem, write_report  # noqa: E402

TASK = "glossary-confidence"
# (source, target): a target the model does not write for the source (it writes the word after #), so that the
# glossary must change its translation. Nouns, whose German form does not change with the sentence.
TERMS = [
    ("woman", "Dame"),  # Frau
    ("man", "Herr"),  # Mann
    ("girl", "Mädel"),  # Mädchen
    ("boy", "Bub"),  # Junge
    ("dog", "Vierbeiner"),  # Hund
    ("street", "Gasse"),  # Straße
    ("car", "Wagen"),  # Auto
    ("hat", "Kopfbedeckung"),  # Hut
    ("water", "Wasserfläche"),  # Wasser
    ("building", "Bauwerk"),  # Gebäude
    ("crowd", "Schar"),  # Menge
    ("beach", "Küste"),  # Strand
    ("dress", "Gewand"),  # Kleid
    ("jacket", "Sakko"),  # Jacke
    ("stage", "Podium"),  # Bühne
    ("grass", "Wiese"),  # Gras
    ("picture", "Aufnahme"),  # Foto, Bild
    ("field", "Acker"),  # Feld
    ("bike", "Drahtesel"),  # Fahrrad
    ("shirt", "Trikot"),  # Hemd, Oberteil
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a trained model directory (the main job's)")
    parser.add_argument("--data-dir", required=True, help="Multi30k: test_2016_flickr.en and .de")
    parser.add_argument("--ct2-dir", help="where the CTranslate2 export is (default MODEL/ctranslate2)")
    parser.add_argument("--engines", nargs="+", default=["torch", "ctranslate2"], choices=["torch", "ctranslate2"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="PyTorch's and CTranslate2's threads")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--limit", type=int, help="the first N test sentences only (a quick run)")
    parser.add_argument("--output-dir", default=str(ROOT / "benchmarks" / "results"))
    return parser.parse_args(argv)


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank): scipy's where it is installed."""
    try:
        from scipy.stats import spearmanr
    except ImportError:
        return _pearson(_ranks(x), _ranks(y))
    return float(spearmanr(x, y).statistic)


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start : end + 1]:
            ranks[i] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def _pearson(x: list[float], y: list[float]) -> float:
    mx, my = statistics.fmean(x), statistics.fmean(y)
    cov = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    return cov / (sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y)) ** 0.5


def translate_both(engine, sentences: list[str], batch_size: int, glossary) -> tuple[list, list, float, float]:
    """Every sentence's best `Hypothesis` without and with `glossary`, and the seconds of each, in batches sorted by
    length (as `translation.translate`): each batch without and with it back to back, in turn first, so that a
    machine that slows down or speeds up favours neither."""
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
    found: tuple[list, list] = ([None] * len(sentences), [None] * len(sentences))
    seconds = [0.0, 0.0]
    for number, first in enumerate(range(0, len(order), batch_size)):
        batch = order[first : first + batch_size]
        for run in (0, 1) if number % 2 == 0 else (1, 0):
            start = time.perf_counter()
            translated = engine.scored_hypotheses([sentences[i] for i in batch], 1, glossary if run else None)
            seconds[run] += time.perf_counter() - start
            for i, hypotheses in zip(batch, translated, strict=True):
                found[run][i] = hypotheses[0]
    return found[0], found[1], seconds[0], seconds[1]


def measure(engine, sources: list[str], references: list[str], args: argparse.Namespace) -> dict:
    import sacrebleu

    from vaswani_transformer.inference.glossary import Glossary

    glossary = Glossary(TERMS)
    matched = [glossary.matches(source) for source in sources]
    holding = [i for i, terms in enumerate(matched) if terms]
    times = {"plain": [], "glossary": [], "glossary_sentences_plain": [], "glossary_sentences_glossary": []}
    for _ in range(args.rounds):
        plain, constrained, without, with_glossary = translate_both(engine, sources, args.batch_size, glossary)
        times["plain"].append(without)
        times["glossary"].append(with_glossary)
        subset = [sources[i] for i in holding]
        *_, without, with_glossary = translate_both(engine, subset, args.batch_size, glossary)
        times["glossary_sentences_plain"].append(without)
        times["glossary_sentences_glossary"].append(with_glossary)

    def has(target: str, text: str) -> bool:  # as a whole word: "Herr" is not in "Herrin"
        return re.search(rf"(?<!\w){re.escape(target)}(?!\w)", text) is not None

    def holds_all(hypothesis, terms) -> bool:
        return all(has(term.target, hypothesis.text) for term in terms)

    per_term = {}
    for term in glossary.terms:
        mine = [i for i in holding if term in matched[i]]
        per_term[f"{term.source} -> {term.target}"] = {
            "sentences": len(mine),
            "target_without_glossary": sum(has(term.target, plain[i].text) for i in mine),
            "target_with_glossary": sum(has(term.target, constrained[i].text) for i in mine),
        }
    without = [i for i in range(len(sources)) if not matched[i]]
    chrf = [sacrebleu.sentence_chrf(h.text, [r]).score for h, r in zip(plain, references, strict=True)]
    confidence = [h.confidence for h in plain]

    def bleu(hypotheses) -> float:
        return round(
            sacrebleu.corpus_bleu([hypotheses[i].text for i in holding], [[references[i] for i in holding]]).score, 2
        )

    return {
        "sentences": len(sources),
        "sentences_with_terms": len(holding),
        "terms_met_with_glossary": round(sum(holds_all(constrained[i], matched[i]) for i in holding) / len(holding), 4),
        "terms_met_without_glossary": round(sum(holds_all(plain[i], matched[i]) for i in holding) / len(holding), 4),
        "sentences_without_terms": len(without),
        "identical_without_terms": sum(plain[i].text == constrained[i].text for i in without),
        "bleu_sentences_with_terms": {"without_glossary": bleu(plain), "with_glossary": bleu(constrained)},
        "bleu_all": {
            "without_glossary": round(sacrebleu.corpus_bleu([h.text for h in plain], [references]).score, 2),
            "with_glossary": round(sacrebleu.corpus_bleu([h.text for h in constrained], [references]).score, 2),
        },
        "seconds_median": {name: round(statistics.median(values), 3) for name, values in times.items()},
        "seconds": times,
        "confidence_spearman_chrf": round(spearman(confidence, chrf), 4),
        "confidence_pearson_chrf": round(_pearson(confidence, chrf), 4),
        "confidence_mean": round(statistics.fmean(confidence), 4),
        "per_term": per_term,
        "examples": [
            {"source": sources[i], "without": plain[i].text, "with": constrained[i].text, "reference": references[i]}
            for i in holding[:8]
        ],
    }


def table(report: dict) -> str:
    lines = [
        f"# Glossaries and confidence: {report['model']}",
        "",
        f"Machine: {report['machine']['cpu']} ({', '.join(report['machine']['cpu_vector_extensions'])}), "
        f"{report['threads']} thread(s); torch {report['machine']['torch']}, transformers "
        f"{report['machine']['transformers']}, ctranslate2 {report['machine']['ctranslate2']}, sacrebleu "
        f"{report['machine']['sacrebleu']}; commit {report['machine']['commit']}; load {report['load_before']} before, "
        f"{report['load_after']} after.",
        "",
        "| | " + " | ".join(report["engines"]) + " |",
        "|---|" + "---|" * len(report["engines"]),
    ]

    def pair(r: dict, field: str, first: str, second: str) -> str:
        return f"{r[field][first]} / {r[field][second]}"

    rows = [
        ("sentences with a source term", lambda r: f"{r['sentences_with_terms']} of {r['sentences']}"),
        (
            "target terms all in the translation (whole words), with glossary",
            lambda r: f"{100 * r['terms_met_with_glossary']:.1f}%",
        ),
        ("... without glossary", lambda r: f"{100 * r['terms_met_without_glossary']:.1f}%"),
        (
            "sentences without terms byte-identical",
            lambda r: f"{r['identical_without_terms']} of {r['sentences_without_terms']}",
        ),
        (
            "BLEU of the sentences with terms, without / with",
            lambda r: pair(r, "bleu_sentences_with_terms", "without_glossary", "with_glossary"),
        ),
        ("BLEU of all, without / with", lambda r: pair(r, "bleu_all", "without_glossary", "with_glossary")),
        ("seconds, all sentences, without / with", lambda r: pair(r, "seconds_median", "plain", "glossary")),
        (
            "seconds, sentences with terms, without / with",
            lambda r: pair(r, "seconds_median", "glossary_sentences_plain", "glossary_sentences_glossary"),
        ),
        ("Spearman(confidence, sentence chrF)", lambda r: f"{r['confidence_spearman_chrf']:.3f}"),
        ("Pearson(confidence, sentence chrF)", lambda r: f"{r['confidence_pearson_chrf']:.3f}"),
    ]
    for name, cell in rows:
        lines.append(f"| {name} | " + " | ".join(cell(report["results"][e]) for e in report["engines"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    import torch

    from vaswani_transformer.data.corpora import iter_lines
    from vaswani_transformer.inference.config import InferenceConfig
    from vaswani_transformer.inference.engines import load_engine

    torch.set_num_threads(args.threads)
    sources = list(iter_lines(Path(args.data_dir) / "test_2016_flickr.en"))[: args.limit]
    references = list(iter_lines(Path(args.data_dir) / "test_2016_flickr.de"))[: args.limit]
    report = {
        "task": TASK,
        "model": args.model,
        "device": args.device,
        "dtype": "float32",
        "threads": args.threads,
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "engines": args.engines,
        "terms": TERMS,
        "machine": {**machine(args.device), "commit": commit_measured()},
        "load_before": load_average(),
        "results": {},
    }
    for name in args.engines:
        config = InferenceConfig(engine=name, device=args.device, ctranslate2_dir=args.ct2_dir)
        engine = load_engine(args.model, config)
        report["results"][name] = measure(engine, sources, references, args)
        print(
            json.dumps({name: {k: v for k, v in report["results"][name].items() if k != "examples"}}), file=sys.stderr
        )
    report["load_after"] = load_average()
    stem = write_report(Path(args.output_dir), report_stem(report, TASK), json.dumps(report, indent=2), table(report))
    print(stem, file=sys.stderr)
    return stem


if __name__ == "__main__":
    main()
