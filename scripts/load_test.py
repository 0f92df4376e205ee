"""Load test of `vaswani-transformer serve`: N concurrent clients, micro-batching against one request at a time.

The script starts the server itself, twice, on a free loopback port each time, with the given model:

- "micro-batching": the server's batching options (`--batch-wait-ms`, `--max-batch-tokens`,
  `--batch-size`, the defaults of `serve` unless given here);
- "one at a time": `--batch-wait-ms 0 --batch-size 1`, each request its own `generate()`;
- "big requests" (only when asked for with `--modes`): micro-batching, and one more client that sends
  one request of `--big-lines` one-character lines (2,500: LibreTranslate's 5,000 characters as
  lines) every `--big-every` seconds (the next as soon as the last is answered, if that takes
  longer). It measures fair queueing: the other clients' latency with the big requests against
  the "micro-batching" run's. The server gets `--sentence-limit` `--big-lines` (in both runs), so
  that it translates the big requests instead of refusing them; its `--request-timeout` is serve's;
- "beside a neighbour" (only when asked for with `--modes`): micro-batching while another process keeps one core
  busy (a Python loop, started before the warm-up and killed after the run), as a training job or another service
  on the same machine would. It measures how serve's threads share the cores: `neighbour_throughput_ratio` is its
  throughput over the "micro-batching" run's.

Each time, after a few warm-up requests, `--clients` threads (each with its own keep-alive
connection) send `--requests` POST /translate requests in all, one Multi30k test sentence each
(LibreTranslate's JSON body), as fast as the answers come back. A run stops by itself after its
requests, or after `--max-seconds` (then the requests not sent are reported, and the run fails).
The server is then stopped with SIGTERM and must exit with status 0.

Reported per run: throughput (answered sentences per second of wall time, first request to last
answer), latency p50/p95/p99 in milliseconds, errors (a status other than 200, a body without a
string `translatedText`, a connection error or a timeout), the share of CPU time other virtual
machines took (steal, from /proc/stat); and the gain: micro-batching's throughput over one at a
time's. With big requests: the big client's answers (HTTP status, seconds), apart from the other
clients' numbers, and the other clients' p99 over the micro-batching run's (`p99_ratio_big_requests`).
The table goes to stdout, the whole report (machine, CPU vector extensions, torch version, commit)
to `--output` as JSON.

    python scripts/load_test.py --model outputs/multi30k-en-de --clients 32 --requests 1000 --output load.json
    python scripts/load_test.py --model outputs/multi30k-en-de --modes micro-batching "big requests" --max-p99-ratio 3

`--threads N` is passed to every server (`serve --threads`; default: serve's, one per core less one):
on two cores shared with the clients, measure 1 and 2.

    python scripts/load_test.py --model outputs/multi30k-en-de --modes micro-batching "beside a neighbour" \
        --min-neighbour-ratio 0.4

Exit status: 0 when every run answered every request of its `--clients` without an error (and, with
`--min-gain`, `--max-p99-ratio` and `--min-neighbour-ratio`, the gain and the ratios kept to them), 1 otherwise. The big
client's answers are reported, not counted as errors: past serve's `--request-timeout`, a 503 is its
right answer.
"""

import argparse
import http.client
import itertools
import json
import math
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmark_common import commit_measured, cpu_times  # scripts/benchmark_common.py: this folder is on sys.path
from benchmark_common import machine as benchmark_machine

from vaswani_transformer.inference.config import ENGINES
from vaswani_transformer.serving.config import ServingConfig

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "micro-batching": [],  # the batching options of the command line are added
    "one at a time": ["--batch-wait-ms", "0", "--batch-size", "1"],
    "big requests": [],  # micro-batching's, and a client of big requests
    "beside a neighbour": [],  # micro-batching's, and a process busy on one core
}
# The neighbour: one core kept busy, and nothing else asked of the machine.
NEIGHBOUR = [sys.executable, "-c", "while True: pass"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model directory (or Hub id) to serve")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (default: 32)")
    parser.add_argument(
        "--requests", type=int, default=1000, help="requests per run, all clients together (default: 1000)"
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=ROOT.parent / "shared" / "data" / "multi30k",
        help="corpus directory (default: ../shared/data/multi30k beside the repository)",
    )
    parser.add_argument("--split", default="test_2016_flickr", help="file stem of the sentences (default: %(default)s)")
    parser.add_argument(
        "--source-lang", default="en", help="language of the sentences: DATA_DIR/SPLIT.LANG (default: en)"
    )
    parser.add_argument("--target-lang", default="de", help="target of the requests (default: de)")
    parser.add_argument(
        "--max-seconds", type=float, default=600, help="time limit of each run, in seconds (default: 600)"
    )
    parser.add_argument("--warmup", type=int, default=8, help="untimed requests before each run (default: 8)")
    parser.add_argument("--engine", choices=ENGINES, default=ENGINES[0], help="serve's --engine")
    parser.add_argument("--threads", type=int, default=None, help="serve's --threads, every run (default: serve's)")
    parser.add_argument("--batch-wait-ms", type=float, default=None, help="serve's option for the micro-batching run")
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="serve's option for the micro-batching run")
    parser.add_argument("--batch-size", type=int, default=None, help="serve's option, micro-batching run")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=["micro-batching", "one at a time"],
        help="runs to make (default: micro-batching and one at a time)",
    )
    parser.add_argument(
        "--big-lines", type=int, default=2500, help="lines of a big request, the 'big requests' run (default: 2500)"
    )
    parser.add_argument(
        "--big-every", type=float, default=10, help="seconds between big requests, their starts (default: 10)"
    )
    parser.add_argument("--min-gain", type=float, default=None, help="fail unless micro-batching gains this factor")
    parser.add_argument(
        "--max-p99-ratio",
        type=float,
        default=None,
        help="fail if the other clients' p99 with big requests is over this many times micro-batching's",
    )
    parser.add_argument(
        "--min-neighbour-ratio",
        type=float,
        default=None,
        help="fail if the throughput beside a neighbour is under this share of micro-batching's (e.g. 0.4)",
    )
    parser.add_argument("--output", type=Path, default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.requests < 1 or args.max_seconds <= 0:
        parser.error("--clients and --requests must be at least 1, --max-seconds above 0")
    if args.big_lines < 1 or args.big_every <= 0:
        parser.error("--big-lines must be at least 1, --big-every above 0 seconds")
    return args


def read_sentences(args: argparse.Namespace) -> list[str]:
    path = args.data_dir / f"{args.split}.{args.source_lang}"
    sentences = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not sentences:
        raise SystemExit(f"{path} holds no sentences")
    return sentences


class Server:
    """`vaswani-transformer serve` in a subprocess on a free loopback port (the system chooses it)."""

    def __init__(self, args: argparse.Namespace, options: list[str], log_path: Path) -> None:
        command = [sys.executable, "-m", "vaswani_transformer.cli", "serve", args.model, "--host", "127.0.0.1"]
        command += ["--port", "0", "--engine", args.engine, "--no-access-log", *options]
        if args.threads is not None:
            command += ["--threads", str(args.threads)]
        self.command = command
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(600)  # loading a model, and exporting it for CTranslate2 the first time
        if not line or " on http://" not in line[0]:
            self.process.kill()
            raise SystemExit(f"the server did not start:\n{log_path.read_text()[-3000:]}")
        address = line[0].rsplit("http://", 1)[1].strip()
        self.host, self.port = address.rsplit(":", 1)[0], int(address.rsplit(":", 1)[1])

    def stop(self) -> int:
        """SIGTERM; the exit status (the server answers what it has, then exits 0)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
        finally:
            self.log.close()


def post(connection: http.client.HTTPConnection, body: bytes) -> tuple[int, bytes]:
    connection.request("POST", "/translate", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, response.read()


def big_client(server: Server, args: argparse.Namespace, stop: threading.Event, answers: list) -> None:
    """One big request every `args.big_every` seconds until `stop`; (HTTP status or error, seconds) of each."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    text = "\n".join(letters[i % len(letters)] for i in range(args.big_lines))
    body = json.dumps({"q": text, "source": args.source_lang, "target": args.target_lang}).encode()
    connection = http.client.HTTPConnection(server.host, server.port, timeout=args.max_seconds)
    start = time.perf_counter()
    for number in itertools.count():
        if stop.wait(max(0.0, start + number * args.big_every - time.perf_counter())):
            break
        sent = time.perf_counter()
        try:
            status, _ = post(connection, body)
            outcome: int | str = status
        except (OSError, http.client.HTTPException) as failure:
            outcome = f"{type(failure).__name__}: {failure}"
            connection.close()
        answers.append((outcome, round(time.perf_counter() - sent, 2)))
    connection.close()


def drive(server: Server, args: argparse.Namespace, sentences: list[str], big_requests: bool = False) -> dict:
    """`args.requests` requests from `args.clients` threads (and big requests); each one's latency and outcome."""
    bodies = [json.dumps({"q": s, "source": args.source_lang, "target": args.target_lang}).encode() for s in sentences]
    warm = http.client.HTTPConnection(server.host, server.port, timeout=300)
    for body in bodies[: args.warmup]:
        post(warm, body)
    warm.close()

    numbers = itertools.count()  # next() on a count is atomic under the GIL: each request is sent once
    results: list[tuple[int, float, str | None, str | None]] = []  # (request, seconds, error, translation)
    lock = threading.Lock()
    start = time.perf_counter()
    deadline = start + args.max_seconds

    def client() -> None:
        connection = None
        while (number := next(numbers)) < args.requests:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            if connection is None:
                connection = http.client.HTTPConnection(server.host, server.port, timeout=remaining)
            sent = time.perf_counter()
            error = translation = None
            try:
                status, raw = post(connection, bodies[number % len(bodies)])
                answer = json.loads(raw)
                translation = answer.get("translatedText") if isinstance(answer, dict) else None
                if status != 200 or not isinstance(translation, str):
                    error = f"HTTP {status}: {raw[:200]!r}"
            except (OSError, http.client.HTTPException, ValueError) as failure:  # timeouts are OSErrors
                error = f"{type(failure).__name__}: {failure}"
                connection.close()
                connection = None
            with lock:
                results.append((number, time.perf_counter() - sent, error, translation))
        if connection is not None:
            connection.close()

    steal_before = cpu_times()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
    stop_big, big_answers = threading.Event(), []
    big = threading.Thread(target=big_client, args=(server, args, stop_big, big_answers), daemon=True)
    if big_requests:  # started before the others, so that the first big request meets them all
        big.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(args.max_seconds + 300)
    wall = time.perf_counter() - start
    steal_after = cpu_times()
    stop_big.set()
    if big_requests:
        big.join(args.max_seconds)  # the request in flight: answered, or refused at serve's --request-timeout

    ok = [seconds for _, seconds, error, _ in results if error is None]
    errors = [error for _, _, error, _ in results if error is not None]
    cut = statistics.quantiles(ok, n=100, method="inclusive") if len(ok) > 1 else [ok[0] if ok else float("nan")] * 99
    steal = None
    if steal_before and steal_after and steal_after[1] > steal_before[1]:
        steal = (steal_after[0] - steal_before[0]) / (steal_after[1] - steal_before[1])
    run = {
        "requests": args.requests,
        "answered": len(ok),
        "errors": len(errors),
        "not_sent": args.requests - len(results),
        "first_errors": errors[:5],
        "seconds": round(wall, 3),
        "sentences_per_second": round(len(ok) / wall, 2),
        "latency_ms": {
            "p50": round(cut[49] * 1000, 1),
            "p95": round(cut[94] * 1000, 1),
            "p99": round(cut[98] * 1000, 1),
            "max": round(max(ok, default=float("nan")) * 1000, 1),
        },
        "cpu_steal": None if steal is None else round(steal, 4),
        "translations": {number: translation for number, _, error, translation in results if error is None},
    }
    if big_requests:
        run["big_requests"] = {"lines": args.big_lines, "every_s": args.big_every, "answers": big_answers}
    return run


def machine(engine: str) -> dict:
    """The machine as `benchmark_common.machine` reports it (CPU model and vector extensions, cores, library versions,
    and the GPU where `serve` puts the model by default: the torch engine's on a machine with CUDA), with
    PyTorch's thread count and the commit."""
    import torch

    device = "cuda" if engine == "torch" and torch.cuda.is_available() else "cpu"
    return {**benchmark_machine(device), "torch_threads": torch.get_num_threads(), "commit": commit_measured()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sentences = read_sentences(args)
    batching = []
    for flag in ("batch_wait_ms", "max_batch_tokens", "batch_size"):
        if getattr(args, flag) is not None:
            batching += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if "big requests" in args.modes:  # the same server for the run with big requests and the one without
        batching += ["--sentence-limit", str(args.big_lines)]
    report: dict = {
        "model": args.model,
        "engine": args.engine,
        "clients": args.clients,
        "requests": args.requests,
        "server_threads": ServingConfig(threads=args.threads).cpu_threads(),  # what serve computes on
        "sentences": f"{args.data_dir / args.split}.{args.source_lang}",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(args.engine),
        "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="load_test_") as workdir:
        for mode in args.modes:
            options = MODES[mode] or batching
            server = Server(args, options, Path(workdir) / f"server-{len(report['runs'])}.log")
            print(f"{mode}: {args.clients} clients, {args.requests} requests ({' '.join(options) or 'defaults'})")
            neighbour = subprocess.Popen(NEIGHBOUR) if mode == "beside a neighbour" else None
            try:
                run = drive(server, args, sentences, big_requests=mode == "big requests")
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
                run_status = server.stop()
            run["server_options"] = options
            run["server_exit_status"] = run_status
            if run_status != 0:
                run["server_log_tail"] = server.log_path.read_text()[-2000:]
            report["runs"][mode] = run

    runs = report["runs"]
    if "micro-batching" in runs and "big requests" in runs:
        without = runs["micro-batching"]["latency_ms"]["p99"]
        report["p99_ratio_big_requests"] = round(runs["big requests"]["latency_ms"]["p99"] / without, 2)
    if "micro-batching" in runs and "beside a neighbour" in runs:
        idle = runs["micro-batching"]["sentences_per_second"]
        report["neighbour_throughput_ratio"] = round(runs["beside a neighbour"]["sentences_per_second"] / idle, 2)
    if "micro-batching" in runs and "one at a time" in runs:
        batched, alone = runs["micro-batching"], runs["one at a time"]
        if alone["sentences_per_second"] > 0:
            report["gain"] = round(batched["sentences_per_second"] / alone["sentences_per_second"], 2)
        same = [n for n in batched["translations"] if n in alone["translations"]]
        # Information, not an error: a batch pads sentences, which may move a beam search tie.
        report["translations_differing_between_runs"] = sum(
            batched["translations"][n] != alone["translations"][n] for n in same
        )
    for run in runs.values():
        run.pop("translations")

    print(f"\n{'run':<16}{'sent/s':>9}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'errors':>8}{'not sent':>10}{'exit':>6}")
    for mode, run in runs.items():
        latency = run["latency_ms"]
        print(
            f"{mode:<16}{run['sentences_per_second']:>9.2f}{latency['p50']:>9.1f}{latency['p95']:>9.1f}"
            f"{latency['p99']:>9.1f}{run['errors']:>8}{run['not_sent']:>10}{run['server_exit_status']:>6}"
        )
        for error in run["first_errors"]:
            print(f"  {mode} error: {error}")
    if "gain" in report:
        print(f"gain of micro-batching: {report['gain']:.2f}x")
    if "big requests" in runs:
        answers = runs["big requests"]["big_requests"]["answers"]
        print(f"big requests ({args.big_lines} lines every {args.big_every:g} s): (status, seconds) {answers}")
    if "neighbour_throughput_ratio" in report:
        print(f"throughput beside a neighbour busy on one core: {report['neighbour_throughput_ratio']:.2f}x idle")
    if "p99_ratio_big_requests" in report:
        print(f"the other clients' p99 with big requests: {report['p99_ratio_big_requests']:.2f}x without")
    cpu = report["machine"]
    print(
        f"machine: {cpu['cpu']} ({cpu['cores']} cores; {' '.join(cpu['cpu_vector_extensions'])}), torch {cpu['torch']}"
    )
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {args.output}")

    failed = any(run["errors"] or run["not_sent"] or run["server_exit_status"] for run in runs.values())
    if args.min_gain is not None and report.get("gain", 0) < args.min_gain:
        failed = True
    if args.max_p99_ratio is not None and report.get("p99_ratio_big_requests", math.inf) > args.max_p99_ratio:
        failed = True
    if args.min_neighbour_ratio is not None and report.get("neighbour_throughput_ratio", 0) < args.min_neighbour_ratio:
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
