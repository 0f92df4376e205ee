"""Parallel corpora: their splits found and read (§5.1), and the token-based batches of §5.1.

A corpus is text files aligned by line (`AlignedFiles`, read as streams) or a `datasets` dataset (Hub or
local folder, in `datasets`' memory-mapped files, or streamed). `train` prepares it once
(`training.corpus`); `load_parallel_corpus` reads one whole into memory, for fine-tuning and tests. The
batch sampler keeps only two integer arrays of lengths.
"""

import codecs
import itertools
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

import datasets
import numpy as np
import torch

from ..utils.files import sha256_file

logger = logging.getLogger(__name__)

# Files of a local `datasets` folder (what `load_dataset(directory)` reads).
DATASET_SUFFIXES = {".json", ".jsonl", ".parquet", ".csv", ".arrow"}
# File stems that name the validation split of a corpus directory.
VALIDATION_STEMS = ("validation", "valid", "val", "dev")


def _find_split_files(data_dir: Path, source_lang: str, target_lang: str) -> dict[str, "AlignedFiles"]:
    """Map split names to (source file, target file) for `<stem>.<lang>` files in a directory."""
    splits: dict[str, AlignedFiles] = {}
    for source_file in sorted(data_dir.glob(f"*.{source_lang}")):
        stem = source_file.name[: -len(source_lang) - 1]
        target_file = data_dir / f"{stem}.{target_lang}"
        if not target_file.is_file():
            continue
        files = AlignedFiles(source_file, target_file)
        if stem == "train":
            splits["train"] = files
        elif stem in VALIDATION_STEMS:
            if "validation" in splits:
                raise ValueError(
                    f"{data_dir} holds two validation sets, {splits['validation'][0].name} and {source_file.name}: "
                    "keep one of them in the directory."
                )
            splits["validation"] = files
        elif stem.startswith("test"):
            splits[stem] = files
    return splits


class AlignedFiles(NamedTuple):
    """Two line-aligned UTF-8 text files of a parallel corpus, read as streams (§5.1).

    Attributes:
        source, target: the files, one sentence per line (lines as `iter_lines` reads them).
    """

    source: Path
    target: Path

    def count_pairs(self) -> int:
        """The number of sentence pairs, counted without decoding (as `wc -l`, plus an unterminated last line).

        Raises:
            FileNotFoundError: a file does not exist.
            ValueError: a file is empty, or the two differ in line count (both files and counts are named).
        """
        counts = []
        for path in self:
            if not path.is_file():
                raise FileNotFoundError(
                    f"Parallel corpus file {path} does not exist; check the path and language codes."
                )
            if path.stat().st_size == 0:
                raise ValueError(f"Parallel corpus file {path} is empty; it needs one sentence per line.")
            counts.append(count_lines(path))
        if counts[0] != counts[1]:
            raise ValueError(
                f"Parallel files must have one sentence per line, aligned by line, but {self.source} has "
                f"{counts[0]} lines and {self.target} has {counts[1]}."
            )
        return counts[0]

    def lines(self, side: int, chosen: np.ndarray | None = None) -> Iterator[str]:
        """The sentences of one side (0: source, 1: target): all, or those where the boolean mask `chosen` is True.

        Raises:
            ValueError: a line that is not valid UTF-8 (file and line named), when it is reached.
        """
        lines = iter_lines(self[side])
        return lines if chosen is None else itertools.compress(lines, chosen)

    def batches(self, size: int) -> Iterator[tuple[list[str], list[str]]]:
        """(sources, targets) of `size` pairs at a time, in file order; one batch is in memory at a time.

        Raises:
            ValueError: a line that is not valid UTF-8 (file and line named); the files end at different lines
                (`count_pairs` says so first, naming both counts).
        """
        pairs = zip(self.lines(0), self.lines(1), strict=True)
        while batch := list(itertools.islice(pairs, size)):
            sources, targets = zip(*batch, strict=True)
            yield list(sources), list(targets)


def count_lines(path: Path) -> int:
    """Lines of a file as `iter_lines` reads them: line feeds, plus one for a last line without one.

    Raises:
        OSError: the file cannot be read.
    """
    count, last = 0, b"\n"
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def _read_aligned_files(files: AlignedFiles, source_lang: str, target_lang: str) -> datasets.Dataset:
    """One in-memory Arrow table with a column per language from two line-aligned text files."""
    files.count_pairs()
    # Read as `wc -l` counts lines (ending at a line feed only), not as `datasets`' text loader, which
    # also ends them at a lone carriage return and would misalign the two files.
    return datasets.Dataset.from_dict({source_lang: list(files.lines(0)), target_lang: list(files.lines(1))})


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


def corpus_splits(
    data: str | os.PathLike,
    source_lang: str,
    target_lang: str,
    dataset_config: str | None = None,
    files: dict[str, tuple[str, str]] | None = None,
    streaming: bool = False,
) -> dict[str, AlignedFiles | datasets.Dataset | datasets.IterableDataset]:
    """Find the splits of a parallel corpus without reading its text files: `AlignedFiles`, or `datasets` tables.

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
        streaming: read a dataset (not text files) as `datasets.IterableDataset`s, never downloaded whole.

    Returns:
        `{split: AlignedFiles or Dataset}` with "train", perhaps "validation" and test splits; a `Dataset` (in
        `datasets`' memory-mapped files) or `IterableDataset` has the columns `source_lang` and `target_lang`.

    Raises:
        FileNotFoundError: `data` does not exist (and is no Hub dataset id).
        ValueError: `data` is a file (a directory or dataset is needed), a directory holds two validation sets
            (`val.*` and `dev.*`), or the dataset has no training split or no column for a language (streamed:
            when the first row arrives); `streaming` with text files.
    """
    splits: dict[str, AlignedFiles | datasets.Dataset | datasets.IterableDataset] = {}
    path = Path(data) if data else None
    text_files = _find_split_files(path, source_lang, target_lang) if path and path.is_dir() else {}
    splits.update(text_files)
    if path is not None and not text_files:
        if path.is_dir():
            if any(p.suffix in DATASET_SUFFIXES for p in path.rglob("*")):
                splits.update(_load_dataset_corpus(str(data), source_lang, target_lang, dataset_config, streaming))
        elif path.exists():
            raise ValueError(f"{data} is a file; give the directory that holds the corpus, or --train-files.")
        elif re.fullmatch(r"[\w.-]+(/[\w.-]+)?", str(data)):
            splits.update(_load_dataset_corpus(str(data), source_lang, target_lang, dataset_config, streaming))
        else:
            raise FileNotFoundError(f"{data} does not exist (expected a corpus directory or a Hub dataset id).")
    for split, (source_file, target_file) in (files or {}).items():
        splits[split] = AlignedFiles(Path(source_file), Path(target_file))
    if streaming and any(isinstance(split, AlignedFiles) for split in splits.values()):
        raise ValueError(
            "--streaming reads a dataset (--dataset); text files are streamed and prepared once without it."
        )
    if "train" not in splits:
        raise ValueError(
            f"No training split found in {data!r}: expected files train.{source_lang} and train.{target_lang}, "
            "a Hub dataset with a 'train' split, or explicit training files."
        )
    return splits


def load_parallel_corpus(
    data: str | os.PathLike,
    source_lang: str,
    target_lang: str,
    dataset_config: str | None = None,
    files: dict[str, tuple[str, str]] | None = None,
) -> datasets.DatasetDict:
    """Load a parallel corpus as a `DatasetDict` with one string column per language, text files read into memory.

    For corpora that fit in memory (fine-tuning, tests); `train` streams its corpus instead
    (`training.corpus.prepare_corpus`). See docs/robustness.md, "Bad input".

    Args:
        data, source_lang, target_lang, dataset_config, files: as for `corpus_splits`.

    Returns:
        `DatasetDict` with splits "train", "validation" and any test splits, each with columns
        `source_lang` and `target_lang`.

    Raises:
        FileNotFoundError: a named file or directory does not exist.
        ValueError: as for `corpus_splits`; or a file is empty, is not valid UTF-8 (the file and line are
            named), or two aligned files differ in line count (both files and counts are named).
    """
    splits = corpus_splits(data, source_lang, target_lang, dataset_config, files)
    return datasets.DatasetDict(
        {
            name: _read_aligned_files(split, source_lang, target_lang) if isinstance(split, AlignedFiles) else split
            for name, split in splits.items()
        }
    )


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
    dataset_id: str, source_lang: str, target_lang: str, dataset_config: str | None, streaming: bool = False
) -> dict[str, datasets.Dataset | datasets.IterableDataset]:
    loaded = datasets.load_dataset(dataset_id, dataset_config, streaming=streaming)
    splits = {}
    for split, table in loaded.items():
        name = "validation" if split in VALIDATION_STEMS else split
        if streaming:  # rows arrive one by one: each is read as it comes, and a missing language said at the first
            where = f"Dataset {dataset_id} split {split}"
            splits[name] = table.map(_languages_of, fn_kwargs={"languages": (source_lang, target_lang), "where": where})
            splits[name] = splits[name].select_columns([source_lang, target_lang])
            continue
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
        splits[name] = table.select_columns([source_lang, target_lang])
    return splits


def _languages_of(row: dict, languages: tuple[str, str], where: str) -> dict[str, str]:
    # A streamed row's sentence in each language, from a `translation` dict (WMT14, OPUS) or a column per language.
    texts = row.get("translation", row)
    missing = [lang for lang in languages if lang not in texts]
    if missing:
        raise ValueError(f"{where} has no column for {', '.join(missing)}; its rows hold {', '.join(texts)}.")
    return {lang: texts[lang] for lang in languages}


def text_batches(
    split: AlignedFiles | datasets.Dataset,
    languages: list[str],
    chosen: np.ndarray | None = None,
    batch_size: int = 1000,
) -> Iterator[list[str]]:
    """Batches of a split's sentences, one language after the other, for `train_tokenizer` (§5.1).

    Args:
        split: text files (`AlignedFiles`, their sides in the order of `languages`) or a table with a column
            per language.
        languages: the source and target language codes.
        chosen: a boolean mask of the pairs to take, shape `(pairs,)` (a sample of a large corpus); None: all.
        batch_size: sentences per batch.

    Returns:
        An iterator over lists of sentences; one batch is in memory at a time.
    """
    for side, lang in enumerate(languages):
        if isinstance(split, AlignedFiles):
            lines = split.lines(side, chosen)
            while batch := list(itertools.islice(lines, batch_size)):
                yield batch
        else:
            sample = split if chosen is None else split.select(np.flatnonzero(chosen))
            for batch in sample.select_columns([lang]).iter(batch_size=batch_size):
                yield batch[lang]


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
    """The `source_length` and `target_length` columns of a prepared split as integer arrays of shape `(pairs,)` (§5.1).

    Read through Arrow, not row by row: milliseconds for millions of pairs.
    """
    columns = table.select_columns(["source_length", "target_length"]).with_format("arrow")[:]
    return columns.column("source_length").to_numpy(), columns.column("target_length").to_numpy()
