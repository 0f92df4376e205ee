"""The steps of a `train` run: one optimizer update from token batches (§5.1, §5.3), and the log of them.

`StepLoop` makes the updates and counts them in the run's `state.RunState`; `StepLog` shows them on the progress
bar and writes the records of `training_log.jsonl` (the loss, the speed and the model FLOPs utilisation, `flops`).
When to log, validate and checkpoint is `run.TrainingRun.after_step`'s decision.
"""

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from tqdm.auto import tqdm

from ..model.modeling_vaswani import VaswaniForConditionalGeneration
from ..utils.files import read_log
from . import checkpoints as ckpt
from .config import TrainingConfig
from .flops import training_flops
from .state import RunState


class NonFiniteLossError(ValueError):
    """The loss of an optimizer step (§5.4, label-smoothed) became NaN or infinite.

    Raised by `train` before the weights are updated with it, so the last checkpoint and the model
    in memory are both good; `TrainingConfig.skip_nonfinite` skips such steps instead.
    """


def _parameter_checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


class StepLoop:
    """The optimizer updates of a run (§5.1, §5.3): `update_freq` token batches per process, one Adam step.

    Args:
        config: the run's settings (`update_freq`, `max_tokens`, `skip_nonfinite`).
        accelerator: the run's processes; `model` and `optimizer` as its `prepare` returned them.
        model: the model to train, as Accelerate prepared it (data parallel, FSDP, DeepSpeed, or itself).
        unwrapped: the model itself, whose configuration counts the FLOPs (`flops.training_flops`).
        optimizer, scheduler: Adam and the schedule of Eq. 3 (`optimizer.adam_with_schedule`).
        stream: the endless batches of this process (`batches.endless_batches`), from the run's position.
        state: the run's progress; each update advances `step`, `epoch`, `batches_done` and `interval`,
            sets `learning_rate`, and a skipped one counts in `skipped_nonfinite` (`RunState.count_update`,
            `RunState.count_skipped`).
        checkpoints_dir: where the run's checkpoints are, for the message of `NonFiniteLossError`.
    """

    def __init__(
        self,
        config: TrainingConfig,
        accelerator: Accelerator,
        model: torch.nn.Module,
        unwrapped: VaswaniForConditionalGeneration,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LambdaLR,
        stream: Iterator[tuple[int, int, dict]],
        state: RunState,
        checkpoints_dir: Path,
    ) -> None:
        self.config, self.accelerator = config, accelerator
        self.model, self.unwrapped = model, unwrapped
        self.optimizer, self.scheduler = optimizer, scheduler
        self.stream, self.state, self.checkpoints_dir = stream, state, checkpoints_dir

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
        accelerator = self.accelerator
        accumulated = [next(self.stream) for _ in range(self.config.update_freq)]
        tokens = sum(batch["labels"].ne(-100).sum() for _, _, batch in accumulated)
        flops = sum(training_flops(self.unwrapped.config, b["attention_mask"], b["labels"]) for *_, b in accumulated)
        counts = torch.stack([tokens.double(), torch.tensor(flops, dtype=torch.float64)]).to(accelerator.device)
        global_tokens, global_flops = accelerator.reduce(counts, reduction="sum")
        # DDP averages gradients over processes: dividing by (all tokens / processes) gives sum / all tokens.
        normaliser = global_tokens / accelerator.num_processes
        step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        for index, (_, _, batch) in enumerate(accumulated):
            step_loss += self._backward(batch, normaliser, last=index == len(accumulated) - 1)
        # The loss of the whole step, over every process: all processes agree on what follows.
        step_loss = accelerator.reduce(step_loss, reduction="sum") / accelerator.num_processes
        epoch, batches_done = accumulated[-1][:2]
        if not torch.isfinite(step_loss):
            self._skip_nonfinite(step_loss, epoch, batches_done)
            return None
        learning_rate = self.optimizer.param_groups[0]["lr"]  # this step's rate (Eq. 3), before the schedule moves on
        self.optimizer.step()
        if not accelerator.optimizer_step_was_skipped:  # fp16 loss scaling skips steps with overflowing gradients
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.stack([step_loss * global_tokens, global_tokens, global_flops])
        self.state.count_update(learning_rate, epoch, batches_done, sums)
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

    def _skip_nonfinite(self, step_loss: torch.Tensor, epoch: int, batches_done: int) -> None:
        # Gradients dropped, and the step counted as skipped (the batches consumed), or refused.
        self.optimizer.zero_grad(set_to_none=True)
        if not self.config.skip_nonfinite:
            latest = ckpt.list_checkpoints(self.checkpoints_dir)
            raise NonFiniteLossError(
                f"The loss is {float(step_loss)} at step {self.state.step + 1}; training stopped without applying "
                f"it. Last good checkpoint: {latest[-1] if latest else 'none'} (continue with --resume, perhaps "
                "with a lower --learning-rate-scale), or pass --skip-nonfinite to skip such batches."
            )
        self.state.count_skipped(epoch, batches_done)
        self.accelerator.print(f"Skipped a batch with loss {float(step_loss)} ({self.state.skipped_nonfinite} so far).")


def cut_log(log_path: Path, step: int, accelerator: Accelerator) -> None:
    """Keep the records of `training_log.jsonl` up to `step` only: what a killed run logged after its checkpoint goes.

    Args:
        log_path: the run's `training_log.jsonl`; it need not exist (a new run), and is then created empty.
        step: the step the run starts from (0, or its checkpoint's).
        accelerator: the main process alone writes.
    """
    records = read_log(log_path) if log_path.is_file() else []
    if accelerator.is_main_process:
        kept = "".join(json.dumps(r) + "\n" for r in records if r["step"] <= step)
        ckpt.write_text_atomically(log_path, kept)


class StepLog:
    """The progress bar of a run's steps and its `training_log.jsonl`: loss, speed and model FLOPs utilisation.

    Args:
        accelerator: the run's processes (the main process writes the file; the trackers of `report_to`).
        unwrapped: the model itself, whose replicas' checksums the last record compares.
        state: the run's progress: the step, and the sums and clocks of the interval since the last record.
        log_path: the run's `training_log.jsonl`, appended one JSON line per record.
        max_steps: the bar's length (None: the run is capped by minutes alone).
        peak_flops: the device's peak FLOP/s for the MFU (`flops.peak_flops`, or `peak_tflops`); None: unknown.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        unwrapped: VaswaniForConditionalGeneration,
        state: RunState,
        log_path: Path,
        max_steps: int | None,
        peak_flops: float | None,
    ) -> None:
        self.accelerator, self.unwrapped, self.state = accelerator, unwrapped, state
        self.log_path, self.peak_flops = log_path, peak_flops
        self.progress = tqdm(
            total=max_steps, initial=state.step, desc="Training", unit="step",
            disable=not accelerator.is_local_main_process,
        )  # fmt: skip

    def close(self) -> None:
        """End the progress bar, so that nothing printed after it joins its line; closing twice does nothing."""
        self.progress.close()

    def advance(self, step_loss: torch.Tensor) -> None:
        """Move the progress bar on by the step just made, showing its loss (nats per target token) and rate."""
        self.progress.update(1)
        self.progress.set_postfix(loss=f"{float(step_loss):.3f}", lr=f"{self.state.learning_rate:.2e}")

    def interval_record(self) -> dict:
        """The record of the steps since the last one, and the sums of the interval set back to zero.

        Returns:
            `step`, `epoch`, `train_loss` (nats per target token over the interval), `learning_rate` (of the
            last step, Eq. 3), `minutes` (of training so far), `target_tokens_per_second` and
            `model_tflops_per_second` over all processes (validation and checkpoints excluded), and `mfu`
            where the peak is known.
        """
        state, now = self.state, time.monotonic()
        record = {
            "step": state.step,
            "epoch": state.epoch,
            "train_loss": float(state.interval[0] / state.interval[1]),
            "learning_rate": state.learning_rate,
            "minutes": round((now - state.started) / 60, 3),
            "target_tokens_per_second": round(float(state.interval[1]) / max(now - state.interval_started, 1e-9)),
        }
        record.update(self._utilization(float(state.interval[2]), now - state.interval_started))
        state.interval.zero_()
        return record

    def _utilization(self, flops: float, seconds: float) -> dict:
        # Model FLOPs per second over all processes (`flops.training_flops`) and, where the peak is known, MFU.
        achieved = flops / max(seconds, 1e-9)
        utilization = {"model_tflops_per_second": float(f"{achieved / 1e12:.4g}")}
        if self.peak_flops:
            utilization["mfu"] = float(f"{achieved / (self.peak_flops * self.accelerator.num_processes):.4g}")
        return utilization

    def write(self, record: dict, done: bool) -> None:
        """Show `record` and append it to the log and the trackers, with the skipped steps so far.

        Args:
            record: from `interval_record`, with the validation's scores if any (`validation.Validator`).
            done: the run's last record: with several data-parallel processes, it gains `replica_checksums`
                (each process's sum of its parameters), which differ only where a process fell out of step.
        """
        accelerator = self.accelerator
        record["skipped_nonfinite"] = self.state.skipped_nonfinite
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
