"""§5.3: Adam's settings and the learning rate of Eq. 3, as the optimizer of a run steps them."""

import pytest
import torch
from conftest import MINI_MODEL

from vaswani_transformer.training.config import TrainingConfig
from vaswani_transformer.training.optimizer import adam_with_schedule, inverse_square_root_schedule


def test_learning_rate_schedule_is_equation_3():
    rate = inverse_square_root_schedule(d_model=512, warmup_steps=4000)
    for step in (1, 100, 3999, 4000, 4001, 100_000):
        expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
        assert rate(step - 1) == pytest.approx(expected)
    peak = max(range(1, 10_000), key=lambda s: rate(s - 1))
    assert peak == 4000


def test_adam_is_the_papers_and_its_rate_follows_equation_3_step_by_step():
    from vaswani_transformer.model.modeling_vaswani import VaswaniConfig, VaswaniForConditionalGeneration

    model = VaswaniForConditionalGeneration(VaswaniConfig.from_preset("tiny", vocab_size=64, **MINI_MODEL))
    config = TrainingConfig(data="unused", source_lang="en", target_lang="de", output_dir="unused", max_steps=1,
                            warmup_steps=3, learning_rate_scale=2.0)  # fmt: skip
    optimizer, scheduler = adam_with_schedule(model, config, torch.device("cpu"))
    group = optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9 and group["fused"]
    rate = inverse_square_root_schedule(model.config.d_model, warmup_steps=3, scale=2.0)
    seen = []
    for _ in range(6):
        seen.append(group["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == [pytest.approx(rate(step)) for step in range(6)]
    assert max(range(6), key=seen.__getitem__) == 2  # the peak at the last warm-up step
