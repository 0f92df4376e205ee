"""The paper's training recipe (§5) on Accelerate: token batches, Adam, warm-up, label smoothing.

`train(TrainingConfig(...))` reads a parallel corpus, trains (or loads) the shared BPE
tokenizer, trains a `VaswaniForConditionalGeneration` on one CPU or many devices (data parallel
under `accelerate launch`), checkpoints so that a killed run resumes exactly, averages the last
checkpoints (§6.1), and writes a directory that `from_pretrained` loads. One run at a time holds
an output directory (a lock that the operating system releases when its process ends).

`TrainingRun` sets a run up and holds its state; each of its jobs is a module of its own: the processes and
precision (`training_devices`), the output directory (`training_directory`), the tokenizer and batches
(`training_data`), Adam and Eq. 3 (`training_optimizer`), the steps (`training_steps`), validation
(`training_validation`), checkpoints (`training_checkpoints`) and the end of the run (`training_finish`).
"""

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from . import checkpoints as ckpt
from .configuration_vaswani import VaswaniConfig
from .corpus_preparation import prepare_corpus
from .data import corpus_fingerprint
from .files import ensure_writable, read_log, room_for
from .flops import peak_flops
from .modeling_vaswani import VaswaniForConditionalGeneration
from .training_checkpoints import RunCheckpoints, weight_bytes
from .training_config import TrainingConfig
from .training_data import micro_batches, run_batches, run_tokenizer
from .training_devices import avoid_cudnn_attention, fastest_mixed_precision, resolve_mixed_precision, start_accelerator
from .training_directory import check_output_dir, hold_output_dir, read_record
from .training_finish import RunEnd
from .training_optimizer import adam_with_schedule, inverse_square_root_schedule
from .training_steps import NonFiniteLossError, RunSteps
from .training_validation import RunValidation, validation_loss

# Where the rest of the package, the scripts and users import them from.
__all__ = [
    "NonFiniteLossError",
    "TrainingConfig",
    "TrainingRun",
    "avoid_cudnn_attention",
    "fastest_mixed_precision",
    "inverse_square_root_schedule",
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
    tokenizer are prepared into the data cache (`corpus_preparation.prepare_corpus`) and nothing is trained.

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
    if config.prepare_only:  # one machine prepares what others train on; no output directory is touched
        files = corpus_fingerprint(config.data, config.source_lang, config.target_lang, config.files)
        return prepare_corpus(config, run_tokenizer(config, resuming=False), files).directory
    run = TrainingRun(config)
    try:
        done = run.ended()
        while not done:
            step_loss = run.optimizer_step()
            if step_loss is not None:  # None: a non-finite loss, skipped
                done = run.after_step(step_loss)
        return run.finish()
    finally:
        run.close()


class TrainingRun(RunSteps, RunValidation, RunCheckpoints, RunEnd):
    """The state of one `train` run and its steps: set-up, optimizer step, validation, checkpoint, finish (§5).

    Everything a run changes lives here (the progress in `state`, a dict saved with every checkpoint),
    so that two runs in one process share nothing but the process-wide random number generators.

    Args:
        config: the run's settings. Creating the run sets everything up: the output directory (held against
            other runs until `close`), the corpus and tokenizer (§5.1), the model, Adam with the §5.3 schedule,
            and the state of the checkpoint it resumes from, if any.

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

    def __init__(self, config: TrainingConfig) -> None:
        self.config = config
        self.output_dir = Path(config.output_dir)
        self.checkpoints_dir = self.output_dir / "checkpoints"
        self.log_path = self.output_dir / "training_log.jsonl"
        self.max_steps = config.max_steps or math.inf
        self._held = contextlib.ExitStack()  # what `close` lets go: the output directory's lock, the progress bar
        try:
            resume_from, state = self._start()
            self._prepare(self._load_data_and_model(resume_from))
            self._resume(resume_from, state)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """End the progress bar and let other runs have the output directory; `train` calls it however a run ends."""
        self._held.close()

    def _start(self) -> tuple[Path | None, dict | None]:
        # The processes, the output directory, and the checkpoint to resume from (None: a new run).
        config = self.config
        launched_on_cpus = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
        if config.mixed_precision == "auto":  # recorded in training_config.json, as every setting
            self.config = config = replace(config, mixed_precision=resolve_mixed_precision(config, launched_on_cpus))
        self.accelerator = accelerator = start_accelerator(config, launched_on_cpus)
        if accelerator.is_main_process:
            ensure_writable(self.output_dir)
        hold_output_dir(accelerator, self.output_dir, self._held)
        check_output_dir(self.output_dir, config.resume)
        self.corpus_files = corpus_fingerprint(config.data, config.source_lang, config.target_lang, config.files)
        if config.resume and ckpt.list_checkpoints(self.checkpoints_dir):
            record = read_record(self.output_dir)
            if data_changes := config.check_resumes(record, self.corpus_files):  # allowed by --allow-data-change
                logger.warning("Resuming on a changed corpus: %s.", "; ".join(data_changes))
                if accelerator.is_main_process:  # the next resume compares with the data trained on now
                    record["corpus_fingerprint"] = self.corpus_files
                    ckpt.write_text_atomically(
                        self.output_dir / "training_config.json", json.dumps(record, indent=2) + "\n"
                    )
        if accelerator.is_main_process:
            for leftover in ckpt.remove_leftovers(self.checkpoints_dir):
                accelerator.print(f"Removed {leftover.name}, left behind by a run that was killed.")
        resume_from, state = ckpt.latest_good_checkpoint(self.checkpoints_dir, accelerator.num_processes)
        accelerator.wait_for_everyone()
        set_seed(config.seed, device_specific=True)  # different dropout masks on every process
        return resume_from, state

    def _load_data_and_model(self, resume_from: Path | None) -> VaswaniForConditionalGeneration:
        # The corpus, its tokenizer and batches, and a new model sized for the tokenizer.
        config, accelerator = self.config, self.accelerator
        corpus = prepare_corpus(config, run_tokenizer(config, resuming=resume_from is not None), self.corpus_files)
        self.tokenizer = tokenizer = corpus.tokenizer
        model_config = VaswaniConfig.from_preset(
            config.preset,
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.bos_token_id,
            **config.model_overrides,
        )
        model = VaswaniForConditionalGeneration(model_config)
        # A checkpoint holds the weights and Adam's two moments of each (§5.3), besides files of a few kB.
        self.checkpoint_bytes = 3 * weight_bytes(model)
        # Before the first step: a disk without room for a checkpoint would otherwise stop the run at its first save.
        with room_for(self.output_dir, self.checkpoint_bytes, "a checkpoint", "run the same command again"):
            if accelerator.is_main_process and resume_from is None:
                tokenizer.save_pretrained(self.output_dir)  # resumed runs must tokenize exactly alike
                record = {**asdict(config), "corpus_fingerprint": self.corpus_files}  # what a resume must find again
                (self.output_dir / "training_config.json").write_text(json.dumps(record, indent=2) + "\n")
                model_config.save_pretrained(self.output_dir)  # `average` builds the model from it, before the run ends
        self.train_batches, self.valid_batches = run_batches(corpus, config, accelerator)
        if self.valid_batches is None:
            logger.warning(
                "No validation split (val.%s / val.%s): no validation loss or BLEU, and no best checkpoint kept; "
                "the model averages the last checkpoints.",
                config.source_lang,
                config.target_lang,
            )
        else:
            self.validation_sources = list(corpus.validation[config.source_lang])
            self.validation_references = list(corpus.validation[config.target_lang])
        return model

    def _prepare(self, model: VaswaniForConditionalGeneration) -> None:
        # Adam and the learning-rate schedule of §5.3, and the model and optimizer placed by Accelerate.
        config, device = self.config, self.accelerator.device
        optimizer, self.scheduler = adam_with_schedule(model, config, device)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.mixed_precision, torch.float32)
        self.peak_flops = (config.peak_tflops or 0) * 1e12 or peak_flops(device, dtype)
        # The batches are already sharded per process (TokenBatchSampler), so Accelerate does not prepare them.
        # Not the scheduler: Accelerate's would step once per process, and the schedule counts optimizer steps.
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.unwrapped = self.accelerator.unwrap_model(self.model)

    def _resume(self, resume_from: Path | None, state: dict | None) -> None:
        # The run's progress: new, or restored from its checkpoint, with the log cut back to it.
        config, accelerator = self.config, self.accelerator
        self.state = state or {
            "step": 0, "epoch": 0, "batches_done": 0, "elapsed_seconds": 0.0, "skipped_nonfinite": 0,
            "best_step": None, "best_score": None, "validations_without_improvement": 0,
            "world_size": accelerator.num_processes, "interval": [0.0, 0.0, 0.0],
        }  # fmt: skip
        if resume_from is not None:
            self._restore_checkpoint(resume_from)
            accelerator.print(f"Resuming from {resume_from} (step {self.state['step']}).")
        records = read_log(self.log_path) if self.log_path.is_file() else []
        if accelerator.is_main_process:  # without what a killed run logged after its checkpoint
            kept = "".join(json.dumps(r) + "\n" for r in records if r["step"] <= self.state["step"])
            ckpt.write_text_atomically(self.log_path, kept)
        if config.report_to:
            accelerator.init_trackers("vaswani_transformer", config={k: str(v) for k, v in asdict(config).items()})
        self.started = time.monotonic() - self.state["elapsed_seconds"]
        self.interval_started = time.monotonic()
        self.last_save = time.monotonic()
        self.progress = tqdm(
            total=config.max_steps, initial=self.state["step"], desc="Training", unit="step",
            disable=not accelerator.is_local_main_process,
        )  # fmt: skip
        self._held.callback(self.progress.close)  # however the run ends: nothing printed after it joins its line
        self.stream = micro_batches(self.train_batches, self.state["epoch"], self.state["batches_done"])
        # Summed loss, target tokens and model FLOPs since the last log record (a checkpoint carries them across a
        # resume; checkpoints of earlier versions counted no FLOPs).
        interval = [*self.state["interval"], 0.0][:3]
        self.interval = torch.tensor(interval, dtype=torch.float64, device=accelerator.device)
        self.model.train()
