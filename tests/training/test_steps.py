"""The steps of a run: the update of §5.3 from token batches, eager or compiled, and the model FLOPs logged."""

import pytest
from accelerate.state import AcceleratorState
from conftest import mini_run, read_log


@pytest.mark.heavy
def test_compiled_training_follows_eager_training_and_logs_model_flops(mini_corpus, tmp_path, monkeypatch):
    # torch.compile (dynamic shapes, lengths padded to multiples of 8) computes the same steps to float rounding.
    from vaswani_transformer.training import batches as training_data
    from vaswani_transformer.training.run import train

    # The same batches: the eager run padded as the compiled one is, the padding counted in the token budget.
    batches = training_data.token_batches
    monkeypatch.setattr(training_data, "token_batches", lambda *args, pad_to=1: batches(*args[:6], pad_to=8))
    settings = dict(model_overrides={**mini_run(mini_corpus, "-").model_overrides, "dropout": 0.0}, max_steps=4)
    eager = read_log(train(mini_run(mini_corpus, tmp_path / "eager", **settings)))
    monkeypatch.undo()
    compiled = read_log(train(mini_run(mini_corpus, tmp_path / "compiled", compile=True, peak_tflops=0.5, **settings)))
    assert AcceleratorState().dynamo_plugin.backend.value.lower() == "inductor"  # not the eager run's state
    assert [r["step"] for r in compiled] == [1, 2, 3, 4]
    for ours, theirs in zip(compiled, eager, strict=True):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], abs=1e-4)
        assert ours["model_tflops_per_second"] > 0
        assert "mfu" not in theirs  # no peak is known for a CPU
        # the MFU is the model's FLOP/s over the peak given
        assert ours["mfu"] == pytest.approx(ours["model_tflops_per_second"] / 0.5, rel=0.05, abs=1e-4)
