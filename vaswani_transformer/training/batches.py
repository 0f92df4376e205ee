"""The data of a `train` run (§5.1): its tokenizer, where it has one, and this process's token-budget batches.

Each batch holds about `max_tokens` padded tokens per side (`data.TokenBatchSampler`), not a number of
sentences; every process reads its own share of them, and a resumed run continues at the batch it stopped at.
"""

from collections.abc import Iterator

import torch
from accelerate import Accelerator
from datasets import Dataset
from transformers import AutoTokenizer, DataCollatorForSeq2Seq, PreTrainedTokenizerBase

from ..data.corpora import TokenBatchSampler, lengths_of
from .config import TrainingConfig
from .corpus import PreparedCorpus
from .streaming import StreamedBatches


def run_tokenizer(config: TrainingConfig, resuming: bool) -> PreTrainedTokenizerBase | None:
    """The run's tokenizer where it has one: that saved beside a resumed run's checkpoints, or `config.tokenizer`.

    Args:
        config: the run's settings (`tokenizer`, `max_length`, `output_dir`).
        resuming: the run resumes from a checkpoint: it must tokenize exactly as it started.

    Returns:
        The tokenizer, its `model_max_length` the run's `max_length` (translation truncates to it); None where the
        run trains one (`training.corpus.prepare_corpus`).

    Raises:
        OSError: the saved or given tokenizer cannot be loaded (`AutoTokenizer.from_pretrained`).
    """
    if resuming:  # the tokenizer the run started with, saved beside its checkpoints
        return AutoTokenizer.from_pretrained(config.output_dir)
    if not config.tokenizer:
        return None
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    tokenizer.model_max_length = config.max_length  # saved with the model: translation truncates to it
    return tokenizer


def token_batches(
    split: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_tokens: int,
    shuffle: bool,
    seed: int,
    accelerator: Accelerator,
    pad_to: int = 1,
) -> torch.utils.data.DataLoader:
    """A DataLoader of this process's token-budget batches (`TokenBatchSampler`, §5.1), padded to multiples of `pad_to`.

    Args:
        split: a prepared split (`training.corpus.PreparedCorpus`): `input_ids` and `labels` of each pair.
        tokenizer: its tokenizer, for the padding.
        max_tokens: padded tokens per batch and side.
        shuffle: shuffle the batches every epoch (training), with `seed`; else in order (validation).
        seed: the seed of the shuffling.
        accelerator: this process's place among the processes, each reading its own share of the batches.
        pad_to: pad every batch's length to a multiple of this (8 for compiled training: few shapes).

    Returns:
        The DataLoader: batches of `input_ids`, `attention_mask` and `labels` of shape (sentences, tokens),
        `labels` -100 on padding; `batch_sampler.set_epoch(epoch, skip=batches)` places it in the corpus.
    """
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


def run_batches(
    corpus: PreparedCorpus, config: TrainingConfig, accelerator: Accelerator
) -> tuple[torch.utils.data.DataLoader | StreamedBatches, torch.utils.data.DataLoader | None]:
    """This process's training and validation batches (`token_batches`), checked to give every process some.

    Args:
        corpus: the prepared corpus (`training.corpus.prepare_corpus`) and its tokenizer.
        config: the run's settings (`max_tokens`, `seed`, `compile`: compiled runs pad lengths to multiples of 8).
        accelerator: this process's place among the processes.

    Returns:
        (training batches, shuffled by `config.seed`: a DataLoader, or with `config.streaming` the
        `StreamedBatches` of the stream; validation batches in order, or None without a validation split).

    Raises:
        ValueError: no training batch: no pair is within `max_length`, or the pairs make fewer batches than
            there are processes (the message says which setting to change).
    """
    # Compiled code is specialised to shapes; lengths in steps of 8 leave it few to meet (and suit matrix units).
    pad_to = 8 if config.compile else 1
    train, tokenizer = corpus.train, corpus.tokenizer
    if config.streaming:
        train_batches = StreamedBatches(train, tokenizer, config, accelerator, pad_to)
    else:
        train_batches = token_batches(train, tokenizer, config.max_tokens, True, config.seed, accelerator, pad_to)
    if (
        not config.streaming and len(train_batches.batch_sampler) == 0
    ):  # else the endless stream of batches would wait forever
        if len(train) == 0:
            raise ValueError(
                f"No training batches: none of the {corpus.training_pairs} training pairs is both non-empty and "
                f"at most --max-length ({config.max_length}) tokens long on both sides; check the training "
                "files for empty lines, or raise --max-length."
            )
        raise ValueError(
            f"No training batches for every process: the {len(train)} training pairs make fewer "
            f"batches of --max-tokens ({config.max_tokens}) than the {accelerator.num_processes} processes; "
            "lower --max-tokens or start fewer processes."
        )
    if corpus.validation is None:
        return train_batches, None
    return train_batches, token_batches(corpus.validation, tokenizer, config.max_tokens, False, 0, accelerator)


def endless_batches(
    loader: torch.utils.data.DataLoader | StreamedBatches, epoch: int, done: int
) -> Iterator[tuple[int, int, dict]]:
    """Endless (epoch, batches done in the epoch, batch) from position (`epoch`, `done`) on.

    Args:
        loader: the training batches (`token_batches`, or `StreamedBatches`).
        epoch: the epoch to start in, from 0.
        done: the batches of that epoch already trained on, which are skipped.

    Returns:
        An endless iterator; its epochs follow one another, each shuffled anew.
    """
    # Either places itself in the corpus: a DataLoader through its sampler, a stream by itself.
    positioned = loader.batch_sampler if isinstance(loader, torch.utils.data.DataLoader) else loader
    while True:
        positioned.set_epoch(epoch, skip=done)
        for batch in loader:
            done += 1
            yield epoch, done, batch
        epoch, done = epoch + 1, 0
