"""How `train` starts on corpora of WMT size: seconds to the first optimizer step, and peak memory, by corpus size.

The corpora are Multi30k's training set repeated K times (`--repeats`, e.g. 155 for 4,495,000 pairs, WMT14's size),
with its validation set once, written under `--work-dir`. For each, three commands of
`vaswani-transformer train --preset tiny --max-steps 1`, one after the other:

- "first": a new data cache: the corpus is counted, hashed, the BPE tokenizer trained (on `train`'s default
  `--tokenizer-sample`) and the corpus prepared (`training.corpus.prepare_corpus`);
- "second": a new output directory on the same corpus and cache, with `--tokenizer` the first run's;
- "resume": the first run's directory again with `--resume --max-steps 2`.

Reported per command: seconds from its start to its first optimizer step (when the "Training" bar first counts
beyond where it started), the command's wall seconds, its peak resident memory (`wait4`), and after the first, the
data cache's size on disk. The machine, CPU vector extensions, library versions and commit go with them to
benchmarks/results/DATE_DEVICE_COMMIT_corpus-preparation.{json,md}.

    python scripts/benchmark_corpus.py --data-dir ../shared/data/multi30k --work-dir /tmp/corpora --repeats 1 10 50 155
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmark_common import ROOT, commit_measured, cpu_times, load_average, machine, report_stem, write_report

BAR = re.compile(r"Training:\s+\d+%\|[^|]*\|\s*(\d+)/\d+")


def build_corpus(data_dir: Path, directory: Path, repeats: int) -> int:
    """Multi30k's training files `repeats` times over and its validation files once; returns the pairs."""
    directory.mkdir(parents=True, exist_ok=True)
    for lang in ("en", "de"):
        text = (data_dir / f"train.{lang}").read_bytes()
        with open(directory / f"train.{lang}", "wb") as file:
            for _ in range(repeats):
                file.write(text)
        shutil.copyfile(data_dir / f"val.{lang}", directory / f"val.{lang}")
    return repeats * (data_dir / "train.en").read_bytes().count(b"\n")


def timed_train(arguments: list[str], cache: Path) -> dict:
    """Run `train` with `arguments`: seconds to its first optimizer step and in all, peak RSS in MiB.

    Raises:
        RuntimeError: the command failed (its last output is in the message).
    """
    command = [sys.executable, "-m", "vaswani_transformer.cli", "train", *arguments]
    environment = {**os.environ, "HF_DATASETS_CACHE": str(cache)}
    started = time.monotonic()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environment)
    first_step, tail = [None], []

    def watch() -> None:  # the "Training" bar's first count beyond its start is the first optimizer step
        start, text = None, b""
        for chunk in iter(lambda: child.stderr.read1(4096), b""):
            text = (text + chunk)[-8192:]
            tail[:] = [text]
            for match in BAR.finditer(text.decode(errors="replace").replace("\r", "\n")):
                count = int(match.group(1))
                start = count if start is None else start
                if count > start and first_step[0] is None:
                    first_step[0] = time.monotonic() - started

    reader = threading.Thread(target=watch)
    reader.start()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.monotonic() - started
    reader.join()
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"train failed ({child.returncode}): {tail[0][-2000:].decode(errors='replace')}")
    return {"seconds_to_first_step": first_step[0], "seconds": round(wall, 1), "peak_rss_mib": usage.ru_maxrss // 1024}


def directory_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def measure(args: argparse.Namespace, repeats: int) -> dict:
    """The three commands on the corpus of `repeats` copies, each in a directory of its own under --work-dir."""
    work = args.work_dir / f"x{repeats}"
    pairs = build_corpus(args.data_dir, work / "corpus", repeats)
    cache = work / "cache"
    for leftover in (cache, work / "first", work / "second"):
        shutil.rmtree(leftover, ignore_errors=True)
    common = ["--data-dir", str(work / "corpus"), "--source-lang", "en", "--target-lang", "de", "--preset", "tiny"]
    row = {"pairs": pairs, "corpus_bytes": directory_bytes(work / "corpus")}
    steal = cpu_times()
    row["first"] = timed_train([*common, "--output-dir", str(work / "first"), "--max-steps", "1"], cache)
    row["cache_bytes"] = directory_bytes(cache)
    # The model's vocabulary, which the tokenizer's sample decides: a batch's logits, and the peak, grow with it.
    row["vocab_size"] = json.loads((work / "first" / "config.json").read_text())["vocab_size"]
    tokenizer = ["--tokenizer", str(work / "first")]
    row["second"] = timed_train([*common, "--output-dir", str(work / "second"), "--max-steps", "1", *tokenizer], cache)
    row["resume"] = timed_train([*common, "--output-dir", str(work / "first"), "--max-steps", "2", "--resume"], cache)
    if steal and (after := cpu_times()):
        row["steal_share"] = round((after[0] - steal[0]) / max(1, after[1] - steal[1]), 4)
    print(json.dumps(row), flush=True)
    return row


def table(report: dict) -> str:
    lines = [
        f"# Corpus preparation: {report['machine']['cpu']}, {report['machine']['cores']} cores, commit "
        f"{report['machine']['commit']}",
        "",
        "| pairs | vocabulary | first run: to step 1 / peak RSS | second run | resume | cache on disk |",
        "|---:|---:|---|---|---|---:|",
    ]
    for row in report["rows"]:
        cells = [
            f"{row[run]['seconds_to_first_step']:.1f} s / {row[run]['peak_rss_mib']:,} MiB"
            for run in ("first", "second", "resume")
        ]
        vocabulary = f"{row['vocab_size']:,}" if "vocab_size" in row else "?"
        lines.append(
            f"| {row['pairs']:,} | {vocabulary} | {' | '.join(cells)} | {row['cache_bytes'] / 2**20:,.0f} MiB |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data" / "multi30k")
    parser.add_argument("--work-dir", type=Path, required=True, help="where the corpora, caches and runs go")
    parser.add_argument("--repeats", type=int, nargs="+", default=[1, 10, 50, 155])
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    commit = commit_measured()  # now: files edited while it runs are no part of what it measured
    rows = [measure(args, repeats) for repeats in args.repeats]
    report = {"task": "corpus-preparation", "device": "cpu", "dtype": "float32", "load_average": load_average()}
    from importlib.metadata import version

    libraries = {name: version(name) for name in ("tokenizers", "datasets", "pyarrow")}
    report["machine"] = {**machine("cpu"), **libraries, "commit": commit}
    report["rows"] = rows
    stem = write_report(
        args.output_dir, report_stem(report, "corpus-preparation"), json.dumps(report, indent=2), table(report)
    )
    print(table(report))
    print(f"Wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
