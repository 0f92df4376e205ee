"""Where a training step's time goes: a profile of `train --preset base --mixed-precision bf16` (issue 67, point 1).

On the batches `vaswani-transformer train --preset base --mixed-precision bf16 --max-tokens 25000` trains
on (§5.1: about 25,000 source and 25,000 target tokens; Multi30k en->de, shared 8,000-token BPE, as
scripts/benchmark.py), eager, the script measures in one process, in this order:

1. throughput of the real training step: `TrainingRun.steps.optimizer_step` + `after_step`, the very
   code of `train()`'s loop (Accelerate's bf16 autocast, the fused output projection and label-smoothed
   loss, fused Adam, the schedule, the non-finite-loss check), on a run whose corpus is replaced by the
   prepared batches. Real source + target tokens per second, target tokens per second (what `train`
   logs), model TFLOP/s and MFU counted by `flops.training_flops` / `flops.peak_flops` as `train` counts them;
2. on CUDA, the host synchronisations of one step and the Python lines that cause them
   (`torch.cuda.set_sync_debug_mode("warn")`);
3. `torch.profiler` (CPU + CUDA) over `--profile-steps` steps: wall time per step against the time the
   GPU is busy (the union of kernels, copies and memsets) and the sum of kernel times, i.e. how long
   the GPU idles waiting for the host; the 10 most expensive kernels; kernel launches, synchronising
   calls and device-to-host copies per step; the host time of the top CPU operators;
4. ours against HF Marian with identical weights (`convert.to_marian`), taking turns step by step on the
   same batches: `scripts/benchmark_train.py`'s `child_train_turns` / `training_step` imported as they are
   (its step: plain torch.autocast, fused Adam, batches already on the device). Time only, no profile;
5. with `--compile`, the seconds of the first steps compiled as `train --compile` compiles them
   (Accelerate's dynamo plugin, Inductor, dynamic shapes, lengths padded to multiples of 8), in a
   child process killed when the time budget runs out.

Every phase checks the budget `--time-limit` (seconds from the start) and is skipped when too little is
left; every result is printed as it comes and `summary.json` is rewritten after each phase, so a run
killed from outside still leaves what it measured. Written to `--out`:
`summary.json`, `log.txt`, `key_averages.txt` (sorted by self CUDA time on a GPU, self CPU time on a
CPU), `key_averages_cpu.txt` (by self CPU time, on a GPU) and, when it compresses below 40 MB,
`trace.json.gz` (chrome://tracing or ui.perfetto.dev).

Multi30k is read from `--data-dir`; where it is missing (a lent GPU machine gets the repository only) or
with `--synthetic`, the batches are random token ids whose sentence lengths follow a log-normal fit of
Multi30k's (BPE 8,000: mean log length 2.69 en / 2.71 de, sd 0.29 / 0.33, correlation 0.86), cut by the
same `TokenBatchSampler`: the same shapes, about 21,000 real tokens a side per 25,000-token batch.

    # the GPU run (5 minutes at most, --time-limit):
    python scripts/profile_gpu.py --device cuda --synthetic --out "$OUT" [--compile]
    # smoke test on a CPU (under a minute):
    python scripts/profile_gpu.py --device cpu --synthetic --preset tiny --max-tokens 2000 --warmup 1 --steps 3 \
        --profile-steps 2 --marian-warmup 1 --marian-steps 2 --threads 1 --out /tmp/profile
"""

import argparse
import contextlib
import gc
import gzip
import itertools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import benchmark_common  # noqa: E402  (scripts/benchmark_common.py: the commit, as the benchmark names it)
import benchmark_train  # noqa: E402  (scripts/benchmark_train.py: the benchmark's Marian comparison)

STARTED = time.monotonic()
TRACE_LIMIT = 40 * 2**20  # bytes of the compressed Chrome trace; larger ones are not written
# Multi30k en/de lengths in tokens (BPE 8,000, with </s>): mean and sd of their logarithms, and their correlation.
LOG_LENGTH_MEAN, LOG_LENGTH_SD, LOG_LENGTH_CORR = (2.685, 2.709), (0.295, 0.329), 0.859
LAUNCHES = {
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel",
}


class Report:
    """The run's printed log (also in `log.txt`) and `summary.json`, rewritten whenever a phase adds to it."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.log_file = open(out / "log.txt", "a", buffering=1)
        self.summary: dict = {}

    def log(self, *parts) -> None:
        line = f"[{time.monotonic() - STARTED:6.1f}s] " + " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.log_file.write(line + "\n")

    def save(self, **entries) -> None:
        self.summary.update(entries)
        self.summary["elapsed_seconds"] = round(time.monotonic() - STARTED, 1)
        partial = self.out / "summary.json.tmp"
        partial.write_text(json.dumps(self.summary, indent=2, default=str) + "\n")
        partial.replace(self.out / "summary.json")


def left(args: argparse.Namespace) -> float:
    """Seconds of the budget left."""
    return args.time_limit - (time.monotonic() - STARTED)


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# The machine --------------------------------------------------------------------------------------------


def environment(args: argparse.Namespace) -> dict:
    import accelerate
    import torch
    import transformers

    info = {
        "command": " ".join([sys.executable, *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        info["commit"] = benchmark_common.commit_measured()
    except OSError:  # no git here
        info["commit"] = None
    if args.device == "cuda":
        info.update(
            gpu=torch.cuda.get_device_name(),
            capability=".".join(map(str, torch.cuda.get_device_capability())),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        )
        query = "name,driver_version,clocks.sm,clocks.max.sm,power.limit,pstate,temperature.gpu"
        try:
            smi = subprocess.run(
                ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            values = [x.strip() for x in smi.stdout.split("\n")[0].split(",")]
            info["nvidia_smi"] = dict(zip(query.split(","), values, strict=False))
        except (OSError, subprocess.SubprocessError) as error:
            info["nvidia_smi"] = repr(error)
    return info


# The batches ----------------------------------------------------------------------------------------------


def make_batches(args: argparse.Namespace, count: int, report: Report) -> tuple[list, dict]:
    """`count` training batches as `train`'s DataLoader yields them (BatchEncoding of CPU tensors), and their source.

    Multi30k prepared as `train` prepares it (`training.corpus.prepare_corpus`) and `TokenBatchSampler` (seed 1,
    `train`'s default), or synthetic ids cut by the same sampler from lengths drawn like Multi30k's.
    """
    import numpy as np
    import torch
    from transformers import BatchEncoding

    from vaswani_transformer.data.corpora import TokenBatchSampler, lengths_of

    synthetic = args.synthetic or not (args.data_dir / "train.en").is_file()
    if synthetic:
        reason = "--synthetic" if args.synthetic else f"no Multi30k in {args.data_dir}"
        rng = np.random.default_rng(0)
        (m1, m2), (s1, s2), r = LOG_LENGTH_MEAN, LOG_LENGTH_SD, LOG_LENGTH_CORR
        logs = rng.multivariate_normal([m1, m2], [[s1 * s1, r * s1 * s2], [r * s1 * s2, s2 * s2]], args.sentences)
        lengths = np.clip(np.rint(np.exp(logs)), 2, 256).astype(np.int64)
        source_lengths, target_lengths = lengths[:, 0], lengths[:, 1]
        pad, eos = 0, 2  # tokenization.SPECIAL_TOKENS: <pad> 0, <s> 1, </s> 2, <unk> 3

        def rows(lengths):  # random ids of the ordinary tokens, each sentence ending in </s>
            return [list(rng.integers(4, args.vocab_size, n - 1)) + [eos] for n in lengths]

        def collate(indices):
            def pad_to(seqs, value):
                width = max(map(len, seqs))
                return torch.tensor([s + [value] * (width - len(s)) for s in seqs], dtype=torch.long)

            source, target = rows(source_lengths[indices]), rows(target_lengths[indices])
            input_ids = pad_to(source, pad)
            return BatchEncoding(
                {"input_ids": input_ids, "attention_mask": input_ids.ne(pad).long(), "labels": pad_to(target, -100)}
            )

        source = {"data": "synthetic", "why": reason, "vocab_size": args.vocab_size, "pad_token_id": pad}
    else:
        import tempfile

        from transformers import DataCollatorForSeq2Seq

        from vaswani_transformer.data.corpora import corpus_fingerprint
        from vaswani_transformer.training.config import TrainingConfig
        from vaswani_transformer.training.corpus import prepare_corpus

        config = TrainingConfig(
            data=str(args.data_dir), source_lang="en", target_lang="de", output_dir="", max_steps=1,
            vocab_size=args.vocab_size, max_length=256, data_cache_dir=tempfile.mkdtemp(prefix="profile-data-"),
        )  # fmt: skip
        prepared = prepare_corpus(config, None, corpus_fingerprint(config.data, "en", "de"))
        tokenizer, train = prepared.tokenizer, prepared.train
        source_lengths, target_lengths = lengths_of(train)
        collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, return_tensors="pt")
        table = train.select_columns(["input_ids", "labels"])

        def collate(indices):  # as training_data.token_batches' DataLoader: the collator over the selected rows
            return collator([table[int(i)] for i in indices])

        source = {"data": str(args.data_dir), "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    sampler = TokenBatchSampler(source_lengths, target_lengths, args.max_tokens, shuffle=True, seed=1)
    indices = list(sampler)
    source.update(
        sentences=len(source_lengths), batches_per_epoch=len(indices), padding_efficiency=sampler.padding_efficiency()
    )
    batches = [collate(np.asarray(i)) for i in itertools.islice(itertools.cycle(indices), count)]
    report.log(f"batches: {source['data']} ({source.get('why', '')}), {len(indices)} per epoch of "
               f"{len(source_lengths)} pairs, {count} made")  # fmt: skip
    return batches, source


def batch_shape(batches: list) -> dict:
    real_source = [int(b["attention_mask"].sum()) for b in batches]
    real_target = [int(b["labels"].ne(-100).sum()) for b in batches]
    return {
        "sentences_per_batch": sum(len(b["input_ids"]) for b in batches) / len(batches),
        "real_source_tokens_per_batch": sum(real_source) / len(batches),
        "real_target_tokens_per_batch": sum(real_target) / len(batches),
        "padded_source_tokens_per_batch": sum(b["input_ids"].numel() for b in batches) / len(batches),
        "padded_target_tokens_per_batch": sum(b["labels"].numel() for b in batches) / len(batches),
    }


def padded_to_multiple(batch, multiple: int, pad: int):
    """The batch with both sides padded to a multiple of `multiple` (`train --compile` pads to 8)."""
    import torch.nn.functional as F
    from transformers import BatchEncoding

    def widen(tensor, value):
        extra = -tensor.shape[1] % multiple
        return F.pad(tensor, (0, extra), value=value) if extra else tensor

    return BatchEncoding(
        {
            "input_ids": widen(batch["input_ids"], pad),
            "attention_mask": widen(batch["attention_mask"], 0),
            "labels": widen(batch["labels"], -100),
        }  # fmt: skip
    )


# The real training step -------------------------------------------------------------------------------------


def model_config(args: argparse.Namespace, source: dict):
    from vaswani_transformer import VaswaniConfig

    # Special ids as `train` takes them from the tokenizer (tokenization.SPECIAL_TOKENS: 0, 1, 2).
    return VaswaniConfig.from_preset(
        args.preset, vocab_size=source["vocab_size"], pad_token_id=source["pad_token_id"], bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1,
    )  # fmt: skip


class FedBatches:
    """Stands in for a run's token batches: each step trains on the one batch `feed` gave it (update_freq 1)."""

    def __init__(self) -> None:
        self.pending: list[dict] = []

    def feed(self, batch: dict) -> None:
        self.pending.append(batch)

    def set_epoch(self, epoch: int, skip: int = 0) -> None:  # as `batches.micro_batches` positions a corpus
        pass

    def __iter__(self):
        while self.pending:
            yield self.pending.pop()


def training_run(args: argparse.Namespace, config, workdir: Path, compile: bool = False):
    """A `TrainingRun` of `train` whose corpus is left out, and a function that runs its step on one batch.

    The step is `train()`'s loop body: `run.steps.optimizer_step()` (which moves the batch to the device, counts
    its FLOPs, runs forward and backward under Accelerate, checks the loss, steps Adam and the schedule) and
    `run.after_step()` (progress, clocks); its logging, validation and checkpoints never fall due.
    """
    from vaswani_transformer import VaswaniForConditionalGeneration
    from vaswani_transformer.training.config import TrainingConfig
    from vaswani_transformer.training.run import RunData, build_run

    batches = FedBatches()

    def load(*args):  # no corpus: the batches come from `step`
        return RunData(None, batches, None), VaswaniForConditionalGeneration(config)

    never = 10**9
    settings = TrainingConfig(
        data=str(workdir / "no-corpus"), source_lang="en", target_lang="de",
        output_dir=str(workdir / ("run-compiled" if compile else "run")), preset=args.preset,
        vocab_size=config.vocab_size, max_tokens=args.max_tokens, max_steps=never, log_steps=never,
        eval_steps=never, save_steps=never, save_minutes=0, bleu_sentences=0,
        mixed_precision=args.mixed_precision, compile=compile, peak_tflops=args.peak_tflops,
    )  # fmt: skip
    run = build_run(settings, load=load)

    def step(batch) -> None:
        batches.feed(batch)
        loss = run.steps.optimizer_step()
        if loss is not None:  # None: a non-finite loss, skipped as `train` skips it
            run.after_step(loss)

    return run, step


def save_models(args: argparse.Namespace, config, workdir: Path) -> Path:
    """Ours (seed 0) and its HF Marian twin (`convert.to_marian`), saved as scripts/benchmark.py lays them out."""
    import torch

    from vaswani_transformer import VaswaniForConditionalGeneration
    from vaswani_transformer.exchange.marian import to_marian

    preset_dir = workdir / "saved" / args.preset  # benchmark's layout: its train_batches.pt one folder up
    if not (preset_dir / "marian").is_dir():
        torch.manual_seed(0)
        model = VaswaniForConditionalGeneration(config)
        model.save_pretrained(preset_dir / "ours")
        to_marian(model).save_pretrained(preset_dir / "marian")
    return preset_dir


def benchmark_namespace(args: argparse.Namespace, preset_dir: Path, warmup: int = 0) -> argparse.Namespace:
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(args.mixed_precision, "float32")
    return argparse.Namespace(workdir=preset_dir, device=args.device, dtype=dtype, compile=False, train_warmup=warmup)


def fallback_step(args: argparse.Namespace, config, workdir: Path):
    """Where `training_run` fails (the package changed under it): scripts/benchmark_train.py's step of ours instead."""
    ours = benchmark_train.training_step("ours", benchmark_namespace(args, save_models(args, config, workdir)))

    def step(batch) -> None:
        ours({name: tensor.to(args.device) for name, tensor in batch.items()})

    return step


def timed_steps(step, batches: list, device: str) -> float:
    synchronize(device)
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    synchronize(device)
    return time.perf_counter() - start


def throughput(config, batches: list, seconds: float, peak: float | None) -> dict:
    from vaswani_transformer.training.flops import training_flops

    source = sum(int(b["attention_mask"].sum()) for b in batches)
    target = sum(int(b["labels"].ne(-100).sum()) for b in batches)
    flops = sum(training_flops(config, b["attention_mask"], b["labels"]) for b in batches)
    return {
        "steps": len(batches),
        "seconds": round(seconds, 4),
        "seconds_per_step": round(seconds / len(batches), 5),
        "tokens_per_second": round((source + target) / seconds),
        "target_tokens_per_second": round(target / seconds),
        "model_tflops_per_second": round(flops / seconds / 1e12, 2),
        "mfu": round(flops / seconds / peak, 4) if peak else None,
        "mflop_per_token": round(flops / (source + target) / 1e6, 1),
    }


def sync_sites(step, batch) -> dict:
    """The synchronising CUDA calls of one step, by the Python line that made them (sync debug mode)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    sites = Counter(
        f"{'/'.join(Path(w.filename).parts[-3:])}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower()
    )
    return {"count": sum(sites.values()), "sites": dict(sites.most_common(20))}


# The profile ----------------------------------------------------------------------------------------------


def profile_steps(step, batches: list, device: str, workdir: Path) -> tuple:
    """Profile `step` over `batches` (the first one a profiler warm-up); the profiler and its Chrome trace path."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    active = len(batches) - 1
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=active, repeat=1)) as prof:
        for index, batch in enumerate(batches):
            step(batch)
            if index == len(batches) - 1:
                synchronize(device)  # the last step's kernels inside its window
            prof.step()
    trace = workdir / "trace.json"
    prof.export_chrome_trace(str(trace))
    return prof, trace


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def trace_stats(trace: Path, steps: int, device: str) -> dict:
    """Per step, from the Chrome trace: wall time, GPU busy time, kernel time, launches, syncs, top kernels."""
    events = [e for e in json.loads(trace.read_text()).get("traceEvents", []) if e.get("ph") == "X"]
    spans = [  # the host's step spans (the GPU's copies of them, "gpu_user_annotation", start later)
        e
        for e in events
        if str(e.get("name", "")).startswith("ProfilerStep#") and e.get("cat") != "gpu_user_annotation"
    ]
    start = min((e["ts"] for e in spans), default=0.0)
    end = max((e["ts"] + e["dur"] for e in spans), default=0.0)
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    end = max([end] + [e["ts"] + e.get("dur", 0) for e in gpu])
    wall = (end - start) / 1e3  # ms
    busy = union_length([(max(e["ts"], start), min(e["ts"] + e.get("dur", 0), end)) for e in gpu]) / 1e3
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    by_kernel = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_kernel[e["name"]][0] += 1
        by_kernel[e["name"]][1] += e.get("dur", 0) / 1e3
    kernel_ms = sum(v[1] for v in by_kernel.values())
    runtime_time = Counter()
    for e in runtime:
        runtime_time[e["name"]] += e.get("dur", 0) / 1e3
    per = lambda x: round(x / steps, 3)  # noqa: E731
    if device != "cuda":
        return {"profiled_steps": steps, "wall_ms_per_step": per(wall)}
    return {
        "profiled_steps": steps,
        "wall_ms_per_step": per(wall),
        "gpu_busy_ms_per_step": per(busy),  # union of kernels, copies and memsets
        "gpu_idle_fraction": round(1 - busy / wall, 4) if wall else None,
        "kernel_ms_per_step": per(kernel_ms),  # sum of kernel durations (overlaps counted twice)
        "kernels_per_step": per(len(kernels)),
        "launches_per_step": per(sum(1 for e in runtime if e["name"] in LAUNCHES)),
        "synchronize_calls_per_step": {
            name: per(count) for name, count in Counter(e["name"] for e in runtime if "ynchronize" in e["name"]).items()
        },
        "copies_per_step": {
            name: per(count) for name, count in Counter(e["name"] for e in gpu if e.get("cat") == "gpu_memcpy").items()
        },
        "memsets_per_step": per(sum(1 for e in gpu if e.get("cat") == "gpu_memset")),
        "cuda_runtime_ms_per_step": {name: per(ms) for name, ms in runtime_time.most_common(8)},
        "top_kernels": [
            {
                "name": name[:200],
                "calls_per_step": per(calls),
                "ms_per_step": per(ms),
                "share_of_kernel_time": round(ms / kernel_ms, 4),
            }  # fmt: skip
            for name, (calls, ms) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:10]
        ],
    }


def top_cpu_ops(prof, steps: int, limit: int = 15) -> list[dict]:
    rows = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    rows.sort(key=lambda e: -e.self_cpu_time_total)
    return [
        {
            "name": e.key[:120],
            "calls_per_step": round(e.count / steps, 2),
            "self_cpu_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3),
            "cpu_total_ms_per_step": round(e.cpu_time_total / 1e3 / steps, 3),
        }  # fmt: skip
        for e in rows[:limit]
    ]


def averages_table(prof, sort_by: str) -> str:
    averages = prof.key_averages()
    for key in (sort_by, sort_by.replace("device", "cuda")):
        try:
            return averages.table(sort_by=key, row_limit=80, max_name_column_width=90)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=80)


def profile(args: argparse.Namespace, step, batches: list, workdir: Path, report: Report) -> None:
    """Phase 3: profile `len(batches) - 1` steps; the tables, the trace's statistics and (if small) the trace."""
    prof, trace = profile_steps(step, batches, args.device, workdir)
    steps = len(batches) - 1
    sort = "self_device_time_total" if args.device == "cuda" else "self_cpu_time_total"
    (args.out / "key_averages.txt").write_text(averages_table(prof, sort))
    if args.device == "cuda":
        (args.out / "key_averages_cpu.txt").write_text(averages_table(prof, "self_cpu_time_total"))
    stats = {"top_cpu_ops": top_cpu_ops(prof, steps), "trace_mib": round(trace.stat().st_size / 2**20, 1)}
    report.save(profile=stats)
    stats = {**trace_stats(trace, steps, args.device), **stats}
    report.save(profile=stats)
    report.log("profile:", json.dumps({k: v for k, v in stats.items() if k not in ("top_kernels", "top_cpu_ops")}))
    for kernel in stats.get("top_kernels", []):
        cost = f"{kernel['ms_per_step']:9.3f} ms/step {kernel['calls_per_step']:7.1f}x"
        report.log(f"  kernel {cost}  {kernel['name'][:100]}")
    for op in stats["top_cpu_ops"][:10]:
        report.log(f"  cpu op {op['self_cpu_ms_per_step']:9.3f} ms/step {op['calls_per_step']:7.1f}x  {op['name']}")
    if left(args) > 20:
        packed = workdir / "trace.json.gz"
        with open(trace, "rb") as raw, gzip.open(packed, "wb", compresslevel=5) as gz:
            shutil.copyfileobj(raw, gz)
        small = packed.stat().st_size < TRACE_LIMIT
        if small:
            shutil.copy(packed, args.out / "trace.json.gz")
        report.save(trace_written=small, trace_gz_mib=round(packed.stat().st_size / 2**20, 1))


@contextlib.contextmanager
def phase(report: Report, name: str):
    """Run a phase; where it fails, log and record the error under `name` and go on with the next one."""
    try:
        yield
    except Exception as error:  # noqa: BLE001  (one shot on a lent GPU: the other phases still count)
        report.log(f"{name} failed:", traceback.format_exc())
        report.save(**{name: f"failed: {error!r}"})


# Marian, and the compiled step -------------------------------------------------------------------------


def marian_turns(args: argparse.Namespace, config, batches: list, workdir: Path, peak: float | None) -> dict:
    """Ours and HF Marian (identical weights) taking turns on the same batches: `benchmark_train.child_train_turns`."""
    import torch

    from vaswani_transformer.training.flops import training_flops

    preset_dir = save_models(args, config, workdir)
    torch.save([dict(b) for b in batches], preset_dir.parent / "train_batches.pt")
    result = benchmark_train.child_train_turns(benchmark_namespace(args, preset_dir, args.marian_warmup))
    timed = batches[args.marian_warmup :]
    flops_per_token = sum(training_flops(config, b["attention_mask"], b["labels"]) for b in timed) / sum(
        benchmark_train.real_tokens(b) for b in timed
    )
    result["model_tflops_per_second"] = {
        engine: round(rate * flops_per_token / 1e12, 2) for engine, rate in result["tokens_per_second"].items()
    }
    if peak:
        result["mfu"] = {
            engine: round(rate * flops_per_token / peak, 4) for engine, rate in result["tokens_per_second"].items()
        }
    result["ours_over_marian"] = round(result.pop("ratio"), 3)
    result["step"] = (
        "scripts/benchmark_train.py training_step: torch.autocast, fused Adam, batches already on the device"
    )
    return result


def compiled_steps(
    args: argparse.Namespace, batches: list, source: dict, workdir: Path, seconds: float, report: Report
) -> dict:
    """The first compiled steps, in a child process given `seconds` at most; what it printed before it ended."""
    import torch

    folder = workdir / "compile"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save([dict(b) for b in batches], folder / "batches.pt")
    (folder / "source.json").write_text(json.dumps(source))
    command = [sys.executable, __file__, "--child-compile", str(folder), "--device", args.device,
               "--preset", args.preset, "--max-tokens", str(args.max_tokens),
               "--mixed-precision", args.mixed_precision, "--out", str(args.out)]  # fmt: skip
    command += ["--threads", str(args.threads)] if args.threads else []
    lines: list[dict] = []
    with open(args.out / "compile_child.log", "w") as stderr:
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)

        def read() -> None:
            for line in child.stdout:
                try:
                    lines.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
                report.log("compile:", line.strip())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            returncode = child.wait(timeout=seconds)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the child and its Inductor compile workers
            returncode, timed_out = child.wait(), True
        reader.join(timeout=5)
    result = {"budget_seconds": round(seconds, 1), "timed_out": timed_out, "returncode": returncode, "steps": lines}
    if lines:
        result["first_step_seconds"] = lines[0]["seconds"]
    steady = lines[2:]  # after the first compile and a second shape's
    if steady:
        seconds_sum = sum(x["seconds"] for x in steady)
        result["steady_tokens_per_second"] = round(sum(x["tokens"] for x in steady) / seconds_sum)
        result["steady_model_tflops_per_second"] = round(sum(x["flops"] for x in steady) / seconds_sum / 1e12, 2)
    return result


def child_compile(args: argparse.Namespace) -> None:
    """In the child: `train --compile`'s step on the batches padded to multiples of 8; one JSON line per step."""
    import torch

    from vaswani_transformer.training.flops import training_flops

    folder = args.child_compile
    source = json.loads((folder / "source.json").read_text())
    config = model_config(args, source)
    # On the host, as `train`'s loop gets them: the parent's steps moved its batches in place (BatchEncoding.to).
    saved = torch.load(folder / "batches.pt", map_location="cpu")
    batches = [padded_to_multiple(b, 8, source["pad_token_id"]) for b in saved]
    _, step = training_run(args, config, folder, compile=True)
    for index, batch in enumerate(batches):
        synchronize(args.device)
        start = time.perf_counter()
        step(batch)
        synchronize(args.device)
        print(json.dumps({
            "step": index, "seconds": round(time.perf_counter() - start, 3), "shape": list(batch["input_ids"].shape),
            "tokens": benchmark_train.real_tokens(batch),
            "flops": training_flops(config, batch["attention_mask"], batch["labels"]),
        }), flush=True)  # fmt: skip


# The run ----------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--preset", default="base", help="model size (default: base)")
    parser.add_argument(
        "--max-tokens", type=int, default=25000, help="padded tokens per side and batch (default: 25000)"
    )
    parser.add_argument("--mixed-precision", choices=["bf16", "no"], default=None,
                        help="as `train --mixed-precision` (default: bf16 on CUDA; no on the CPU, where bf16 "
                        "products without AMX are many times slower)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps (default: 30)")
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps, after one more (default: 3)")
    parser.add_argument("--marian-warmup", type=int, default=3, help="untimed steps per engine (default: 3)")
    parser.add_argument(
        "--marian-steps", type=int, default=10, help="timed steps per engine; 0: no Marian (default: 10)"
    )
    parser.add_argument("--compile", action="store_true", help="also time the first compiled steps (child process)")
    parser.add_argument("--compile-steps", type=int, default=6, help="compiled steps to time (default: 6)")
    parser.add_argument(
        "--time-limit", type=float, default=300.0, help="seconds for the whole run; phases that do not fit are skipped"
    )
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data" / "multi30k")
    parser.add_argument("--synthetic", action="store_true", help="random ids with Multi30k's lengths, not Multi30k")
    parser.add_argument("--sentences", type=int, default=29000, help="synthetic pairs (Multi30k train: 29000)")
    parser.add_argument("--vocab-size", type=int, default=8000, help="BPE vocabulary (default: 8000, as benchmark.py)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak, where flops.py lacks it")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch (default: its own)")
    parser.add_argument("--out", type=Path, required=True, help="where summary.json and the tables go")
    parser.add_argument("--child-compile", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.mixed_precision = args.mixed_precision or ("bf16" if args.device == "cuda" else "no")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child_compile:
        child_compile(args)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu for the smoke test)")
    from vaswani_transformer import VaswaniForConditionalGeneration
    from vaswani_transformer.training.flops import peak_flops

    report = Report(args.out)
    report.save(environment=environment(args), settings={k: str(v) for k, v in vars(args).items()})
    report.log("environment:", json.dumps(report.summary["environment"]))
    workdir = Path(tempfile.mkdtemp(prefix="vaswani-profile-"))
    try:
        total = args.warmup + args.steps + 1 + (args.profile_steps + 1)
        batches, source = make_batches(args, max(total, args.marian_warmup + args.marian_steps), report)
        config = model_config(args, source)
        dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
        peak = (args.peak_tflops or 0) * 1e12 or peak_flops(torch.device(args.device), dtype)
        with torch.device("meta"):
            parameters = sum(p.numel() for p in VaswaniForConditionalGeneration(config).parameters())
        report.save(data=source, batches=batch_shape(batches), parameters=parameters,
                    peak_tflops=peak / 1e12 if peak else None)  # fmt: skip
        report.log("batches:", json.dumps(report.summary["batches"]))

        # 1. The real step's throughput.
        try:
            run, step = training_run(args, config, workdir)
            report.save(step="TrainingRun.steps.optimizer_step + after_step (train's loop), eager")
        except Exception as error:  # noqa: BLE001  (one shot on a lent GPU: measure what can be measured)
            report.log("TrainingRun failed, falling back to scripts/benchmark_train.py's step:", repr(error))
            run, step = None, fallback_step(args, config, workdir)
            report.save(step=f"scripts/benchmark_train.py training_step (TrainingRun failed: {error!r})")
        warm, timed = batches[: args.warmup], batches[args.warmup : args.warmup + args.steps]
        rest = batches[args.warmup + args.steps :]
        report.log(f"warm-up: {len(warm)} steps")
        warmup_seconds = timed_steps(step, warm, args.device)
        report.log(f"warm-up took {warmup_seconds:.2f} s; timing {len(timed)} steps")
        result = throughput(config, timed, timed_steps(step, timed, args.device), peak)
        if args.device == "cuda":
            result["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        report.save(warmup_seconds=round(warmup_seconds, 2), train_step=result)
        report.log("train step:", json.dumps(result))

        # 2. Host synchronisations of one step.
        if args.device == "cuda":
            with phase(report, "syncs_one_step"):
                syncs = sync_sites(step, rest[0])
                report.save(syncs_one_step=syncs)
                report.log("syncs in one step:", json.dumps(syncs))

        # 3. The profile.
        if left(args) > 30:
            with phase(report, "profile"):
                profile(args, step, rest[1 : args.profile_steps + 2], workdir, report)
        else:
            report.log(f"profile skipped: {left(args):.0f} s left")
            report.save(profile=f"skipped: {left(args):.0f} s left")
        train_seconds_per_step = result["seconds_per_step"]
        del run, step
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()

        # 4. Ours against HF Marian, taking turns.
        needed = 30 + 4 * (args.marian_warmup + args.marian_steps) * train_seconds_per_step
        if args.marian_steps and left(args) > needed:
            report.log(f"Marian: {args.marian_warmup} + {args.marian_steps} steps per engine, taking turns")
            with phase(report, "marian_comparison"):
                marian = batches[: args.marian_warmup + args.marian_steps]
                comparison = marian_turns(args, config, marian, workdir, peak)
                report.save(marian_comparison=comparison)
                report.log("ours vs Marian:", json.dumps(comparison))
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
        elif args.marian_steps:
            report.log(f"Marian skipped: {left(args):.0f} s left, {needed:.0f} s needed")
            report.save(marian_comparison=f"skipped: {left(args):.0f} s left")

        # 5. The compiled step.
        if args.compile:
            budget = left(args) - 15
            if budget < 30:
                report.log(f"compile skipped: {left(args):.0f} s left")
                report.save(compile=f"skipped: {left(args):.0f} s left")
            else:
                report.log(f"compile: up to {budget:.0f} s for {args.compile_steps} steps in a child process")
                with phase(report, "compile"):
                    compiled = compiled_steps(args, batches[: args.compile_steps], source, workdir, budget, report)
                    report.save(compile=compiled)
                    report.log("compile:", json.dumps({k: v for k, v in compiled.items() if k != "steps"}))
        report.log("done:", args.out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
