"""A run's checkpoints: when they are written, and what they hold (more in test_checkpoints.py)."""

import pytest
from conftest import mini_run, read_log

from vaswani_transformer.training.optimizer import inverse_square_root_schedule


def test_checkpoints_by_the_clock_alone_for_a_time_capped_run(mini_corpus, tmp_path):
    from vaswani_transformer.training import checkpoints as ckpt
    from vaswani_transformer.training.run import train

    with pytest.raises(ValueError, match="one must be positive"):
        mini_run(mini_corpus, tmp_path / "refused", save_steps=0)
    with pytest.raises(ValueError, match="must not be negative"):
        mini_run(mini_corpus, tmp_path / "refused", save_minutes=-1)
    # A checkpoint every 10^-6 minutes is one after every step, whatever steps save_steps would have chosen.
    config = mini_run(mini_corpus, tmp_path / "run", max_steps=4, save_steps=0, save_minutes=1e-6, keep_checkpoints=4)
    output = train(config)
    assert [path.name for path in ckpt.list_checkpoints(output / "checkpoints")] == [f"step-{i}" for i in range(1, 5)]
    assert "last 2 checkpoints (steps 3 to 4), 1e-06 minutes apart" in (output / "README.md").read_text()
    # Each step logs the rate its update used: Eq. 3 at that step, the peak at the last warm-up step.
    rate = inverse_square_root_schedule(config.model_overrides["d_model"], config.warmup_steps)
    assert [r["learning_rate"] for r in read_log(output)] == [pytest.approx(rate(step - 1)) for step in range(1, 5)]
