"""Fault campaign: SIGKILL a training run at random moments, resume it each time, compare with an uninterrupted run.

    python scripts/fault_campaign.py --data-dir ../shared/data/multi30k --kills 20

Trains a tiny model on the first sentences of the corpus twice: once without interruption, and
once killed `--kills` times (every third kill aimed at a checkpoint being written, the others at
a random moment of training), each time restarted with `--resume`. A resume succeeds
when the restarted run continues from the newest checkpoint on disk (or starts afresh when there
was none) without an error. The report (JSON, last line) gives the number of successful resumes
and whether the final parameters equal those of the uninterrupted run, bitwise.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from vaswani_transformer.training.checkpoints import checkpoint_step, list_checkpoints

# One layer each side: a model that trains in seconds (the tests' `mini_run` uses it too).
MINI_MODEL = {"d_model": 32, "d_ff": 64, "encoder_layers": 1, "decoder_layers": 1, "num_attention_heads": 2}


def make_corpus(data_dir: Path, corpus: Path, pairs: int) -> Path:
    """The first `pairs` training and `pairs // 4` validation pairs of an en-de corpus directory."""
    corpus.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", pairs), ("val", pairs // 4)):
        for lang in ("en", "de"):
            lines = (data_dir / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()[:count]
            (corpus / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return corpus


def train_command(corpus: Path, output_dir: Path, steps: int, save_steps: int) -> list[str]:
    command = [sys.executable, "-m", "vaswani_transformer.cli", "train", "--data-dir", str(corpus)]
    command += ["--source-lang", "en", "--target-lang", "de", "--output-dir", str(output_dir), "--preset", "small"]
    for key, value in MINI_MODEL.items():
        command += ["--model-option", f"{key}={value}"]
    command += ["--vocab-size", "300", "--max-tokens", "256", "--warmup-steps", "10", "--max-steps", str(steps)]
    command += ["--log-steps", "5", "--eval-steps", "1000", "--save-steps", str(save_steps), "--average-last", "2"]
    return [*command, "--resume"]


def newest_step(output_dir: Path) -> int:
    found = list_checkpoints(output_dir / "checkpoints")
    return checkpoint_step(found[-1]) if found else 0


def kill_once(command: list[str], output_dir: Path, rng: random.Random, during_write: bool, limit: float) -> dict:
    """Start the run, kill it (at a checkpoint write, or after a random delay), report what happened."""
    before = newest_step(output_dir)
    log = output_dir.parent / f"{output_dir.name}-attempt.log"
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    # Past the start-up (imports, tokenization, loading the checkpoint) first, so that each kill hits training.
    while process.poll() is None and "Training:" not in log.read_text(errors="replace"):
        time.sleep(0.05)
    moment = "checkpoint write" if during_write else f"{rng.uniform(0.0, limit):.2f} s into training"
    if during_write:
        checkpoints = output_dir / "checkpoints"
        deadline = time.monotonic() + 120
        while process.poll() is None and time.monotonic() < deadline:
            if checkpoints.is_dir() and any(p.name.startswith(".incomplete-") for p in os.scandir(checkpoints)):
                break
            time.sleep(0.0005)
    else:
        try:
            process.wait(timeout=float(moment.split()[0]))
        except subprocess.TimeoutExpired:
            pass
    finished = process.poll() is not None
    if not finished:
        process.send_signal(signal.SIGKILL)
        process.wait()
    text = log.read_text(errors="replace")
    resumed = "Resuming from" in text
    expected = f"(step {before})." if before else None
    ok = (resumed and expected in text) if before else not resumed
    ok = ok and "error:" not in text and "Traceback" not in text
    return {
        "killed_at": moment,
        "finished_before_kill": finished,
        "newest_checkpoint_before": before,
        "resumed_from_newest": ok,
        "newest_checkpoint_after": newest_step(output_dir),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data/multi30k"), help="en-de corpus directory")
    parser.add_argument("--work-dir", type=Path, default=Path("outputs/fault-campaign"), help="scratch directory")
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs to inflict (default: 20)")
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps of the run (default: 500)")
    parser.add_argument("--save-steps", type=int, default=4, help="checkpoint every N steps (default: 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments (default: 0)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    try:
        corpus = make_corpus(args.data_dir, args.work_dir / "corpus", 1000)
    except OSError as error:
        parser.error(f"{error} (--data-dir must hold train.en, train.de, val.en and val.de; --work-dir be writable)")

    reference_dir, campaign_dir = args.work_dir / "uninterrupted", args.work_dir / "killed"
    for directory in (reference_dir, campaign_dir):
        subprocess.run(["rm", "-rf", str(directory)], check=True)
    started = time.monotonic()
    subprocess.run(
        train_command(corpus, reference_dir, args.steps, args.save_steps),
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    reference_seconds = time.monotonic() - started
    print(f"uninterrupted run: {args.steps} steps in {reference_seconds:.0f} s", flush=True)

    command = train_command(corpus, campaign_dir, args.steps, args.save_steps)
    attempts = []
    while len([a for a in attempts if not a["finished_before_kill"]]) < args.kills:
        if (campaign_dir / "model.safetensors").exists():
            raise SystemExit("The run finished before every kill was made: raise --steps.")
        during_write = len(attempts) % 3 == 2
        attempt = kill_once(command, campaign_dir, rng, during_write, limit=min(10.0, reference_seconds / 4))
        attempts.append(attempt)
        print(json.dumps(attempt), flush=True)
    final = subprocess.run(command, capture_output=True, text=True)
    resumed_last = "Resuming from" in final.stdout + final.stderr and final.returncode == 0

    reference, ours = load_file(reference_dir / "model.safetensors"), load_file(campaign_dir / "model.safetensors")
    identical = reference.keys() == ours.keys() and all(torch.equal(reference[k], ours[k]) for k in reference)
    kills = [a for a in attempts if not a["finished_before_kill"]]
    resumes = [a["resumed_from_newest"] for a in attempts[1:]] + [resumed_last]
    report = {
        "kills": len(kills),
        "kills_during_checkpoint_writes": sum(a["killed_at"] == "checkpoint write" for a in kills),
        "resumes": len(resumes),
        "resumes_succeeded": sum(resumes),
        "final_parameters_identical": identical,
        "steps": args.steps,
    }
    print(f"{report['resumes_succeeded']} of {report['resumes']} resumes succeeded; final parameters "
          f"{'identical to' if identical else 'DIFFERENT from'} the uninterrupted run")  # fmt: skip
    print(json.dumps(report))


if __name__ == "__main__":
    main()
