"""Reading parallel corpora and batching them by tokens (§5.1)."""

import json

import numpy as np
import pytest

from vaswani_transformer.data.corpora import TokenBatchSampler, lengths_of, load_parallel_corpus


def test_multi30k_directory_loads_every_split_aligned(corpus, multi30k_dir):
    assert corpus["train"].num_rows == 29000
    assert corpus["validation"].num_rows == 1014
    assert corpus["test_2016_flickr"].num_rows == 1000
    first_en = (multi30k_dir / "train.en").read_text(encoding="utf-8").splitlines()[123]
    first_de = (multi30k_dir / "train.de").read_text(encoding="utf-8").splitlines()[123]
    assert corpus["train"][123] == {"en": first_en, "de": first_de}


def test_explicit_files_and_a_mismatched_line_count(tmp_path, multi30k_dir):
    source, target = tmp_path / "a.en", tmp_path / "a.de"
    source.write_text("one\ntwo\nthree\n", encoding="utf-8")
    target.write_text("eins\nzwei\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"a\.en has 3 lines and .*a\.de has 2"):
        load_parallel_corpus("", "en", "de", files={"train": (source, target)})
    target.write_text("eins\nzwei\ndrei\n", encoding="utf-8")
    corpus = load_parallel_corpus("", "en", "de", files={"train": (source, target)})
    assert corpus["train"]["de"] == ["eins", "zwei", "drei"]


def test_missing_training_split_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="No training split"):
        load_parallel_corpus(tmp_path, "en", "de")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_parallel_corpus("", "en", "de", files={"train": (tmp_path / "x.en", tmp_path / "x.de")})


def test_token_batches_respect_the_budget_cover_every_pair_and_group_similar_lengths(prepared):
    source_lengths, target_lengths = lengths_of(prepared.train)
    sampler = TokenBatchSampler(source_lengths, target_lengths, max_tokens=1024, seed=3)
    batches = list(sampler)
    longest = np.maximum(source_lengths, target_lengths)
    assert sorted(i for batch in batches for i in batch) == list(range(len(source_lengths)))
    assert all(len(batch) * longest[batch].max() <= 1024 for batch in batches)
    real = sum(int(source_lengths[b].sum() + target_lengths[b].sum()) for b in map(np.array, batches))
    padded = sum(2 * len(b) * int(longest[b].max()) for b in map(np.array, batches))
    assert real / padded > 0.85, "sentences of similar length should be batched together"
    sampler.set_epoch(1)
    assert list(sampler) != batches, "each epoch draws a new order"


def test_token_batches_padded_to_a_multiple_as_the_collator_pads_them_keep_the_budget(prepared, tokenizer):
    from transformers import DataCollatorForSeq2Seq

    train = prepared.train.select(range(3000))
    sampler = TokenBatchSampler(*lengths_of(train), max_tokens=512, seed=0, pad_to_multiple_of=8)
    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, pad_to_multiple_of=8, return_tensors="pt")
    pairs = train.select_columns(["input_ids", "labels"])
    sizes = [{name: collator([pairs[i] for i in b])[name].numel() for name in ("input_ids", "labels")} for b in sampler]
    assert max(size for batch in sizes for size in batch.values()) <= 512
    assert sum(sum(batch.values()) for batch in sizes) / (2 * 512 * len(sizes)) > 0.85, "and fill it"


@pytest.mark.parametrize("max_tokens", [2048, 4096])
def test_token_batches_of_multi30k_are_at_least_95_percent_real_tokens(prepared, max_tokens):
    source_lengths, target_lengths = lengths_of(prepared.train)
    sampler = TokenBatchSampler(source_lengths, target_lengths, max_tokens=max_tokens, seed=1)
    batches = [np.array(b) for b in sampler]
    real = sum(int(source_lengths[b].sum() + target_lengths[b].sum()) for b in batches)
    padded = sum(len(b) * int(source_lengths[b].max() + target_lengths[b].max()) for b in batches)
    assert real / padded == pytest.approx(sampler.padding_efficiency()) and real / padded >= 0.95


def test_data_parallel_shards_split_the_batches_evenly_and_resume_at_a_position(prepared):
    source_lengths, target_lengths = lengths_of(prepared.train)
    whole = list(TokenBatchSampler(source_lengths, target_lengths, max_tokens=1024, seed=5))
    shards = [
        list(TokenBatchSampler(source_lengths, target_lengths, max_tokens=1024, seed=5, num_shards=3, shard_index=i))
        for i in range(3)
    ]
    assert len({len(shard) for shard in shards}) == 1, "every process runs the same number of steps"
    usable = len(whole) - len(whole) % 3
    assert [shard[k] for k in range(usable // 3) for shard in shards] == whole[:usable]
    resumed = TokenBatchSampler(source_lengths, target_lengths, max_tokens=1024, seed=5, num_shards=3, shard_index=1)
    resumed.set_epoch(0, skip=7)
    assert list(resumed) == shards[1][7:]


def test_evaluation_shards_score_every_validation_pair_once_in_as_many_batches(prepared):
    source_lengths, target_lengths = lengths_of(prepared.validation)
    for processes in (2, 3, 8):
        shards = [
            list(
                TokenBatchSampler(
                    source_lengths, target_lengths, 2048, shuffle=False, num_shards=processes, shard_index=i
                )
            )
            for i in range(processes)
        ]
        assert len({len(shard) for shard in shards}) == 1, "every process runs the same number of forward passes"
        scored = sorted(i for shard in shards for batch in shard for i in batch)
        assert scored == list(range(len(source_lengths))), f"{processes} processes"
        for batch in (np.array(b) for shard in shards for b in shard):
            assert len(batch) * max(source_lengths[batch].max(), target_lengths[batch].max()) <= 2048


def test_a_dataset_with_a_translation_column_is_flattened_to_one_column_per_language(tmp_path):
    # The layout of WMT14 and OPUS on the Hub, read by `datasets.load_dataset` from a local folder.
    rows = [{"translation": {"de": "Ein Hund.", "en": "A dog."}}, {"translation": {"de": "Katze", "en": "Cat"}}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "validation.jsonl").write_text(json.dumps(rows[0]) + "\n")
    splits = load_parallel_corpus(tmp_path, "en", "de")
    assert splits["train"]["en"] == ["A dog.", "Cat"] and splits["train"]["de"] == ["Ein Hund.", "Katze"]
    assert splits["validation"].num_rows == 1
    with pytest.raises(ValueError, match="no column for fr"):
        load_parallel_corpus(tmp_path, "en", "fr")


def test_a_directory_with_two_validation_sets_is_refused_not_one_kept_silently(tmp_path):
    for stem in ("train", "val", "dev"):
        for lang in ("en", "de"):
            (tmp_path / f"{stem}.{lang}").write_text("A dog.\n", encoding="utf-8")
    with pytest.raises(ValueError, match="two validation sets, dev.en and val.en: keep one"):
        load_parallel_corpus(str(tmp_path), "en", "de")
