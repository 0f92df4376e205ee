"""Preparing a corpus once (§5.1): token ids as `tokenizer()` gives them, kept by corpus and tokenizer, never stale."""

import errno
import logging
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import cli_arguments, mini_run, one_line_error

from vaswani_transformer.cli import main
from vaswani_transformer.data.corpora import AlignedFiles, corpus_fingerprint, text_batches
from vaswani_transformer.data.tokenizer import train_tokenizer
from vaswani_transformer.training import corpus as corpus_preparation
from vaswani_transformer.training.config import TrainingConfig
from vaswani_transformer.training.corpus import prepare_corpus, tokenizer_sample


def corpus_config(data, cache, **settings) -> TrainingConfig:
    return TrainingConfig(
        data=str(data), source_lang="en", target_lang="de", output_dir="", max_steps=1, data_cache_dir=str(cache),
        **settings,
    )  # fmt: skip


def prepare(config: TrainingConfig, tokenizer=None):
    return prepare_corpus(config, tokenizer, corpus_fingerprint(config.data, "en", "de", config.files))


@pytest.fixture
def small_corpus(tmp_path, multi30k_dir):
    """The first 2,000 training pairs and 100 validation pairs of Multi30k, as files of their own."""
    directory = tmp_path / "corpus"
    directory.mkdir()
    for stem, count in (("train", 2000), ("val", 100)):
        for lang in ("en", "de"):
            lines = (multi30k_dir / f"{stem}.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)
            (directory / f"{stem}.{lang}").write_text("".join(lines[:count]), encoding="utf-8")
    return directory


def test_prepared_ids_are_the_tokenizers_own_and_validation_keeps_its_text(prepared, corpus, tokenizer):
    train, validation = corpus["train"].to_dict(), corpus["validation"].to_dict()
    encoded = tokenizer(train["en"], text_target=train["de"])
    kept = [i for i, pair in enumerate(zip(encoded["input_ids"], encoded["labels"], strict=True))
            if all(1 < len(ids) <= prepared.tokenizer.model_max_length for ids in pair)]  # fmt: skip
    assert prepared.training_pairs == len(train["en"]) and 28_000 < len(kept) == len(prepared.train)
    assert [list(ids) for ids in prepared.train["input_ids"]] == [encoded["input_ids"][i] for i in kept]
    assert [list(ids) for ids in prepared.train["labels"]] == [encoded["labels"][i] for i in kept]
    assert list(prepared.train["source_length"]) == [len(encoded["input_ids"][i]) for i in kept]
    assert list(prepared.validation["en"]) == validation["en"] and list(prepared.validation["de"]) == validation["de"]


def test_training_pairs_too_long_or_empty_are_left_out_and_said_at_every_run(tmp_path, tokenizer, caplog):
    (tmp_path / "train.en").write_text("A dog.\n\n" + "word " * 100 + "\nA cat.\n", encoding="utf-8")
    (tmp_path / "train.de").write_text("Ein Hund.\nLeer\nWort\nEine Katze.\n", encoding="utf-8")
    config = corpus_config(tmp_path, tmp_path / "cache", max_length=50)
    for _ in range(2):  # prepared, then opened
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vaswani_transformer.training.corpus"):
            prepared = prepare(config, tokenizer)
        labels = [list(ids) for ids in prepared.train["labels"]]
        assert tokenizer.batch_decode(labels, skip_special_tokens=True) == ["Ein Hund.", "Eine Katze."]
        assert [r.getMessage() for r in caplog.records] == [
            "Left out 2 of the 4 training pairs: 1 (25.0%) longer than max_length (50 tokens) on a side, "
            "1 (25.0%) with an empty side."
        ]
    assert prepared.validation is None


def test_validation_pairs_are_cut_to_max_length_with_their_end_of_sentence(small_corpus, tmp_path, tokenizer):
    prepared = prepare(corpus_config(small_corpus, tmp_path / "cache", max_length=16), tokenizer)
    en, de = ((small_corpus / f"val.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("en", "de"))
    expected = tokenizer(en, text_target=de, truncation=True, max_length=16)
    assert [list(ids) for ids in prepared.validation["input_ids"]] == expected["input_ids"]
    assert [list(ids) for ids in prepared.validation["labels"]] == expected["labels"]
    assert max(prepared.validation["target_length"]) == 16, "some were cut"
    assert all(ids[-1] == tokenizer.eos_token_id for ids in prepared.validation["labels"])
    assert max(max(prepared.train["source_length"]), max(prepared.train["target_length"])) <= 16


def test_a_second_run_opens_the_prepared_files_and_a_changed_file_is_prepared_anew(
    small_corpus, tmp_path, tokenizer, monkeypatch
):
    config = corpus_config(small_corpus, tmp_path / "cache")
    first = prepare(config, tokenizer)
    written = (first.directory / "train.arrow").stat().st_mtime_ns
    with monkeypatch.context() as patched:  # a run on the same corpus and tokenizer encodes nothing
        patched.setattr(corpus_preparation, "_write_split", lambda *args: pytest.fail("prepared again"))
        again = prepare(config, tokenizer)
    assert again.directory == first.directory and (first.directory / "train.arrow").stat().st_mtime_ns == written
    # One sentence changed in place, to one of the same length, and the file's times put back: only its content
    # tells the corpora apart.
    target = small_corpus / "train.de"
    times, text = target.stat(), target.read_text(encoding="utf-8")
    changed = text.replace("Zwei junge", "Zwei Junge", 1)
    assert changed != text and len(changed.encode()) == len(text.encode())
    target.write_text(changed, encoding="utf-8")
    os.utime(target, ns=(times.st_atime_ns, times.st_mtime_ns))
    fresh = prepare(config, tokenizer)
    assert fresh.directory != first.directory
    index = next(i for i, line in enumerate(changed.splitlines()) if "Zwei Junge" in line)
    assert tokenizer.decode(fresh.train[index]["labels"], skip_special_tokens=True) == changed.splitlines()[index]


def test_the_tokenizer_is_trained_on_a_random_sample_and_kept_for_the_next_run(small_corpus, tmp_path):
    config = corpus_config(small_corpus, tmp_path / "cache", vocab_size=500, tokenizer_sample=100)
    prepared = prepare(config)
    chosen = tokenizer_sample(2000, 100)
    assert chosen.sum() == 100 and np.flatnonzero(chosen).max() > 1000, "spread over the corpus"
    assert not np.array_equal(chosen[::20], chosen[1::20]), "not every k-th pair"
    files = AlignedFiles(small_corpus / "train.en", small_corpus / "train.de")
    sampled = train_tokenizer(text_batches(files, ["en", "de"], chosen), vocab_size=500)
    assert prepared.tokenizer.backend_tokenizer.to_str() == sampled.backend_tokenizer.to_str()
    assert prepared.tokenizer.model_max_length == config.max_length
    again = prepare(config)  # the kept tokenizer, so the same prepared files
    assert again.directory == prepared.directory
    assert prepare(corpus_config(small_corpus, tmp_path / "cache", vocab_size=600)).directory != prepared.directory


def test_a_tokenizer_saved_and_loaded_again_opens_the_same_prepared_files(small_corpus, tmp_path, tokenizer):
    # What a resumed run does: it loads the tokenizer saved beside its checkpoints.
    from transformers import AutoTokenizer

    config = corpus_config(small_corpus, tmp_path / "cache")
    tokenizer.save_pretrained(tmp_path / "saved")
    assert (
        prepare(config, AutoTokenizer.from_pretrained(tmp_path / "saved")).directory
        == prepare(config, tokenizer).directory
    )


def test_a_slow_tokenizer_is_refused_with_what_to_do(small_corpus, tmp_path):
    from transformers import PreTrainedTokenizer

    class Slow(PreTrainedTokenizer):
        def get_vocab(self):
            return {"<pad>": 0}

    with pytest.raises(ValueError, match="Slow is a slow .*Leave out --tokenizer"):
        prepare(corpus_config(small_corpus, tmp_path / "cache"), Slow())


def test_a_half_written_entry_is_never_read(small_corpus, tmp_path, tokenizer, monkeypatch):
    config = corpus_config(small_corpus, tmp_path / "cache")

    def fail(*args):
        raise KeyboardInterrupt  # a run stopped while it prepared

    with monkeypatch.context() as patched, pytest.raises(KeyboardInterrupt):
        patched.setattr(corpus_preparation, "_write_split", fail)
        prepare(config, tokenizer)
    left = [path.name for path in (tmp_path / "cache" / "corpora").iterdir() if path.is_dir()]
    assert left == [], "no entry, and no partial directory"
    prepared = prepare(config, tokenizer)
    assert len(prepared.train) == 2000 and np.all(np.asarray(prepared.train["target_length"]) > 1)


def cut_short(path) -> None:
    os.truncate(path, path.stat().st_size // 2)


DAMAGES = {
    "validation.arrow deleted": ("corpora", lambda entry: (entry / "validation.arrow").unlink()),
    "train.arrow cut short": ("corpora", lambda entry: cut_short(entry / "train.arrow")),
    "train.arrow deleted": ("corpora", lambda entry: (entry / "train.arrow").unlink()),
    "manifest.json deleted": ("corpora", lambda entry: (entry / "manifest.json").unlink()),
    "tokenizer.json cut short": ("tokenizers", lambda entry: cut_short(entry / "tokenizer.json")),
}


def entry_of(cache, kind):
    (entry,) = [path for path in (cache / kind).iterdir() if path.is_dir()]
    return entry


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_entry_is_found_by_its_manifest_and_prepared_anew_in_one_warning(
    damage, small_corpus, tmp_path, caplog
):
    # Issue 74, cases 6 and 7: a deleted validation.arrow trained without validation; a file cut short or
    # missing stopped the run with a raw pyarrow, errno or JSON error that named no entry.
    config = corpus_config(small_corpus, tmp_path / "cache", vocab_size=300)
    first = prepare(config)
    kind, damaging = DAMAGES[damage]
    entry = entry_of(tmp_path / "cache", kind)
    name = damage.split()[0]
    size = (entry / name).stat().st_size
    damaging(entry)
    with caplog.at_level(logging.WARNING, logger="vaswani_transformer.training.corpus"):
        again = prepare(config)
    found = f"{name} is missing" if "deleted" in damage else f"{name} holds {size // 2:,} bytes, not {size:,}"
    assert [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()] == [
        f"The {'prepared corpus' if kind == 'corpora' else 'trained tokenizer'} in {entry} is damaged ({found}): "
        "preparing it anew."
    ]
    assert again.directory == first.directory and len(again.train) == len(first.train) == 2000
    assert again.validation is not None and list(again.validation["de"]) == list(first.validation["de"])
    assert again.tokenizer.backend_tokenizer.to_str() == first.tokenizer.backend_tokenizer.to_str()
    assert prepare(config).directory == first.directory  # whole again: opened, not prepared


@pytest.mark.parametrize(
    "full",
    [
        Exception("No space left on device (os error 28)"),  # as tokenizers' Rust writer of tokenizer.json says it
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),  # as Python's writes of the other files say it
    ],
    ids=["tokenizers", "python"],
)
def test_a_full_disk_while_the_tokenizer_is_saved_stops_in_one_line_and_leaves_no_entry(
    full, mini_corpus, tmp_path, monkeypatch, capsys
):
    # Issue 74, case 8: a 25-line traceback and exit 1, where the corpus stage gives one line.
    def trained_on_a_full_disk(*args, **kwargs):
        trained = train_tokenizer(*args, **kwargs)

        def save_pretrained(directory, *more, **options):
            (Path(directory) / "tokenizer_config.json").write_text("{")  # what was written before the disk filled
            raise full

        trained.save_pretrained = save_pretrained
        return trained

    cache = tmp_path / "cache"
    arguments = [*cli_arguments(mini_run(mini_corpus, tmp_path / "out", data_cache_dir=str(cache))), "--prepare-only"]
    monkeypatch.setattr(corpus_preparation, "train_tokenizer", trained_on_a_full_disk)
    error = one_line_error(main(arguments), capsys.readouterr().err)
    assert error.startswith(f"vaswani-transformer train: error: No space left in {cache / 'tokenizers'} for the "
                            "trained tokenizer: it needs about 0.0"), error  # fmt: skip
    assert error.endswith("Free some space, then run the same command again."), error
    assert [path.name for path in (cache / "tokenizers").iterdir() if not path.name.endswith(".lock")] == []
    monkeypatch.undo()
    assert main(arguments) == 0


@pytest.fixture
def read_only_view(tmp_path):
    """`view(directory)`: the same files at another path, on a read-only mount (a bind mount, remounted read-only),
    where this process may mount (root on Linux); else, for a user whom permissions bind, through modes alone."""
    mounted, copied = [], []

    def view(directory):
        path = tmp_path / f"read-only-{len(mounted) + len(copied)}"
        path.mkdir()
        bound = subprocess.run(["mount", "--bind", str(directory), str(path)], capture_output=True)
        if bound.returncode == 0:
            mounted.append(path)
            subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], check=True)
        elif os.geteuid() != 0:
            copied.append(path)
            path.rmdir()
            shutil.copytree(directory, path, symlinks=True)
            for inner in [path, *path.rglob("*")]:
                inner.chmod(inner.stat().st_mode & ~0o222)
        else:
            pytest.skip(f"cannot mount read-only here, and root writes through modes: {bound.stderr.decode().strip()}")
        return path

    yield view
    for path in mounted:  # lazily: a failed test's traceback may still hold a file open in it
        subprocess.run(["umount", "--lazy", str(path)], check=True)
    for path in copied:  # so that pytest can remove it
        for inner in [path, *path.rglob("*")]:
            inner.chmod(inner.stat().st_mode | 0o200)


@pytest.fixture
def prepared_cache(mini_corpus, tmp_path, capsys) -> tuple[Path, Path]:
    """`(cache, entry)`: a data cache in which `train --prepare-only` prepared the mini corpus, and its entry."""
    cache = tmp_path / "cache"
    arguments = cli_arguments(mini_run(mini_corpus, tmp_path / "out", data_cache_dir=str(cache)))
    assert main([*arguments, "--prepare-only"]) == 0
    return cache, Path(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_prepared_cache_on_a_read_only_mount_is_used_and_what_it_lacks_is_said_in_one_line(
    prepared_cache, mini_corpus, tmp_path, read_only_view, capsys
):
    # Issue 74, case 9: a fully prepared cache on a read-only mount stopped at creating tokenizers/KEY.lock.
    cache, prepared = prepared_cache
    shared = read_only_view(cache)
    before = sorted((path.relative_to(shared), path.stat().st_mtime_ns) for path in shared.rglob("*"))
    reading = [*cli_arguments(mini_run(mini_corpus, tmp_path / "out", data_cache_dir=str(shared))), "--prepare-only"]
    assert main(reading) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(shared / "corpora" / prepared.name)
    assert main(reading[:-1]) == 0 and (tmp_path / "out" / "model.safetensors").is_file(), "trains from it"
    assert sorted((path.relative_to(shared), path.stat().st_mtime_ns) for path in shared.rglob("*")) == before
    # What the cache lacks cannot be prepared there: one line that says so, and where the cache may go instead.
    other = [*cli_arguments(mini_run(mini_corpus, tmp_path / "other", vocab_size=301, data_cache_dir=str(shared)))]
    error = one_line_error(main([*other, "--prepare-only"]), capsys.readouterr().err)
    assert f"Cannot write to the data cache {shared / 'tokenizers'} to prepare the trained tokenizer these " in error
    assert error.endswith(". Give --data-cache-dir a directory this process can write."), error


def test_a_damaged_entry_on_a_read_only_mount_is_refused_in_one_line_that_says_how_to_remove_it(
    prepared_cache, mini_corpus, tmp_path, read_only_view, capsys
):
    cache, prepared = prepared_cache
    size = (prepared / "train.arrow").stat().st_size
    cut_short(prepared / "train.arrow")
    shared = read_only_view(cache)
    entry = shared / "corpora" / prepared.name
    reading = [*cli_arguments(mini_run(mini_corpus, tmp_path / "out", data_cache_dir=str(shared))), "--prepare-only"]
    error = one_line_error(main(reading), capsys.readouterr().err)
    assert error.startswith(f"vaswani-transformer train: error: The prepared corpus in {entry} is damaged "
                            f"(train.arrow holds {size // 2:,} bytes, not {size:,}), and the data cache cannot be "
                            "written to prepare it anew ("), error  # fmt: skip
    assert error.endswith(f"delete it (rm -r {entry}) where the cache can be written, or give --data-cache-dir "
                          "another directory."), error  # fmt: skip


def write_wmt14_layout(directory, multi30k_dir, pairs: int) -> None:
    """A dataset folder laid out as the Hub's wmt14 (wmt/wmt14): a config per pair, Parquet shards of `translation`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (directory / "de-en").mkdir(parents=True)
    card = ["---", "configs:", "- config_name: de-en", "  data_files:"]
    for split, stem, count in (
        ("train", "train", pairs),
        ("validation", "val", pairs // 4),
        ("test", "test_2016_flickr", 50),
    ):
        en, de = (
            (multi30k_dir / f"{stem}.{lang}").read_text(encoding="utf-8").splitlines()[:count] for lang in ("en", "de")
        )
        rows = pa.table({"translation": [{"de": d, "en": e} for e, d in zip(en, de, strict=True)]})
        pq.write_table(rows, directory / "de-en" / f"{split}-00000-of-00001.parquet")
        card += [f"  - split: {split}", f"    path: de-en/{split}-*"]
    (directory / "README.md").write_text("\n".join([*card, "---", ""]))


def test_the_wmt14_recipes_data_path_trains_from_a_dataset_of_its_layout(multi30k_dir, tmp_path, monkeypatch, capsys):
    write_wmt14_layout(tmp_path / "wmt14", multi30k_dir, 400)
    monkeypatch.chdir(tmp_path)  # `--dataset wmt14` is read from ./wmt14, as `datasets.load_dataset` reads a folder
    arguments = cli_arguments(mini_run(tmp_path / "unused", tmp_path / "out", max_steps=2, eval_steps=2))
    data = arguments.index("--data-dir")
    arguments[data : data + 2] = ["--dataset", "wmt14", "--dataset-config", "de-en"]
    assert main(arguments) == 0
    prepared = prepare(corpus_config("wmt14", tmp_path / "cache", dataset_config="de-en", vocab_size=300))
    assert prepared.training_pairs == 400 and len(prepared.validation) == 100
    assert list(prepared.validation["en"][:2]) == (multi30k_dir / "val.en").read_text(encoding="utf-8").splitlines()[:2]
    log = [line for line in (tmp_path / "out" / "training_log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and '"validation_loss"' in log[-1]


def test_prepare_only_prepares_what_the_training_command_then_opens_and_touches_no_output(
    mini_corpus, tmp_path, capsys
):
    arguments = cli_arguments(
        mini_run(mini_corpus, tmp_path / "out", max_steps=1, data_cache_dir=str(tmp_path / "cache"))
    )
    assert main([*arguments, "--prepare-only"]) == 0
    captured = capsys.readouterr()
    prepared = captured.out.strip().splitlines()[-1]
    assert "Tokenizing train" in captured.err and not (tmp_path / "out").exists()
    assert prepared.startswith(str(tmp_path / "cache" / "corpora")) and (tmp_path / prepared / "train.arrow").is_file()
    assert main(arguments) == 0
    captured = capsys.readouterr()
    assert "Tokenizing" not in captured.err and "Training the tokenizer" not in captured.err
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_streamed_dataset_gives_token_batches_of_every_pair_each_epoch_and_trains(
    multi30k_dir, tmp_path, monkeypatch, tokenizer
):
    import datasets

    from vaswani_transformer.training.streaming import StreamedBatches

    write_wmt14_layout(tmp_path / "wmt14", multi30k_dir, 400)
    monkeypatch.chdir(tmp_path)
    settings = dict(dataset_config="de-en", streaming=True, shuffle_buffer=150, max_tokens=512)
    config = corpus_config("wmt14", tmp_path / "cache", **settings)
    prepared = prepare(config, tokenizer)
    assert isinstance(prepared.train, datasets.IterableDataset) and prepared.training_pairs is None
    assert len(prepared.validation) == 100, "the validation split is prepared whole"

    one_process = type("Accelerator", (), {"process_index": 0, "num_processes": 1})()
    batches = StreamedBatches(prepared.train, tokenizer, config, one_process)
    epoch = list(batches)
    assert all(batch[side].numel() <= 512 for batch in epoch for side in ("input_ids", "labels"))
    labels = [ids[ids != -100].tolist() for batch in epoch for ids in batch["labels"]]
    expected = (multi30k_dir / "train.de").read_text(encoding="utf-8").splitlines()[:400]
    assert sorted(tokenizer.batch_decode(labels, skip_special_tokens=True)) == sorted(expected), "each pair once"
    batches.set_epoch(0, skip=3)  # a resumed run's place in its epoch
    assert all(a["input_ids"].equal(b["input_ids"]) for a, b in zip(list(batches), epoch[3:], strict=True))
    batches.set_epoch(1)
    assert [b["input_ids"].shape for b in batches] != [b["input_ids"].shape for b in epoch], "a new order"

    arguments = cli_arguments(mini_run(tmp_path / "unused", tmp_path / "out", max_steps=2, eval_steps=2, **settings))
    data = arguments.index("--data-dir")
    arguments[data : data + 2] = ["--dataset", "wmt14"]
    assert main(arguments) == 0
    assert len((tmp_path / "out" / "training_log.jsonl").read_text().splitlines()) == 2
