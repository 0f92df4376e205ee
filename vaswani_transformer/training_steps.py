"""The steps of a `train` run: one optimizer update from token batches (§5.1, §5.3), and what follows it.

After each update the step number and the clock say whether to log (the loss, the speed and the model FLOPs
utilisation, `flops`), to validate (`training_validation`), to checkpoint (`training_checkpoints`), and whether
the run is over.
"""

import contextlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from tqdm.auto import tqdm

from . import checkpoints as ckpt
from .flops import training_flops
from .modeling_vaswani import VaswaniForConditionalGeneration
from .training_config import TrainingConfig
from .training_devices import broadcast_from_main


class NonFiniteLossError(ValueError):
    """The loss of an optimizer step (§5.4, label-smoothed) became NaN or infinite.

    Raised by `train` before the weights are updated with it, so the last checkpoint and the model
    in memory are both good; `TrainingConfig.skip_nonfinite` skips such steps instead.
    """


def _parameter_checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


class RunSteps:
    """A `TrainingRun`'s optimizer steps, and the logging, validation and checkpoints that the step and clock call for.

    A part of `training.TrainingRun`, which sets what it reads: the run's `config`, `accelerator`, `model` (as
    Accelerate prepared it) and `unwrapped`, `optimizer` and `scheduler` (§5.3), `stream` (the endless
    micro-batches, `training_data.micro_batches`), `valid_batches`, `state`, `interval` (summed loss, target
    tokens and model FLOPs since the last log record), `max_steps`, `started`, `interval_started`, `last_save`,
    `peak_flops`, `progress`, `log_path` and `checkpoints_dir`. It validates with `validate`
    (`training_validation.RunValidation`) and saves with `save_checkpoint` (`training_checkpoints.RunCheckpoints`).
    """

    config: TrainingConfig
    accelerator: Accelerator
    model: torch.nn.Module
    unwrapped: VaswaniForConditionalGeneration
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    stream: Iterator[tuple[int, int, dict]]
    valid_batches: torch.utils.data.DataLoader | None
    state: dict
    interval: torch.Tensor
    max_steps: float
    started: float
    interval_started: float
    last_save: float
    peak_flops: float | None
    progress: tqdm
    log_path: Path
    checkpoints_dir: Path

    def optimizer_step(self) -> torch.Tensor | None:
        """One update from `update_freq` batches per process (§5.1, §5.3); its loss, or None if it was skipped.

        Returns:
            The label-smoothed loss of the step (§5.4), a float64 scalar tensor in nats per target token,
            averaged over every process's batches; None for a non-finite loss skipped by `skip_nonfinite`
            (the weights and the step count are then unchanged, the batches are consumed).

        Raises:
            NonFiniteLossError: the loss is NaN or infinite and `skip_nonfinite` is off.
            MemoryError: a batch did not fit on the device.
        """
        accelerator, state = self.accelerator, self.state
        micro_batches = [next(self.stream) for _ in range(self.config.update_freq)]
        tokens = sum(batch["labels"].ne(-100).sum() for _, _, batch in micro_batches)
        flops = sum(training_flops(self.unwrapped.config, b["attention_mask"], b["labels"]) for *_, b in micro_batches)
        counts = torch.stack([tokens.double(), torch.tensor(flops, dtype=torch.float64)]).to(accelerator.device)
        global_tokens, global_flops = accelerator.reduce(counts, reduction="sum")
        # DDP averages gradients over processes: dividing by (all tokens / processes) gives sum / all tokens.
        normaliser = global_tokens / accelerator.num_processes
        step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        for index, (_, _, batch) in enumerate(micro_batches):
            step_loss += self._backward(batch, normaliser, last=index == len(micro_batches) - 1)
        # The loss of the whole step, over every process: all processes agree on what follows.
        step_loss = accelerator.reduce(step_loss, reduction="sum") / accelerator.num_processes
        if not torch.isfinite(step_loss):
            self._skip_nonfinite(step_loss)
            state["epoch"], state["batches_done"] = micro_batches[-1][:2]
            return None
        self.learning_rate = self.optimizer.param_groups[0]["lr"]  # this step's rate (Eq. 3), for the log
        self.optimizer.step()
        if not accelerator.optimizer_step_was_skipped:  # fp16 loss scaling skips steps with overflowing gradients
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        state["step"] += 1
        state["epoch"], state["batches_done"] = micro_batches[-1][:2]
        self.interval += torch.stack([step_loss * global_tokens, global_tokens, global_flops])
        return step_loss

    def _backward(self, batch: dict, normaliser: torch.Tensor, last: bool) -> torch.Tensor:
        # Gradients of one batch's share of the step's loss; processes synchronise on the last batch only.
        accelerator = self.accelerator
        sync = contextlib.nullcontext() if last else accelerator.no_sync(self.model)
        try:
            with sync:
                loss = self.model(**batch.to(accelerator.device), num_items_in_batch=normaliser).loss
                accelerator.backward(loss)
        except torch.OutOfMemoryError as error:
            raise MemoryError(
                f"Out of memory on {accelerator.device} with a batch of {tuple(batch['input_ids'].shape)} tokens: "
                f"lower --max-tokens (now {self.config.max_tokens}) and raise --update-freq to keep the batch size."
            ) from error
        return loss.detach().double()

    def _skip_nonfinite(self, step_loss: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if not self.config.skip_nonfinite:
            latest = ckpt.list_checkpoints(self.checkpoints_dir)
            raise NonFiniteLossError(
                f"The loss is {float(step_loss)} at step {self.state['step'] + 1}; training stopped without applying "
                f"it. Last good checkpoint: {latest[-1] if latest else 'none'} (continue with --resume, perhaps "
                "with a lower --learning-rate-scale), or pass --skip-nonfinite to skip such batches."
            )
        self.state["skipped_nonfinite"] += 1
        self.accelerator.print(
            f"Skipped a batch with loss {float(step_loss)} ({self.state['skipped_nonfinite']} so far)."
        )

    def ended(self) -> bool:
        """Whether the run resumed at its end (steps or minutes spent, patience out): it then only finishes (§6.1)."""
        config, state = self.config, self.state
        patience = config.early_stopping_patience
        return (
            state["step"] >= self.max_steps
            or state["elapsed_seconds"] >= 60 * (config.max_minutes or math.inf)
            or (patience is not None and state["validations_without_improvement"] >= patience)
        )

    def after_step(self, step_loss: torch.Tensor) -> bool:
        """Log, validate and checkpoint as the step number and the clock say; True when the run is over.

        Args:
            step_loss: the loss `optimizer_step` returned (nats per target token), for the progress bar.

        Returns:
            True once `max_steps` steps are done, `max_minutes` minutes have passed (a deadline the main
            process reads for all), or early stopping's patience ran out.
        """
        config, step = self.config, self.state["step"]
        self.progress.update(1)
        self.progress.set_postfix(loss=f"{float(step_loss):.3f}", lr=f"{self.learning_rate:.2e}")
        # Deadlines are read on the main process and shared, so that every process stops and saves alike.
        clock = torch.tensor(
            [time.monotonic() - self.started >= 60 * (config.max_minutes or math.inf),
             time.monotonic() - self.last_save >= 60 * (config.save_minutes or math.inf)],
            device=self.accelerator.device,
        ).float()  # fmt: skip
        out_of_time, save_due = (bool(flag) for flag in broadcast_from_main(self.accelerator, clock))
        done = step >= self.max_steps or out_of_time
        record = {}
        if step % config.log_steps == 0 or step % config.eval_steps == 0 or done:
            now = time.monotonic()
            record = {
                "step": step,
                "epoch": self.state["epoch"],
                "train_loss": float(self.interval[0] / self.interval[1]),
                "learning_rate": self.learning_rate,
                "minutes": round((now - self.started) / 60, 3),
                # Over the steps since the last record, on all processes; validation and checkpoints excluded.
                "target_tokens_per_second": round(float(self.interval[1]) / max(now - self.interval_started, 1e-9)),
            }
            record.update(self._utilization(float(self.interval[2]), now - self.interval_started))
            self.interval.zero_()
        if self.valid_batches is not None and (step % config.eval_steps == 0 or done):
            improved, patience_over = self.validate(record)
            save_due, done = save_due or improved, done or patience_over
        if record:
            self._log(record, done)
        if (config.save_steps and step % config.save_steps == 0) or save_due or done:
            self.save_checkpoint()
        if record:
            self.interval_started = time.monotonic()
        return done

    def _utilization(self, flops: float, seconds: float) -> dict:
        # Model FLOPs per second over all processes (`flops.training_flops`) and, where the peak is known, MFU.
        achieved = flops / max(seconds, 1e-9)
        utilization = {"model_tflops_per_second": float(f"{achieved / 1e12:.4g}")}
        if self.peak_flops:
            utilization["mfu"] = float(f"{achieved / (self.peak_flops * self.accelerator.num_processes):.4g}")
        return utilization

    def _log(self, record: dict, done: bool) -> None:
        accelerator = self.accelerator
        record["skipped_nonfinite"] = self.state["skipped_nonfinite"]
        if done and accelerator.num_processes > 1 and accelerator.distributed_type != DistributedType.FSDP:
            # Data parallelism keeps replicas identical; a differing sum would reveal a desynchronised process
            # (FSDP's processes hold different shards, whose sums differ by design).
            sums = accelerator.gather(torch.tensor([_parameter_checksum(self.unwrapped)], device=accelerator.device))
            record["replica_checksums"] = sums.tolist()
        self.progress.write(json.dumps(record))
        if accelerator.is_main_process:
            with self.log_path.open("a") as log:
                log.write(json.dumps(record) + "\n")
        accelerator.log({k: v for k, v in record.items() if isinstance(v, float)}, step=record["step"])
