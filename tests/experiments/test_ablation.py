"""`vaswani-transformer ablate` end to end on a slice of Multi30k (experiments/ablation.py, report.py)."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import MINI_MODEL

from vaswani_transformer.cli import main


def ablate(corpus, output_dir, *more: str) -> list[str]:
    arguments = [
        "ablate", "--data-dir", str(corpus), "--source-lang", "en", "--target-lang", "de",
        "--output-dir", str(output_dir), "--preset", "tiny", "--vocab-size", "300", "--max-tokens", "256",
        "--warmup-steps", "4", "--max-steps", "20", "--log-steps", "5", "--eval-steps", "10", "--save-steps", "10",
        "--bleu-sentences", "8", "--rows", "A1",
    ]  # fmt: skip
    for key, value in MINI_MODEL.items():
        arguments += ["--model-option", f"{key}={value}"]
    return [*arguments, *more]


def test_ablate_trains_scores_and_reports_rows_then_skips_them_and_adds_seeds(mini_corpus, tmp_path, capsys):
    output_dir = tmp_path / "table3"
    assert main(ablate(mini_corpus, output_dir, "--base-seeds", "1")) == 0
    first = capsys.readouterr().out
    assert "base seed 1: BLEU" in first and "A1 seed 1: BLEU" in first
    runs = sorted(path.name for path in output_dir.glob("*-seed*"))
    assert runs == ["A1-seed1", "base-seed1"]
    written = {run: (output_dir / run / "model.safetensors").stat().st_mtime_ns for run in runs}
    a1 = json.loads((output_dir / "A1-seed1" / "result.json").read_text())
    assert a1["model"]["num_attention_heads"] == 1 and a1["key_dim"] == 32 and a1["steps"] == 20

    # Again with a second seed of the base row, on two worker processes: only that run trains.
    assert main(ablate(mini_corpus, output_dir, "--base-seeds", "2", "--processes", "2")) == 0
    second = capsys.readouterr().out
    assert "A1 seed 1: done before, skipped" in second and "base seed 1: done before, skipped" in second
    assert "base seed 2: BLEU" in second
    assert {run: (output_dir / run / "model.safetensors").stat().st_mtime_ns for run in runs} == written

    record = json.loads((output_dir / "table3.json").read_text())
    rows = {row["row"]: row for row in record["rows"]}
    assert list(rows) == ["base", "A1"] and len(rows["base"]["runs"]) == 2 and len(rows["A1"]["runs"]) == 1
    for row in rows.values():
        for run in row["runs"]:
            assert math.isfinite(run["validation_bleu"]) and 1 < run["validation_perplexity"] < 300
            assert run["parameters"] > 0 and run["train_minutes"] > 0 and run["steps"] == 20
            assert run["model"]["label_smoothing"] == 0.1  # as trained, not as the perplexity is measured
    table = (output_dir / "table3.md").read_text().splitlines()
    assert "PPL (dev)" in table[0] and "BLEU (dev)" in table[0]
    base_line = next(line for line in table if "| base |" in line)
    assert "2 seeds" in base_line
    a1_line = next(line for line in table if "| A1 |" in line)
    assert a1_line.startswith("| (A) | A1 | ")
    for plot in ("table3_scores.png", "table3_curves_A.png"):
        assert (output_dir / plot).read_bytes()[:4] == b"\x89PNG"

    # Another recipe in the same directory would put rows of two budgets in one table: refused, nothing trained.
    assert main(ablate(mini_corpus, output_dir, "--max-steps", "30")) == 2
    assert "holds an ablation of another recipe (max_steps was 20, now 30)" in capsys.readouterr().err
    assert sorted(path.name for path in output_dir.glob("*-seed*")) == ["A1-seed1", "base-seed1", "base-seed2"]


def test_ablate_without_bleu_sentences_says_what_to_give(mini_corpus, tmp_path, capsys):
    arguments = ablate(mini_corpus, tmp_path / "out")
    arguments.remove("--bleu-sentences")
    arguments.remove("8")
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "give --bleu-sentences N" in error
    assert not (tmp_path / "out").exists()


def children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def running(pid: int) -> bool:
    try:  # a zombie has ended: where init does not reap the orphan, it stays in /proc as Z
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {seconds:.0f} s"
        time.sleep(0.2)


def training_ablation(corpus, output_dir: Path) -> tuple[subprocess.Popen, list[int]]:
    """`ablate` in a process of its own, two runs on two workers, once both train; and the workers' ids."""
    arguments = ablate(corpus, output_dir, "--base-seeds", "1", "--processes", "2", "--threads", "1")
    arguments[arguments.index("--max-steps") + 1] = "100000"  # still training when it is stopped
    ablation = subprocess.Popen([sys.executable, "-m", "vaswani_transformer.cli", *arguments],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_for(lambda: len(list(output_dir.glob("*-seed1/training_log.jsonl"))) == 2, 300, "both runs training")
    workers = [pid for pid in children(ablation.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
    return ablation, workers


def stop_all(ablation: subprocess.Popen, workers: list[int]) -> None:
    ablation.kill()
    for pid in filter(running, workers):  # what a failed test leaves would train on beside the next tests
        os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads a process's children from Linux's /proc")
def test_the_runs_stop_when_the_ablation_is_killed_and_none_trains_on_as_an_orphan(mini_corpus, tmp_path):
    ablation, workers = training_ablation(mini_corpus, tmp_path / "table3")
    try:
        assert len(workers) == 2
        ablation.kill()  # SIGKILL: the parent does nothing on its way out, so only the workers' own watch stops them
        ablation.wait()
        wait_for(lambda: not any(running(pid) for pid in workers), 60, "the workers' end")
    finally:
        stop_all(ablation, workers)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads a process's children from Linux's /proc")
def test_a_worker_killed_mid_run_stops_the_ablation_in_one_line_instead_of_a_wait_without_end(mini_corpus, tmp_path):
    ablation, workers = training_ablation(mini_corpus, tmp_path / "table3")
    try:
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)  # as the kernel's out-of-memory killer ends a process
        _, err = ablation.communicate(timeout=120)
        assert ablation.returncode == 2, err[-3000:]
        # One line, though a progress bar may stand before it on the terminal's line.
        assert err.count("vaswani-transformer ablate: error: A worker process ended without its run's result") == 1
        assert "Traceback" not in err, err[-3000:]
        wait_for(lambda: not any(running(pid) for pid in workers), 60, "the other worker's end")
    finally:
        stop_all(ablation, workers)
