"""What the benchmark tasks share: engines and tasks, the machine and commit measured, report names, child helpers.

`scripts/benchmark.py` runs the tasks; `scripts/load_test.py` and `scripts/profile_gpu.py` describe the machine and
the commit with the same functions, so that every report in benchmarks/results/ names them alike.
"""

import argparse
import os
import platform
import re
import resource
import subprocess
import time
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


# The machine and the commit measured ------------------------------------------------------------------------------


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
        # Our decoding's float32 CPU products: PyTorch's own, or oneDNN's from this size (inference.cpu_kernels).
        "onednn_min_product": os.environ.get("VASWANI_ONEDNN_MIN_PRODUCT"),
    }


def _nvidia_driver() -> str | None:
    result = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
    )
    return result.stdout.strip() or None


def load_average() -> str:
    """The 1, 5 and 15-minute load averages, as "0.52 0.61 0.70": how busy the machine was around a run."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# Report files -----------------------------------------------------------------------------------------------------


def report_stem(report: dict, task: str | None = None) -> str:
    """`DATE_DEVICE_COMMIT[_TASK]`: a run's file set in benchmarks/results/ (e.g. 2026-11-24_cpu-xeon-amx_1a2b3c4, with
    `-bfloat16` after the vector extension for a CPU run of training in mixed precision, `_onednn-SIZE` for a run with
    `VASWANI_ONEDNN_MIN_PRODUCT` set, and `_ct2-engine` for the task of that name)."""
    machine = report["machine"]
    if report["device"] == "cpu":
        extensions = machine["cpu_vector_extensions"]
        widest = next((x for x in ("amx", "avx512", "avx2") if any(e.startswith(x) for e in extensions)), "novec")
        device = f"cpu-{machine['cpu']}-{widest}" + (f"-{report['dtype']}" if report["dtype"] != "float32" else "")
    else:
        device = f"{machine['gpu']}-{report['dtype']}"
    device = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    compiled = "_compile" if report.get("compile") else ""
    onednn = f"_onednn-{machine['onednn_min_product']}" if machine.get("onednn_min_product") else ""
    suffix = f"_{task}" if task else ""
    return f"{time.strftime('%Y-%m-%d')}_{device}_{machine['commit'] or 'nocommit'}{compiled}{onednn}{suffix}"


def free_stem(directory: Path, name: str) -> Path:
    """`directory / name`, or `name-2`, `name-3`, ... where a run of the same day, device and commit has its files
    there already: a run's results neither overwrite another's nor get lost after its measurements."""
    stem, number = directory / name, 1
    while any(stem.with_suffix(suffix).exists() for suffix in (".json", ".md", ".log")):
        number += 1
        stem = directory / f"{name}-{number}"
    return stem


def write_report(directory: Path, name: str, report_json: str, table: str) -> Path:
    """Write `name`.json and `name`.md (or `name-2`..., see `free_stem`) into `directory`; return their stem.

    Raises:
        FileExistsError: another run wrote a file of that stem between the choice and the writing.
    """
    directory.mkdir(parents=True, exist_ok=True)
    stem = free_stem(directory, name)
    for suffix, text in ((".json", report_json), (".md", table)):
        with open(stem.with_suffix(suffix), "x") as file:  # a run's results are never overwritten
            file.write(text)
    return stem


# In the children ---------------------------------------------------------------------------------------------------


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
