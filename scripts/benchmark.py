"""Speed and memory of this Transformer beside HF Marian and CTranslate2, on identical weights, in one run.

For each preset the script builds one randomly initialised `VaswaniForConditionalGeneration`,
the `MarianMTModel` that computes the same function (`marian.to_marian`: zero attention biases,
zero `final_logits_bias`, ReLU, sqrt(d_model) embedding scale, the sinusoid permutation) and the
CTranslate2 model of `ctranslate2.write_ctranslate2_export`. Every measurement runs in a fresh Python
process (this script with `--child`), which reports its own peak resident memory (VmHWM):

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

The tasks live in modules of their own beside this one: `benchmark_prepare` (models and data),
`benchmark_train`, `benchmark_decode`, `benchmark_translate`, `benchmark_report` (the Markdown table),
`benchmark_engines` (`--tasks ct2-engine`) and `benchmark_common` (the machine, the commit, report names).

`--tasks ct2-engine --model DIR` (not among the default tasks) measures `translate --engine ctranslate2` after
start-up against CTranslate2's own `translate_batch` on the same export and batches, and against `--engine torch`,
on the 1,000 sentences of test_2016_flickr.en, and writes its own file set, `DATE_DEVICE_COMMIT_ct2-engine`
(see `benchmark_engines`).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import benchmark_engines
from benchmark_common import (
    ENGINES,
    ROOT,
    TASKS,
    TRAINED,
    commit_measured,
    cpu_times,
    load_average,
    machine,
    peak_rss_mib,
    report_stem,
    write_report,
)
from benchmark_decode import child_decode_ct2, child_decode_torch
from benchmark_prepare import prepare
from benchmark_report import markdown, speed
from benchmark_train import child_train, child_train_turns
from benchmark_translate import child_translate

# The parent: models, data, one child process per (engine, task), the report ----------------------


def run_child(args: argparse.Namespace, workdir: Path | None, preset: str, engine: str, task: str) -> dict:
    """Run one measurement in a fresh Python process and return its JSON result; RuntimeError if it fails.

    `workdir`: the folder of `prepare`'s files, whose `preset` subfolder the child reads; None for a task that
    reads `--model` and `--data-dir` alone.
    """
    command = [sys.executable, __file__, "--child", engine, task, "--data-dir", str(args.data_dir)]
    command += ["--workdir", str(workdir / preset)] if workdir else []
    command += ["--model", str(args.model)] if args.model else []
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


def parent(args: argparse.Namespace) -> None:
    """Prepare models and data in a temporary folder, run every child, write the JSON and Markdown reports."""
    load_before = load_average()
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
        load_after=load_average(),
        decode_length=args.decode_length,
        decode_sentences=args.decode_batches * 32,
        rounds=args.rounds,
        translate_model=str(args.model) if args.model else None,
        note=args.note,
    )
    table = markdown(report)
    stem = write_report(args.output_dir, report_stem(report), json.dumps(report, indent=2) + "\n", table)
    print(table)
    print(f"Results: {stem}.json and .md (keep the stderr lines beside them as {stem.name}.log)", file=sys.stderr)


def child(args: argparse.Namespace) -> None:
    """One (engine, task) measurement; prints its result as one JSON line."""
    engine, task = args.child
    if not engine.startswith("ct2"):
        import torch

        torch.set_num_threads(args.threads)
    if task == benchmark_engines.TASK:
        result = benchmark_engines.child(engine, args)
    elif task == "train":
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
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=[*TASKS, benchmark_engines.TASK],
                        help=f"what to measure (default: all but {benchmark_engines.TASK})")  # fmt: skip
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
    parser.add_argument("--model", type=Path, default=None,
                        help=f"a trained model: adds `translate`, needed by {benchmark_engines.TASK}")  # fmt: skip
    parser.add_argument("--translate-batches", type=int, default=8, help="batches of 32 test sentences (default: 8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed decoding repeats; the best counts (default: 3)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every child, order alternating (default: 1)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where engines run (default: cpu)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="training autocast and decoding dtype; on the CPU float32, or bfloat16 for --tasks train "
                        "(default: float32)")  # fmt: skip
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results", help="where the reports go")
    parser.add_argument("--compile", action="store_true", help="torch.compile both engines' training (dynamic shapes)")
    parser.add_argument("--note", default=None, help="a remark the reports carry, e.g. that the machine was shared")
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
        if task in TASKS and set(TASKS[task]) & set(args.engines) and (args.model or not task.startswith("translate"))
        and not (task == "translate-workers" and args.device == "cuda")
    ]  # fmt: skip
    engines_task = benchmark_engines.TASK in args.tasks and not args.child
    if engines_task and (not args.model or args.device != "cpu"):
        parser.error(f"--tasks {benchmark_engines.TASK} needs --model DIR (a trained model) and --device cpu")
    if not args.child and not planned and not engines_task:
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
    from vaswani_transformer.model.configuration_vaswani import PRESETS  # not in children, which set threads first

    if unknown := [preset for preset in args.presets if preset not in PRESETS]:
        parser.error(f"--presets: unknown {' '.join(unknown)}; choose from {' '.join(PRESETS)}")
    if planned:
        parent(args)
    if engines_task:
        benchmark_engines.parent(args, run_child)


if __name__ == "__main__":
    main()
