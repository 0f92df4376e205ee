"""The paper's training recipe (§5) on Accelerate: token batches, Adam, warm-up, label smoothing.

`train(TrainingConfig(...))` reads a parallel corpus, trains (or loads) the shared BPE
tokenizer, trains a `VaswaniForConditionalGeneration` on one CPU or many devices, averages the
last checkpoints (§6.1), and writes a directory that `from_pretrained` loads.
"""

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import AutoTokenizer, DataCollatorForSeq2Seq, PreTrainedTokenizerBase

from .configuration_vaswani import VaswaniConfig
from .data import TokenBatchSampler, lengths_of, load_parallel_corpus, text_batches, tokenize_corpus
from .hub import save_translator, write_model_card
from .modeling_vaswani import VaswaniForConditionalGeneration
from .plotting import plot_learning_curve
from .tokenization import train_tokenizer


@dataclass
class TrainingConfig:
    """Everything a training run needs; the command line `vaswani-transformer train` fills it.

    Attributes:
        data: corpus directory or Hub dataset id (see `load_parallel_corpus`).
        source_lang, target_lang: language codes.
        output_dir: where the trained model, tokenizer and generation config are written.
        preset: model size, "small", "base" or "big" (`VaswaniConfig.from_preset`).
        model_overrides: other `VaswaniConfig` fields, e.g. `{"dropout": 0.2}`.
        tokenizer: directory of an existing tokenizer; None trains one on the training split.
        vocab_size: tokens in the trained BPE vocabulary (§5.1: 37,000 for WMT14 En-De).
        max_length: longest training sentence, in tokens.
        max_tokens: padded source (and target) tokens per batch and device (§5.1).
        learning_rate_scale: factor on the §5.3 schedule
            lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5) (Eq. 3); 1 is the paper's.
        warmup_steps: linear warm-up length in optimizer steps (§5.3: 4000).
        adam_beta1, adam_beta2, adam_epsilon: Adam's (§5.3: 0.9, 0.98, 1e-9).
        max_steps: stop after this many optimizer steps (None: no limit).
        max_minutes: stop after this many minutes of training (None: no limit).
        eval_steps: validation loss every this many steps.
        save_steps: a checkpoint every this many steps.
        average_last: average the weights of this many last checkpoints into the final model (§6.1);
            1 keeps the final weights.
        mixed_precision: "no", "bf16" or "fp16" (Accelerate's setting).
        seed: random seed of initialisation, dropout and batch order.
        dataset_config: configuration name of a Hub dataset.
        files: explicit `{split: (source_file, target_file)}` (see `load_parallel_corpus`).
    """

    data: str
    source_lang: str
    target_lang: str
    output_dir: str
    preset: str = "small"
    model_overrides: dict = field(default_factory=dict)
    tokenizer: str | None = None
    vocab_size: int = 8000
    max_length: int = 256
    max_tokens: int = 4096
    learning_rate_scale: float = 1.0
    warmup_steps: int = 4000
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_epsilon: float = 1e-9
    max_steps: int | None = None
    max_minutes: float | None = None
    eval_steps: int = 500
    save_steps: int = 500
    average_last: int = 5
    mixed_precision: str = "no"
    seed: int = 1
    dataset_config: str | None = None
    files: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_steps is None and self.max_minutes is None:
            raise ValueError("Give a training budget: max_steps (--max-steps) or max_minutes (--max-minutes).")
        for name in (
            "vocab_size",
            "max_length",
            "max_tokens",
            "warmup_steps",
            "eval_steps",
            "save_steps",
            "average_last",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}.")


def inverse_square_root_schedule(d_model: int, warmup_steps: int, scale: float = 1.0):
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5) (§5.3, Eq. 3).

    Returns a function of the 0-based optimizer step for `torch.optim.lr_scheduler.LambdaLR` with a
    base learning rate of 1: it rises linearly for `warmup_steps` steps and then decays as 1/sqrt(step).
    """

    def learning_rate(step: int) -> float:
        step += 1  # the paper counts from 1
        return scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)

    return learning_rate


def _prepare_tokenizer(config: TrainingConfig, corpus) -> PreTrainedTokenizerBase:
    if config.tokenizer:
        return AutoTokenizer.from_pretrained(config.tokenizer)
    return train_tokenizer(
        text_batches(corpus, [config.source_lang, config.target_lang]),
        vocab_size=config.vocab_size,
        model_max_length=config.max_length,
    )


def _batches(split, tokenizer, max_tokens: int, shuffle: bool, seed: int) -> torch.utils.data.DataLoader:
    source_lengths, target_lengths = lengths_of(split)
    sampler = TokenBatchSampler(source_lengths, target_lengths, max_tokens, shuffle=shuffle, seed=seed)
    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, return_tensors="pt")
    return torch.utils.data.DataLoader(
        split.select_columns(["input_ids", "labels"]), batch_sampler=sampler, collate_fn=collator
    )


@torch.no_grad()
def validation_loss(model, batches, accelerator: Accelerator) -> float:
    """Label-smoothed loss per target token over all validation batches (nats), with dropout off."""
    model.eval()
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    for batch in batches:
        target_tokens = int(batch["labels"].ne(-100).sum())
        loss = model(**batch).loss
        total += loss.double().cpu() * target_tokens
        tokens += target_tokens
    model.train()
    return float(total) / max(tokens, 1)


def _save_checkpoint(model, checkpoints_dir: Path, step: int, keep: int) -> None:
    """Write the weights of `step` atomically (a temporary file renamed into place) and keep the last `keep`."""
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()}
    # The tied matrices share storage; safetensors stores each tensor once, so keep one name.
    state.pop("lm_head.weight", None)
    state = {k: v for k, v in state.items() if not k.endswith("embeddings.embed_tokens.weight")}
    temporary = checkpoints_dir / f".step-{step}.safetensors.tmp"
    save_file(state, temporary)
    os.replace(temporary, checkpoints_dir / f"step-{step}.safetensors")
    for old in sorted(checkpoints_dir.glob("step-*.safetensors"), key=_checkpoint_step)[:-keep]:
        old.unlink()


def _load_weights(model: VaswaniForConditionalGeneration, state: dict[str, torch.Tensor]) -> None:
    """Load weights saved by `_save_checkpoint`, in which the tied copies of the embedding are left out."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    untied = [
        name for name in missing if name != "lm_head.weight" and not name.endswith("embeddings.embed_tokens.weight")
    ]
    if untied or unexpected:
        raise ValueError(f"Checkpoint does not match the model: missing {untied}, unexpected {unexpected}.")


def _checkpoint_step(path: Path) -> int:
    return int(path.name[len("step-") : -len(".safetensors")])


def average_checkpoints(paths: list[Path]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the weights in `paths` (§6.1, checkpoint averaging), in float32.

    Raises:
        ValueError: `paths` is empty or the files do not hold the same tensors.
    """
    if not paths:
        raise ValueError("No checkpoints to average.")
    average = {k: v.double() for k, v in load_file(paths[0]).items()}
    for path in paths[1:]:
        state = load_file(path)
        if state.keys() != average.keys():
            raise ValueError(f"{path} does not hold the same tensors as {paths[0]}; cannot average them.")
        for name, tensor in state.items():
            average[name] += tensor.double()
    return {name: (total / len(paths)).float() for name, total in average.items()}


def train(config: TrainingConfig) -> Path:
    """Train a Transformer translator as §5 describes and save it to `config.output_dir`.

    Args:
        config: the run's settings.

    Returns:
        The output directory, holding `config.json`, `model.safetensors`, `generation_config.json`,
        the tokenizer files and `training_log.jsonl` (one JSON line per validation).

    Raises:
        ValueError, FileNotFoundError: from loading the corpus, or invalid settings.
    """
    accelerator = Accelerator(mixed_precision=config.mixed_precision)
    set_seed(config.seed)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    corpus = load_parallel_corpus(
        config.data, config.source_lang, config.target_lang, config.dataset_config, config.files
    )
    tokenizer = _prepare_tokenizer(config, corpus)
    tokenized = tokenize_corpus(corpus, tokenizer, config.source_lang, config.target_lang, config.max_length)
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

    train_batches = _batches(tokenized["train"], tokenizer, config.max_tokens, True, config.seed)
    valid_batches = (
        _batches(tokenized["validation"], tokenizer, config.max_tokens, False, config.seed)
        if "validation" in tokenized
        else None
    )
    optimizer = torch.optim.Adam(
        model.parameters(), lr=1.0, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, inverse_square_root_schedule(model_config.d_model, config.warmup_steps, config.learning_rate_scale)
    )
    model, optimizer, train_batches, scheduler = accelerator.prepare(model, optimizer, train_batches, scheduler)
    if valid_batches is not None:
        valid_batches = accelerator.prepare(valid_batches)

    checkpoints_dir = output_dir / "checkpoints"
    log_path = output_dir / "training_log.jsonl"
    log_path.unlink(missing_ok=True)
    deadline = time.monotonic() + 60 * config.max_minutes if config.max_minutes else math.inf
    max_steps = config.max_steps or math.inf
    progress = tqdm(total=config.max_steps, desc="Training", unit="step", disable=not accelerator.is_local_main_process)
    model.train()
    step, epoch, done = 0, 0, False
    while not done:
        train_batches.set_epoch(epoch)
        for batch in train_batches:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            progress.update(1)
            progress.set_postfix(loss=f"{loss.item():.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}", epoch=epoch)
            done = step >= max_steps or time.monotonic() >= deadline
            if step % config.eval_steps == 0 or done:
                record = {"step": step, "epoch": epoch, "train_loss": loss.item()}
                if valid_batches is not None:
                    record["validation_loss"] = validation_loss(model, valid_batches, accelerator)
                progress.write(json.dumps(record))
                if accelerator.is_main_process:
                    with log_path.open("a") as log:
                        log.write(json.dumps(record) + "\n")
            if accelerator.is_main_process and (step % config.save_steps == 0 or done):
                _save_checkpoint(accelerator.unwrap_model(model), checkpoints_dir, step, config.average_last)
            if done:
                break
        epoch += 1
    progress.close()

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        final = accelerator.unwrap_model(model)
        checkpoints = sorted(checkpoints_dir.glob("step-*.safetensors"), key=_checkpoint_step)[-config.average_last :]
        _load_weights(final, average_checkpoints(checkpoints))
        save_translator(final, tokenizer, output_dir)
        (output_dir / "training_config.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
        write_model_card(output_dir)
        try:
            plot_learning_curve(log_path, output_dir / "learning_curve.png")
        except ImportError as error:  # matplotlib is optional
            accelerator.print(f"No learning_curve.png: {error}")
        shutil.rmtree(checkpoints_dir)
    return output_dir
