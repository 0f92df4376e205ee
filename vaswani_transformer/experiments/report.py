"""The report of an ablation (`ablation`): Table 3 as the paper lays it out, a JSON record, and plots.

Read from every run's `result.json` and `training_log.jsonl` in the ablation's directory, so that it holds every
run there is, of this call and of earlier ones:

- `table3.md`: one line per row, the paper's columns (N, d_model, d_ff, h, d_k, d_v, P_drop, epsilon_ls, positions,
  steps, PPL and BLEU on the development set, parameters), a cell left empty where the row keeps the base's value
  as in the paper; scores are the mean over seeds, with their spread (min to max) where a row has several;
- `table3.json`: the same per row, with every run's result;
- `table3_scores.png`: BLEU and perplexity of every row, each seed a point, the base row's spread a band;
- `table3_curves_<group>.png`: validation BLEU and cross entropy (label-smoothed, as trained) against steps, for
  the base row and one group's rows, each seed a line.
"""

import json
import statistics
from pathlib import Path

from ..utils.files import read_log, write_text_atomically
from ..utils.plotting import pyplot
from .table3 import BASE, GROUPS, UNSCALED_FIELD

# The table's model columns: heading, and how a result gives the value.
COLUMNS = (
    ("N", lambda r: r["model"]["encoder_layers"]),
    ("d_model", lambda r: r["model"]["d_model"]),
    ("d_ff", lambda r: r["model"]["d_ff"]),
    ("h", lambda r: r["model"]["num_attention_heads"]),
    ("d_k", lambda r: r["key_dim"]),
    ("d_v", lambda r: r["value_dim"]),
    ("P_drop", lambda r: r["model"]["dropout"]),
    ("ε_ls", lambda r: r["model"]["label_smoothing"]),
    ("PE", lambda r: r["model"]["position_embedding_type"]),
    ("1/√d_k", lambda r: "off" if r["overrides"].get(UNSCALED_FIELD) is False else "on"),
)


def read_results(output_dir: Path) -> list[dict]:
    """Every run's `result.json` in an ablation's directory (`OUTPUT_DIR/<row>-seed<k>/`), in no set order."""
    return [json.loads(path.read_text()) for path in sorted(Path(output_dir).glob("*-seed*/result.json"))]


def _spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "runs": len(values)}


def summarize(results: list[dict]) -> list[dict]:
    """One record per row, in the table's order: its runs, and the mean and spread of each score over its seeds.

    Args:
        results: runs' results (`read_results`).

    Returns:
        [{"row", "group", "runs": [result, ...], "validation_bleu", "validation_perplexity", "steps",
        "train_minutes": {"mean", "min", "max", "runs"} or None, "parameters", "diverged": runs that diverged}].
    """
    by_row: dict[str, list[dict]] = {}
    for result in sorted(results, key=lambda r: r["seed"]):
        by_row.setdefault(result["row"], []).append(result)

    def order(name: str) -> tuple:
        group = by_row[name][0]["group"]
        number = name[len(group) :] if name != BASE else ""
        return (GROUPS.index(group) if group in GROUPS else len(GROUPS), int(number) if number.isdigit() else 0)

    rows = []
    for name in sorted(by_row, key=order):
        runs = by_row[name]
        scored = [run for run in runs if not run["diverged"]]
        rows.append({
            "row": name,
            "group": runs[0]["group"],
            "runs": runs,
            "diverged": len(runs) - len(scored),
            "parameters": scored[0]["parameters"] if scored else None,
            **{key: _spread([run[key] for run in scored])
               for key in ("validation_bleu", "validation_perplexity", "steps", "train_minutes")},
        })  # fmt: skip
    return rows


def _score(spread: dict | None, digits: int = 2) -> str:
    if spread is None:
        return "diverged"
    text = f"{spread['mean']:.{digits}f}"
    if spread["runs"] > 1:
        text += f" ({spread['min']:.{digits}f}–{spread['max']:.{digits}f}, {spread['runs']} seeds)"
    return text


def markdown_table(rows: list[dict]) -> str:
    """Table 3's layout in Markdown: a line per row, empty cells where the base's value is kept (`summarize`)."""
    base = next((row["runs"][0] for row in rows if row["row"] == BASE and not row["diverged"]), None)
    headings = ["", "row", *(name for name, _ in COLUMNS), "train steps", "train min",
                "PPL (dev)", "BLEU (dev)", "params ×10⁶"]  # fmt: skip
    lines = ["| " + " | ".join(headings) + " |", "|" + "---|" * len(headings)]
    last_group = None
    for row in rows:
        scored = [run for run in row["runs"] if not run["diverged"]]
        first = scored[0] if scored else None
        cells = []
        for _, value in COLUMNS:
            if first is None or (base is not None and row["row"] != BASE and value(first) == value(base)):
                cells.append("")
            else:
                cells.append(str(value(first)))
        group = row["group"] if row["group"] != last_group and row["row"] != BASE else ""
        last_group = row["group"]
        steps = "" if row["steps"] is None else f"{row['steps']['mean']:.0f}"
        minutes = "" if row["train_minutes"] is None else f"{row['train_minutes']['mean']:.1f}"
        params = "" if row["parameters"] is None else f"{row['parameters'] / 1e6:.2f}"
        if row["diverged"]:
            params += f" ({row['diverged']} of {len(row['runs'])} runs diverged)"
        label = f"({group})" if group else ""
        cells = [label, row["row"], *cells, steps, minutes, _score(row["validation_perplexity"]),
                 _score(row["validation_bleu"]), params]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_scores(rows: list[dict], path: Path) -> Path:
    """BLEU and perplexity of every row (x), each seed a point and the mean a bar, the base's spread a band.

    Args:
        rows: `table3.json`'s rows (`write_report`), each with its runs' results.
        path: the PNG to write.

    Returns:
        `path`.

    Raises:
        ImportError: matplotlib is missing (the `plot` extra).
    """
    plt = pyplot()
    figure, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.45 * len(rows) + 2), 6), sharex=True)
    for axis, key, label in zip(axes, ("validation_bleu", "validation_perplexity"),
                                ("BLEU (dev)", "perplexity (dev)"), strict=True):  # fmt: skip
        for x, row in enumerate(rows):
            values = [run[key] for run in row["runs"] if not run["diverged"]]
            axis.scatter([x] * len(values), values, color="tab:blue", s=18, zorder=3)
            if values:
                axis.hlines(statistics.fmean(values), x - 0.3, x + 0.3, color="tab:blue")
            if row["row"] == BASE and values:
                axis.axhspan(min(values), max(values), color="tab:orange", alpha=0.2, label="base row, seed spread")
        axis.set_ylabel(label)
        if any(row["row"] == BASE for row in rows):
            axis.legend(loc="best", fontsize=8)
    axes[-1].set_xticks(range(len(rows)), [row["row"] for row in rows], rotation=45)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def plot_curves(output_dir: Path, rows: list[dict], group: str, path: Path) -> Path:
    """Validation BLEU and cross entropy against steps of the base row's and `group`'s runs, from their logs.

    Args:
        output_dir: the ablation's directory, which holds each run's `training_log.jsonl`.
        rows: `table3.json`'s rows (`write_report`).
        group: the row group drawn beside the base row ("A", ..., "U").
        path: the PNG to write.

    Returns:
        `path`.

    Raises:
        ImportError: matplotlib is missing (the `plot` extra).
    """
    plt = pyplot()
    figure, (bleu_axis, loss_axis) = plt.subplots(1, 2, figsize=(11, 4))
    chosen = [row for row in rows if row["row"] == BASE or row["group"] == group]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, row in enumerate(chosen):
        for number, run in enumerate(row["runs"]):
            records = read_log(Path(output_dir) / f"{run['row']}-seed{run['seed']}" / "training_log.jsonl")
            points = [record for record in records if "validation_bleu" in record]
            label = row["row"] if number == 0 else None
            style = dict(color=colors[index % len(colors)], label=label, marker=".", alpha=0.8)
            bleu_axis.plot([p["step"] for p in points], [p["validation_bleu"] for p in points], **style)
            loss_axis.plot([p["step"] for p in points], [p["validation_loss"] for p in points], **style)
    bleu_axis.set_ylabel("validation BLEU")
    loss_axis.set_ylabel("validation loss (label-smoothed, nats per token)")
    for axis in (bleu_axis, loss_axis):
        axis.set_xlabel("optimizer step")
    bleu_axis.legend(loc="best", fontsize=8)
    figure.suptitle(f"Table 3, rows {group} against the base row (each seed a line)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def write_report(output_dir: str | Path, curves: str = "A") -> Path:
    """Write `table3.md`, `table3.json`, `table3_scores.png` and `table3_curves_<curves>.png` (module docstring).

    Args:
        output_dir: the ablation's directory.
        curves: the row group whose learning curves are drawn beside the base row's.

    Returns:
        The path of `table3.md`.

    Raises:
        ImportError: matplotlib is missing (the `plot` extra).
    """
    output_dir = Path(output_dir)
    rows = summarize(read_results(output_dir))
    table = output_dir / "table3.md"
    write_text_atomically(table, markdown_table(rows))
    write_text_atomically(output_dir / "table3.json", json.dumps({"rows": rows}, indent=2) + "\n")
    if rows:
        plot_scores(rows, output_dir / "table3_scores.png")
        plot_curves(output_dir, rows, curves, output_dir / f"table3_curves_{curves}.png")
    return table
