"""The shared BPE vocabulary (§5.1) on the Multi30k training corpus."""

import copy
import os

import pytest
from conftest import needs_fork, random_model
from transformers import AutoTokenizer

from vaswani_transformer import VaswaniConfig
from vaswani_transformer.data.tokenizer import SPECIAL_TOKENS, check_tokenizer_matches, tokenizer_lock, train_tokenizer
from vaswani_transformer.inference.engines import load_translator


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


def test_another_models_smaller_tokenizer_beside_the_model_is_refused_by_the_loader(tokenizer, corpus, tmp_path):
    # The same special tokens at the same ids, 1,000 tokens for a model of 2,000: it passed and translated garbage.
    sentences = corpus["train"]["en"][:4000] + corpus["train"]["de"][:4000]
    other = train_tokenizer([sentences], vocab_size=1000)
    assert len(other) == 1000 and other.all_special_ids == tokenizer.all_special_ids
    random_model(tokenizer).save_pretrained(tmp_path)
    other.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"has 1000 tokens but the model's config.vocab_size is 2000: use the tok"):
        load_translator(str(tmp_path), "cpu")


@pytest.mark.parametrize(
    "changes, refusal",
    [
        ({}, None),
        (dict(vocab_size=2048), None),  # resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
        (dict(vocab_size=2200), r"has 2000 tokens but the model's config.vocab_size is 2200"),
        (dict(vocab_size=1999), r"has 2000 tokens but the model has embeddings for config.vocab_size=1999"),
        (dict(decoder_start_token_id=5), r"decoder_start_token_id=5 but the tokenizer in model-dir has '.+' there"),
        (dict(eos_token_id=3), r"eos_token_id=2 but the model's config has eos_token_id=3"),
    ],
)
def test_the_tokenizer_must_fit_the_models_vocabulary_and_special_ids(tokenizer, changes, refusal):
    config = VaswaniConfig(d_model=32, d_ff=64, num_attention_heads=4, **{"vocab_size": 2000, **changes})
    if refusal is None:
        check_tokenizer_matches(config, tokenizer, "model-dir")
    else:
        with pytest.raises(ValueError, match=refusal):
            check_tokenizer_matches(config, tokenizer, "model-dir")


def test_a_tokenizer_without_the_pad_or_eos_token_the_model_uses_is_refused(tokenizer):
    config = VaswaniConfig(d_model=32, d_ff=64, num_attention_heads=4, vocab_size=len(tokenizer))
    for name in ("pad_token", "eos_token"):
        lacking = copy.deepcopy(tokenizer)
        setattr(lacking, name, None)
        with pytest.raises(ValueError, match=f"has no {name} but the model's config has {name}_id="):
            check_tokenizer_matches(config, lacking)
