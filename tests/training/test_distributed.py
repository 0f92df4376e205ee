"""Data parallelism: two processes (gloo on CPU) under `accelerate launch` train like one with the same global batch."""

import subprocess
import sys

import pytest
import torch
from conftest import cli_arguments, free_port, mini_run, read_log
from safetensors.torch import load_file

from vaswani_transformer.training.run import train


@pytest.mark.heavy
def test_two_processes_keep_identical_parameters_and_follow_the_single_process_loss(mini_corpus, tmp_path):
    # No dropout, so that the processes' random draws do not matter; one process accumulating two
    # batches per step sees exactly the batches that two processes see together.
    settings = dict(model_overrides={**mini_run(mini_corpus, "-").model_overrides, "dropout": 0.0}, max_steps=8)
    single = train(mini_run(mini_corpus, tmp_path / "single", update_freq=2, **settings))

    # A data cache of its own: the processes find no prepared corpus, and one of them prepares it for both.
    parallel = mini_run(mini_corpus, tmp_path / "parallel", data_cache_dir=str(tmp_path / "cache"), **settings)
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
        "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1", "-m", "vaswani_transformer.cli",
    ]  # fmt: skip
    result = subprocess.run([*launch, *cli_arguments(parallel)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stderr.count("Tokenizing train:   0%") == 1, "one process prepares the corpus, the other opens it"

    single_log, parallel_log = read_log(single), read_log(tmp_path / "parallel")
    assert [r["step"] for r in parallel_log] == list(range(1, 9))
    for ours, theirs in zip(parallel_log, single_log, strict=True):
        assert abs(ours["train_loss"] - theirs["train_loss"]) < 1e-4, (ours, theirs)
    checksums = parallel_log[-1]["replica_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1], "the two processes' parameters differ"
    for name, tensor in load_file(single / "model.safetensors").items():
        torch.testing.assert_close(
            load_file(tmp_path / "parallel" / "model.safetensors")[name], tensor, atol=1e-4, rtol=0
        )
