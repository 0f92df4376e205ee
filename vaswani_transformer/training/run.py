"""The paper's training recipe (§5) on Accelerate: token batches, Adam, warm-up, label smoothing.

`train(TrainingConfig(...))` reads a parallel corpus, trains (or loads) the shared BPE
tokenizer, trains a `VaswaniForConditionalGeneration` on one CPU or many devices (data parallel
under `accelerate launch`), checkpoints so that a killed run resumes exactly, averages the last
checkpoints (§6.1), and writes a directory that `from_pretrained` loads. One run at a time holds
an output directory (a lock that the operating system releases when its process ends).

`build_run` sets a run up, in this one place, and returns a `TrainingRun` of explicit collaborators, each a
module of its own: the progress they share (`state.RunState`), the optimizer steps and their log
(`steps.StepLoop`, `steps.StepLog`), validation (`validation.Validator`), checkpoints
(`checkpointer.Checkpointer`) and the end of the run (`finish.Finisher`). The processes and precision are
`devices`', the output directory `directory`'s, the tokenizer and batches `batches`' and `corpus`', Adam and
Eq. 3 `optimizer`'s.
"""

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import PreTrainedTokenizerBase

from ..data.corpora import corpus_fingerprint
from ..inference.config import torch_threads
from ..inference.cpu_kernels import use_pinned_products
from ..model.configuration_vaswani import VaswaniConfig
from ..model.modeling_vaswani import VaswaniForConditionalGeneration
from ..utils.files import ensure_writable, room_for
from . import checkpoints as ckpt
from .batches import endless_batches, run_batches, run_tokenizer
from .checkpointer import Checkpointer, WholeModel, checkpoint_bytes
from .config import TrainingConfig
from .corpus import prepare_corpus
from .devices import (
    avoid_cudnn_attention,
    broadcast_from_main,
    fastest_mixed_precision,
    resolve_mixed_precision,
    start_accelerator,
)
from .directory import check_output_dir, hold_output_dir, read_record
from .finish import Finisher
from .flops import peak_flops
from .optimizer import adam_with_schedule, inverse_square_root_schedule
from .state import RunState
from .steps import NonFiniteLossError, StepLog, StepLoop, cut_log
from .streaming import StreamedBatches
from .validation import ValidationSplit, Validator, validation_loss

# Where the rest of the package, the scripts and users import them from.
__all__ = [
    "NonFiniteLossError",
    "RunData",
    "TrainingConfig",
    "TrainingRun",
    "avoid_cudnn_attention",
    "build_run",
    "fastest_mixed_precision",
    "inverse_square_root_schedule",
    "load_data_and_model",
    "train",
    "validation_loss",
]

logger = logging.getLogger(__name__)


def train(config: TrainingConfig) -> Path:
    """Train a Transformer translator as §5 describes and save it to `config.output_dir`.

    One optimizer step accumulates `update_freq` token-budget batches on every process; its loss
    is the label-smoothed cross entropy summed over all of them and divided by their number of
    target tokens, so that the update is that of one big batch whatever the split (§5.1, §5.4).
    A checkpoint is written every `save_steps` steps, and once `save_minutes` minutes have passed since
    the last one (0 turns either clock off); with `resume`, a run continues from its newest checkpoint
    and ends with the parameters an uninterrupted run would have had (bitwise on CPU). The last
    `average_last` checkpoints are averaged into the model (§6.1). With `prepare_only`, the corpus and
    tokenizer are prepared into the data cache (`corpus.prepare_corpus`) and nothing is trained. PyTorch computes
    on `config.cpu_threads()` CPU threads while the run lasts (`--threads`), and on as many as before after it.

    Args:
        config: the run's settings.

    Returns:
        With `prepare_only`, the prepared corpus's directory. Else the output directory, holding `config.json`,
        `model.safetensors`, `generation_config.json`, the tokenizer files, `training_log.jsonl` (one JSON line
        per log or validation step, with the minutes of training so far, and since the line before the target
        tokens per second, the model TFLOP/s and, where the device's peak is known, the MFU: see `flops`),
        `README.md` (model card), `learning_curve.png` and `checkpoints/` (the last `keep_checkpoints` and the
        best one).

    Raises:
        ValueError, FileNotFoundError: from loading the corpus, or invalid settings; the output directory
            holds a run's checkpoints but `resume` is off (or on, with settings of `RUN_FIELDS` that differ
            from the run's), or a model but no checkpoints; no training batch fits the settings (no pair
            within `max_length`, or fewer batches than processes), or `max_tokens` is below the longest pair.
        OSError: the output directory cannot be written, another run holds it, or its disk has no room for a
            checkpoint or the model (the message says how much is needed; `resume` then continues the run).
        checkpoints.CheckpointError: the checkpoint to resume from is damaged or unsafe (names the last good one).
        NonFiniteLossError: the loss became NaN or infinite and `skip_nonfinite` is off.
        MemoryError: a device ran out of memory (the message names `--max-tokens`).
    """
    with torch_threads(config.cpu_threads()):
        if config.prepare_only:  # one machine prepares what others train on; no output directory is touched
            files = corpus_fingerprint(config.data, config.source_lang, config.target_lang, config.files)
            return prepare_corpus(config, run_tokenizer(config, resuming=False), files).directory
        with build_run(config) as run:  # however the run ends, the output directory is let go
            done = run.ended()
            while not done:
                step_loss = run.steps.optimizer_step()
                if step_loss is not None:  # None: a non-finite loss, skipped
                    done = run.after_step(step_loss)
            return run.finish()


@dataclass(eq=False)
class TrainingRun:
    """One `train` run: its collaborators, as `build_run` made them, and what follows each optimizer step (§5).

    Everything a run changes lives in `state` (saved with every checkpoint) and in the collaborators, so that two
    runs in one process share nothing but the process-wide random number generators. A context manager: leaving
    it calls `close`.

    Attributes:
        config: the run's settings (`mixed_precision` "auto" resolved).
        accelerator: the run's processes.
        state: the progress that the collaborators share.
        steps: the optimizer steps (`steps.optimizer_step()`, §5.3).
        log: the progress bar and `training_log.jsonl`.
        validator: validation and early stopping; None without a validation split.
        checkpointer: saves and restores the run's training state.
        finisher: averages the last checkpoints into the model and saves it (§6.1).
        held: what `close` lets go: the output directory's lock, the progress bar.
    """

    config: TrainingConfig
    accelerator: Accelerator
    state: RunState
    steps: StepLoop
    log: StepLog
    validator: Validator | None
    checkpointer: Checkpointer
    finisher: Finisher
    held: contextlib.ExitStack

    def __enter__(self) -> "TrainingRun":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """End the progress bar and let other runs have the output directory; `train` calls it however a run ends."""
        self.held.close()

    @property
    def max_steps(self) -> float:
        """The steps the run may make: `config.max_steps`, or infinity for a run capped by `max_minutes` alone."""
        return self.config.max_steps or math.inf

    def ended(self) -> bool:
        """Whether the run resumed at its end (steps or minutes spent, patience out): it then only finishes (§6.1)."""
        config, state = self.config, self.state
        patience = config.early_stopping_patience
        return (
            state.step >= self.max_steps
            or state.elapsed_seconds >= 60 * (config.max_minutes or math.inf)
            or (patience is not None and state.validations_without_improvement >= patience)
        )

    def after_step(self, step_loss: torch.Tensor) -> bool:
        """Log, validate and checkpoint as the step number and the clock say; True when the run is over.

        Args:
            step_loss: the loss `steps.optimizer_step()` returned (nats per target token), for the progress bar.

        Returns:
            True once `max_steps` steps are done, `max_minutes` minutes have passed (a deadline the main
            process reads for all), or early stopping's patience ran out.
        """
        config, step = self.config, self.state.step
        self.log.advance(step_loss)
        out_of_time, save_due = self._deadlines()
        done = step >= self.max_steps or out_of_time
        record = {}
        if step % config.log_steps == 0 or step % config.eval_steps == 0 or done:
            record = self.log.interval_record()
        if self.validator is not None and (step % config.eval_steps == 0 or done):
            improved, patience_over = self.validator.validate(record)
            save_due, done = save_due or improved, done or patience_over
        if record:
            self.log.write(record, done)
        if (config.save_steps and step % config.save_steps == 0) or save_due or done:
            self.checkpointer.save()
        if record:
            self.state.restart_interval()
        return done

    def _deadlines(self) -> tuple[bool, bool]:
        # (out of time, a checkpoint due by the clock), read on the main process and shared, so that every process
        # stops and saves alike.
        config, state = self.config, self.state
        clock = torch.tensor(
            [time.monotonic() - state.started >= 60 * (config.max_minutes or math.inf),
             time.monotonic() - state.last_save >= 60 * (config.save_minutes or math.inf)],
            device=self.accelerator.device,
        ).float()  # fmt: skip
        out_of_time, save_due = (bool(flag) for flag in broadcast_from_main(self.accelerator, clock))
        return out_of_time, save_due

    def finish(self) -> Path:
        """End the progress bar, then average, choose the decoding and save the model (`finish.Finisher.finish`)."""
        self.log.close()
        return self.finisher.finish()


@dataclass(frozen=True)
class RunData:
    """What a run trains on: the tokenizer (§5.1), this process's training batches, the validation split.

    Attributes:
        tokenizer: the shared BPE tokenizer of source and target.
        train_batches: this process's token batches (`batches.run_batches`), endless through `batches.endless_batches`.
        validation: the validation split; None without one (no validation, no best checkpoint).
    """

    tokenizer: PreTrainedTokenizerBase
    train_batches: torch.utils.data.DataLoader | StreamedBatches
    validation: ValidationSplit | None


def build_run(
    config: TrainingConfig,
    load: Callable[..., tuple[RunData, VaswaniForConditionalGeneration]] | None = None,
) -> TrainingRun:
    """Set a run up: processes, output directory, data, model, Adam (§5.3), and the checkpoint it resumes from.

    Every collaborator of the run is made here, in order, and given what it needs.

    Args:
        config: the run's settings.
        load: makes the data and the new model, called as `load_data_and_model` is (its default); a profiler
            may give batches of its own.

    Returns:
        The run, holding its output directory against other runs until `TrainingRun.close`.

    Raises:
        ValueError, FileNotFoundError: the corpus cannot be read, the output directory holds a run's
            checkpoints and `config.resume` is off (on: other settings of `RUN_FIELDS` than the run's, corpus
            files changed since it started without `allow_data_change`; or a model and no checkpoints), no
            training batch fits the settings (no pair within `max_length`, or fewer batches than processes),
            `max_tokens` is below the longest pair, or `config.update_freq` is above 1 under DeepSpeed.
        OSError: the output directory is not writable, another run holds it, or its disk has no room for a
            checkpoint.
        checkpoints.CheckpointError: the checkpoint to resume from is damaged or unsafe.
    """
    held = contextlib.ExitStack()
    try:
        config, accelerator = _start_processes(config)
        output_dir = Path(config.output_dir)
        checkpoints_dir, log_path = output_dir / "checkpoints", output_dir / "training_log.jsonl"
        corpus_files, resume_from, saved = _claim_output_dir(config, accelerator, held)
        set_seed(config.seed, device_specific=True)  # different dropout masks on every process
        data, model = (load or load_data_and_model)(config, accelerator, corpus_files, resume_from is not None)
        needs_bytes = checkpoint_bytes(model)
        optimizer, scheduler = adam_with_schedule(model, config, accelerator.device)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.mixed_precision, torch.float32)
        peak = (config.peak_tflops or 0) * 1e12 or peak_flops(accelerator.device, dtype)
        # The batches are already sharded per process (TokenBatchSampler), so Accelerate does not prepare them.
        # Not the scheduler: Accelerate's would step once per process, and the schedule counts optimizer steps.
        model, optimizer = accelerator.prepare(model, optimizer)
        unwrapped = accelerator.unwrap_model(model)
        whole = WholeModel(accelerator, model, unwrapped)
        state = RunState.from_checkpoint(saved, accelerator.num_processes, accelerator.device)
        checkpointer = Checkpointer(
            accelerator, whole, optimizer, scheduler, state, output_dir, checkpoints_dir,
            keep=config.keep_checkpoints, needs_bytes=needs_bytes,
        )  # fmt: skip
        if resume_from is not None:
            checkpointer.restore(resume_from)
            accelerator.print(f"Resuming from {resume_from} (step {state.step}).")
        cut_log(log_path, state.step, accelerator)  # without what a killed run logged after its checkpoint
        if config.report_to:
            accelerator.init_trackers("vaswani_transformer", config={k: str(v) for k, v in asdict(config).items()})
        state.start_clocks()
        log = StepLog(accelerator, unwrapped, state, log_path, config.max_steps, peak)
        held.callback(log.close)  # however the run ends: nothing printed after it joins its line
        stream = endless_batches(data.train_batches, state.epoch, state.batches_done)
        steps = StepLoop(config, accelerator, model, unwrapped, optimizer, scheduler, stream, state, checkpoints_dir)
        validator = None if data.validation is None else Validator(
            config, accelerator, whole, data.tokenizer, data.validation, state
        )  # fmt: skip
        finisher = Finisher(
            config, accelerator, whole, data.tokenizer, data.validation, output_dir, checkpoints_dir, log_path
        )
        model.train()
        return TrainingRun(config, accelerator, state, steps, log, validator, checkpointer, finisher, held)
    except BaseException:
        held.close()
        raise


def _start_processes(config: TrainingConfig) -> tuple[TrainingConfig, Accelerator]:
    # The run's processes, with `--mixed-precision auto` resolved first: the settings are recorded as run.
    launched_on_cpus = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    if config.mixed_precision == "auto":  # recorded in training_config.json, as every setting
        config = replace(config, mixed_precision=resolve_mixed_precision(config, launched_on_cpus))
    return config, start_accelerator(config, launched_on_cpus)


def _claim_output_dir(
    config: TrainingConfig, accelerator: Accelerator, held: contextlib.ExitStack
) -> tuple[dict, Path | None, dict | None]:
    # The output directory held and checked, the corpus's fingerprint, and the checkpoint to resume from with its
    # progress (None, None: a new run).
    output_dir = Path(config.output_dir)
    checkpoints_dir = output_dir / "checkpoints"
    if accelerator.is_main_process:
        ensure_writable(output_dir)
    hold_output_dir(accelerator, output_dir, held)
    check_output_dir(output_dir, config.resume)
    corpus_files = corpus_fingerprint(config.data, config.source_lang, config.target_lang, config.files)
    if config.resume and ckpt.list_checkpoints(checkpoints_dir):
        record = read_record(output_dir)
        if data_changes := config.check_resumes(record, corpus_files):  # allowed by --allow-data-change
            logger.warning("Resuming on a changed corpus: %s.", "; ".join(data_changes))
            if accelerator.is_main_process:  # the next resume compares with the data trained on now
                record["corpus_fingerprint"] = corpus_files
                ckpt.write_text_atomically(output_dir / "training_config.json", json.dumps(record, indent=2) + "\n")
    if accelerator.is_main_process:
        for leftover in ckpt.remove_leftovers(checkpoints_dir):
            accelerator.print(f"Removed {leftover.name}, left behind by a run that was killed.")
    resume_from, saved = ckpt.latest_good_checkpoint(checkpoints_dir, accelerator.num_processes)
    accelerator.wait_for_everyone()
    return corpus_files, resume_from, saved


def load_data_and_model(
    config: TrainingConfig, accelerator: Accelerator, corpus_files: dict, resuming: bool
) -> tuple[RunData, VaswaniForConditionalGeneration]:
    """The corpus, its tokenizer and batches (§5.1), and a new model sized for the tokenizer (§3).

    A new run also writes, on the main process, what a resume and `average` need before the run ends: the
    tokenizer, `training_config.json` (the settings and the corpus's fingerprint) and the model's `config.json`.

    Args:
        config: the run's settings.
        accelerator: the run's processes (the batches are sharded over them).
        corpus_files: the corpus's fingerprint (`data.corpora.corpus_fingerprint`), recorded for resumes.
        resuming: the run resumes from a checkpoint: the tokenizer saved beside it is the one to use.

    Returns:
        (data, model): the model with its initial weights, on the CPU.

    Raises:
        ValueError, FileNotFoundError: the corpus cannot be read, or no training batch fits the settings.
        OSError: the disk has no room for a checkpoint.
    """
    output_dir = Path(config.output_dir)
    corpus = prepare_corpus(config, run_tokenizer(config, resuming=resuming), corpus_files)
    tokenizer = corpus.tokenizer
    model_config = VaswaniConfig.from_preset(
        config.preset,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id,
        source_lang=config.source_lang,  # the pair the translation pipeline checks its src_lang and tgt_lang against
        target_lang=config.target_lang,
        **config.model_overrides,
    )
    model = VaswaniForConditionalGeneration(model_config)
    if kernels := use_pinned_products(model, keep=[model.get_output_embeddings()]):
        accelerator.print(f"{kernels}.")
    # Before the first step: a disk without room for a checkpoint would otherwise stop the run at its first save.
    with room_for(output_dir, checkpoint_bytes(model), "a checkpoint", "run the same command again"):
        if accelerator.is_main_process and not resuming:
            tokenizer.save_pretrained(output_dir)  # resumed runs must tokenize exactly alike
            record = {**asdict(config), "corpus_fingerprint": corpus_files}  # what a resume must find again
            (output_dir / "training_config.json").write_text(json.dumps(record, indent=2) + "\n")
            model_config.save_pretrained(output_dir)  # `average` builds the model from it, before the run ends
    train_batches, valid_batches = run_batches(corpus, config, accelerator)
    if valid_batches is None:
        logger.warning(
            "No validation split (val.%s / val.%s): no validation loss or BLEU, and no best checkpoint kept; "
            "the model averages the last checkpoints.",
            config.source_lang,
            config.target_lang,
        )
        return RunData(tokenizer, train_batches, None), model
    sources, references = corpus.validation[config.source_lang], corpus.validation[config.target_lang]
    return RunData(tokenizer, train_batches, ValidationSplit(valid_batches, list(sources), list(references))), model
