"""Training batches from a dataset read as a stream (§5.1), for corpora too large to download or prepare whole.

`train --dataset ID --streaming` never downloads the training split: its pairs arrive through `datasets`' streaming,
each process reading its own shard (`split_dataset_by_node`), shuffled in a buffer of `shuffle_buffer` pairs
(`IterableDataset.shuffle`, a new order every epoch). Every `shuffle_buffer` pairs that arrive are encoded, those
with an empty side or a side longer than `max_length` tokens left out, and cut into token batches by
`data.TokenBatchSampler`, as a prepared corpus is cut over the whole.

The trade-off: lengths are sorted within a buffer, not over the corpus, so batches pad a little more; an epoch ends
where a process's shard ends, so processes may start their next epochs a few batches apart; and a resumed run reads
its epoch's stream again up to the batch it stopped at, which takes longer the further in it was. The validation
split and the tokenizer are prepared as usual (`training.corpus.prepare_corpus`).

See docs/data.md, "Streaming".
"""

from collections.abc import Iterator

import datasets
import numpy as np
import pyarrow as pa
from accelerate import Accelerator
from datasets.distributed import split_dataset_by_node
from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerBase

from ..data.corpora import TokenBatchSampler
from .config import TrainingConfig
from .corpus import encode_texts, encoder_of


class StreamedBatches:
    """This process's token batches of a streamed training split, epoch after epoch (§5.1).

    Args:
        stream: the training split's text, columns named by the languages.
        tokenizer: the run's tokenizer (a fast one).
        config: `source_lang`, `target_lang`, `max_length`, `max_tokens`, `shuffle_buffer` and `seed`.
        accelerator: this process's place among the processes, which each read a shard of the stream.
        pad_to: pad every batch's length to a multiple of this (as `training_data.token_batches`).

    Raises:
        ValueError: an epoch of the stream gave this process no batch at all (on iteration).
    """

    def __init__(
        self,
        stream: datasets.IterableDataset,
        tokenizer: PreTrainedTokenizerBase,
        config: TrainingConfig,
        accelerator: Accelerator,
        pad_to: int = 1,
    ) -> None:
        self.stream = split_dataset_by_node(
            stream, rank=accelerator.process_index, world_size=accelerator.num_processes
        )
        self.encoder = encoder_of(tokenizer)
        self.collator = DataCollatorForSeq2Seq(
            tokenizer, label_pad_token_id=-100, pad_to_multiple_of=pad_to, return_tensors="pt"
        )
        self.config, self.pad_to, self.rank = config, pad_to, accelerator.process_index
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Read epoch `epoch` (a new shuffle) from the start, and leave out its first `skip` batches."""
        self.epoch, self.skip = epoch, skip

    def __iter__(self) -> Iterator[dict]:
        config, made = self.config, 0
        shuffled = self.stream.shuffle(seed=config.seed, buffer_size=config.shuffle_buffer)
        shuffled.set_epoch(self.epoch)
        for chunk in shuffled.iter(batch_size=config.shuffle_buffer):
            source_ids, source_lengths = encode_texts(self.encoder, chunk[config.source_lang], pa.int32())
            target_ids, target_lengths = encode_texts(self.encoder, chunk[config.target_lang], pa.int32())
            bounds = (source_lengths, target_lengths)
            kept = np.flatnonzero(np.all([(1 < n) & (n <= config.max_length) for n in bounds], axis=0))
            sources, targets = source_ids.take(kept).to_pylist(), target_ids.take(kept).to_pylist()
            sampler = TokenBatchSampler(
                source_lengths[kept], target_lengths[kept], config.max_tokens,
                seed=config.seed + self.epoch, pad_to_multiple_of=self.pad_to,
            )  # fmt: skip
            for batch in sampler:
                made += 1
                if made > self.skip:
                    yield self.collator([{"input_ids": sources[i], "labels": targets[i]} for i in batch])
        if made == 0:  # else the endless stream of epochs would wait forever
            raise ValueError(
                f"The streamed training split gave process {self.rank} no batch: none of its pairs is both non-empty "
                f"and at most --max-length ({config.max_length}) tokens long on both sides."
            )
