"""`vaswani-transformer ablate` end to end on a slice of Multi30k (experiments/ablation.py, report.py)."""

import json
import math

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
