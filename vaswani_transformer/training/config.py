"""`TrainingConfig`: every setting of a training run, and the one place where each is defined.

The command line `vaswani-transformer train` is generated from these fields (`cli.py`): a field's
`help` metadata is its help text, its default is the option's default, and a run saves the whole
config as `training_config.json`. Defaults are the paper's recipe (§5) wherever the paper gives one.
"""

import difflib
import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from ..inference.config import DEFAULT_THREADS, cpu_threads
from ..model.configuration_vaswani import PRESETS, VaswaniConfig
from ..model.generation_vaswani import PAPER_LENGTH_PENALTY, PAPER_NUM_BEAMS, check_length_penalty, check_num_beams
from ..utils.options import option

# VaswaniConfig fields that `train` takes from the tokenizer it trains or loads, never from --model-option.
TOKENIZER_FIELDS = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
# VaswaniConfig fields that `train` takes from --source-lang and --target-lang, never from --model-option.
LANGUAGE_FIELDS = ("source_lang", "target_lang")

# The settings that make a run what it is: its corpus, model, batches (`compile` pads them), schedule, precision and
# the measure its best checkpoint is chosen by (BLEU or loss: `bleu_sentences` above 0 or not). A resumed run keeps
# them, for its checkpoint holds that model's weights, its place in those batches and its best score; the budgets,
# clocks, logging and the decoding choice may change, and the tokenizer is the one saved beside the checkpoints
# (docs/training.md, "Training at scale, and runs that survive being killed").
RUN_FIELDS = (
    "data", "dataset_config", "files", "streaming", "shuffle_buffer", "source_lang", "target_lang", "max_length",
    "preset", "model_overrides", "max_tokens", "update_freq", "compile", "learning_rate_scale", "warmup_steps",
    "adam_beta1", "adam_beta2", "adam_epsilon", "seed", "mixed_precision", "bleu_sentences",
)  # fmt: skip

# Accelerate's precisions, and auto: bf16 where this machine computes it clearly faster (`fastest_mixed_precision`).
MIXED_PRECISIONS = ("no", "bf16", "fp16", "auto")


def _require_positive(config: object, *names: str) -> None:
    # The sizes, steps and counts of a config that only a positive value makes sense of.
    for name in names:
        if getattr(config, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(config, name)}.")


@dataclass
class DataConfig:
    """What a run reads and where it writes: the parallel corpus (§5.1) and the output directory.

    `data` and `files` name the corpus (see `data.corpus_splits`); on the command line they come
    from `--data-dir`, `--dataset`, `--train-files` and `--validation-files`.

    Raises:
        ValueError: a `shuffle_buffer` that is not positive.
    """

    data: str
    source_lang: str = option(help="source language code, the corpus files' extension (e.g. en)", group="corpus")
    target_lang: str = option(help="target language code (e.g. de)", group="corpus")
    output_dir: str = option(help="where the model, tokenizer, log and checkpoints are written", group="output")
    dataset_config: str | None = option(None, help="configuration of --dataset, e.g. de-en", group="corpus")
    files: dict = field(default_factory=dict)
    data_cache_dir: str | None = option(
        None,
        help="where prepared corpora and tokenizers are kept for later runs; none: "
        "$HF_DATASETS_CACHE/vaswani_transformer",
        group="corpus",
    )
    streaming: bool = option(
        False,
        help="read --dataset as a stream, never downloaded whole: lengths are sorted within --shuffle-buffer pairs "
        "at a time, not over the corpus (docs/data.md)",
        group="corpus",
    )
    shuffle_buffer: int = option(
        100_000, help="with --streaming: pairs shuffled together, then sorted by length into batches", group="corpus"
    )
    prepare_only: bool = option(
        False,
        help="prepare the corpus and tokenizer into the data cache, then stop: one machine prepares, others train",
        group="corpus",
    )

    def __post_init__(self) -> None:
        _require_positive(self, "shuffle_buffer")


@dataclass
class ModelConfig:
    """The model a run trains: a preset of Table 3 (or for CPUs), changed field by field, and its vocabulary (§5.1).

    Raises:
        ValueError: an unknown `preset`; a `model_overrides` key that is no VaswaniConfig field or is set from
            the tokenizer or the languages, or an impossible value; a `vocab_size` that is not positive, a negative
            `tokenizer_sample`.
    """

    preset: str = option(
        "base", help="model size: Table 3's base or big, or small or tiny for CPUs", group="model", choices=PRESETS
    )
    model_overrides: dict = option(
        {},
        help="set a VaswaniConfig field, e.g. dropout=0.2 (repeatable)",
        group="model",
        flag="--model-option",
        metavar="KEY=VALUE",
    )
    tokenizer: str | None = option(
        None, help="an existing tokenizer's directory; by default a BPE one is trained", group="model"
    )
    vocab_size: int = option(
        VaswaniConfig.vocab_size,
        help="shared BPE vocabulary, in tokens (§5.1: about 37,000 for WMT14 En-De)",
        group="model",
    )
    tokenizer_sample: int = option(
        1_000_000,
        help="sentence pairs the BPE tokenizer learns from, drawn at random from a larger corpus (0: all)",
        group="model",
    )

    def __post_init__(self) -> None:
        _require_positive(self, "vocab_size")
        if self.tokenizer_sample < 0:
            raise ValueError(f"tokenizer_sample must be 0 (all pairs) or positive, got {self.tokenizer_sample}.")
        self._check_model_overrides()

    def _check_model_overrides(self) -> None:
        # Before the corpus is read and a tokenizer trained: a misspelt key would otherwise become an attribute
        # that nothing reads, and an impossible value would fail only when the model is built.
        fields = [name for name in VaswaniConfig.__annotations__ if name not in TOKENIZER_FIELDS + LANGUAGE_FIELDS]
        fields.append("attn_implementation")  # transformers' choice of attention code (eager: Eq. 1 spelled out)
        for key in self.model_overrides:
            if key in TOKENIZER_FIELDS:
                raise ValueError(
                    f"model_overrides (--model-option) cannot set {key}: it comes from the tokenizer "
                    "(--vocab-size sets the size of the one trained, --tokenizer gives another)."
                )
            if key in LANGUAGE_FIELDS:
                raise ValueError(
                    f"model_overrides (--model-option) cannot set {key}: it comes from --{key.replace('_', '-')}."
                )
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1, cutoff=0.8)
                hint = f"; did you mean {close[0]}?" if close else f"; it takes {', '.join(fields)}."
                raise ValueError(f"model_overrides (--model-option): {key} is no VaswaniConfig field{hint}")
        VaswaniConfig.from_preset(self.preset, **self.model_overrides)


@dataclass
class BatchConfig:
    """The batches of §5.1: sentence pairs of similar length, about `max_tokens` tokens per side, accumulated.

    Raises:
        ValueError: a size that is not positive.
    """

    max_length: int = option(256, help="longest training sentence, in tokens; longer pairs are left out")
    max_tokens: int = option(4096, help="padded tokens per batch, per side and device (§5.1)")
    update_freq: int = option(
        1,
        help="batches accumulated per optimizer step and device: a step sees max-tokens x update-freq x processes "
        "tokens per side (the paper's ~25,000 is e.g. 4096 x 6 on one device)",
    )

    def __post_init__(self) -> None:
        _require_positive(self, "max_length", "max_tokens", "update_freq")


@dataclass
class OptimizerConfig:
    """The optimizer of §5.3: Adam, and the learning rate of Eq. 3 with its warm-up.

    Raises:
        ValueError: a `warmup_steps` that is not positive, a learning-rate scale that is no positive number,
            Adam betas outside [0, 1) or a negative `adam_epsilon`.
    """

    learning_rate_scale: float = option(
        1.0, help="factor on the learning rate of §5.3, Eq. 3: d_model^-0.5 min(step^-0.5, step warmup^-1.5)"
    )
    warmup_steps: int = option(4000, help="linear learning-rate warm-up, in optimizer steps (§5.3: 4000)")
    adam_beta1: float = option(0.9, help="Adam's beta_1 (§5.3: 0.9)")
    adam_beta2: float = option(0.98, help="Adam's beta_2 (§5.3: 0.98)")
    adam_epsilon: float = option(1e-9, help="Adam's epsilon (§5.3: 1e-9)")

    def __post_init__(self) -> None:
        _require_positive(self, "warmup_steps")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must lie in [0, 1) (§5.3: 0.9 and 0.98), got {getattr(self, name)}.")
        if not self.adam_epsilon >= 0.0:
            raise ValueError(f"adam_epsilon must not be negative (§5.3: 1e-9), got {self.adam_epsilon}.")
        if not (math.isfinite(self.learning_rate_scale) and self.learning_rate_scale > 0):
            raise ValueError(f"learning_rate_scale must be a positive number, got {self.learning_rate_scale}.")


@dataclass
class BudgetConfig:
    """How long a run trains, how often it logs and validates, and when it stops early (§5.2's budget, in steps).

    Raises:
        ValueError: no budget (neither `max_steps` nor `max_minutes`), or one that is not finite and positive;
            a log or validation interval or a patience that is not positive; a negative `bleu_sentences`.
    """

    max_steps: int | None = option(None, help="stop after this many optimizer steps (give this or --max-minutes)")
    max_minutes: float | None = option(
        None, help="stop after this many minutes of training, resumed runs included (give this or --max-steps)"
    )
    log_steps: int = option(100, help="a training-loss record every this many steps")
    eval_steps: int = option(500, help="validation loss (and BLEU) every this many steps")
    bleu_sentences: int = option(
        0, help="translate this many validation sentences at each validation and log their sacreBLEU (0: off)"
    )
    early_stopping_patience: int | None = option(
        None, help="stop after this many validations without a better BLEU (or loss, without BLEU); none: never"
    )

    def __post_init__(self) -> None:
        if self.max_steps is None and self.max_minutes is None:
            raise ValueError("Give a training budget: max_steps (--max-steps) or max_minutes (--max-minutes).")
        for name in ("max_steps", "max_minutes"):  # nan compares false with everything: it would never stop a run
            if getattr(self, name) is not None and not 0 < getattr(self, name) < math.inf:
                raise ValueError(
                    f"{name} must be positive and finite, got {getattr(self, name)}; leave it out for no such limit."
                )
        _require_positive(self, "log_steps", "eval_steps")
        if self.bleu_sentences < 0:
            raise ValueError(f"bleu_sentences must be 0 (no BLEU) or more, got {self.bleu_sentences}.")
        if self.early_stopping_patience is not None and self.early_stopping_patience < 1:
            raise ValueError(
                f"early_stopping_patience must be at least 1 validation, got {self.early_stopping_patience}; "
                "leave it out never to stop early."
            )


@dataclass
class CheckpointConfig:
    """A run's checkpoints: when they are written, and how many are kept and averaged into the model (§6.1).

    Raises:
        ValueError: no checkpoint clock (`save_steps` and `save_minutes` both 0) or a negative one; an
            `average_last` that is not positive, or fewer checkpoints kept than averaged.
    """

    save_steps: int = option(
        500, help="a checkpoint every this many steps (0: by --save-minutes only)", group="checkpoints and faults"
    )
    save_minutes: float = option(
        0.0,
        help="a checkpoint once this many minutes have passed since the last one (0: by --save-steps only)",
        group="checkpoints and faults",
    )
    keep_checkpoints: int | None = option(
        None,
        help="checkpoints kept in OUTPUT_DIR/checkpoints besides the best; none: --average-last",
        group="checkpoints and faults",
    )
    average_last: int = option(5, help="average this many last checkpoints into the model (§6.1: 5 base, 20 big)")

    def __post_init__(self) -> None:
        _require_positive(self, "average_last")
        if self.save_minutes is None:  # None meant "by steps only" before 0 did
            self.save_minutes = 0.0
        if self.save_steps < 0 or self.save_minutes < 0 or not (self.save_steps or self.save_minutes):
            raise ValueError(
                f"save_steps and save_minutes must not be negative, and one must be positive (0 turns a clock off), "
                f"got save_steps={self.save_steps} and save_minutes={self.save_minutes}."
            )
        if self.keep_checkpoints is None:
            self.keep_checkpoints = self.average_last
        if self.keep_checkpoints < self.average_last:
            raise ValueError(
                f"keep_checkpoints ({self.keep_checkpoints}) must be at least average_last ({self.average_last})."
            )


@dataclass
class DecodingConfig:
    """The decoding a run chooses for its model on the development set, as §6.1 chose beam size and length penalty.

    Raises:
        ValueError: a beam size below 1, or a length penalty that is no finite number, to choose from.
    """

    choose_num_beams: list[int] = option(
        [],
        help="after averaging, choose the beam size among these by BLEU on the whole validation set, as §6.1 chose "
        f"{PAPER_NUM_BEAMS} (with --choose-length-penalty; none: {PAPER_NUM_BEAMS})",
        group="decoding",
        nargs="+",
        metavar="N",
    )
    choose_length_penalty: list[float] = option(
        [],
        help="after averaging, choose the GNMT length penalty alpha among these by BLEU on the whole validation set, "
        f"as §6.1 chose {PAPER_LENGTH_PENALTY} (with --choose-num-beams; none: {PAPER_LENGTH_PENALTY})",
        group="decoding",
        nargs="+",
        metavar="ALPHA",
    )

    def __post_init__(self) -> None:
        for name, values, check in (
            ("choose_num_beams", self.choose_num_beams, check_num_beams),
            ("choose_length_penalty", self.choose_length_penalty, check_length_penalty),
        ):
            try:
                for value in values:
                    check(value)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None


@dataclass
class FaultConfig:
    """What a run survives: being killed (it resumes from its last checkpoint), a changed corpus, a non-finite loss.

    See docs/training.md, "Training at scale, and runs that survive being killed".
    """

    resume: bool = option(
        False,
        help="continue the run saved in OUTPUT_DIR/checkpoints where its last checkpoint left it "
        "(a new run when there is none)",
        group="checkpoints and faults",
    )
    allow_data_change: bool = option(
        False,
        help="with --resume, continue even if the corpus files (training and validation) changed since the run "
        "started, in size or content: on the new data from the checkpoint on (else such a resume is refused)",
        group="checkpoints and faults",
    )
    skip_nonfinite: bool = option(
        False,
        help="skip (and count) steps whose loss is NaN or infinite instead of stopping the run",
        group="checkpoints and faults",
    )


@dataclass
class ComputeConfig:
    """How a run computes and reports: its precision, compilation, CPU threads, the device's peak for the MFU,
    trackers, seed.

    Raises:
        ValueError: an unknown `mixed_precision`, a `peak_tflops` that is not positive, or `threads` below 1.
    """

    mixed_precision: str = option(
        "no",
        help="Accelerate's mixed precision; auto: bf16 where this machine computes it clearly faster than float32 "
        "(a GPU with bfloat16, or a CPU where a measured product is), else no",
        choices=MIXED_PRECISIONS,
    )
    compile: bool = option(
        False,
        help="compile the model for training with torch.compile (Inductor, dynamic shapes); batches are padded to a "
        "multiple of 8 tokens so that few shapes occur",
        group="speed",
    )
    peak_tflops: float | None = option(
        None,
        help="the device's dense peak, in TFLOP/s for the training dtype, for the logged model-FLOPs utilisation "
        "(MFU); none: known for H100, H200 and A100 in bf16 and fp16",
        group="speed",
    )
    threads: int | None = option(
        None,
        help=f"CPU threads of PyTorch's operators in each process (by default {DEFAULT_THREADS}, divided among the "
        "processes accelerate launch starts on this machine)",
        group="speed",
    )
    report_to: list[str] = option([], help="an Accelerate tracker to log to, e.g. tensorboard (repeatable)")
    seed: int = option(1, help="random seed of initialisation, dropout and batch order")

    def __post_init__(self) -> None:
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"peak_tflops must be positive, got {self.peak_tflops}; leave it out to look it up.")
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise ValueError(
                f"mixed_precision must be one of {', '.join(MIXED_PRECISIONS)}; got {self.mixed_precision!r}."
            )
        cpu_threads(self.threads)  # refuses a count below 1

    def cpu_threads(self) -> int:
        """PyTorch's CPU threads of each process of the run: `threads`, or the cores this process may use less one,
        divided among the processes that `accelerate launch` started on this machine (`LOCAL_WORLD_SIZE`).

        Raises:
            ValueError: `LOCAL_WORLD_SIZE` is set to something other than a positive count.
        """
        local = os.environ.get("LOCAL_WORLD_SIZE", "1")
        if not local.isdigit() or int(local) < 1:
            raise ValueError(f"LOCAL_WORLD_SIZE={local!r} is no count of processes: unset it or give one, e.g. 2.")
        return cpu_threads(self.threads, processes=int(local))


# A dataclass lists the fields of its last base first: the options of `train --help` follow the order of the groups
# from DataConfig on.
@dataclass
class TrainingConfig(
    ComputeConfig,
    FaultConfig,
    DecodingConfig,
    CheckpointConfig,
    BudgetConfig,
    OptimizerConfig,
    BatchConfig,
    ModelConfig,
    DataConfig,
):
    """Everything a training run needs (§5); `vaswani-transformer train` fills it from its options.

    Each field's meaning and unit is its `help` metadata, which `vaswani-transformer train --help`
    prints. The fields come in groups, one dataclass each, that check their own values: `DataConfig`
    (the corpus and output directory), `ModelConfig`, `BatchConfig` (§5.1), `OptimizerConfig` (§5.3),
    `BudgetConfig`, `CheckpointConfig` (§6.1), `DecodingConfig` (§6.1), `FaultConfig` and `ComputeConfig`.

    Raises:
        ValueError: a value that a group refuses (each group's docstring says which), the budget checked first;
            `streaming` with neither `tokenizer` nor a `tokenizer_sample`.
    """

    def __post_init__(self) -> None:
        # Each group checks its own fields; first the budget, the one choice that no default makes.
        checked = (
            BudgetConfig,
            DataConfig,
            ModelConfig,
            BatchConfig,
            OptimizerConfig,
            CheckpointConfig,
            DecodingConfig,
            ComputeConfig,
        )
        for group in checked:
            group.__post_init__(self)
        if self.streaming and not self.tokenizer and self.tokenizer_sample == 0:
            raise ValueError(
                "--streaming trains the tokenizer on the stream's first --tokenizer-sample pairs; give a number "
                "(0, all of them, would hold the whole corpus in memory), or --tokenizer."
            )

    def check_resumes(self, record: dict, corpus: dict | None = None) -> list[str]:
        """Refuse to resume a run whose settings, or corpus files, differ from those it started with.

        See docs/training.md, "Training at scale, and runs that survive being killed".

        Args:
            record: the run's `training_config.json` as its start wrote it; fields it lacks (an earlier
                version's record) are not compared.
            corpus: the corpus files now, `{name: {"bytes": size, "sha256": digest}}` (`data.corpus_fingerprint`),
                compared with the record's `corpus_fingerprint` where it has one.

        Returns:
            The changes of the corpus files that `allow_data_change` lets pass, one phrase each (none without it).

        Raises:
            ValueError: a field of `RUN_FIELDS` differs, naming each field's option, the run's value and this
                one. The corpus compares by its resolved path where both paths exist here, as written where
                neither does (a Hub dataset), and not at all where only one does (a relative path written
                from another directory). The model compares as the config that `preset` and
                `model_overrides` give, `attn_implementation` apart: it changes the speed, not the function
                (§3.2.1, Eq. 1 either way). Or a corpus file differs in size or SHA-256, is new or is gone,
                and `allow_data_change` is off (the message names each file).
        """
        options = {f.name: f.metadata.get("flag", "--" + f.name.replace("_", "-")) for f in fields(self)}
        options.update(data="--data-dir/--dataset", files="--train-files/--validation-files")
        same_model = _model(record.get("preset", self.preset), record.get("model_overrides")) == _model(
            self.preset, self.model_overrides
        )
        changed = []
        for name in RUN_FIELDS:
            if name not in record:
                continue
            was, now = json.loads(json.dumps(record[name])), json.loads(json.dumps(getattr(self, name)))
            if name in ("data", "files"):
                same = _same_corpus(was, now)
            elif name in ("preset", "model_overrides"):  # named where it differs as written
                same = was == now or same_model
            elif name == "bleu_sentences":  # how many may change; not whether the best is chosen by BLEU or loss
                same = bool(was) == bool(now)
            else:
                same = was == now
            if not same:
                changed.append(f"{options[name]} was {record[name]!r}, now {getattr(self, name)!r}")
        if changed:
            raise ValueError(
                f"Cannot resume the run in {self.output_dir} with other settings: {'; '.join(changed)}. Resume it "
                "with the settings in its training_config.json, or give another --output-dir for a new run."
            )
        recorded = record.get("corpus_fingerprint")
        data_changes = _corpus_changes(recorded, corpus) if isinstance(recorded, dict) and corpus is not None else []
        if data_changes and not self.allow_data_change:
            raise ValueError(
                f"Cannot resume the run in {self.output_dir}: {'; '.join(data_changes)}. Restore the files the run "
                "started with, or pass --allow-data-change to continue on the new data from the last checkpoint."
            )
        return data_changes


def _paths(value: Any) -> list[str]:
    # The strings of a corpus setting (a directory or Hub id; or {split: [source, target]}).
    if isinstance(value, dict):
        return [path for item in value.values() for path in _paths(item)]
    if isinstance(value, list):
        return [path for item in value for path in _paths(item)]
    return [value] if isinstance(value, str) else []


def _same_corpus(was: Any, now: Any) -> bool:
    # Resolved where every path exists here; as written where none does; unknowable (so not refused) otherwise.
    found = [os.path.exists(path) for path in _paths(was) + _paths(now)]
    if found and all(found):
        return [os.path.realpath(p) for p in _paths(was)] == [os.path.realpath(p) for p in _paths(now)]
    return was == now or any(found)


def _corpus_changes(was: dict, now: dict) -> list[str]:
    # How the corpus files differ between two `data.corpus_fingerprint`s, one phrase per file.
    changes = []
    for name in sorted(was.keys() | now.keys()):
        before, after = was.get(name), now.get(name)
        if before is None or after is None:
            changes.append(f"{name} is {'new' if before is None else 'gone'} since the run started")
        elif before["bytes"] != after["bytes"]:
            changes.append(f"{name} changed since the run started ({before['bytes']} bytes, now {after['bytes']})")
        elif before["sha256"] != after["sha256"]:
            changes.append(f"{name} changed since the run started (same size, another SHA-256)")
    return changes


def _model(preset: str, overrides: Any) -> dict | None:
    # The model a preset and overrides give, attn_implementation apart; None where they give none.
    overrides = (
        {k: v for k, v in overrides.items() if k != "attn_implementation"} if isinstance(overrides, dict) else {}
    )
    try:
        return VaswaniConfig.from_preset(preset, **overrides).to_diff_dict()
    except (ValueError, TypeError):
        return None
