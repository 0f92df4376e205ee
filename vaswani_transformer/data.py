"""Parallel corpora as `datasets` tables, their tokenization, and token-based batches (§5.1).

Every per-sentence operation runs on Arrow tables through `datasets` (`load_dataset`, `map`);
Hub datasets stay in `datasets`' files on disk, while text files are read into memory (as
Python strings while they are read, then as one Arrow table). The batch sampler keeps only two
integer arrays of lengths.
"""

import codecs
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import datasets
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from .files import sha256_file

logger = logging.getLogger(__name__)

# Files of a local `datasets` folder (what `load_dataset(directory)` reads).
DATASET_SUFFIXES = {".json", ".jsonl", ".parquet", ".csv", ".arrow"}
# File stems that name the validation split of a corpus directory.
VALIDATION_STEMS = ("validation", "valid", "val", "dev")


def _find_split_files(data_dir: Path, source_lang: str, target_lang: str) -> dict[str, tuple[Path, Path]]:
    """Map split names to (source file, target file) for `<stem>.<lang>` files in a directory."""
    splits: dict[str, tuple[Path, Path]] = {}
    for source_file in sorted(data_dir.glob(f"*.{source_lang}")):
        stem = source_file.name[: -len(source_lang) - 1]
        target_file = data_dir / f"{stem}.{target_lang}"
        if not target_file.is_file():
            continue
        if stem == "train":
            splits["train"] = (source_file, target_file)
        elif stem in VALIDATION_STEMS:
            if "validation" in splits:
                raise ValueError(
                    f"{data_dir} holds two validation sets, {splits['validation'][0].name} and {source_file.name}: "
                    "keep one of them in the directory."
                )
            splits["validation"] = (source_file, target_file)
        elif stem.startswith("test"):
            splits[stem] = (source_file, target_file)
    return splits


def _read_aligned_files(source_file: Path, target_file: Path, source_lang: str, target_lang: str) -> datasets.Dataset:
    """One Arrow table with a column per language from two line-aligned text files."""
    for path in (source_file, target_file):
        if not path.is_file():
            raise FileNotFoundError(f"Parallel corpus file {path} does not exist; check the path and language codes.")
        if path.stat().st_size == 0:
            raise ValueError(f"Parallel corpus file {path} is empty; it needs one sentence per line.")
    # Read as `wc -l` counts lines (ending at a line feed only), not as `datasets`' text loader, which
    # also ends them at a lone carriage return and would misalign the two files.
    columns = {lang: list(iter_lines(path)) for path, lang in ((source_file, source_lang), (target_file, target_lang))}
    if len(columns[source_lang]) != len(columns[target_lang]):
        raise ValueError(
            f"Parallel files must have one sentence per line, aligned by line, but {source_file} has "
            f"{len(columns[source_lang])} lines and {target_file} has {len(columns[target_lang])}."
        )
    return datasets.Dataset.from_dict(columns)


def iter_lines(source: str | os.PathLike | BinaryIO, name: str | None = None) -> Iterator[str]:
    """The lines of a UTF-8 text file or binary stream, without line ends, one at a time.

    Lines end at a line feed only (a carriage return before it is dropped), as `wc -l` counts them;
    a carriage return elsewhere stays in the text, with one warning (a file whose lines end with
    carriage returns alone is one line); a UTF-8 byte-order mark at the start is removed, with one
    warning. A missing file is reported at once, but the file is opened only when the first line is
    asked for, and closed after the last.

    See docs/robustness.md, "Bad input".

    Args:
        source: a path, or a binary stream such as `sys.stdin.buffer`.
        name: what error messages call the source (default: the path, or the stream's name).

    Returns:
        An iterator over the lines, as strings.

    Raises:
        FileNotFoundError: the file does not exist (at the call).
        IsADirectoryError: the path is a directory.
        ValueError: a line is not valid UTF-8, when that line is reached; the message names the
            file and the line number.
    """
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        raise IsADirectoryError(f"{source} is a directory, not a text file; check the path.")
    if isinstance(source, (str, os.PathLike)) and not Path(source).exists():  # a pipe, `<(...)`, is read as a file
        raise FileNotFoundError(f"{source} does not exist; check the path.")
    return _decoded_lines(source, name)


def _decoded_lines(source: str | os.PathLike | BinaryIO, name: str | None) -> Iterator[str]:
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as handle:
            yield from _decoded_lines(handle, name or str(source))
        return
    name = name or getattr(source, "name", "input")
    warned = False
    for number, raw in enumerate(source, start=1):
        if number == 1 and raw.startswith(codecs.BOM_UTF8):
            # A byte-order mark is no part of the first sentence (editors on Windows write one).
            logger.warning("%s: removed the UTF-8 byte-order mark at its start.", name)
            raw = raw[len(codecs.BOM_UTF8) :]
        try:
            line = raw.decode("utf-8")
            # A carriage return goes only as part of a CRLF ending: any other belongs to the text.
            line = line[:-2] if line.endswith("\r\n") else line.removesuffix("\n")
            if "\r" in line and not warned:  # most likely a file whose lines end with CRs alone: one "line"
                logger.warning(
                    "%s, line %d: a carriage return inside the line, kept as text. Lines end at line feeds; if the "
                    "file's lines end with carriage returns alone, convert it first: tr '\\r' '\\n' < IN > OUT.",
                    name, number,
                )  # fmt: skip
                warned = True
            yield line
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{name}, line {number}: not valid UTF-8 ({error.reason}, byte {error.start + 1} of the line); "
                "convert the file to UTF-8, e.g. with iconv."
            ) from None


def corpus_location(data_dir: str | None, dataset: str | None) -> str:
    """`load_parallel_corpus`'s `data` from a command line's `--data-dir` or `--dataset` ("" for neither).

    Raises:
        ValueError: both are given.
        FileNotFoundError: `data_dir` is not a directory (a typo such as `data/multi30K` would
            otherwise be looked up as a Hub dataset, which is `--dataset`).
    """
    if data_dir and dataset:
        raise ValueError("Give the corpus with one of --data-dir and --dataset, not both.")
    if data_dir and not Path(data_dir).is_dir():
        raise FileNotFoundError(f"--data-dir {data_dir} is not a directory; a Hub dataset is --dataset.")
    return data_dir or dataset or ""


def load_parallel_corpus(
    data: str | os.PathLike,
    source_lang: str,
    target_lang: str,
    dataset_config: str | None = None,
    files: dict[str, tuple[str, str]] | None = None,
) -> datasets.DatasetDict:
    """Load a parallel corpus as a `DatasetDict` with one string column per language.

    See docs/robustness.md, "Bad input".

    Args:
        data: a directory holding `train.<lang>`, `val.<lang>` (or `valid`, `dev`, `validation`) and
            `test*.<lang>` files, one sentence per line and aligned by line; or a Hub dataset id, or
            a local folder of dataset files (JSON, Parquet, CSV) that `datasets.load_dataset`
            reads, with a `translation` column of `{lang: text}` dicts (as WMT14 and OPUS have)
            or one column per language. May be empty when `files` gives every split.
        source_lang, target_lang: language codes, the file extensions or dict keys.
        dataset_config: configuration name of a Hub dataset (e.g. "de-en" for WMT14).
        files: explicit `{split: (source_file, target_file)}`, added to or replacing those found in `data`.

    Returns:
        `DatasetDict` with splits "train", "validation" and any test splits, each with columns
        `source_lang` and `target_lang`.

    Raises:
        FileNotFoundError: a named file or directory does not exist.
        ValueError: `data` is a file (a directory or dataset is needed), a directory holds two
            validation sets (`val.*` and `dev.*`), a file is empty, is not valid UTF-8 (the file and line
            are named), two aligned files differ in line count (both files and counts are named), or the
            dataset has no training split or no column for a language.
    """
    splits: dict[str, datasets.Dataset] = {}
    path = Path(data) if data else None
    text_files = _find_split_files(path, source_lang, target_lang) if path and path.is_dir() else {}
    for split, (source_file, target_file) in text_files.items():
        splits[split] = _read_aligned_files(source_file, target_file, source_lang, target_lang)
    if path is not None and not text_files:
        if path.is_dir():
            if any(p.suffix in DATASET_SUFFIXES for p in path.rglob("*")):
                splits.update(_load_dataset_corpus(str(data), source_lang, target_lang, dataset_config))
        elif path.exists():
            raise ValueError(f"{data} is a file; give the directory that holds the corpus, or --train-files.")
        elif re.fullmatch(r"[\w.-]+(/[\w.-]+)?", str(data)):
            splits.update(_load_dataset_corpus(str(data), source_lang, target_lang, dataset_config))
        else:
            raise FileNotFoundError(f"{data} does not exist (expected a corpus directory or a Hub dataset id).")
    for split, (source_file, target_file) in (files or {}).items():
        splits[split] = _read_aligned_files(Path(source_file), Path(target_file), source_lang, target_lang)
    if "train" not in splits:
        raise ValueError(
            f"No training split found in {data!r}: expected files train.{source_lang} and train.{target_lang}, "
            "a Hub dataset with a 'train' split, or explicit training files."
        )
    return datasets.DatasetDict(splits)


def corpus_fingerprint(
    data: str | os.PathLike,
    source_lang: str,
    target_lang: str,
    files: dict[str, tuple[str, str]] | None = None,
) -> dict[str, dict[str, int | str]]:
    """The size and SHA-256 of each local file that `train` learns from, to tell whether a corpus changed in place.

    The files are those `load_parallel_corpus` reads for the training and validation splits: `<stem>.<lang>`
    text files of a directory, the files of a local dataset folder, and explicit `files`. A Hub dataset has none.

    See docs/training.md, "Training at scale, and runs that survive being killed".

    Args:
        data, source_lang, target_lang, files: as for `load_parallel_corpus`.

    Returns:
        `{name: {"bytes": size, "sha256": digest}}`, named by the path inside `data`, or for explicit files by
        the file's name and its split (no path of this machine).

    Raises:
        OSError: a file cannot be read.
    """
    files = files or {}
    path = Path(data) if data else None
    found: dict[str, Path] = {}
    if path is not None and path.is_dir():
        text_files = _find_split_files(path, source_lang, target_lang)
        for split in ("train", "validation"):
            if split in text_files and split not in files:
                found.update({file.name: file for file in text_files[split]})
        if not text_files:
            tables = (p for p in sorted(path.rglob("*")) if p.suffix in DATASET_SUFFIXES and p.is_file())
            found.update({table.relative_to(path).as_posix(): table for table in tables})
    for split in ("train", "validation"):
        found.update({f"{Path(file).name} ({split} files)": Path(file) for file in files.get(split, ())})
    return {name: {"bytes": file.stat().st_size, "sha256": sha256_file(file)} for name, file in found.items()}


def _load_dataset_corpus(
    dataset_id: str, source_lang: str, target_lang: str, dataset_config: str | None
) -> dict[str, datasets.Dataset]:
    loaded = datasets.load_dataset(dataset_id, dataset_config)
    splits = {}
    for split, table in loaded.items():
        if "translation" in table.column_names:
            table = table.flatten()
            table = table.rename_columns(
                {
                    f"translation.{lang}": lang
                    for lang in (source_lang, target_lang)
                    if f"translation.{lang}" in table.column_names
                }
            )
        missing = [lang for lang in (source_lang, target_lang) if lang not in table.column_names]
        if missing:
            raise ValueError(
                f"Dataset {dataset_id} split {split} has no column for {', '.join(missing)}; "
                f"its columns are {table.column_names}."
            )
        splits["validation" if split in VALIDATION_STEMS else split] = table.select_columns([source_lang, target_lang])
    return splits


def text_batches(corpus: datasets.DatasetDict, languages: list[str], batch_size: int = 1000) -> Iterator[list[str]]:
    """Batches of training sentences of each language in turn, for `train_tokenizer` (§5.1)."""
    for lang in languages:
        for batch in corpus["train"].select_columns([lang]).iter(batch_size=batch_size):
            yield batch[lang]


def tokenize_corpus(
    corpus: datasets.DatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    source_lang: str,
    target_lang: str,
    max_length: int,
    num_proc: int | None = None,
) -> datasets.DatasetDict:
    """Tokenize every split with `datasets.map` (§5.1); drop training pairs that are empty or too long, with a count.

    One warning says how many training pairs were left out, and what share, where any were.

    Args:
        corpus: from `load_parallel_corpus`.
        tokenizer: the shared tokenizer.
        max_length: longest sentence, in tokens with `</s>`, kept for training; longer ones in
            other splits are truncated (`TrainingConfig.max_length`).
        num_proc: worker processes for `map`.

    Returns:
        The same splits with columns `input_ids`, `labels`, `source_length`, `target_length`
        (token counts) beside the text columns.
    """

    def encode(batch: dict[str, list[str]], limit: int) -> dict[str, list]:
        encoded = tokenizer(batch[source_lang], text_target=batch[target_lang], truncation=True, max_length=limit)
        return {
            "input_ids": encoded["input_ids"],
            "labels": encoded["labels"],
            "source_length": [len(ids) for ids in encoded["input_ids"]],
            "target_length": [len(ids) for ids in encoded["labels"]],
        }

    # Training pairs one token longer than max_length are found (and dropped, below); the rest are cut to it.
    tokenized = datasets.DatasetDict(
        {
            name: split.map(
                encode,
                batched=True,
                num_proc=num_proc,
                fn_kwargs={"limit": max_length + 1 if name == "train" else max_length},
                desc=f"Tokenizing {name}",
            )
            for name, split in corpus.items()
        }
    )
    # A sentence of max_length + 1 tokens was truncated: drop such training pairs rather than learn
    # from a cut-off translation; `</s>` alone (length 1) is an empty line.
    source, target = lengths_of(tokenized["train"])
    too_long = (source > max_length) | (target > max_length)
    empty = ~too_long & ((source <= 1) | (target <= 1))
    left_out = too_long | empty
    if left_out.any():
        share = lambda count: f"{count:,} ({100 * count / len(source):.1f}%)"  # noqa: E731
        logger.warning(
            "Left out %s of the %s training pairs: %s longer than max_length (%d tokens) on a side, %s with an "
            "empty side.",
            f"{left_out.sum():,}", f"{len(source):,}", share(too_long.sum()), max_length, share(empty.sum()),
        )  # fmt: skip
        tokenized["train"] = tokenized["train"].select(np.flatnonzero(~left_out))
    return tokenized


class TokenBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of sentence pairs of similar length, each holding at most `max_tokens` padded tokens (§5.1).

    "Sentence pairs were batched together by approximate sequence length": indices are shuffled,
    sorted by length (stably, so equal lengths stay shuffled), cut into batches whose padded size
    `batch_size * max(source_len, target_len)` (rounded up to `pad_to_multiple_of`, as the collator
    pads) fits the budget, and the batches are shuffled.
    Each epoch (see `set_epoch`) draws a new order from `seed + epoch`, so any position in the data
    can be recomputed from (epoch, batches done) alone: that is what a checkpoint records.

    With several data-parallel processes, every process builds the same list of batches and takes
    every `num_shards`-th one, starting at `shard_index`; the list is cut to a multiple of
    `num_shards` (at most `num_shards - 1` batches of an epoch are left out) so that every process
    runs the same number of steps. One optimizer step over all processes thus covers the same
    batches as one process accumulating `num_shards` batches. Without shuffling (evaluation), the
    largest batches are halved instead, so that every sentence is scored (unless there are fewer
    sentences than processes).

    Args:
        source_lengths, target_lengths: token counts per pair, arrays of shape `(num_pairs,)`.
        max_tokens: budget of padded tokens per side and batch.
        shuffle: shuffle pairs and batches; False keeps the sorted order (for evaluation).
        seed: random seed.
        num_shards, shard_index: data-parallel processes and this process's rank.
        pad_to_multiple_of: the multiple of tokens each side of a batch is padded to (the collator's
            `pad_to_multiple_of`), counted in the budget.

    Raises:
        ValueError: `max_tokens` is smaller than the longest pair (padded), which could never be
            batched, or `shard_index` is not in [0, num_shards).
    """

    def __init__(
        self,
        source_lengths: np.ndarray,
        target_lengths: np.ndarray,
        max_tokens: int,
        shuffle: bool = True,
        seed: int = 0,
        num_shards: int = 1,
        shard_index: int = 0,
        pad_to_multiple_of: int = 1,
    ) -> None:
        self.pad_to_multiple_of = pad_to_multiple_of
        self.source_lengths, self.target_lengths = np.asarray(source_lengths), np.asarray(target_lengths)
        self.lengths = self._padded(np.maximum(self.source_lengths, self.target_lengths))
        if len(self.lengths) and self.lengths.max() > max_tokens:
            raise ValueError(
                f"max_tokens={max_tokens} is smaller than the longest sentence ({self.lengths.max()} tokens, padded "
                f"to a multiple of {pad_to_multiple_of}); raise --max-tokens or lower --max-length."
            )
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}.")
        self.max_tokens = max_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.num_shards, self.shard_index = num_shards, shard_index
        self.epoch, self.skip = 0, 0
        self._batches = self._make_batches()

    def _padded(self, lengths: np.ndarray) -> np.ndarray:
        return -(-lengths // self.pad_to_multiple_of) * self.pad_to_multiple_of

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Draw the order of epoch `epoch` (completed passes over the data) and start after its first `skip` batches.

        `skip` counts this process's batches; resuming a run passes the position its checkpoint recorded.

        See docs/training.md, "Training at scale, and runs that survive being killed".
        """
        if epoch != self.epoch:
            self.epoch = epoch
            self._batches = self._make_batches()
        self.skip = skip

    def _make_batches(self) -> list[np.ndarray]:
        rng = np.random.default_rng(self.seed + self.epoch)
        order = rng.permutation(len(self.lengths)) if self.shuffle else np.arange(len(self.lengths))
        # By the longer side, then by the source side, so that both sides of a batch pad little.
        order = order[np.lexsort((self.source_lengths[order], self.lengths[order]))]
        sorted_lengths = self.lengths[order]
        batches, start = [], 0
        while start < len(order):
            # Lengths ascend, so a batch [start, end) is padded to sorted_lengths[end - 1]: find the
            # largest end with (end - start) * sorted_lengths[end - 1] <= max_tokens.
            step = max(1, self.max_tokens // int(sorted_lengths[start]))
            end = min(len(order), start + step)
            while (end - start) * int(sorted_lengths[end - 1]) > self.max_tokens:
                end -= 1
            batches.append(order[start:end])
            start = end
        if self.shuffle:
            rng.shuffle(batches)
        while not self.shuffle and len(batches) % self.num_shards and any(len(b) > 1 for b in batches):
            # Evaluation scores every sentence: the largest batches are halved until each process gets as many.
            largest = max(range(len(batches)), key=lambda i: len(batches[i]))
            batches[largest : largest + 1] = np.array_split(batches[largest], 2)
        usable = len(batches) - len(batches) % self.num_shards
        return batches[self.shard_index : usable : self.num_shards]

    def padding_efficiency(self) -> float:
        """Real tokens over all tokens of the padded batches of this epoch, source and target together (<= 1).

        See docs/training.md, "Training at scale, and runs that survive being killed".
        """
        real = sum(int(self.source_lengths[b].sum() + self.target_lengths[b].sum()) for b in self._batches)
        padded = sum(
            len(b) * int(self._padded(self.source_lengths[b].max()) + self._padded(self.target_lengths[b].max()))
            for b in self._batches
        )
        return real / max(padded, 1)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self._batches[self.skip :]:
            yield batch.tolist()

    def __len__(self) -> int:
        return len(self._batches) - self.skip


def lengths_of(table: datasets.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """The `source_length` and `target_length` columns of a tokenized split as integer arrays (§5.1)."""
    columns = table.select_columns(["source_length", "target_length"]).with_format("numpy")[:]
    return columns["source_length"], columns["target_length"]
