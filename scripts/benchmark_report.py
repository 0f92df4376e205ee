"""The Markdown report of the training, decoding and translation tasks: a table per preset, then the trained model's."""

import statistics

from benchmark_common import ENGINES, TRAINED


def ratio(a: float | None, b: float | None) -> str:
    """a / b as "1.23x", or "–" when either is missing."""
    return f"{a / b:.2f}x" if a and b else "–"


def median_ratio(speeds: dict[str, list[float]], other: str) -> str:
    """Median over rounds of ours / `other` within each round, as "1.23x", or "–" when `other` did not run."""
    if other not in speeds or "ours" not in speeds:
        return "–"
    return ratio(statistics.median(a / b for a, b in zip(speeds["ours"], speeds[other], strict=True)), 1.0)


def speed(task: str, result: dict) -> float:
    """What a task measures per second: sentences for the translation tasks, tokens otherwise."""
    return result["sentences_per_second" if task.startswith("translate") else "tokens_per_second"]


def markdown(report: dict) -> str:
    """The results as one Markdown table per preset (throughput, peak memory, ratios), then the trained model's."""
    lines = []
    ct2 = f"CT2 {report['dtype']}"
    int8 = "CT2 int8" if report["dtype"] == "float32" else f"CT2 int8_{report['dtype']}"
    for preset, results in report["results"].items():
        if preset == TRAINED or not results:  # not results: only the trained model's translation was asked for
            continue
        lines += [
            f"**{preset}** ({report['presets'][preset]['parameters'] / 1e6:.1f}M parameters, "
            f"vocabulary {report['vocab_size']})",
            "",
            f"| Measure | Ours | HF Marian | {ct2} | {int8} | Ours / Marian | Ours / {ct2} |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        names = {
            "train": "training, tokens/s",
            "beam": "beam 4, generated tokens/s",
            "beam-es-false": "beam 4, early_stopping=False, tokens/s",
            "greedy": "greedy, tokens/s",
        }
        for task, name in names.items():
            row = results.get(task, {})
            rate = {engine: row[engine]["tokens_per_second"] if engine in row else None for engine in ENGINES}
            cells = [f"{rate[e]:,.0f}" if rate[e] else "–" for e in ENGINES]
            lines.append(
                f"| {name} | {' | '.join(cells)} | {ratio(rate['ours'], rate['marian'])} | "
                f"{ratio(rate['ours'], rate['ct2'])} |"
            )
        train = results.get("train", {})
        if any(train.get(e, {}).get("mfu") for e in ENGINES):
            cells = [
                f"{train[e]['model_tflops_per_second']:,.1f} ({train[e]['mfu']:.1%})" if e in train else "–"
                for e in ENGINES
            ]
            lines.append(f"| training, model TFLOP/s (MFU) | {' | '.join(cells)} | | |")
        # The peak memory of the fastest round; on a GPU also PyTorch's peak allocation there.
        for task in names:
            row = results.get(task, {})
            cells = [f"{row[e]['peak_rss_mib']:,.0f}" if e in row else "–" for e in ENGINES]
            lines.append(f"| peak memory, {task}, MiB | {' | '.join(cells)} | | |")
            if report["device"] == "cuda":
                gpu = {e: row.get(e, {}).get("peak_gpu_mib") for e in ENGINES}  # CTranslate2 does not report it
                cells = [f"{gpu[e]:,.0f}" if gpu[e] else "–" for e in ENGINES]
                lines.append(f"| peak GPU memory (PyTorch), {task}, MiB | {' | '.join(cells)} | | |")
        lines.append("")
    if TRAINED in report["results"]:
        lines += [
            f"**trained model** ({report['translate_model']}): beam 4 on {report['translate_sentences']} Multi30k "
            "test sentences, natural lengths",
            "",
            f"| Measure | Ours | HF Marian | {ct2} | {int8} | Ours / Marian | Ours / {ct2} |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        names = {"translate": "", "translate-workers": f", {report['threads']} workers of 1 thread"}
        for task, workers in names.items():
            row = report["results"][TRAINED].get(task)
            if not row:
                continue
            rate = {engine: speed(task, row[engine]) if engine in row else None for engine in ENGINES}
            rates = " | ".join(f"{rate[e]:,.1f}" if rate[e] else "–" for e in ENGINES)
            tokens = " | ".join(str(row[e]["tokens"]) if e in row else "–" for e in ENGINES)
            bleu = " | ".join(f"{row[e]['bleu']:.2f}" if e in row else "–" for e in ENGINES)
            lines += [
                f"| translation{workers}, sentences/s | {rates} | {ratio(rate['ours'], rate['marian'])} | "
                f"{ratio(rate['ours'], rate['ct2'])} |",
                f"| generated tokens{workers} | {tokens} | | |",
                f"| sacreBLEU of these translations{workers} | {bleu} | | |",
            ]
        lines.append("")
    if report["rounds"] > 1:
        lines += [
            f"Median over the {report['rounds']} rounds of each round's ratio (engines of one round run back to back):",
            "",
            f"| Measure | Ours / Marian | Ours / {ct2} |",
            "|---|---:|---:|",
        ]
        for group, tasks in report["round_speeds"].items():
            for task, speeds in tasks.items():
                cells = [median_ratio(speeds, other) for other in ("marian", "ct2")]
                lines.append(f"| {group}, {task} | {' | '.join(cells)} |")
        lines.append("")
    if report.get("train_turns"):
        lines += ["Training with both engines in one process, taking turns step by step (`--train-turns`):", ""]
        for preset, result in report["train_turns"].items():
            rate = result["tokens_per_second"]
            lines.append(
                f"- {preset}: ours {rate['ours']:,.0f}, Marian {rate['marian']:,.0f} tokens/s, ours / Marian "
                f"{result['ratio']:.2f}x (median of the per-step ratios {result['step_ratio_median']:.2f}x"
                + (f"; {result['cpu_steal']:.1%} of the CPU time stolen)" if "cpu_steal" in result else ")")
            )
        lines.append("")
    steals = [
        (steal, f"{engine} {task} {group}, round {index + 1}")
        for group, tasks in report.get("round_steal", {}).items()
        for task, engines in tasks.items()
        for engine, rounds in engines.items()
        for index, steal in enumerate(rounds)
        if steal is not None
    ]
    if steals:
        worst = max(steals)
        lines += [
            "CPU time stolen by the hypervisor while a child ran: median "
            f"{statistics.median(s for s, _ in steals):.1%}, highest {worst[0]:.1%} ({worst[1]}). "
            "Round speeds and steal per child: the JSON report.",
            "",
        ]
    m = report["machine"]
    ct2_version = f"ctranslate2 {m['ctranslate2']}" if m["ctranslate2"] else "no ctranslate2"
    where = (
        f"{m['gpu']} (driver {m['gpu_driver']}, CUDA {m['cuda']}), {report['dtype']}"
        + (" (training: mixed precision)" if report["dtype"] != "float32" else "")
        if report["device"] == "cuda"
        else f"{m['cpu']} ({' '.join(m['cpu_vector_extensions'])}), {report['threads']} threads of {m['cores']} cores"
        + (f"; training in mixed precision ({report['dtype']} autocast)" if report["dtype"] != "float32" else "")
    )
    where += f"; commit {m['commit']}"
    if report.get("compile"):
        where += "; training compiled (torch.compile, dynamic shapes)"
    lines.append(
        f"{where}; torch {m['torch']}, transformers {m['transformers']}, "
        f"{ct2_version}. Load average before / after: "
        f"{report['load_before']} / {report['load_after']}. Decoding: {report['decode_sentences']} Multi30k test "
        f"sentences in batches of 32, {report['decode_length']} tokens each; training: "
        f"{report['train_tokens_per_step']:,.0f} real tokens per step."
        + (f" {report['note']}" if report.get("note") else "")
    )
    return "\n".join(lines) + "\n"
