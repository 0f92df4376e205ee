"""A `train` run's corpus, prepared once (§5.1): token ids in memory-mapped Arrow files, kept by corpus and tokenizer.

Preparing a corpus of WMT's size (4.5M pairs for WMT14 En-De) takes minutes. Every later run on the same corpus
(its files by SHA-256, or a `datasets` table by its fingerprint) with the same tokenizer, a resumed run, and every
process of a multi-process run open what the first one wrote instead. Preparing:

1. reads the training and validation splits as streams: text files line by line, `datasets` tables by batch;
2. trains the shared BPE tokenizer (`tokenization.train_tokenizer`) on at most `tokenizer_sample` pairs drawn at
   random from the corpus, unless a tokenizer is given, and keeps it, keyed by the corpus and its settings;
3. encodes every pair with `tokenizers` in Rust, on every core, and leaves out the training pairs with an empty
   side or a side longer than `max_length` tokens;
4. writes `input_ids`, `labels` and both lengths to Arrow files (the validation split with its text too), which
   `datasets` memory-maps: a run holds the lengths in memory, not the corpus.

The cache is `data_cache_dir`, by default `$HF_DATASETS_CACHE/vaswani_transformer`: `tokenizers/<key>/` and
`corpora/<key>/`. Each entry is written into a temporary directory and renamed whole, under a file lock, so that
concurrent runs and processes prepare a corpus once and none reads half of one. Its `manifest.json`, written last,
lists its files and their sizes: an entry whose files are missing, of other sizes, or unreadable is damaged, and is
prepared anew (or, where the cache cannot be written, refused with how to remove it). A whole entry is opened
without the lock, so that a cache on a read-only mount serves what it holds. Nothing removes old entries.

See docs/data.md.
"""

import collections
import hashlib
import itertools
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import datasets
import numpy as np
import pyarrow as pa
from filelock import FileLock
from tokenizers import Tokenizer
from tqdm.auto import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ..data.corpora import AlignedFiles, corpus_splits, text_batches
from ..data.tokenizer import train_tokenizer
from ..utils.files import room_for
from .config import TrainingConfig

logger = logging.getLogger(__name__)

# Raised whenever the files' layout changes: entries written in an earlier one are then never read.
# 2: every entry's manifest.json lists its files and their sizes.
FORMAT_VERSION = 2
# The splits a run learns from; test splits are for `evaluate`.
SPLITS = ("train", "validation")
# Pairs encoded at a time: enough to keep every core busy in Rust, few enough to hold in memory.
CHUNK_PAIRS = 50_000


@dataclass(frozen=True)
class PreparedCorpus:
    """A corpus ready for §5.1's batches: its tokenizer, and its splits in memory-mapped Arrow files.

    Attributes:
        tokenizer: the shared tokenizer the splits are encoded with.
        train: the training pairs kept (each side non-empty and at most `max_length` tokens, `</s>` included):
            columns `input_ids` and `labels` (token ids), `source_length` and `target_length` (tokens). With
            `streaming`, the training split's text as a `datasets.IterableDataset` instead (`corpus_streaming`).
        validation: the same columns for every validation pair (cut to `max_length` tokens), and its text in
            columns named by the two languages; None without a validation split.
        directory: where the files are.
        training_pairs: the training pairs of the corpus, before any were left out; None for a stream.
    """

    tokenizer: PreTrainedTokenizerBase
    train: datasets.Dataset | datasets.IterableDataset
    validation: datasets.Dataset | None
    directory: Path
    training_pairs: int | None


def cache_directory(config: TrainingConfig) -> Path:
    """Where prepared corpora (§5.1) and their tokenizers are kept: `config.data_cache_dir`, else
    `$HF_DATASETS_CACHE/vaswani_transformer`. See docs/data.md, "The data cache"."""
    return Path(config.data_cache_dir or Path(datasets.config.HF_DATASETS_CACHE) / "vaswani_transformer")


def prepare_corpus(
    config: TrainingConfig, tokenizer: PreTrainedTokenizerBase | None, corpus_files: dict
) -> PreparedCorpus:
    """Prepare `config`'s corpus once, or open the prepared one: tokenizer, then token ids and lengths (§5.1).

    With `config.streaming`, the training split stays a stream: only the validation split and the tokenizer (trained
    on the stream's first `tokenizer_sample` pairs) are prepared.

    Args:
        config: the corpus (`data`, `files`, `dataset_config`, the languages, `streaming`), the tokenizer's
            settings (`vocab_size`, `tokenizer_sample`), `max_length`, and `data_cache_dir`.
        tokenizer: the run's tokenizer, or None to train a BPE tokenizer on the corpus (or take the one kept for it).
        corpus_files: the corpus's local files, by size and SHA-256 (`data.corpus_fingerprint`): with the
            tokenizer, what names the prepared files, so that a changed file is prepared anew.

    Returns:
        The prepared corpus; its tokenizer's `model_max_length` is `config.max_length` where it was trained here.

    Raises:
        FileNotFoundError, ValueError: as `data.corpus_splits` and `data.AlignedFiles` raise them (a missing,
            empty or misaligned file, a line that is not UTF-8); or `tokenizer` is no fast tokenizer, or one that
            encodes targets otherwise than sources.
        OSError: the cache's disk has no room for the tokenizer or the prepared corpus; or the cache cannot be
            written (a read-only mount) and lacks the entry, or holds it damaged (the message says how to remove it).
    """
    found = corpus_splits(
        config.data, config.source_lang, config.target_lang, config.dataset_config, config.files, config.streaming
    )
    splits = {name: split for name, split in found.items() if name in SPLITS}
    streamed = splits.pop("train") if config.streaming else None
    if streamed is not None:
        # Of a stream, only what is small is held: the validation split, and the first pairs for the tokenizer.
        splits = {name: datasets.Dataset.from_list(list(split)) for name, split in splits.items()}
        if tokenizer is None:
            splits["train"] = datasets.Dataset.from_list(list(streamed.take(config.tokenizer_sample)))
    tables = {name: split._fingerprint for name, split in splits.items() if isinstance(split, datasets.Dataset)}
    corpus = {
        "files": corpus_files,
        "tables": tables,
        "languages": [config.source_lang, config.target_lang],
        "version": FORMAT_VERSION,
    }
    root = cache_directory(config)
    if tokenizer is None:
        tokenizer = _kept_tokenizer(config, splits["train"], corpus, root)
    encoder = encoder_of(tokenizer)
    settings = {
        "corpus": corpus,
        "tokenizer": hashlib.sha256(encoder.to_str().encode()).hexdigest(),
        "max_length": config.max_length,
    }
    if streamed is not None:  # a stream's training pairs are encoded as they arrive (`corpus_streaming`)
        splits.pop("train", None)
    directory = root / "corpora" / _key(settings)

    def write(building: Path) -> None:
        with room_for(directory.parent, _text_bytes(splits), "the prepared corpus", _AGAIN):
            _write_splits(building, splits, encoder, config, settings)

    counts, opened = _kept_entry(directory, "prepared corpus", write, _open_splits)
    if "train" in counts:
        _report_left_out(counts["train"], config.max_length)
    return PreparedCorpus(
        tokenizer=tokenizer,
        train=streamed if streamed is not None else opened["train"],
        validation=opened.get("validation"),
        directory=directory,
        training_pairs=counts["train"]["pairs"] if "train" in counts else None,
    )


def _key(settings: dict) -> str:
    # An entry's name: the digest of everything that decides its content.
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:24]


# What a message of a full disk tells the user to do once there is room.
_AGAIN = "run the same command again"
_Opened = TypeVar("_Opened")


class _Damaged(Exception):
    """An entry that is there but not whole: its message says what is wrong with it."""


def _kept_entry(
    directory: Path, what: str, write: Callable[[Path], None], open_entry: Callable[[Path], _Opened]
) -> _Opened:
    # The cache entry at `directory`, opened by `open_entry`; where it is absent or damaged, first `write` into a
    # temporary directory under the entry's lock, renamed to it whole. A whole entry is opened without the lock: a
    # renamed entry is never written again, and a cache on a read-only mount could not create the lock file.
    damage = None
    if directory.is_dir():
        try:
            return open_entry(directory)
        except _Damaged as error:
            damage = str(error)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(f"{directory}.lock")
        lock.acquire()
    except OSError as error:
        reason = error.strerror or str(error)
        if damage is not None:
            raise OSError(
                f"The {what} in {directory} is damaged ({damage}), and the data cache cannot be written to prepare it "
                f"anew ({reason}): delete it (rm -r {directory}) where the cache can be written, or give "
                "--data-cache-dir another directory."
            ) from error
        raise OSError(
            f"Cannot write to the data cache {directory.parent} to prepare the {what} these settings need: {reason}. "
            "Give --data-cache-dir a directory this process can write."
        ) from error
    try:
        if directory.is_dir():  # another process may have prepared it meanwhile
            try:
                return open_entry(directory)
            except _Damaged as error:
                logger.warning("The %s in %s is damaged (%s): preparing it anew.", what, directory, error)
                shutil.rmtree(directory)
        building = Path(tempfile.mkdtemp(prefix=f"{directory.name}.", suffix=".partial", dir=directory.parent))
        try:
            write(building)
            building.rename(directory)
        finally:
            shutil.rmtree(building, ignore_errors=True)
        try:
            return open_entry(directory)
        except _Damaged as error:  # just written: the disk or another process spoiled it
            raise OSError(f"The {what} just prepared in {directory} cannot be read ({error}): delete it "
                          f"(rm -r {directory}) and run the same command again.") from error  # fmt: skip
    finally:
        lock.release()


def _write_manifest(directory: Path, contents: dict) -> None:
    # Last into an entry, so that an entry with a manifest was written whole: what decided it, and its files' sizes.
    files = {path.name: path.stat().st_size for path in sorted(directory.iterdir())}
    (directory / "manifest.json").write_text(json.dumps({**contents, "files": files}, indent=2) + "\n")


def _checked_manifest(directory: Path) -> dict:
    # The entry's manifest, its files there in the sizes it lists; else _Damaged, saying what is wrong.
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except FileNotFoundError:
        raise _Damaged("manifest.json is missing") from None
    except ValueError as error:  # not whole JSON, or not UTF-8
        raise _Damaged(f"manifest.json cannot be read: {error}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise _Damaged("manifest.json lists no files")
    found = []
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            found.append(f"{name} is missing")
        elif path.stat().st_size != size:
            found.append(f"{name} holds {path.stat().st_size:,} bytes, not {size:,}")
    if found:
        raise _Damaged("; ".join(found))
    return manifest


def _opened(files: str, read: Callable[[str], _Opened], path: Path) -> _Opened:
    # `read(path)`, of an entry's `files`; a reader's error (pyarrow's, json's, or tokenizers' plain Exception from
    # Rust) is the entry's damage, named by its files.
    try:
        return read(str(path))
    except PermissionError:  # the entry may be whole: it is this process that may not read it
        raise
    except Exception as error:
        raise _Damaged(f"{files} cannot be read: {error}") from error


def _open_splits(directory: Path) -> tuple[dict, dict[str, datasets.Dataset]]:
    # A prepared corpus's counts (`_write_splits`) and its splits, memory-mapped.
    manifest = _checked_manifest(directory)
    splits = {
        name: _opened(f"{name}.arrow", datasets.Dataset.from_file, directory / f"{name}.arrow")
        for name in manifest["splits"]
    }
    return manifest["splits"], splits


def _kept_tokenizer(
    config: TrainingConfig, train: AlignedFiles | datasets.Dataset, corpus: dict, root: Path
) -> PreTrainedTokenizerBase:
    # The BPE tokenizer of §5.1 trained on an even sample of the training pairs, or the one kept from a run before.
    settings = {"corpus": corpus, "vocab_size": config.vocab_size, "tokenizer_sample": config.tokenizer_sample}
    directory = root / "tokenizers" / _key(settings)

    def write(building: Path) -> None:
        chosen = tokenizer_sample(_count_pairs(train), config.tokenizer_sample)
        sentences = 2 * (int(chosen.sum()) if chosen is not None else _count_pairs(train))
        with tqdm(total=sentences, desc="Training the tokenizer", unit="sentences", unit_scale=True) as bar:
            batches = _counted(text_batches(train, [config.source_lang, config.target_lang], chosen), bar)
            trained = train_tokenizer(batches, vocab_size=config.vocab_size)
        # tokenizer.json is nearly all of it; tokenizers reports a full disk in a plain Exception of its own.
        size = len(trained.backend_tokenizer.to_str(pretty=True).encode())
        with room_for(directory.parent, size, "the trained tokenizer", _AGAIN):
            trained.save_pretrained(building)
            _write_manifest(building, settings)

    def open_tokenizer(entry: Path) -> PreTrainedTokenizerBase:
        _checked_manifest(entry)
        return _opened("its tokenizer files", AutoTokenizer.from_pretrained, entry)

    tokenizer = _kept_entry(directory, "trained tokenizer", write, open_tokenizer)
    tokenizer.model_max_length = config.max_length  # saved with the model: translation truncates to it
    return tokenizer


def tokenizer_sample(pairs: int, size: int) -> np.ndarray | None:
    """Which of `pairs` sentence pairs the BPE tokenizer learns from (§5.1): a boolean mask, shape `(pairs,)`, with
    `size` pairs chosen at random, seed 0.

    A random sample, not every k-th pair: a corpus made of parts in turn (or of one part repeated) would otherwise
    give the sample one kind of pair only. None, all of them, where `size` is 0 or at least `pairs`.
    """
    if not size or size >= pairs:
        return None
    chosen = np.zeros(pairs, dtype=bool)
    chosen[np.random.default_rng(0).choice(pairs, size, replace=False)] = True
    return chosen


def _counted(batches: Iterable[list[str]], bar: tqdm) -> Iterator[list[str]]:
    for batch in batches:
        bar.update(len(batch))
        yield batch


def encoder_of(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """A copy of `tokenizer`'s Rust pipeline, encoding as `tokenizer(sources, text_target=targets)` does (§5.1).

    A copy of the run's own, so that no truncation or padding an earlier call set on it applies, and no state is
    shared with other calls.

    Raises:
        ValueError: `tokenizer` is slow (Python), or encodes targets otherwise than sources.
    """
    if not tokenizer.is_fast or hasattr(tokenizer, "_switch_to_target_mode"):
        kind = "a slow (Python) tokenizer" if not tokenizer.is_fast else "one that encodes targets otherwise"
        raise ValueError(
            f"{type(tokenizer).__name__} is {kind}; train prepares its corpus with a fast tokenizer (tokenizer.json) "
            "that encodes both languages alike. Leave out --tokenizer to train one on the corpus."
        )
    encoder = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    encoder.no_truncation()
    encoder.no_padding()
    return encoder


def _count_pairs(split: AlignedFiles | datasets.Dataset) -> int:
    return split.count_pairs() if isinstance(split, AlignedFiles) else len(split)


def _text_bytes(splits: dict[str, AlignedFiles | datasets.Dataset]) -> int:
    # The prepared files take less than the text (a token of about four bytes becomes two), never more.
    return sum(path.stat().st_size for split in splits.values() if isinstance(split, AlignedFiles) for path in split)


def _write_splits(
    directory: Path,
    splits: dict[str, AlignedFiles | datasets.Dataset],
    encoder: Tokenizer,
    config: TrainingConfig,
    settings: dict,
) -> None:
    # Every split's Arrow file, then the manifest, which says what they hold and how many pairs were left out.
    ids = pa.uint16() if encoder.get_vocab_size(with_added_tokens=True) <= 1 << 16 else pa.int32()
    counts = {
        name: _write_split(directory / f"{name}.arrow", name, split, encoder, config, ids)
        for name, split in splits.items()
    }
    _write_manifest(directory, {**settings, "splits": counts})


def _write_split(
    path: Path,
    name: str,
    split: AlignedFiles | datasets.Dataset,
    encoder: Tokenizer,
    config: TrainingConfig,
    ids: pa.DataType,
) -> dict[str, int]:
    # One split encoded chunk by chunk into an Arrow stream file; training pairs out of bounds are left out,
    # other splits are cut to max_length (as `tokenizer(..., truncation=True)` cuts them) and keep their text.
    source_lang, target_lang, max_length = config.source_lang, config.target_lang, config.max_length
    training = name == "train"
    if not training:
        encoder = Tokenizer.from_str(encoder.to_str())
        encoder.enable_truncation(max_length)
    fields = [("input_ids", pa.list_(ids)), ("labels", pa.list_(ids))]
    fields += [("source_length", pa.int32()), ("target_length", pa.int32())]
    if not training:
        fields += [(source_lang, pa.string()), (target_lang, pa.string())]
    schema = pa.schema(fields)
    counts = {"pairs": _count_pairs(split), "too_long": 0, "empty": 0}
    with (
        pa.OSFile(str(path), "wb") as sink,
        pa.ipc.new_stream(sink, schema) as writer,
        tqdm(total=counts["pairs"], desc=f"Tokenizing {name}", unit="pairs", unit_scale=True) as bar,
    ):
        for sources, targets, (source_ids, source_lengths), (target_ids, target_lengths) in _encoded_batches(
            _pair_batches(split, source_lang, target_lang), encoder, ids
        ):
            columns = [source_ids, target_ids, pa.array(source_lengths), pa.array(target_lengths)]
            text = [] if training else [pa.array(sources, pa.string()), pa.array(targets, pa.string())]
            batch = pa.record_batch(columns + text, schema=schema)
            if training:
                # A side of `</s>` alone is an empty line; neither it nor a side too long is learned from.
                too_long = (source_lengths > max_length) | (target_lengths > max_length)
                empty = ~too_long & ((source_lengths <= 1) | (target_lengths <= 1))
                counts["too_long"] += int(too_long.sum())
                counts["empty"] += int(empty.sum())
                batch = batch.filter(pa.array(~(too_long | empty)))
                bar.set_postfix(left_out=counts["too_long"] + counts["empty"], refresh=False)
            writer.write_batch(batch)
            bar.update(len(sources))
    return counts


def _pair_batches(
    split: AlignedFiles | datasets.Dataset, source_lang: str, target_lang: str
) -> Iterator[tuple[list[str], list[str]]]:
    if isinstance(split, AlignedFiles):
        yield from split.batches(CHUNK_PAIRS)
        return
    for batch in split.select_columns([source_lang, target_lang]).iter(batch_size=CHUNK_PAIRS):
        yield batch[source_lang], batch[target_lang]


def _encoded_batches(
    batches: Iterable[tuple[list[str], list[str]]], encoder: Tokenizer, ids: pa.DataType
) -> Iterator[tuple[list[str], list[str], tuple[pa.ListArray, np.ndarray], tuple[pa.ListArray, np.ndarray]]]:
    # Each batch with both sides encoded (`encode_texts`), the next one encoded on a thread meanwhile: `tokenizers`
    # releases the GIL, so that reading and writing in Python use the time the Rust threads leave a core idle.
    def encode(sources: list[str], targets: list[str]) -> tuple:
        return sources, targets, encode_texts(encoder, sources, ids), encode_texts(encoder, targets, ids)

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending: collections.deque[Future] = collections.deque()
        for sources, targets in batches:
            pending.append(pool.submit(encode, sources, targets))
            if len(pending) == 2:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def encode_texts(encoder: Tokenizer, texts: list[str], ids: pa.DataType) -> tuple[pa.ListArray, np.ndarray]:
    """Token ids of each text with its `</s>` (§5.1): an Arrow list array of `len(texts)` rows of `ids` values, and
    their lengths in tokens, an int32 array of shape `(len(texts),)`.

    `encode_batch_fast` runs on every core and skips the character offsets that nothing here reads.
    """
    encoded = [encoding.ids for encoding in encoder.encode_batch_fast(texts)]
    lengths = np.fromiter(map(len, encoded), dtype=np.int32, count=len(encoded))
    offsets = np.zeros(len(encoded) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(itertools.chain.from_iterable(encoded), dtype=ids.to_pandas_dtype(), count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)), lengths


def _report_left_out(counts: dict[str, int], max_length: int) -> None:
    # One warning, at every run on the corpus, of the training pairs that were left out and why.
    left_out, pairs = counts["too_long"] + counts["empty"], counts["pairs"]
    if left_out:
        share = lambda count: f"{count:,} ({100 * count / pairs:.1f}%)"  # noqa: E731
        logger.warning(
            "Left out %s of the %s training pairs: %s longer than max_length (%d tokens) on a side, %s with an "
            "empty side.",
            f"{left_out:,}", f"{pairs:,}", share(counts["too_long"]), max_length, share(counts["empty"]),
        )  # fmt: skip
