"""Speed and memory of this Transformer beside HF Marian and CTranslate2, on identical weights, in one run.

For each preset the script builds one randomly initialised `VaswaniForConditionalGeneration`,
the `MarianMTModel` that computes the same function (`convert.to_marian`: zero attention biases,
zero `final_logits_bias`, ReLU, sqrt(d_model) embedding scale, the sinusoid permutation) and the
CTranslate2 model of `export.export_ctranslate2`. Every measurement runs in a fresh Python process
(this script with `--child`), which reports its own peak resident memory (VmHWM):

- training: non-padding source + target tokens per second of forward + backward + (fused) Adam step, on
  the same Multi30k batches (the project's `TokenBatchSampler`, `--max-tokens` per side) for both
  PyTorch engines. Both compute the same loss: ours its output projection fused with the
  label-smoothed cross entropy (`ops_vaswani.linear_label_smoothed_cross_entropy`), Marian
  `F.cross_entropy(..., label_smoothing=0.1)` on its logits (Marian's own loss is unsmoothed).
  Both apply dropout in the same places at the same rate; ours draws its CPU masks with fewer generator
  calls (`ops_vaswani.residual_dropout`), Marian with `F.dropout`.
- decoding: generated tokens per second of beam search (beam 4; `beam-es-false` with transformers'
  default early_stopping=False) and greedy search, batches of 32
  Multi30k test sentences. Untrained weights would stop at random lengths, so every engine is
  forced to produce exactly `--decode-length` tokens per sentence (HF: min_new_tokens =
  max_new_tokens; CTranslate2: min_decoding_length = max_decoding_length); each child checks the
  lengths it produced, and the parent refuses results whose token counts differ.
- translation (with `--model`, a trained model directory): sentences per second of beam search
  (beam 4, length normalisation alpha 1, up to 128 tokens) on Multi30k test sentences in batches
  of 32, each sentence ending where the model ends it, as in real use: here a search that stops
  working on finished sentences gains. Every engine runs the same trained weights (CTranslate2 int8
  quantizes them when loading); the sacreBLEU of each engine's translations of those sentences
  shows what quantization costs. `translate-workers` (CPU only) runs the same translation in
  `--threads` worker processes of one thread each (`translation.map_in_workers`, as `translate
  --num-workers` does; CTranslate2: `inter_threads` workers of one thread, the batches submitted together).

    python scripts/benchmark.py --presets small base --threads 2 [--model outputs/multi30k-en-de]

writes `benchmarks/results/DATE_DEVICE_COMMIT.{json,md}` (the CPU model and its widest vector
extension, with the dtype where it is not float32, or the GPU and dtype; refusing to overwrite an
earlier run), with the machine, its vector extensions, GPU driver and CUDA, the commit and library
versions in the report. With `--device cuda --dtype bfloat16` (or float16) it measures on the GPU
instead: training in mixed
precision (autocast, and a gradient scaler for float16, as `train --mixed-precision` runs it, and
without cuDNN's attention, as `train` does: `training.avoid_cudnn_attention`),
decoding with the weights in that dtype, CTranslate2 with that compute type (int8: int8_<dtype>).
On the CPU, `--dtype bfloat16 --tasks train` measures training under bfloat16 autocast for both
engines, as `train --mixed-precision bf16` runs it (decoding on the CPU is float32 only).
Multi30k is read from `--data-dir` (default: ../shared/data/multi30k beside the repository); nothing
from it is written to the repository.

With `--rounds N` every child runs N times, the engines of a task back to back and in the reverse order
every other round; each engine's fastest round fills the table, a second table gives the median of the
rounds' ratios, and the JSON keeps every round's speed (`round_speeds`) and the share of the machine's
CPU time other virtual machines took while the child ran (`round_steal`, from /proc/stat).

With `--train-turns` one more child per preset trains ours and Marian in the same process, taking turns
step by step on the same batches (which engine goes first alternates), and reports each one's tokens per
second and their ratio (`train_turns`): a second view of training, in which a machine whose speed drifts
between processes (a virtual machine whose neighbours come and go) slows both engines alike, though the
two then share one process's memory allocator and caches.
"""

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINES = {"ours": "Ours", "marian": "HF Marian", "ct2": "CT2", "ct2-int8": "CT2 int8"}  # "ct2": at --dtype
TASKS = {
    "train": ("ours", "marian"),
    "beam": tuple(ENGINES),
    # transformers' default early_stopping=False, which CTranslate2 does not have: the forced lengths make it search
    # as long as "beam", but it decides at every step whether a sentence is done by another rule.
    "beam-es-false": ("ours", "marian"),
    "greedy": tuple(ENGINES),
    "translate": tuple(ENGINES),
    "translate-workers": ("ours", "marian", "ct2"),
}
TRAINED = "trained"  # the --model directory's engines, beside the presets'


# The parent: models, data, one child process per (engine, task), the report ----------------------


def prepare(args: argparse.Namespace, workdir: Path) -> dict:
    """Tokenizer, shared data files and, per preset, the three models with identical weights."""
    import torch
    from transformers import AutoTokenizer

    from vaswani_transformer import VaswaniConfig, VaswaniForConditionalGeneration
    from vaswani_transformer.convert import to_marian
    from vaswani_transformer.data import TokenBatchSampler, load_parallel_corpus, text_batches, tokenize_corpus
    from vaswani_transformer.export import export_ctranslate2
    from vaswani_transformer.tokenization import train_tokenizer
    from vaswani_transformer.training_config import TrainingConfig

    corpus = load_parallel_corpus(args.data_dir, "en", "de")
    tokenizer = train_tokenizer(text_batches(corpus, ["en", "de"]), vocab_size=args.vocab_size)

    # Training batches: the first sentence pairs of the training set, batched as `train` batches them.
    max_length = TrainingConfig.max_length  # as `train` keeps them
    train = tokenize_corpus(corpus, tokenizer, "en", "de", max_length)["train"].select(range(args.train_sentences))
    sampler = TokenBatchSampler(train["source_length"], train["target_length"], args.max_tokens, seed=0)
    batches = []
    for indices in list(sampler)[: args.train_warmup + args.train_steps]:
        rows = train.select(indices)
        source = tokenizer.pad({"input_ids": rows["input_ids"]}, return_tensors="pt")
        labels = tokenizer.pad({"input_ids": rows["labels"]}, return_tensors="pt")
        labels = labels["input_ids"].masked_fill(labels["attention_mask"] == 0, -100)
        batches.append({"input_ids": source["input_ids"], "attention_mask": source["attention_mask"], "labels": labels})
    torch.save(batches, workdir / "train_batches.pt")

    sources = corpus["test_2016_flickr"]["en"][: args.decode_batches * 32]
    decode = [tokenizer(sources[i : i + 32], padding=True, return_tensors="pt") for i in range(0, len(sources), 32)]
    torch.save([dict(batch) for batch in decode], workdir / "decode_batches.pt")
    tokens = [[tokenizer.convert_ids_to_tokens(tokenizer(s)["input_ids"]) for s in sources[i : i + 32]]
              for i in range(0, len(sources), 32)]  # fmt: skip
    (workdir / "decode_tokens.json").write_text(json.dumps(tokens))

    info = {"vocab_size": len(tokenizer), "presets": {}}
    with_ct2 = any(engine.startswith("ct2") for engine in args.engines)  # the export needs ctranslate2 installed
    for preset in args.presets:
        torch.manual_seed(0)
        model = VaswaniForConditionalGeneration(VaswaniConfig.from_preset(preset, vocab_size=len(tokenizer))).eval()
        directory = workdir / preset
        model.save_pretrained(directory / "ours")
        tokenizer.save_pretrained(directory / "ours")
        to_marian(model).save_pretrained(directory / "marian")
        if with_ct2:
            export_ctranslate2(directory / "ours", directory / "ct2", force=True)
        info["presets"][preset] = {"parameters": sum(p.numel() for p in model.parameters())}
    if args.model:
        directory = workdir / TRAINED
        trained_tokenizer = AutoTokenizer.from_pretrained(args.model)
        trained = VaswaniForConditionalGeneration.from_pretrained(args.model).eval()
        trained.save_pretrained(directory / "ours")
        trained_tokenizer.save_pretrained(directory / "ours")
        to_marian(trained).save_pretrained(directory / "marian")
        if with_ct2:
            export_ctranslate2(directory / "ours", directory / "ct2", force=True)
        test = corpus["test_2016_flickr"]["en"][: args.translate_batches * 32]
        test_batches = [test[i : i + 32] for i in range(0, len(test), 32)]
        encoded = [dict(trained_tokenizer(batch, padding=True, return_tensors="pt")) for batch in test_batches]
        torch.save(encoded, directory / "translate_batches.pt")
        test_tokens = [[trained_tokenizer.convert_ids_to_tokens(trained_tokenizer(s)["input_ids"]) for s in batch]
                       for batch in test_batches]  # fmt: skip
        (directory / "translate_tokens.json").write_text(json.dumps(test_tokens))
        references = corpus["test_2016_flickr"]["de"][: len(test)]
        (directory / "translate_references.json").write_text(json.dumps(references))
        info["translate_sentences"] = len(test)
    info["train_tokens_per_step"] = sum(real_tokens(b) for b in batches[args.train_warmup :]) / max(
        1, len(batches) - args.train_warmup
    )
    return info


def run_child(args: argparse.Namespace, workdir: Path, preset: str, engine: str, task: str) -> dict:
    """Run one measurement in a fresh Python process and return its JSON result; RuntimeError if it fails."""
    command = [sys.executable, __file__, "--child", engine, task, "--workdir", str(workdir / preset)]
    command += ["--threads", str(args.threads), "--decode-length", str(args.decode_length)]
    command += ["--train-warmup", str(args.train_warmup), "--repeats", str(args.repeats)]
    command += ["--device", args.device, "--dtype", args.dtype] + (["--compile"] if args.compile else [])
    environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    before = cpu_times()
    done = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=ROOT)
    after = cpu_times()
    if done.returncode != 0:
        raise RuntimeError(f"{engine} {task} ({preset}) failed:\n{done.stderr[-3000:]}")
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError) as error:
        raise RuntimeError(f"{engine} {task} ({preset}) printed no result:\n{done.stdout[-3000:]}") from error
    if before and after and after[1] > before[1]:
        result["cpu_steal"] = (after[0] - before[0]) / (after[1] - before[1])
    return result


def cpu_times() -> tuple[int, int] | None:
    """(stolen, total) CPU time of the whole machine so far, in clock ticks, from /proc/stat; None elsewhere.

    On a virtual machine the hypervisor may run other guests on our cores ("steal"). PyTorch with 2
    threads slows down several times under it, so each child's share of stolen time goes into the report.
    """
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def commit_measured() -> str | None:
    """The checkout's short commit, with "-dirty" when tracked files differ from it; None outside git."""
    git = {"cwd": ROOT, "capture_output": True, "text": True, "env": {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **git).stdout.strip()
    edited = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **git).stdout.strip()
    return f"{commit}-dirty" if commit and edited else commit or None


def machine(device: str) -> dict:
    """CPU model, core count, the GPU on `device` "cuda" (else None) and library versions, for the report."""
    from importlib.metadata import PackageNotFoundError, version

    import torch
    import transformers

    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    try:
        ctranslate2_version = version("ctranslate2")
    except PackageNotFoundError:  # a run of the PyTorch engines alone
        ctranslate2_version = None
    return {
        "cpu": cpu or platform.processor(),
        # The vector extensions decide which kernels are fast: a speed-up on one set is not one on another.
        "cpu_vector_extensions": sorted(f for f in flags if f.startswith(("avx", "amx", "fma"))),
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "cuda": torch.version.cuda if device == "cuda" else None,
        "gpu_driver": _nvidia_driver() if device == "cuda" else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ctranslate2": ctranslate2_version,
        "sacrebleu": version("sacrebleu"),  # the translate tasks' BLEU
    }


def _nvidia_driver() -> str | None:
    result = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
    )
    return result.stdout.strip() or None


def report_stem(report: dict) -> str:
    """`DATE_DEVICE_COMMIT`: a run's file set in benchmarks/results/ (e.g. 2026-11-24_cpu-xeon-amx_1a2b3c4, with
    `-bfloat16` after the vector extension for a CPU run of training in mixed precision)."""
    machine = report["machine"]
    if report["device"] == "cpu":
        extensions = machine["cpu_vector_extensions"]
        widest = next((x for x in ("amx", "avx512", "avx2") if any(e.startswith(x) for e in extensions)), "novec")
        device = f"cpu-{machine['cpu']}-{widest}" + (f"-{report['dtype']}" if report["dtype"] != "float32" else "")
    else:
        device = f"{machine['gpu']}-{report['dtype']}"
    device = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    compiled = "_compile" if report.get("compile") else ""
    return f"{time.strftime('%Y-%m-%d')}_{device}_{machine['commit'] or 'nocommit'}{compiled}"


def free_stem(directory: Path, name: str) -> Path:
    """`directory / name`, or `name-2`, `name-3`, ... where a run of the same day, device and commit has its files
    there already: a run's results neither overwrite another's nor get lost after its measurements."""
    stem, number = directory / name, 1
    while any(stem.with_suffix(suffix).exists() for suffix in (".json", ".md", ".log")):
        number += 1
        stem = directory / f"{name}-{number}"
    return stem


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
    )
    return "\n".join(lines) + "\n"


def parent(args: argparse.Namespace) -> None:
    """Prepare models and data in a temporary folder, run every child, write the JSON and Markdown reports."""
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    commit = commit_measured()  # as the run starts: a commit made while it runs is not what ran
    with tempfile.TemporaryDirectory(prefix="vaswani-benchmark-") as tmp:
        workdir = Path(tmp)
        report = {"command": " ".join(["python", "scripts/benchmark.py", *sys.argv[1:]]), **prepare(args, workdir)}
        report["compile"] = args.compile
        groups = [*args.presets, *([TRAINED] if args.model else [])]
        report["results"] = {group: {} for group in groups}
        report["round_speeds"] = {group: {} for group in groups}
        report["round_steal"] = {group: {} for group in groups}  # each child's share of CPU time stolen
        # Rounds interleave the engines, so that a burst of load from other processes hits them all
        # alike, in the reverse order every other round, so that a machine that drifts slower or faster
        # over a run favours none of them; the fastest round of each engine counts, every round is kept.
        for round_index in range(args.rounds):
            for group in groups:
                results = report["results"][group]
                for task, engines in TASKS.items():
                    if task.startswith("translate") != (group == TRAINED) or task not in args.tasks:
                        continue
                    if task == "translate-workers" and args.device == "cuda":  # worker processes are for CPUs
                        continue
                    for engine in [e for e in engines if e in args.engines][:: -1 if round_index % 2 else 1]:
                        result = run_child(args, workdir, group, engine, task)
                        steal = result.get("cpu_steal")
                        stolen = f" {steal:6.1%} steal" if steal is not None else ""
                        print(f"{group:7} {task:9} {engine:12} {speed(task, result):10,.1f} per s "
                              f"{result['peak_rss_mib']:8,.0f} MiB{stolen}", file=sys.stderr, flush=True)  # fmt: skip
                        report["round_speeds"][group].setdefault(task, {}).setdefault(engine, [])
                        report["round_speeds"][group][task][engine].append(speed(task, result))
                        report["round_steal"][group].setdefault(task, {}).setdefault(engine, []).append(steal)
                        best = results.setdefault(task, {}).get(engine)
                        if best is None or speed(task, result) > speed(task, best):
                            results[task][engine] = result
                    generated = {r["tokens"] for r in results.get(task, {}).values()}
                    # Forced lengths make the work equal; a trained model's engines may differ by a few tokens.
                    if task in ("beam", "beam-es-false", "greedy") and len(generated) > 1:
                        raise RuntimeError(f"{task} decoding gave different numbers of tokens per engine: {generated}")
        if args.train_turns and "train" in args.tasks and {"ours", "marian"} <= set(args.engines):
            report["train_turns"] = {}
            for preset in args.presets:
                result = run_child(args, workdir, preset, "both", "train-turns")
                report["train_turns"][preset] = result
                print(f"{preset:7} {'train':9} {'taking turns':12} ours / Marian {result['ratio']:.2f}x, per-step "
                      f"median {result['step_ratio_median']:.2f}x", file=sys.stderr, flush=True)  # fmt: skip
    report.update(
        machine={**machine(args.device), "commit": commit},
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        load_before=load_before,
        load_after=" ".join(f"{x:.2f}" for x in os.getloadavg()),
        decode_length=args.decode_length,
        decode_sentences=args.decode_batches * 32,
        rounds=args.rounds,
        translate_model=str(args.model) if args.model else None,
    )
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = free_stem(args.output_dir, report_stem(report))
    table = markdown(report)
    for suffix, text in ((".json", json.dumps(report, indent=2) + "\n"), (".md", table)):
        with open(stem.with_suffix(suffix), "x") as file:  # a run's results are never overwritten
            file.write(text)
    print(table)
    print(f"Results: {stem}.json and .md (keep the stderr lines beside them as {stem.name}.log)", file=sys.stderr)


# The children: one engine, one task, one process --------------------------------------------------


def peak_rss_mib() -> float:
    """Peak resident memory of this process, in MiB."""
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, so a child would report its parent's peak.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def on_device(batch: dict, args: argparse.Namespace) -> dict:
    """The batch's tensors on `--device`."""
    return {name: tensor.to(args.device) for name, tensor in batch.items()}


def synchronize(args: argparse.Namespace) -> None:
    """Wait for the GPU's queued work, so that a clock read after it counts that work."""
    import torch

    if args.device == "cuda":
        torch.cuda.synchronize()


def ct2_translator(
    engine: str, directory: Path, args: argparse.Namespace, workers: int = 1
) -> "ctranslate2.Translator":  # noqa: F821
    """CTranslate2 on `--device`: "ct2" computes in `--dtype`, "ct2-int8" in int8 (int8_<dtype> on a GPU).

    `workers` above 1: that many workers (`inter_threads`) sharing `--threads` threads.

    Raises:
        ValueError, RuntimeError: from CTranslate2, for a compute type the device lacks or missing CUDA
            libraries (its PyPI wheel needs CUDA 12's cuBLAS).
    """
    import ctranslate2

    compute_type = args.dtype if engine == "ct2" else "int8" if args.dtype == "float32" else f"int8_{args.dtype}"
    return ctranslate2.Translator(
        str(directory),
        device=args.device,
        compute_type=compute_type,
        inter_threads=workers,
        intra_threads=max(1, args.threads // workers),
    )


def training_step(engine: str, args: argparse.Namespace) -> Callable[[dict], "torch.Tensor"]:  # noqa: F821
    """Load `engine` ("ours" or "marian") for training; return a function that runs one step on a batch: its loss.

    Raises:
        OSError: the preset's model is missing from the work folder (from `from_pretrained`).
    """
    import torch
    import torch.nn.functional as F

    from vaswani_transformer.modeling_vaswani import shift_tokens_right
    from vaswani_transformer.training import avoid_cudnn_attention

    torch.manual_seed(0)
    if engine == "ours":
        from vaswani_transformer import VaswaniForConditionalGeneration

        model = VaswaniForConditionalGeneration.from_pretrained(args.workdir / "ours")

        def loss_of(batch):
            return model(**batch).loss  # the projection fused with the label-smoothed cross entropy
    else:
        from transformers import MarianMTModel

        model = MarianMTModel.from_pretrained(args.workdir / "marian")
        config = model.config

        def loss_of(batch):
            # Marian's own loss is unsmoothed: the same function as ours is PyTorch's smoothed cross entropy.
            decoder_input_ids = shift_tokens_right(batch["labels"], config.pad_token_id, config.decoder_start_token_id)
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            logits = model(**inputs, decoder_input_ids=decoder_input_ids).logits
            return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), label_smoothing=0.1)

    model.to(args.device).train()
    if args.device == "cuda":
        avoid_cudnn_attention()  # for both engines, as `train` does: the batches change shape at every step
    if args.compile:  # both engines, as `train --compile` compiles ours: dynamic shapes for token batches
        loss_of = torch.compile(loss_of, dynamic=True)
    # Fused for both: `vaswani_transformer.training` uses it, and so does the HF Trainer (`adamw_torch_fused`).
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    # Mixed precision as Accelerate runs it: float32 weights, autocast, a gradient scaler for float16.
    autocast = torch.autocast(args.device, dtype=getattr(torch, args.dtype), enabled=args.dtype != "float32")
    scaler = torch.amp.GradScaler(args.device, enabled=args.dtype == "float16")

    def step(batch: dict) -> "torch.Tensor":
        with autocast:
            loss = loss_of(batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def real_tokens(batch: dict) -> int:
    """A training batch's non-padding source + target tokens."""
    return int(batch["attention_mask"].sum() + batch["labels"].ne(-100).sum())


def child_train(engine: str, args: argparse.Namespace) -> dict:
    """Training throughput of `engine` ("ours" or "marian"): real source + target tokens per second, and the model
    FLOPs per second (`flops.training_flops`, the same for both engines) with the MFU where the GPU's peak is known."""
    import torch

    from vaswani_transformer import VaswaniConfig
    from vaswani_transformer.flops import peak_flops, training_flops

    step = training_step(engine, args)
    config = VaswaniConfig.from_pretrained(args.workdir / "ours")
    batches = [on_device(batch, args) for batch in torch.load(args.workdir.parent / "train_batches.pt")]
    tokens, flops, elapsed = 0, 0.0, 0.0
    for index, batch in enumerate(batches):
        synchronize(args)
        start = time.perf_counter()
        loss = step(batch)
        synchronize(args)
        if index >= args.train_warmup:
            elapsed += time.perf_counter() - start
            tokens += real_tokens(batch)
            flops += training_flops(config, batch["attention_mask"], batch["labels"])
    peak = peak_flops(torch.device(args.device), getattr(torch, args.dtype))
    return {
        "tokens": tokens, "seconds": elapsed, "tokens_per_second": tokens / elapsed, "final_loss": loss.item(),
        "model_tflops_per_second": flops / elapsed / 1e12, "mfu": flops / elapsed / peak if peak else None,
    }  # fmt: skip


def child_train_turns(args: argparse.Namespace) -> dict:
    """Training throughput of ours and Marian in one process, taking turns step by step (which goes first alternates).

    A machine whose speed drifts between the fresh processes of `child_train` (other tenants of a virtual
    machine) slows both engines alike here. Returns each engine's tokens per second, the ratio ours / Marian
    and the median of the per-step ratios.

    Raises:
        OSError: a preset's model is missing from the work folder (from `training_step`).
    """
    import torch

    steps = {engine: training_step(engine, args) for engine in ("ours", "marian")}
    batches = [on_device(batch, args) for batch in torch.load(args.workdir.parent / "train_batches.pt")]
    seconds, step_ratios, tokens = {"ours": 0.0, "marian": 0.0}, [], 0
    for index, batch in enumerate(batches):
        taken = {}
        for engine in ("ours", "marian") if index % 2 == 0 else ("marian", "ours"):
            synchronize(args)
            start = time.perf_counter()
            steps[engine](batch)
            synchronize(args)
            taken[engine] = time.perf_counter() - start
        if index >= args.train_warmup:
            for engine, elapsed in taken.items():
                seconds[engine] += elapsed
            tokens += real_tokens(batch)
            step_ratios.append(taken["marian"] / taken["ours"])
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": {engine: tokens / elapsed for engine, elapsed in seconds.items()},
        "ratio": seconds["marian"] / seconds["ours"],
        "step_ratio_median": statistics.median(step_ratios),
    }


def child_decode_torch(engine: str, task: str, args: argparse.Namespace) -> dict:
    """Generated tokens per second of `generate()` ("ours" or "marian"), beam 4 or greedy, best of the repeats."""
    import torch
    from transformers import GenerationConfig

    if engine == "ours":
        from vaswani_transformer import VaswaniForConditionalGeneration

        model = VaswaniForConditionalGeneration.from_pretrained(args.workdir / "ours")
    else:
        from transformers import MarianMTModel

        model = MarianMTModel.from_pretrained(args.workdir / "marian")
    model.to(args.device, getattr(torch, args.dtype)).eval()
    config = model.config
    # One decoding configuration for both: same search, same processors, exactly decode_length tokens.
    model.generation_config = GenerationConfig(
        num_beams=1 if task == "greedy" else 4,
        do_sample=False,
        early_stopping=task != "beam-es-false",
        length_penalty=1.0,
        min_new_tokens=args.decode_length,
        max_new_tokens=args.decode_length,
        decoder_start_token_id=config.decoder_start_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        suppress_tokens=[config.pad_token_id, config.bos_token_id],
    )
    batches = [on_device(batch, args) for batch in torch.load(args.workdir.parent / "decode_batches.pt")]
    with torch.inference_mode():
        model.generate(**batches[0])  # warm-up: first-call allocations and lazy initialisation
        times, tokens = [], 0
        for _ in range(args.repeats):
            synchronize(args)
            start = time.perf_counter()
            outputs = [model.generate(**batch) for batch in batches]
            synchronize(args)
            times.append(time.perf_counter() - start)
    for output in outputs:
        generated = output[:, 1:]
        lengths = (generated.ne(config.pad_token_id) & generated.ne(config.eos_token_id)).sum(-1)
        assert bool((lengths == args.decode_length).all()), lengths
        tokens += int(lengths.sum())
    best = min(times)
    return {"tokens": tokens, "seconds": best, "tokens_per_second": tokens / best, "all_seconds": times}


def child_translate(engine: str, args: argparse.Namespace, workers: int = 1) -> dict:
    """Sentences per second of beam search with a trained model, every sentence ending where the engine ends it.

    `workers` above 1: the batches go to that many processes of one thread each (`map_in_workers`), or to
    CTranslate2's `inter_threads` workers.
    """
    from transformers import AutoTokenizer

    # corpus_bleu: also registers the tokenizer (no trust_remote_code prompt)
    from vaswani_transformer.translation import corpus_bleu, map_in_workers

    options = dict(num_beams=4, length_penalty=1.0, max_new_tokens=128)
    tokenizer = AutoTokenizer.from_pretrained(args.workdir / "ours")
    if engine.startswith("ct2"):
        translator = ct2_translator(engine, args.workdir / "ct2", args, workers)
        batches = json.loads((args.workdir / "translate_tokens.json").read_text())

        def run_all(batches):  # submitted together, so that `inter_threads` workers take batches side by side
            search = dict(beam_size=4, length_penalty=1.0, max_decoding_length=128, asynchronous=True)
            results = [translator.translate_batch(batch, **search) for batch in batches]
            return [result.result().hypotheses[0] for batch in results for result in batch]

        def to_ids(hypothesis):  # CTranslate2 gives tokens, without </s>
            return tokenizer.convert_tokens_to_ids(hypothesis) + [tokenizer.eos_token_id]
    else:
        import torch
        from transformers import GenerationConfig

        if engine == "ours":
            from vaswani_transformer import VaswaniForConditionalGeneration as Model
        else:
            from transformers import MarianMTModel as Model
        model = Model.from_pretrained(args.workdir / engine).to(args.device, getattr(torch, args.dtype)).eval()
        config = model.config
        model.generation_config = GenerationConfig(
            **options,
            early_stopping=True,
            decoder_start_token_id=config.decoder_start_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
            suppress_tokens=[config.pad_token_id, config.bos_token_id],
        )
        batches = [on_device(batch, args) for batch in torch.load(args.workdir / "translate_batches.pt")]

        def run(batch):
            with torch.inference_mode():
                generated = model.generate(**batch)[:, 1:]
            return generated.tolist()

        def run_all(batches):
            return [output for outputs in map_in_workers(run, batches, workers) for output in outputs]

        if workers > 1:  # every repeat forks new workers: from a warm process, as CTranslate2's workers stay warm
            run(batches[0])

        def to_ids(row):  # up to and with the first </s>: what follows is filling (with </s> where <pad> is 0)
            return row[: row.index(config.eos_token_id) + 1] if config.eos_token_id in row else row

    run_all(batches[:1])  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = run_all(batches)  # read back: no GPU work left queued
        times.append(time.perf_counter() - start)
    outputs = [to_ids(output) for output in outputs]
    references = json.loads((args.workdir / "translate_references.json").read_text())
    translations = tokenizer.batch_decode(outputs, skip_special_tokens=True)
    best = min(times)
    return {"sentences": len(outputs), "tokens": sum(map(len, outputs)), "seconds": best,
            "sentences_per_second": len(outputs) / best, "tokens_per_second": sum(map(len, outputs)) / best,
            "bleu": corpus_bleu(translations, references)["score"], "all_seconds": times}  # fmt: skip


def child_decode_ct2(engine: str, task: str, args: argparse.Namespace) -> dict:
    """Generated tokens per second of CTranslate2's `translate_batch` (see `ct2_translator`), best of the repeats."""
    translator = ct2_translator(engine, args.workdir / "ct2", args)
    batches = json.loads((args.workdir.parent / "decode_tokens.json").read_text())
    options = dict(
        beam_size=4 if task == "beam" else 1,
        min_decoding_length=args.decode_length,
        max_decoding_length=args.decode_length,
    )
    translator.translate_batch(batches[0], **options)  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = [translator.translate_batch(batch, **options) for batch in batches]
        times.append(time.perf_counter() - start)
    lengths = [len(result.hypotheses[0]) for output in outputs for result in output]
    assert set(lengths) == {args.decode_length}, set(lengths)
    best = min(times)
    return {"tokens": sum(lengths), "seconds": best, "tokens_per_second": sum(lengths) / best, "all_seconds": times}


def child(args: argparse.Namespace) -> None:
    """One (engine, task) measurement; prints its result as one JSON line."""
    engine, task = args.child
    if not engine.startswith("ct2"):
        import torch

        torch.set_num_threads(args.threads)
    if task == "train":
        result = child_train(engine, args)
    elif task == "train-turns":
        result = child_train_turns(args)
    elif task.startswith("translate"):
        result = child_translate(engine, args, args.threads if task == "translate-workers" else 1)
    elif engine.startswith("ct2"):
        result = child_decode_ct2(engine, task, args)
    else:
        result = child_decode_torch(engine, task, args)
    result["peak_rss_mib"] = peak_rss_mib()
    if args.device == "cuda" and not engine.startswith("ct2"):
        import torch

        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(result))


def main() -> None:
    """Parse the options; run the whole benchmark, or one child measurement."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["small", "base"], help="model sizes (default: small base)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS), help="what to measure")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES), help="engines to run")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per engine (default: 2)")
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data" / "multi30k")
    parser.add_argument("--vocab-size", type=int, default=8000, help="BPE vocabulary (default: 8000, as main_job.sh)")
    parser.add_argument("--max-tokens", type=int, default=2048, help="padded tokens per side and training batch")
    parser.add_argument("--train-sentences", type=int, default=4000, help="training pairs the batches are cut from")
    parser.add_argument("--train-warmup", type=int, default=3,
                        help="untimed steps first, while a fresh process faults in memory (default: 3)")  # fmt: skip
    parser.add_argument("--train-steps", type=int, default=10, help="timed training steps (default: 10)")
    parser.add_argument("--train-turns", action="store_true",
                        help="also train ours and Marian in one process, taking turns step by step")  # fmt: skip
    parser.add_argument("--decode-batches", type=int, default=2, help="batches of 32 test sentences (default: 2)")
    parser.add_argument("--decode-length", type=int, default=24, help="tokens generated per sentence (default: 24)")
    parser.add_argument("--model", type=Path, default=None, help="a trained model directory: adds `translate`")
    parser.add_argument("--translate-batches", type=int, default=8, help="batches of 32 test sentences (default: 8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed decoding repeats; the best counts (default: 3)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every child, order alternating (default: 1)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where engines run (default: cpu)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="training autocast and decoding dtype; on the CPU float32, or bfloat16 for --tasks train "
                        "(default: float32)")  # fmt: skip
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results", help="where the reports go")
    parser.add_argument("--compile", action="store_true", help="torch.compile both engines' training (dynamic shapes)")
    parser.add_argument("--child", nargs=2, metavar=("ENGINE", "TASK"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    counts = ("threads", "vocab_size", "max_tokens", "train_sentences", "train_steps", "decode_batches",
              "decode_length", "translate_batches", "repeats", "rounds")  # fmt: skip
    for name in counts:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.train_warmup < 0:
        parser.error(f"--train-warmup must be at least 0, got {args.train_warmup}")
    planned = [
        task for task in args.tasks
        if set(TASKS[task]) & set(args.engines) and (args.model or not task.startswith("translate"))
        and not (task == "translate-workers" and args.device == "cuda")
    ]  # fmt: skip
    if not args.child and not planned:
        parser.error(
            f"nothing to measure: none of --engines {' '.join(args.engines)} runs any of --tasks "
            f"{' '.join(args.tasks)} here (the translate tasks need --model DIR, translate-workers the CPU)"
        )
    # Children get their task alone (`--child ENGINE TASK`), not --tasks.
    bad_cpu_dtype = args.dtype == "float16" or (args.dtype == "bfloat16" and args.tasks != ["train"] and not args.child)
    if args.device == "cpu" and bad_cpu_dtype:
        parser.error(
            f"--dtype {args.dtype} on the CPU: give --dtype bfloat16 --tasks train (training under autocast, as "
            "`train --mixed-precision bf16` runs it); decoding on the CPU runs in float32"
        )
    if args.child:
        child(args)
        return
    from vaswani_transformer.configuration_vaswani import PRESETS  # not in children, which set threads first

    if unknown := [preset for preset in args.presets if preset not in PRESETS]:
        parser.error(f"--presets: unknown {' '.join(unknown)}; choose from {' '.join(PRESETS)}")
    parent(args)


if __name__ == "__main__":
    main()
