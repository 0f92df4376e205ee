"""The progress of a `train` run, in one object that its steps, validation and checkpoints share.

`RunState` is what a checkpoint saves besides the weights and the optimizer (`trainer_state.json`), so that a
killed run resumes where it was, and the clocks and sums that only the running process needs. The collaborators of
`run.TrainingRun` receive it explicitly; none of them keeps progress of its own, and they change it through its
methods only, so that what a step, a validation or a checkpoint does to it is read here.
"""

import time
from dataclasses import dataclass, field

import torch

# The fields a checkpoint saves, in the order `trainer_state.json` lists them.
_SAVED = (
    "step", "epoch", "batches_done", "elapsed_seconds", "skipped_nonfinite",
    "best_step", "best_score", "validations_without_improvement", "world_size",
)  # fmt: skip


@dataclass(eq=False)
class RunState:
    """How far a run is (saved with every checkpoint), and the clocks and sums since its last log record.

    Saved with every checkpoint (`to_checkpoint`) and restored from it (`from_checkpoint`):

    Attributes:
        world_size: the number of processes; a checkpoint resumes only on as many (each has its RNG state).
        step: optimizer steps done (§5.3's step number; the schedule's too).
        epoch, batches_done: where the stream of training batches is (`batches.endless_batches`).
        elapsed_seconds: training time before the last checkpoint, resumed runs included (`max_minutes`).
        skipped_nonfinite: steps skipped for a non-finite loss (`skip_nonfinite`).
        best_step, best_score: the best validation so far (score: the loss in nats per target token, or minus
            BLEU with `bleu_sentences`; lower is better), None before the first.
        validations_without_improvement: validations in a row that did not beat the best (early stopping).
        interval: summed loss (nats), target tokens and model FLOPs since the last log record, over all
            processes; a float64 tensor of shape (3,) on the run's device, saved as a list so that a resumed
            run's first record covers the steps before the kill too.

    Not saved, for this process only:

    Attributes:
        started: `time.monotonic()` at which the run would have started had it never been killed.
        interval_started: `time.monotonic()` at the last log record, for the speed over the interval.
        last_save: `time.monotonic()` at the last checkpoint (`save_minutes`).
        learning_rate: the rate (Eq. 3) of the last optimizer step, for the log; None before the first.
    """

    world_size: int
    step: int = 0
    epoch: int = 0
    batches_done: int = 0
    elapsed_seconds: float = 0.0
    skipped_nonfinite: int = 0
    best_step: int | None = None
    best_score: float | None = None
    validations_without_improvement: int = 0
    interval: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))
    started: float = 0.0
    interval_started: float = 0.0
    last_save: float = 0.0
    learning_rate: float | None = None

    @classmethod
    def from_checkpoint(cls, saved: dict | None, world_size: int, device: torch.device) -> "RunState":
        """A new run's state (`saved` None), or that of the checkpoint it resumes from; call `start_clocks` next.

        Args:
            saved: a checkpoint's `trainer_state.json` (`checkpoints.verify_checkpoint`); keys that are not
                fields (its file checksums) are left out, and fields it lacks take their defaults.
            world_size: the number of processes of this run, for a new run's state.
            device: where `interval` goes (the sums over processes are reduced there).
        """
        saved = saved or {"world_size": world_size}
        state = cls(**{name: saved[name] for name in _SAVED if name in saved})
        # Checkpoints of earlier versions counted no FLOPs: their interval has two sums.
        interval = [*saved.get("interval", ()), 0.0, 0.0, 0.0][:3]
        state.interval = torch.tensor(interval, dtype=torch.float64, device=device)
        return state

    def start_clocks(self) -> None:
        """Start the clocks as the first step is about to run: a resumed run goes on from its `elapsed_seconds`."""
        now = time.monotonic()
        self.started = now - self.elapsed_seconds
        self.interval_started = now
        self.last_save = now

    def count_update(self, learning_rate: float, epoch: int, batches_done: int, sums: torch.Tensor) -> None:
        """Count an optimizer step that was applied.

        Args:
            learning_rate: the rate it used (Eq. 3).
            epoch, batches_done: the position in the training batches after its last micro-batch.
            sums: its summed loss (nats), target tokens and model FLOPs over all processes, added to `interval`.
        """
        self.learning_rate = learning_rate
        self.step += 1
        self.epoch, self.batches_done = epoch, batches_done
        self.interval += sums

    def count_skipped(self, epoch: int, batches_done: int) -> None:
        """Count a step skipped for its non-finite loss, whose batches are consumed all the same (`skip_nonfinite`)."""
        self.skipped_nonfinite += 1
        self.epoch, self.batches_done = epoch, batches_done

    def count_validation(self, score: float) -> bool:
        """Compare a validation's score with the best (lower is better); True, and it becomes the best, if it beats it.

        The first of equal scores stays the best; a score that does not beat it counts one more validation
        without improvement (early stopping).
        """
        if self.best_score is None or score < self.best_score:
            self.best_score, self.best_step, self.validations_without_improvement = score, self.step, 0
            return True
        self.validations_without_improvement += 1
        return False

    def restart_interval(self) -> None:
        """Count the next log record's speed from now: the validation and checkpoint after a record are not steps."""
        self.interval_started = time.monotonic()

    def mark_saved(self) -> None:
        """Restart the clock of `save_minutes`: a checkpoint was just written."""
        self.last_save = time.monotonic()

    def to_checkpoint(self) -> dict:
        """The progress to save in a checkpoint now, `elapsed_seconds` brought up to date: JSON-serialisable."""
        self.elapsed_seconds = time.monotonic() - self.started
        return {**{name: getattr(self, name) for name in _SAVED}, "interval": self.interval.tolist()}
