"""The `ct2-engine` task: the CTranslate2 engine of `translate --engine ctranslate2` against CTranslate2 itself.

For a trained model (`--model`) and the sentences of test_2016_flickr.en, after start-up and model loading, each
run in a fresh process (`benchmark.py --child RUN ct2-engine`), the runs of a round in the reverse order every
other round:

- `ct2-file`: `vaswani-transformer translate --engine ctranslate2 --input FILE` itself (`cli.main`, its output
  kept in memory), with the engine loaded before (`cli_translation`), against CTranslate2's own
  `Translator.translate_batch` on the same translator (so with the same `intra_threads`, PyTorch's thread count)
  on exactly the batches and options the engine gave it, pre-tokenized: recorded while the command translated the
  file once before the timed passes, which alternate between the two;
- `ct2-sorted`: the same with the library's `translation.translate` on the file's lines (batches sorted by length);
- `torch`, `torch-workers`: `translate --engine torch --input FILE` likewise, with `--num-workers` 1 (the
  default) and `--threads` (`translation.map_in_workers`).

The report gives the median over rounds of each run's best pass, the medians of the rounds' ratios (ours over the
reference in one process; torch over the CTranslate2 engine within a round), the share of translations identical
between the engines (CTranslate2's beam search against `generate()`), and each one's sacreBLEU.
"""

import argparse
import io
import json
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

from benchmark_common import commit_measured, load_average, machine, report_stem, write_report

TASK = "ct2-engine"
SOURCE, REFERENCE = "test_2016_flickr.en", "test_2016_flickr.de"  # in --data-dir
RUNS = {
    "ct2-file": "CTranslate2 engine, `translate --input FILE` (translate_stream, the file's lines in batches)",
    "ct2-sorted": "CTranslate2 engine, `translation.translate` (batches sorted by length)",
    "torch": "torch engine, `translate --input FILE`, 1 worker",
    "torch-workers": "torch engine, `translate --input FILE`, `--num-workers` = `--threads`",
}
# Pairs of runs whose translations are compared: (run, run it is compared with).
COMPARED = (("ct2-file", "torch"), ("ct2-sorted", "ct2-file"), ("torch-workers", "torch"))


# In the child: one run, one process --------------------------------------------------------------------------------


class _RecordingTranslator:
    """A `ctranslate2.Translator` that keeps every `translate_batch` call's tokens and options while it passes it on."""

    def __init__(self, translator: "ctranslate2.Translator") -> None:  # noqa: F821
        self.translator, self.calls = translator, []

    def translate_batch(self, tokens: list[list[str]], **options) -> list:
        self.calls.append((tokens, options))
        return self.translator.translate_batch(tokens, **options)


def cli_translation(engine: "Engine", model: Path, path: Path, num_workers: int) -> Callable[[], list[str]]:  # noqa: F821
    """A function that runs `vaswani-transformer translate --model MODEL --engine ENGINE --input PATH --num-workers N`
    in this process (`cli.main`, so with the options' defaults the command has) with `engine` already loaded, its
    `engines.load_engine` answering with it, and returns the lines the command printed.

    Raises (when called):
        RuntimeError: the command failed (its stderr in the message), or asked for an engine other than `engine`.
    """
    from vaswani_transformer import cli
    from vaswani_transformer.inference import input_translation

    argv = ["translate", "--model", str(model), "--engine", engine.name, "--input", str(path)]
    argv += ["--num-workers", str(num_workers)]

    def loaded(name: str, config: "InferenceConfig") -> "Engine":  # noqa: F821
        if config.engine != engine.name:
            raise RuntimeError(f"translate asked for the {config.engine} engine, not the {engine.name} one loaded")
        return engine

    def run() -> list[str]:
        printed, errors = io.StringIO(), io.StringIO()  # the progress bar goes to stderr
        patched = mock.patch.object(input_translation, "load_engine", loaded)
        with patched, redirect_stdout(printed), redirect_stderr(errors):
            status = cli.main(argv)
        if status != 0:
            raise RuntimeError(f"vaswani-transformer {' '.join(argv)} exited with {status}:\n{errors.getvalue()}")
        return printed.getvalue().split("\n")[:-1]  # a line per translation, each ended by a line feed

    return run


def child_ct2(run: str, args: argparse.Namespace) -> dict:
    """Seconds of each pass of the CTranslate2 engine and of `translate_batch` alone on its batches, in turns.

    `run` "ct2-file" translates with `translate --input FILE` (`cli_translation`), "ct2-sorted" with
    `translation.translate`. Returns the passes' seconds (`ours`, `reference`), the translations, the batches and
    PyTorch's thread count, which the engine gives CTranslate2 as `intra_threads`.

    Raises:
        ImportError: ctranslate2 is missing; OSError, ValueError: from `engines.load_engine`.
    """
    import torch

    from vaswani_transformer.data.corpora import iter_lines
    from vaswani_transformer.exchange.ctranslate2 import ensure_ctranslate2_export
    from vaswani_transformer.inference.config import InferenceConfig
    from vaswani_transformer.inference.engines import load_engine
    from vaswani_transformer.inference.translation import translate

    engine = load_engine(str(args.model), InferenceConfig(engine="ctranslate2", device="cpu"))
    path = args.data_dir / SOURCE
    if run == "ct2-file":
        ours = cli_translation(engine, args.model, path, num_workers=1)
    else:
        sentences = list(iter_lines(path))  # read before, as a caller of the library holds its list

        def ours() -> list[str]:
            return translate(engine, engine.tokenizer, sentences)

    recorder = _RecordingTranslator(engine.translator)
    engine.translator = recorder
    translations = ours()  # also the warm-up of both
    engine.translator = recorder.translator

    def reference() -> None:
        for tokens, options in recorder.calls:
            recorder.translator.translate_batch(tokens, **options)

    seconds = {"ours": [], "reference": []}
    for repeat in range(args.repeats):
        for name, function in (("ours", ours), ("reference", reference))[:: -1 if repeat % 2 else 1]:
            start = time.perf_counter()
            function()
            seconds[name].append(time.perf_counter() - start)
    per_batch = ("max_decoding_length", "max_batch_size")  # set from each batch's sources
    penalty = "GNMT" if engine.gnmt else "HF"
    return {
        "seconds": seconds,
        "translations": translations,
        "batches": len(recorder.calls),
        "intra_threads": torch.get_num_threads(),
        "export": str(ensure_ctranslate2_export(str(args.model))),  # where load_engine found it
        "decoding": f"beam {engine.beam_size}, {penalty} length penalty {engine.length_penalty}",
        "translate_batch_options": {k: v for k, v in recorder.calls[0][1].items() if k not in per_batch},
    }


def child_torch(run: str, args: argparse.Namespace) -> dict:
    """Seconds of each pass of `translate --engine torch --input FILE` (`cli_translation`), with 1 worker ("torch")
    or `--threads` workers ("torch-workers"), after one untimed batch; and its translations.

    Raises:
        OSError, ValueError: from `engines.load_engine`.
    """
    from vaswani_transformer.data.corpora import iter_lines
    from vaswani_transformer.inference.config import BATCH_SIZE, InferenceConfig
    from vaswani_transformer.inference.engines import load_engine

    engine = load_engine(str(args.model), InferenceConfig(engine="torch", device="cpu"))
    path = args.data_dir / SOURCE
    workers = args.threads if run == "torch-workers" else 1
    ours = cli_translation(engine, args.model, path, workers)
    engine.translate(list(iter_lines(path))[:BATCH_SIZE])  # warm-up; workers fork from a warm process
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        translations = ours()
        seconds.append(time.perf_counter() - start)
    return {"seconds": {"ours": seconds}, "translations": translations, "workers": workers}


def child(run: str, args: argparse.Namespace) -> dict:
    """One run of the task (a key of `RUNS`) in this process, with `--threads` PyTorch threads (as many as
    `translate` gets on a machine of that many cores; the CTranslate2 engine's `intra_threads`).

    Raises:
        ValueError: an unknown run.
    """
    import torch

    if run not in RUNS:
        raise ValueError(f"{TASK}: unknown run {run!r}; choose from {', '.join(RUNS)}")
    torch.set_num_threads(args.threads)
    return child_ct2(run, args) if run.startswith("ct2") else child_torch(run, args)


# In the parent: rounds of runs, the report ------------------------------------------------------------------------


def best(result: dict, name: str = "ours") -> float:
    """The fastest pass of `name` ("ours" or "reference") in one run, in seconds."""
    return min(result["seconds"][name])


def summary(rounds: list[dict], sentences: int) -> dict:
    """Medians over `rounds` (each {run: result}): each run's best pass (seconds, sentences/s) and the ratios."""
    medians = {run: statistics.median(best(r[run]) for r in rounds) for run in RUNS}
    medians |= {
        f"{run}-reference": statistics.median(best(r[run], "reference") for r in rounds) for run in RUNS if "ct2" in run
    }
    return {
        "seconds": medians,
        "sentences_per_second": {name: sentences / seconds for name, seconds in medians.items()},
        "ours_over_reference": {
            run: statistics.median(best(r[run]) / best(r[run], "reference") for r in rounds)
            for run in ("ct2-file", "ct2-sorted")
        },
        "torch_over_ct2_engine": {
            run: statistics.median(best(r[run]) / best(r["ct2-file"]) for r in rounds)
            for run in ("torch", "torch-workers")
        },
    }


def markdown(report: dict) -> str:
    """The task's results as one Markdown table, the translations compared, and the machine."""
    s, n = report["summary"], report["sentences"]
    seconds, rate = s["seconds"], s["sentences_per_second"]
    ratio = {**s["ours_over_reference"], **s["torch_over_ct2_engine"]}
    compared = {"ct2-file": "its reference", "ct2-sorted": "its reference"}
    compared |= {"torch": "the CTranslate2 engine (file)", "torch-workers": "the CTranslate2 engine (file)"}
    lines = [
        f"**{report['model']}**, its CTranslate2 export `{report['export']}`: the {n:,} sentences of {SOURCE}, "
        f"the model's decoding ({report['decoding']}), after start-up and model loading; medians over "
        f"{report['rounds']} rounds (a fresh process per run and round) of each run's best of {report['repeats']} "
        "passes",
        "",
        "| Run | Seconds | Sentences/s | Median of the rounds' ratios |",
        "|---|---:|---:|---:|",
    ]
    for run, name in RUNS.items():
        if run.startswith("ct2"):
            lines.append(
                f"| reference: `translate_batch` alone on the batches of the run below, pre-tokenized | "
                f"{seconds[run + '-reference']:.2f} | {rate[run + '-reference']:,.1f} | |"
            )
        lines.append(
            f"| {name} | {seconds[run]:.2f} | {rate[run]:,.1f} | {ratio[run]:.2f}x the time of {compared[run]} |"
        )
    identical = "; ".join(f"{pair}: {count:,}" for pair, count in report["identical"].items())
    bleu = ", ".join(f"{run} {score:.2f}" for run, score in report["bleu"].items())
    lines += ["", f"Translations identical (of {n:,}): {identical}. sacreBLEU against {REFERENCE}: {bleu}.", ""]
    m = report["machine"]
    lines.append(
        f"{m['cpu']} ({' '.join(m['cpu_vector_extensions'])}), {report['threads']} threads of {m['cores']} cores "
        f"(CTranslate2 `intra_threads` {report['intra_threads']}); commit {m['commit']}; torch {m['torch']}, "
        f"transformers {m['transformers']}, ctranslate2 {m['ctranslate2']}, Python {m['python']}. Load average "
        f"before / after: {report['load_before']} / {report['load_after']}; CPU time stolen while a run ran: "
        f"highest {max(report['cpu_steal'], default=0):.1%}." + (f" {report['note']}" if report.get("note") else "")
    )
    return "\n".join(lines) + "\n"


def parent(args: argparse.Namespace, run_child: Callable[..., dict]) -> None:
    """Run every run `--rounds` times (order reversed every other round), write the JSON and Markdown reports.

    `run_child(args, workdir, group, engine, task)` runs one child process (`benchmark.run_child`).

    Raises:
        RuntimeError: a child failed; OSError: --model or the data missing.
    """
    from vaswani_transformer.data.corpora import iter_lines
    from vaswani_transformer.inference.translation import corpus_bleu

    load_before, commit = load_average(), commit_measured()  # as the run starts
    rounds = []
    for index in range(args.rounds):
        results = {}
        for run in list(RUNS)[:: -1 if index % 2 else 1]:
            results[run] = result = run_child(args, None, TASK, run, TASK)
            passes = " ".join(f"{name} {min(times):.2f} s" for name, times in result["seconds"].items())
            print(f"round {index + 1} {run:13} {passes}", file=sys.stderr, flush=True)
        rounds.append(results)
    sentences = len(rounds[0]["ct2-file"]["translations"])
    last = rounds[-1]
    references = list(iter_lines(args.data_dir / REFERENCE))
    report = {
        "command": " ".join(["python", "scripts/benchmark.py", *sys.argv[1:]]),
        "task": TASK,
        "model": str(args.model),
        "export": last["ct2-file"]["export"],
        "decoding": last["ct2-file"]["decoding"],
        "sentences": sentences,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "threads": args.threads,
        "intra_threads": last["ct2-file"]["intra_threads"],
        "summary": summary(rounds, sentences),
        "identical": {
            f"{a} / {b}": sum(x == y for x, y in zip(last[a]["translations"], last[b]["translations"], strict=True))
            for a, b in COMPARED
        },
        "bleu": {run: corpus_bleu(last[run]["translations"], references)["score"] for run in RUNS},
        "cpu_steal": [r[run]["cpu_steal"] for r in rounds for run in RUNS if "cpu_steal" in r[run]],
        "rounds_detail": [
            {run: {k: v for k, v in result.items() if k != "translations"} for run, result in r.items()} for r in rounds
        ],
        "machine": {**machine("cpu"), "commit": commit},
        "device": "cpu",
        "dtype": "float32",
        "load_before": load_before,
        "load_after": load_average(),
        "note": args.note,
    }
    table = markdown(report)
    stem = write_report(args.output_dir, report_stem(report, TASK), json.dumps(report, indent=2) + "\n", table)
    print(table)
    print(f"Results: {stem}.json and .md (keep the stderr lines beside them as {stem.name}.log)", file=sys.stderr)
