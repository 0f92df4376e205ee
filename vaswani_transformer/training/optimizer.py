"""The optimizer of §5.3: Adam with beta_1 = 0.9, beta_2 = 0.98, epsilon = 1e-9, and the learning rate of Eq. 3."""

from collections.abc import Callable

import torch

from .config import TrainingConfig


def inverse_square_root_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> Callable[[int], float]:
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5) (§5.3, Eq. 3).

    Args:
        d_model: the model width (512 for base, 1024 for big).
        warmup_steps: the linear warm-up, in optimizer steps (the paper: 4000); positive.
        scale: a factor on the whole schedule (the paper: 1).

    Returns:
        A function of the 0-based optimizer step for `torch.optim.lr_scheduler.LambdaLR` with a base
        learning rate of 1: it rises linearly for `warmup_steps` steps and then decays as 1/sqrt(step).
        Calling it raises ZeroDivisionError if `warmup_steps` is 0 (`TrainingConfig` refuses that).
    """

    def learning_rate(step: int) -> float:
        step += 1  # the paper counts from 1
        return scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)

    return learning_rate


def adam_with_schedule(
    model: torch.nn.Module, config: TrainingConfig, device: torch.device
) -> tuple[torch.optim.Adam, torch.optim.lr_scheduler.LambdaLR]:
    """Adam over `model`'s parameters and its learning rate of Eq. 3, stepped once per optimizer step (§5.3).

    Args:
        model: the model to train, before Accelerate prepares it; its `config.d_model` scales the rate.
        config: the run's settings (`adam_beta1`, `adam_beta2`, `adam_epsilon`, `warmup_steps`,
            `learning_rate_scale`).
        device: the device training runs on: on CPUs and CUDA GPUs Adam updates every parameter in one kernel.

    Returns:
        (optimizer, scheduler): Adam with a base learning rate of 1, and the `LambdaLR` that scales it by
        `inverse_square_root_schedule` (the first step's rate already set).
    """
    optimizer = torch.optim.Adam(
        model.parameters(),
        lr=1.0,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
        # One kernel for all parameters instead of a loop over them (docs/performance.md, "Fused Adam").
        # Other devices keep PyTorch's default implementation.
        fused=True if device.type in ("cpu", "cuda") else None,
    )
    schedule = inverse_square_root_schedule(model.config.d_model, config.warmup_steps, config.learning_rate_scale)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
