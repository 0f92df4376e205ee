"""int8 against float32 on the CPU: `torch.ao.quantization.quantize_dynamic` on a trained model, speed and sacreBLEU.

Dynamic quantization (int8 weights, activations quantized per batch as they come) swaps every `nn.Linear` of the
model for an int8 one: the 6 of each encoder layer, the 10 of each decoder layer and the pre-softmax projection
(docs/compatibility.md, "Quantization"). Both models translate the same test sentences with the library's
`inference.translation.translate` (batches sorted by length, beam 4 and the model's length penalty), one sentence a
line as `evaluate` does, at each `--threads` count in one process: the two models take turns, in reverse order every
other round, so that a machine drifting slower or faster favours neither. Only the ratios of one run compare.

    python scripts/benchmark_quantization.py --model outputs/multi30k-en-de --threads 1 2 --rounds 3

The report goes to benchmarks/results/DATE_DEVICE_COMMIT_int8-dynamic.{json,md} (`benchmark_common.report_stem`);
keep the run's stderr beside them as the `.log`.
"""

import argparse
import copy
import io
import json
import statistics
import sys
import time
from pathlib import Path

from benchmark_common import ROOT, commit_measured, cpu_times, load_average, machine, report_stem, write_report

MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: the model, the test set and its slice, the thread counts, the rounds."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a trained model directory (or Hub id)")
    parser.add_argument("--source", default=str(MULTI30K / "test_2016_flickr.en"), help="source sentences, a line each")
    parser.add_argument("--reference", default=str(MULTI30K / "test_2016_flickr.de"), help="their references")
    parser.add_argument("--sentences", type=int, default=0, help="the first N sentences (default: 0, all)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts (default: 1 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both models per thread count (default: 3)")
    parser.add_argument("--num-beams", type=int, default=4, help="beam size (default: 4, §6.1)")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per generate() (default: translate's)")
    parser.add_argument("--note", default="", help="a sentence for the report: why this run was made")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results", help="where reports go")
    args = parser.parse_args(argv)
    if min(args.threads) < 1 or args.rounds < 1 or args.sentences < 0:
        parser.error("--threads and --rounds must be at least 1, --sentences 0 or more")
    return args


def state_bytes(model) -> int:
    """The bytes of the model's state dict as `torch.save` writes it (the int8 model's packed weights included)."""
    import torch

    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()


def timed(model, tokenizer, sentences: list[str], args: argparse.Namespace) -> tuple[float, list[str]]:
    """Seconds to translate `sentences` as `evaluate` does, and the translations."""
    from vaswani_transformer.inference.translation import translate

    started = time.perf_counter()
    translations = translate(
        model, tokenizer, sentences, batch_size=args.batch_size, split_sentences=False, num_beams=args.num_beams
    )
    return time.perf_counter() - started, translations


def measure(args: argparse.Namespace) -> dict:
    """Both models at every thread count: seconds per round, sentences per second, BLEU, identical translations."""
    import torch

    from vaswani_transformer.inference.engines import load_translator
    from vaswani_transformer.inference.translation import corpus_bleu

    sources = Path(args.source).read_text(encoding="utf-8").splitlines()
    references = Path(args.reference).read_text(encoding="utf-8").splitlines()
    if args.sentences:
        sources, references = sources[: args.sentences], references[: args.sentences]
    model, tokenizer = load_translator(args.model, device="cpu")
    linear = [name for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    int8 = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
    dynamic = torch.ao.nn.quantized.dynamic.Linear
    quantized = [name for name in linear if isinstance(int8.get_submodule(name), dynamic)]
    models = {"float32": model, "int8": int8}
    results = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for candidate in models.values():  # warm-up: the first calls allocate and choose kernels
            timed(candidate, tokenizer, sources[:32], args)
        seconds = {name: [] for name in models}
        translations, steal = {}, []
        for round_number in range(args.rounds):
            order = list(models) if round_number % 2 == 0 else list(reversed(models))
            for name in order:
                before = cpu_times()
                elapsed, translations[name] = timed(models[name], tokenizer, sources, args)
                after = cpu_times()
                if before and after and after[1] > before[1]:
                    steal.append((after[0] - before[0]) / (after[1] - before[1]))
                seconds[name].append(elapsed)
                print(f"threads {threads}, round {round_number + 1}, {name}: {elapsed:.1f} s", file=sys.stderr)
        speed = {name: [len(sources) / s for s in times] for name, times in seconds.items()}
        results[str(threads)] = {
            "seconds": seconds,
            "sentences_per_second_best": {name: max(values) for name, values in speed.items()},
            "int8_over_float32_median": statistics.median(
                i / f for i, f in zip(speed["int8"], speed["float32"], strict=True)
            ),
            "bleu": {name: corpus_bleu(texts, references)["score"] for name, texts in translations.items()},
            "identical_translations": sum(
                a == b for a, b in zip(translations["float32"], translations["int8"], strict=True)
            ),
            "steal_highest": max(steal, default=None),
        }
    return {
        "sentences": len(sources),
        "linear_layers": len(linear),
        "quantized_layers": len(quantized),
        "state_dict_bytes": {name: state_bytes(candidate) for name, candidate in models.items()},
        "results": results,
    }


def markdown(report: dict) -> str:
    """The table: per thread count, both models' speed, the median ratio, BLEU and identical translations."""
    lines = [
        f"**int8 dynamic quantization** (`torch.ao.quantization.quantize_dynamic`, {report['quantized_layers']} of "
        f"{report['linear_layers']} linear layers) against float32: {report['model']}, beam {report['num_beams']}, "
        f"{report['sentences']} sentences of {Path(report['source']).name}, batches of {report['batch_size']}",
        "",
        "| Threads | float32, sentences/s | int8, sentences/s | int8 / float32 (median of rounds) | BLEU float32 | "
        "BLEU int8 | identical translations |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for threads, result in report["results"].items():
        best, bleu = result["sentences_per_second_best"], result["bleu"]
        lines.append(
            f"| {threads} | {best['float32']:.1f} | {best['int8']:.1f} | {result['int8_over_float32_median']:.2f}x | "
            f"{bleu['float32']:.2f} | {bleu['int8']:.2f} | {result['identical_translations']} of "
            f"{report['sentences']} |"
        )
    sizes, found = report["state_dict_bytes"], report["machine"]
    lines += [
        "",
        f"State dict: float32 {sizes['float32'] / 2**20:.1f} MiB, int8 {sizes['int8'] / 2**20:.1f} MiB. Speeds: the "
        f"best of {report['rounds']} rounds; the ratio: the median over rounds of each round's (the two models of a "
        "round run back to back, in turns).",
        "",
        f"{found['cpu']} ({' '.join(found['cpu_vector_extensions'])}), {found['cores']} cores; commit "
        f"{found['commit']}; torch {found['torch']}, transformers {found['transformers']}, sacrebleu "
        f"{found['sacrebleu']}. Load average before / after: {report['load_before']} / {report['load_after']}. "
        f"{report['note']}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    """Measure, then write the report; returns its stem."""
    args = parse_args(argv)
    report = {
        "task": "int8-dynamic",
        "device": "cpu",
        "dtype": "float32",
        "machine": {**machine("cpu"), "commit": commit_measured()},
        "model": args.model,
        "source": args.source,
        "num_beams": args.num_beams,
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "note": args.note,
        "load_before": load_average(),
    }
    report.update(measure(args))
    report["load_after"] = load_average()
    stem = write_report(
        args.results, report_stem(report, "int8-dynamic"), json.dumps(report, indent=2), markdown(report)
    )
    print(stem)
    return stem


if __name__ == "__main__":
    main()
