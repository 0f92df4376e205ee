"""The shared BPE vocabulary (§5.1) on the Multi30k training corpus."""

import os

import pytest
from conftest import needs_fork
from transformers import AutoTokenizer

from vaswani_transformer.tokenization import SPECIAL_TOKENS, tokenizer_lock, train_tokenizer


def test_special_tokens_have_the_ids_the_config_expects(tokenizer):
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2, 3]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (
        0,
        1,
        2,
        3,
    )
    assert len(tokenizer) == 2000


def test_tokenizer_gives_back_the_corpus_sentences(tokenizer, corpus):
    for split in ("train", "validation", "test_2016_flickr"):
        for lang in ("en", "de"):
            sentences = corpus[split][lang][:2000]
            ids = tokenizer(sentences)["input_ids"]
            assert all(row[-1] == tokenizer.eos_token_id for row in ids)
            assert tokenizer.batch_decode(ids, skip_special_tokens=True) == sentences
            assert tokenizer.unk_token_id not in {i for row in ids for i in row}


def test_one_vocabulary_serves_both_languages(tokenizer):
    english = set(tokenizer("A little girl climbing into a wooden playhouse.")["input_ids"][:-1])
    german = set(tokenizer("Ein kleines Mädchen klettert in ein Spielhaus aus Holz.")["input_ids"][:-1])
    assert max(english | german) < len(tokenizer)
    assert tokenizer.convert_ids_to_tokens(sorted(german))  # German words have their own merges
    assert len(tokenizer.tokenize("Mädchen")) <= 2


def test_text_target_gives_labels_and_save_load_with_auto_tokenizer(tokenizer, tmp_path):
    encoded = tokenizer("A dog runs.", text_target="Ein Hund rennt.")
    assert encoded["labels"][-1] == tokenizer.eos_token_id
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("A dog runs.", text_target="Ein Hund rennt.") == encoded
    assert loaded.decode(encoded["labels"], skip_special_tokens=True) == "Ein Hund rennt."


def test_train_tokenizer_rejects_bad_input():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer([["a b c"]], vocab_size=100)
    with pytest.raises(ValueError, match="empty corpus"):
        train_tokenizer([], vocab_size=1000)


@needs_fork
def test_a_process_forked_while_a_tokenizer_is_locked_can_lock_it(tokenizer):
    # Workers are forked from a process whose other threads may be encoding at that moment.
    assert tokenizer_lock(tokenizer) is tokenizer_lock(tokenizer)
    with tokenizer_lock(tokenizer):
        child = os.fork()
        if child == 0:
            os._exit(0 if tokenizer_lock(tokenizer).acquire(timeout=5) else 1)
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
