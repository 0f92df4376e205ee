"""The paper's training recipe (§5) on Accelerate: token batches, Adam, warm-up, label smoothing.

`train(TrainingConfig(...))` reads a parallel corpus, trains (or loads) the shared BPE
tokenizer, trains a `VaswaniForConditionalGeneration` on one CPU or many devices (data parallel
under `accelerate launch`), checkpoints so that a killed run resumes exactly, averages the last
checkpoints (§6.1), and writes a directory that `from_pretrained` loads. One run at a time holds
an output directory (a lock that the operating system releases when its process ends).
"""

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import (
    DistributedType,
    TorchDynamoPlugin,
    broadcast,
    broadcast_object_list,
    parse_flag_from_env,
    set_seed,
)
from filelock import FileLock, Timeout
from tqdm.auto import tqdm
from transformers import AutoTokenizer, DataCollatorForSeq2Seq, PreTrainedTokenizerBase
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

from . import checkpoints as ckpt
from .configuration_vaswani import VaswaniConfig
from .data import (
    TokenBatchSampler,
    corpus_fingerprint,
    lengths_of,
    load_parallel_corpus,
    text_batches,
    tokenize_corpus,
)
from .files import TRAINING_LOCK_NAME, ensure_writable, read_log, room_for
from .flops import peak_flops, training_flops
from .hub import save_translator, write_model_card
from .modeling_vaswani import VaswaniForConditionalGeneration
from .ops_vaswani import bfloat16_products_are_faster
from .plotting import plot_learning_curve
from .tokenization import train_tokenizer
from .training_config import MIXED_PRECISIONS, TrainingConfig

logger = logging.getLogger(__name__)


def fastest_mixed_precision(device: torch.device) -> str:
    """What `--mixed-precision auto` trains in on `device`: "bf16" where it is clearly faster, else "no".

    Mixed precision is not in the paper (§5.2 names only its 8 P100 GPUs); it changes the rounding of
    the products, not the model. On a CUDA GPU, "bf16" from compute capability 8.0
    (Ampere), whose matrix units compute bfloat16 (older GPUs emulate it). On the CPU it is measured,
    since it depends on the processor's instructions: "bf16" where
    `bfloat16_products_are_faster()`, as on CPUs with AVX512_BF16 or AMX
    (docs/performance.md, "Mixed precision on CPUs"). Weights, Adam's state, the softmax over the
    vocabulary and, on CPUs where that is faster, attention stay in float32. Other devices: "no".

    Args:
        device: the device training runs on.

    Returns:
        "bf16" or "no", a value of `TrainingConfig.mixed_precision`.
    """
    if device.type == "cuda":
        return "bf16" if torch.cuda.get_device_capability(device) >= (8, 0) else "no"
    if device.type == "cpu":
        return "bf16" if bfloat16_products_are_faster() else "no"
    return "no"


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


def avoid_cudnn_attention() -> None:
    """Keep PyTorch's scaled-dot-product attention (§3.2.1, Eq. 1) off its cuDNN kernel, for training on CUDA.

    Batches of sentences change shape at nearly every step, and cuDNN's attention builds a plan for
    every new shape, which costs far more than PyTorch's flash and memory-efficient kernels save
    (docs/performance.md, "Attention kernels on GPUs"). Decoding in bfloat16 or float16 (§6.1), whose
    keys grow by one position a step, gains the same (docs/gpu.md, "Decoding"); float32 never takes
    that kernel. The setting is process-wide; nothing happens on machines without CUDA.
    """
    torch.backends.cuda.enable_cudnn_sdp(False)


class NonFiniteLossError(ValueError):
    """The loss of an optimizer step (§5.4, label-smoothed) became NaN or infinite.

    Raised by `train` before the weights are updated with it, so the last checkpoint and the model
    in memory are both good; `TrainingConfig.skip_nonfinite` skips such steps instead.
    """


def _prepare_tokenizer(config: TrainingConfig, corpus, resuming: bool) -> PreTrainedTokenizerBase:
    if resuming:  # the tokenizer the run started with, saved beside its checkpoints
        return AutoTokenizer.from_pretrained(config.output_dir)
    if config.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        tokenizer.model_max_length = config.max_length  # saved with the model: translation truncates to it
        return tokenizer
    return train_tokenizer(
        text_batches(corpus, [config.source_lang, config.target_lang]),
        vocab_size=config.vocab_size,
        model_max_length=config.max_length,
    )


def _batches(split, tokenizer, max_tokens: int, shuffle: bool, seed: int, accelerator: Accelerator, pad_to: int = 1):
    """A DataLoader of this process's token-budget batches (`TokenBatchSampler`), padded to a multiple of `pad_to`."""
    source_lengths, target_lengths = lengths_of(split)
    sampler = TokenBatchSampler(
        source_lengths,
        target_lengths,
        max_tokens,
        shuffle=shuffle,
        seed=seed,
        num_shards=accelerator.num_processes,
        shard_index=accelerator.process_index,
        pad_to_multiple_of=pad_to,
    )
    collator = DataCollatorForSeq2Seq(
        tokenizer, label_pad_token_id=-100, pad_to_multiple_of=pad_to, return_tensors="pt"
    )
    # A generator of its own: every new iterator draws a seed from it, which would otherwise shift
    # the global random numbers that dropout uses, and a resumed run would drop out other units.
    return torch.utils.data.DataLoader(
        split.select_columns(["input_ids", "labels"]),
        batch_sampler=sampler,
        collate_fn=collator,
        generator=torch.Generator(),
    )


def _micro_batches(loader: torch.utils.data.DataLoader, epoch: int, done: int):
    """Endless (epoch, batches done in the epoch, batch) from position (`epoch`, `done`) on."""
    while True:
        loader.batch_sampler.set_epoch(epoch, skip=done)
        for batch in loader:
            done += 1
            yield epoch, done, batch
        epoch, done = epoch + 1, 0


@torch.no_grad()
def validation_loss(model: VaswaniForConditionalGeneration, batches: Iterable[dict], accelerator: Accelerator) -> float:
    """Label-smoothed loss per target token over the validation batches of every process, dropout off (§5.4).

    Args:
        model: the unwrapped model (no data-parallel wrapper, whose forward would synchronise), or under
            FSDP the wrapped one, whose forward gathers the sharded parameters: every process must then run
            as many batches (`TokenBatchSampler` deals them so).
        batches: this process's validation batches: `input_ids`, `attention_mask` and `labels` of shape
            (sentences, tokens), `labels` -100 on padding.
        accelerator: for the device and the sum over processes (every process must call this).

    Returns:
        The loss in nats per target token (0.0 when there are no target tokens). The model is left in
        training mode.
    """
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # summed loss, target tokens
    for batch in batches:
        batch = batch.to(accelerator.device)
        tokens = batch["labels"].ne(-100).sum()
        total += torch.stack([model(**batch, num_items_in_batch=1).loss.double(), tokens.double()])
    model.train()
    total = accelerator.reduce(total, reduction="sum")
    return float(total[0] / total[1].clamp(min=1))


def _check_output_dir(output_dir: Path, resume: bool) -> None:
    existing = ckpt.list_checkpoints(output_dir / "checkpoints")
    if existing and not resume:
        raise ValueError(
            f"{output_dir} already holds the checkpoints of a run (latest: {existing[-1].name}). Pass --resume to "
            "continue it, or choose another --output-dir: a new run would overwrite them."
        )
    model_files = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME, "tf_model.h5")
    if not existing and (held := [name for name in model_files if (output_dir / name).is_file()]):
        raise ValueError(
            f"{output_dir} already holds a trained model ({held[0]}) and no checkpoints to resume from. "
            "Choose another --output-dir, or remove the model: a new run would overwrite it."
        )


def _weight_bytes(model: torch.nn.Module) -> int:
    # The bytes of the model's weights, each stored once (the shared embedding too, §3.4).
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _parameter_checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def train(config: TrainingConfig) -> Path:
    """Train a Transformer translator as §5 describes and save it to `config.output_dir`.

    One optimizer step accumulates `update_freq` token-budget batches on every process; its loss
    is the label-smoothed cross entropy summed over all of them and divided by their number of
    target tokens, so that the update is that of one big batch whatever the split (§5.1, §5.4).
    A checkpoint is written every `save_steps` steps, and once `save_minutes` minutes have passed since
    the last one (0 turns either clock off); with `resume`, a run continues from its newest checkpoint
    and ends with the parameters an uninterrupted run would have had (bitwise on CPU). The last
    `average_last` checkpoints are averaged into the model (§6.1).

    Args:
        config: the run's settings.

    Returns:
        The output directory, holding `config.json`, `model.safetensors`, `generation_config.json`,
        the tokenizer files, `training_log.jsonl` (one JSON line per log or validation step, with
        the minutes of training so far, and since the line before the target tokens per second, the
        model TFLOP/s and, where the device's peak is known, the MFU: see `flops`),
        `README.md` (model card), `learning_curve.png` and `checkpoints/` (the last
        `keep_checkpoints` and the best one).

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


class TrainingRun:
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
        if config.mixed_precision == "auto":
            self.config = config = replace(config, mixed_precision=self._resolve_mixed_precision(launched_on_cpus))
        if AcceleratorState._shared_state and PartialState().num_processes == 1:
            # Accelerate keeps its first Accelerator's state for the process: a second run in one Python session (a
            # notebook) would keep that run's precision and compile settings. Afresh, as TrainingArguments does.
            AcceleratorState._reset_state(reset_partial_state=True)
        self.accelerator = accelerator = Accelerator(
            cpu=launched_on_cpus,  # Accelerate forms a gloo process group on CPUs only when told to use them
            mixed_precision=config.mixed_precision,
            # Dynamic shapes: token batches vary in sentences and length at every step, and a graph per shape
            # would recompile without end. None leaves `accelerate launch --dynamo_backend` in charge.
            dynamo_plugin=TorchDynamoPlugin(backend="inductor", dynamic=True) if config.compile else None,
            log_with=config.report_to or None,
            project_dir=str(self.output_dir / "runs"),
        )
        if accelerator.device.type == "cuda":
            avoid_cudnn_attention()
        if accelerator.distributed_type == DistributedType.DEEPSPEED and config.update_freq > 1:
            # DeepSpeed applies the update inside every backward pass: accumulated batches would be separate steps.
            raise ValueError(
                f"--update-freq {config.update_freq} does not work under DeepSpeed, which updates the weights after "
                "every batch: use --update-freq 1 and reach the batch size with --max-tokens or more processes."
            )
        if accelerator.is_main_process:
            ensure_writable(self.output_dir)
        self._hold_output_dir()
        _check_output_dir(self.output_dir, config.resume)
        self.corpus_files = corpus_fingerprint(config.data, config.source_lang, config.target_lang, config.files)
        if config.resume and ckpt.list_checkpoints(self.checkpoints_dir):
            record = self._record()
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

    def _hold_output_dir(self) -> None:
        # One run at a time writes to an output directory: its main process holds OUTPUT_DIR/.train.lock (flock) until
        # `close`. The kernel releases the lock of a process that ends, killed too, so no stale lock is ever held.
        accelerator, refusal = self.accelerator, [None]
        if accelerator.is_main_process:
            lock = self.output_dir / TRAINING_LOCK_NAME
            try:
                self._held.enter_context(FileLock(lock, timeout=0))
            except Timeout:
                refusal = [
                    f"Cannot train in {self.output_dir}: another train run is writing to it (it holds {lock}). Wait "
                    "for that run to end, or choose another --output-dir."
                ]
        if accelerator.num_processes > 1:  # every process stops alike
            refusal = broadcast_object_list(refusal)
        if refusal[0]:
            raise OSError(refusal[0])

    def _resolve_mixed_precision(self, launched_on_cpus: bool) -> str:
        # `auto`, before Accelerate starts: the resumed run's choice where there is one (training_config.json), so
        # that a run never changes precision halfway; else measured by the main process alone, while the others
        # wait, and given to all, so that every process trains alike. Recorded in training_config.json.
        # `accelerate launch --cpu` reaches Accelerator through the environment, which PartialState does not read.
        state = PartialState(cpu=launched_on_cpus or parse_flag_from_env("ACCELERATE_USE_CPU"))
        choice = [None]
        if state.is_main_process:
            if self.config.resume and ckpt.list_checkpoints(self.checkpoints_dir):
                choice = [self._record().get("mixed_precision")]  # measured anew where it is unreadable
            if choice[0] not in MIXED_PRECISIONS or choice[0] == "auto":
                choice = [fastest_mixed_precision(state.device)]
        return broadcast_object_list(choice)[0]

    def _load_data_and_model(self, resume_from: Path | None) -> VaswaniForConditionalGeneration:
        # The corpus, its tokenizer and batches, and a new model sized for the tokenizer.
        config, accelerator = self.config, self.accelerator
        corpus = load_parallel_corpus(
            config.data, config.source_lang, config.target_lang, config.dataset_config, config.files
        )
        self.tokenizer = tokenizer = _prepare_tokenizer(config, corpus, resuming=resume_from is not None)
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
        self.checkpoint_bytes = 3 * _weight_bytes(model)
        # Before the first step: a disk without room for a checkpoint would otherwise stop the run at its first save.
        with room_for(self.output_dir, self.checkpoint_bytes, "a checkpoint", "run the same command again"):
            if accelerator.is_main_process and resume_from is None:
                tokenizer.save_pretrained(self.output_dir)  # resumed runs must tokenize exactly alike
                record = {**asdict(config), "corpus_fingerprint": self.corpus_files}  # what a resume must find again
                (self.output_dir / "training_config.json").write_text(json.dumps(record, indent=2) + "\n")
                model_config.save_pretrained(self.output_dir)  # `average` builds the model from it, before the run ends
        tokenized = tokenize_corpus(corpus, tokenizer, config.source_lang, config.target_lang, config.max_length)
        # Compiled code is specialised to shapes; lengths in steps of 8 leave it few to meet (and suit matrix units).
        pad_to = 8 if config.compile else 1
        self.train_batches = _batches(
            tokenized["train"], tokenizer, config.max_tokens, True, config.seed, accelerator, pad_to
        )
        if len(self.train_batches.batch_sampler) == 0:  # else the endless stream of batches would wait forever
            if len(tokenized["train"]) == 0:
                raise ValueError(
                    f"No training batches: none of the {len(corpus['train'])} training pairs is both non-empty and "
                    f"at most --max-length ({config.max_length}) tokens long on both sides; check the training "
                    "files for empty lines, or raise --max-length."
                )
            raise ValueError(
                f"No training batches for every process: the {len(tokenized['train'])} training pairs make fewer "
                f"batches of --max-tokens ({config.max_tokens}) than the {accelerator.num_processes} processes; "
                "lower --max-tokens or start fewer processes."
            )
        self.valid_batches = None
        if "validation" not in tokenized:
            logger.warning(
                "No validation split (val.%s / val.%s): no validation loss or BLEU, and no best checkpoint kept; "
                "the model averages the last checkpoints.",
                config.source_lang,
                config.target_lang,
            )
        else:
            self.valid_batches = _batches(tokenized["validation"], tokenizer, config.max_tokens, False, 0, accelerator)
            self.validation_sources = list(corpus["validation"][config.source_lang])
            self.validation_references = list(corpus["validation"][config.target_lang])
        return model

    def _prepare(self, model: VaswaniForConditionalGeneration) -> None:
        # Adam and the learning-rate schedule of §5.3, and the model and optimizer placed by Accelerate.
        config = self.config
        optimizer = torch.optim.Adam(
            model.parameters(),
            lr=1.0,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_epsilon,
            # One kernel for all parameters instead of a loop over them (docs/performance.md, "Fused Adam").
            # Other devices keep PyTorch's default implementation.
            fused=True if self.accelerator.device.type in ("cpu", "cuda") else None,
        )
        schedule = inverse_square_root_schedule(model.config.d_model, config.warmup_steps, config.learning_rate_scale)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.mixed_precision, torch.float32)
        self.peak_flops = (config.peak_tflops or 0) * 1e12 or peak_flops(self.accelerator.device, dtype)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
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
        self.stream = _micro_batches(self.train_batches, self.state["epoch"], self.state["batches_done"])
        # Summed loss, target tokens and model FLOPs since the last log record (a checkpoint carries them across a
        # resume; checkpoints of earlier versions counted no FLOPs).
        interval = [*self.state["interval"], 0.0][:3]
        self.interval = torch.tensor(interval, dtype=torch.float64, device=accelerator.device)
        self.model.train()

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
        out_of_time, save_due = (bool(flag) for flag in _broadcast(self.accelerator, clock))
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

    def validate(self, record: dict) -> tuple[bool, bool]:
        """Validation loss (and BLEU, §6.1) into `record`; whether it is the best so far, whether patience ran out.

        Args:
            record: the step's log record (with its `step`); gains `validation_loss` (nats per target token)
                and, with `bleu_sentences`, `validation_bleu` (0 to 100, the same on every process).

        Returns:
            (improved, patience_over): a better BLEU (or loss, without BLEU) than any before, and whether
            `early_stopping_patience` validations in a row have not improved.
        """
        accelerator, state = self.accelerator, self.state
        # FSDP's forward gathers the sharded parameters: every process runs the wrapped model, on as many batches.
        model = self.model if accelerator.distributed_type == DistributedType.FSDP else self.unwrapped
        record["validation_loss"] = score = validation_loss(model, self.valid_batches, accelerator)
        if self.config.bleu_sentences:
            bleu = 0.0
            weights = self._whole_weights() if self._sharded() else None  # every process takes part in gathering
            if accelerator.is_main_process:
                n = self.config.bleu_sentences
                sources, references = self.validation_sources[:n], self.validation_references[:n]
                from .translation import validation_bleu

                bleu = validation_bleu(self._whole_model(weights), self.tokenizer, sources, references)
            record["validation_bleu"] = bleu = float(
                _broadcast(accelerator, torch.tensor([bleu], dtype=torch.float64))[0]
            )
            score = -bleu
        improved = state["best_score"] is None or score < state["best_score"]
        if improved:  # the best model is kept as a checkpoint, whatever --save-steps says
            state.update(best_score=score, best_step=record["step"], validations_without_improvement=0)
        else:
            state["validations_without_improvement"] += 1
        patience = self.config.early_stopping_patience
        patience_over = patience is not None and state["validations_without_improvement"] >= patience
        if patience_over:
            accelerator.print(f"Early stopping at step {record['step']}: no improvement in {patience} validations.")
        return improved, patience_over

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

    def _sharded(self) -> bool:
        # No process holds the whole float32 model: FSDP shards the parameters, DeepSpeed ZeRO the float32 master
        # weights (its module's weights are bf16 copies under --mixed-precision bf16).
        return self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)

    def _whole_weights(self) -> dict[str, torch.Tensor]:
        # The whole model's float32 weights on the main process's CPU (FSDP leaves the others none), from FSDP's
        # shards or ZeRO's master weights (each summed from its partitions). Every process must call this.
        if self.accelerator.distributed_type != DistributedType.DEEPSPEED:
            return self.accelerator.get_state_dict(self.model)
        from deepspeed.utils import safe_get_full_fp32_param

        masters = {id(p): safe_get_full_fp32_param(p).cpu() for p in self.unwrapped.parameters()}
        parameters = dict(self.unwrapped.named_parameters(remove_duplicate=False))
        state = self.unwrapped.state_dict()
        return {name: masters[id(parameters[name])] if name in parameters else t for name, t in state.items()}

    def _whole_model(self, weights: dict[str, torch.Tensor] | None = None) -> VaswaniForConditionalGeneration:
        # The model as one float32 module, to translate with and to save on the main process: the trained one itself
        # on one process or under DDP; else (`_sharded`) a new one on the same device, holding `weights` if given.
        if not self._sharded():
            return self.unwrapped
        with torch.device(self.accelerator.device):
            model = VaswaniForConditionalGeneration(self.unwrapped.config)
        if weights is not None:
            ckpt.load_model_state(model, weights)
        return model

    def _training_state(self, directory: Path) -> tuple[torch.nn.Module | dict[str, torch.Tensor], dict | None]:
        # The weights and the optimizer state for the main process to write, and under DeepSpeed this process's
        # partition of the optimizer, written here. Every process must call this: FSDP gathers its shards.
        accelerator = self.accelerator
        if accelerator.distributed_type == DistributedType.FSDP:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            # Whole tensors, keyed by parameter name, on the CPU of the main process (the others get none).
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            optimizer = get_optimizer_state_dict(self.model, self.optimizer.optimizer, options=options)
            return self._whole_weights(), optimizer
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            zero = self.optimizer.optimizer  # DeepSpeed's ZeRO optimizer; its `optimizer`, the Adam of `_prepare`
            partition = {
                "optimizer": zero.optimizer.state_dict(),  # Adam over this process's flat partitions
                "masters": [t.detach().cpu() for t in zero.single_partition_of_fp32_groups],
                "loss_scaler": {k: v for k, v in vars(zero.loss_scaler).items() if k in _ZERO_LOSS_SCALER_STATE},
            }
            ckpt.write_optimizer_partition(directory, accelerator.process_index, partition)
            return self._whole_weights(), None
        return self.unwrapped, self.optimizer.state_dict() if accelerator.is_main_process else None

    def save_checkpoint(self) -> Path:
        """Save the state of the run as `checkpoints/step-N`, to resume exactly or to average (§6.1).

        Every process writes its RNG state (and, under DeepSpeed, its partition of the optimizer), the main
        process the rest (weights, optimizer, schedule, loss scaler and `state`); the weights are the whole
        model in float32 even where the processes hold shards of it (FSDP, DeepSpeed ZeRO). The checkpoint
        appears atomically, and only the last `keep_checkpoints` and the best one stay. Every process must
        call this.

        Returns:
            The checkpoint's directory.

        Raises:
            OSError: writing failed (the incomplete checkpoint is hidden and removed by the next run); where the
                disk has no room for it, before anything is written if it can be told, one line says how much
                room it needs and how to resume.
        """
        accelerator, state = self.accelerator, self.state
        state.update(elapsed_seconds=time.monotonic() - self.started, interval=self.interval.tolist())
        last = ckpt.list_checkpoints(self.checkpoints_dir)
        resume = f"run the same command with --resume: it continues from {last[-1].name if last else 'the start'}"
        with room_for(self.output_dir, self.checkpoint_bytes, f"checkpoint step-{state['step']}", resume):
            directory = ckpt.incomplete_dir(self.checkpoints_dir, state["step"], create=accelerator.is_main_process)
            accelerator.wait_for_everyone()
            ckpt.write_rng_state(directory, accelerator.process_index)
            weights, optimizer = self._training_state(directory)
            accelerator.wait_for_everyone()
            published = self.checkpoints_dir / f"step-{state['step']}"
            if accelerator.is_main_process:
                optimizer_state = {"scheduler": self.scheduler.state_dict()}
                if optimizer is not None:  # None: in the processes' `optimizer-<rank>.pt` (DeepSpeed ZeRO)
                    optimizer_state["optimizer"] = optimizer
                if accelerator.scaler is not None:
                    optimizer_state["scaler"] = accelerator.scaler.state_dict()
                ckpt.write_main_state(directory, weights, optimizer_state, state, self.unwrapped.config)
                best = (state["best_step"],) if state.get("best_step") else ()
                published = ckpt.publish_checkpoint(directory, self.config.keep_checkpoints, protect=best)
        accelerator.wait_for_everyone()
        self.last_save = time.monotonic()
        return published

    def _restore_checkpoint(self, path: Path) -> None:
        # Weights, optimizer, scheduler, loss scaler and this process's RNG state from a verified checkpoint.
        accelerator = self.accelerator
        saved = ckpt.load_optimizer_state(path)
        if accelerator.distributed_type == DistributedType.FSDP:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            # Every process reads the whole state and keeps its shards; the tied copies of the embedding are not saved.
            options = StateDictOptions(full_state_dict=True, strict=False)
            ckpt.check_loaded_names(
                *set_model_state_dict(self.model, ckpt.load_weights(path), options=options), self.unwrapped.config
            )
            set_optimizer_state_dict(self.model, self.optimizer.optimizer, saved["optimizer"], options=options)
        elif accelerator.distributed_type == DistributedType.DEEPSPEED:
            # This process's partition; the module's weights are copied from the masters, as after an optimizer step.
            zero, partition = self.optimizer.optimizer, ckpt.load_optimizer_state(path, accelerator.process_index)
            zero.optimizer.load_state_dict(partition["optimizer"])
            for master, saved_master in zip(zero.single_partition_of_fp32_groups, partition["masters"], strict=True):
                master.data.copy_(saved_master)
            vars(zero.loss_scaler).update(partition["loss_scaler"])
            zero.update_lp_params()
        else:
            ckpt.load_model_state(self.unwrapped, ckpt.load_weights(path))
            self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        if self.accelerator.scaler is not None and "scaler" in saved:
            self.accelerator.scaler.load_state_dict(saved["scaler"])
        ckpt.restore_rng_state(path, self.accelerator.process_index)

    def finish(self) -> Path:
        """Average the last `average_last` checkpoints into the model (§6.1), choose its decoding on the validation
        set when asked (`choose_num_beams`, `choose_length_penalty`), and save it with its card and curve.

        Returns:
            The output directory, loadable with `from_pretrained`.

        Raises:
            ValueError: no checkpoint is left to average, or their tensors differ.
            OSError: the disk has no room for the model (the message says how much it needs; a resumed run that
                has ended only finishes).
        """
        self.progress.close()
        accelerator = self.accelerator
        if accelerator.is_main_process:
            last = ckpt.list_checkpoints(self.checkpoints_dir)[-self.config.average_last :]
            model = self._whole_model()
            ckpt.load_model_state(model, ckpt.average_checkpoints(last))
            self._choose_decoding(model)  # may rewrite training_config.json: the averaged steps go in after
            resume = "run the same command with --resume: it only saves the model"
            with room_for(self.output_dir, _weight_bytes(model), "the model", resume):
                save_translator(model, self.tokenizer, self.output_dir)
                ckpt.record_averaged_steps(self.output_dir, last)
                write_model_card(self.output_dir, keep_results=False)  # scores of earlier weights (resumed) go
                try:
                    plot_learning_curve(self.log_path, self.output_dir / "learning_curve.png")
                except (ImportError, ValueError) as error:  # matplotlib is optional; a run with no log has no curve
                    accelerator.print(f"No learning_curve.png: {error}")
        accelerator.wait_for_everyone()
        accelerator.end_training()  # closes the trackers and the process group
        return self.output_dir

    def _choose_decoding(self, model: VaswaniForConditionalGeneration) -> None:
        # §6.1's beam size and length penalty, chosen on the development set: the best pair becomes the model's
        # generation config, and every pair tried is recorded in training_config.json.
        config, generation = self.config, model.generation_config
        if not (config.choose_num_beams or config.choose_length_penalty):
            return
        if self.valid_batches is None:
            logger.warning("No validation split: the decoding stays the paper's (`paper_generation_config`, §6.1).")
            return
        from .translation import choose_decoding

        model.eval()
        choice = choose_decoding(
            model,
            self.tokenizer,
            self.validation_sources,
            self.validation_references,
            config.choose_num_beams or [generation.num_beams],
            config.choose_length_penalty or [float(generation.length_penalty)],
        )
        generation.num_beams = choice["num_beams"]
        if choice["length_penalty"] is None:  # greedy: transformers refuses to save beam-search settings with it
            generation.length_penalty, generation.early_stopping = 1.0, False
        else:
            generation.length_penalty = choice["length_penalty"]
        self.accelerator.print(json.dumps({"decoding_choice": choice}))
        saved = self._record() or asdict(config)  # deleted or damaged during the run: rewritten from the settings
        ckpt.write_text_atomically(
            self.output_dir / "training_config.json", json.dumps({**saved, "decoding_choice": choice}, indent=2) + "\n"
        )

    def _record(self) -> dict:
        # training_config.json as the run's start wrote it, or {} (with a warning) where it is gone or damaged.
        path = self.output_dir / "training_config.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            logger.warning("%s is unreadable: %r", path, error)
            return {}
        if not isinstance(record, dict):
            logger.warning("%s holds no JSON object: %.60r", path, record)
            return {}
        return record


# What DeepSpeed's loss scaler changes as it trains (fp16's dynamic scale); with bf16 its scale stays 1.
_ZERO_LOSS_SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _broadcast(accelerator: Accelerator, tensor: torch.Tensor) -> torch.Tensor:
    # The main process's `tensor` on every process.
    return broadcast(tensor.to(accelerator.device)) if accelerator.num_processes > 1 else tensor
