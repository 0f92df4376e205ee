"""FSDP and DeepSpeed ZeRO-2 on two CPU processes (gloo): whole checkpoints, and a killed run resumes bitwise.

The runs go through `scripts/accelerate/`'s configuration files and `sharded_on_cpu.py`, which lets
Accelerate use FSDP (version 2) and DeepSpeed on CPUs. DeepSpeed is not a dependency of the project:
its test runs where it is installed (its first run on a machine compiles a communication kernel).
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import cli_arguments, free_port, mini_run, read_log
from safetensors.torch import load_file

from vaswani_transformer import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani_transformer.training import checkpoints as ckpt

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_OPTIONS = {
    "fsdp": ["--config_file", "scripts/accelerate/fsdp.yaml", "--fsdp_version", "2"],  # FSDP1 refuses CPUs
    "deepspeed": ["--config_file", "scripts/accelerate/deepspeed_zero2.yaml"],
}


def launch(backend: str, config) -> subprocess.Popen:
    """`accelerate launch` of `vaswani-transformer train` on two CPU processes with `backend`."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", *LAUNCH_OPTIONS[backend], "--num_processes", "2",
        "--main_process_port", str(free_port()), "--num_cpu_threads_per_process", "1",
        str(ROOT / "tests" / "sharded_on_cpu.py"), *cli_arguments(config),
    ]  # fmt: skip
    environment = {**os.environ, "DS_ACCELERATOR": "cpu"}
    return subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def finish(process: subprocess.Popen) -> None:
    _, errors = process.communicate(timeout=300)
    assert process.returncode == 0, errors.decode()[-4000:]


def assert_bitwise_equal(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    different = [name for name in left if not torch.equal(left[name], right[name])]
    assert not different, f"parameters differ: {different}"


@pytest.mark.heavy
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_a_sharded_run_killed_after_a_checkpoint_resumes_to_the_same_whole_parameters(backend, mini_corpus, tmp_path):
    if backend == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    # bf16: float32 weights (DeepSpeed: float32 masters of bf16 module weights), bf16 compute. BLEU at every
    # validation: the main process translates with the whole model while the others wait.
    settings = dict(mixed_precision="bf16", bleu_sentences=4)
    finish(launch(backend, mini_run(mini_corpus, tmp_path / "uninterrupted", **settings)))

    killed = launch(backend, mini_run(mini_corpus, tmp_path / "killed", **settings))
    checkpoints = tmp_path / "killed" / "checkpoints"
    deadline = time.monotonic() + 300
    while not (checkpoints / "step-6").exists() and killed.poll() is None:
        assert time.monotonic() < deadline, "the training run did not reach its checkpoint"
        time.sleep(0.01)
    launcher = psutil.Process(killed.pid)
    for process in [launcher, *launcher.children(recursive=True)]:  # the launcher and its training processes
        process.kill()
    killed.communicate()
    assert killed.returncode == -signal.SIGKILL, "the run ended before it was killed"
    finish(launch(backend, mini_run(mini_corpus, tmp_path / "killed", resume=True, **settings)))

    kept = [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path / "uninterrupted" / "checkpoints")]
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(checkpoints)] == kept
    last = ckpt.list_checkpoints(checkpoints)[-2:]
    assert [ckpt.checkpoint_step(p) for p in last] == [9, 12]
    reference = ckpt.load_weights(tmp_path / "uninterrupted" / "checkpoints" / "step-12")
    assert_bitwise_equal(ckpt.load_weights(last[-1]), reference)
    final = load_file(tmp_path / "killed" / "model.safetensors")
    assert_bitwise_equal(final, load_file(tmp_path / "uninterrupted" / "model.safetensors"))
    log = read_log(tmp_path / "killed")
    assert [r["step"] for r in log] == list(range(1, 13)), "a resumed run logs every step exactly once"
    assert [r["train_loss"] for r in log] == [r["train_loss"] for r in read_log(tmp_path / "uninterrupted")]

    # The checkpoints hold the whole model in float32, as one process writes it, and the model is their average.
    model = VaswaniForConditionalGeneration(VaswaniConfig.from_pretrained(tmp_path / "killed"))
    whole = {name: (t.shape, torch.float32) for name, t in ckpt.model_state(model).items()}
    assert {name: (t.shape, t.dtype) for name, t in ckpt.load_weights(last[-1]).items()} == whole
    averaged = ckpt.average_checkpoints(last)
    assert_bitwise_equal({name: final[name] for name in averaged}, averaged)
    files = json.loads((last[-1] / ckpt.STATE_NAME).read_text())["files"]
    if backend == "fsdp":  # the whole optimizer state, gathered and keyed by parameter name
        optimizer = ckpt.load_optimizer_state(last[-1])["optimizer"]
        assert set(optimizer["state"]) == set(whole) and not any(n.startswith("optimizer-") for n in files)
    else:  # each process's ZeRO partition
        assert {name for name in files if name.startswith("optimizer-")} == {"optimizer-0.pt", "optimizer-1.pt"}
