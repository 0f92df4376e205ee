"""The processes and precision of a run: `--mixed-precision auto` chosen once per run, a fresh Accelerate state."""

import json

import pytest
import torch
from accelerate.state import AcceleratorState
from conftest import mini_run, read_log


def test_mixed_precision_auto_is_chosen_once_per_run_and_recorded(mini_corpus, tmp_path, monkeypatch):
    from vaswani_transformer.training import devices as training_devices
    from vaswani_transformer.training import run as training

    with pytest.raises(ValueError, match="mixed_precision must be one of no, bf16, fp16, auto"):
        mini_run(mini_corpus, tmp_path / "refused", mixed_precision="bf32")
    for faster, expected in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr(training_devices, "bfloat16_products_are_faster", lambda faster=faster: faster)
        assert training_devices.fastest_mixed_precision(torch.device("cpu")) == expected
    assert training_devices.fastest_mixed_precision(torch.device("meta")) == "no"
    measured, precisions, accelerator = [], [], training_devices.Accelerator
    monkeypatch.setattr(
        training_devices, "Accelerator", lambda **kw: precisions.append(kw["mixed_precision"]) or accelerator(**kw)
    )

    def run(max_steps, measures_as):
        monkeypatch.setattr(
            training_devices, "fastest_mixed_precision", lambda d: measured.append(d.type) or measures_as
        )
        config = mini_run(mini_corpus, tmp_path / "run", max_steps=max_steps, save_steps=1, mixed_precision="auto")
        config.resume = True
        return training.train(config)  # each run starts Accelerate's state afresh, as a process of its own would

    output = run(2, measures_as="bf16")
    assert measured == ["cpu"] and precisions == ["bf16"]
    assert json.loads((output / "training_config.json").read_text())["mixed_precision"] == "bf16"
    assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in read_log(output) if "train_loss" in r)
    # Resumed, the run keeps the precision it started with rather than measuring again...
    run(3, measures_as="no")
    assert measured == ["cpu"] and precisions == ["bf16", "bf16"]
    assert [r["step"] for r in read_log(output) if "train_loss" in r][-1] == 3
    # ... unless its record is unreadable: then it measures again, rather than leave other processes waiting.
    (output / "training_config.json").write_text("{")
    resumed = mini_run(mini_corpus, output, max_steps=4, mixed_precision="auto", resume=True)
    assert training_devices.resolve_mixed_precision(resumed, launched_on_cpus=False) == "no"
    assert measured == ["cpu", "cpu"]


def test_two_runs_in_one_python_session_may_train_in_different_precisions(mini_corpus, tmp_path):
    # A notebook trains in float32, then in bf16: Accelerate's per-process state would refuse the second.
    from vaswani_transformer.training.run import train

    for precision in ("no", "bf16"):
        output = train(mini_run(mini_corpus, tmp_path / precision, max_steps=3, mixed_precision=precision))
        assert AcceleratorState().mixed_precision == precision  # what the run trained in, not only what it recorded
        assert json.loads((output / "training_config.json").read_text())["mixed_precision"] == precision
        assert (output / "model.safetensors").is_file()
