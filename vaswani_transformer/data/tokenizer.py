"""The shared source-target BPE vocabulary of §5.1, trained with `tokenizers`.

The paper encodes sentences with byte-pair encoding (Sennrich et al., 2016) and one vocabulary
shared by source and target. Here BPE runs over bytes (as in GPT-2 and BART): every Unicode
string has an encoding, no token is ever `<unk>`, and decoding gives the text back exactly,
whitespace, control characters and all (`tests/test_properties.py` checks this on arbitrary
Unicode text with hypothesis), with two exceptions:

- NFC normalization: text comes back in NFC form, so a decomposed "e" + combining acute accent
  comes back as the single character "é", and compatibility singletons such as the Angstrom sign
  U+212B as their canonical letter ("Å", U+00C5).
- The literal strings `<pad>`, `<s>`, `</s>` and `<unk>` in the text are read as those special
  tokens (so "</s>" inside a sentence ends it for the model) and `skip_special_tokens=True`
  drops them on decoding.
"""

import os
import threading
import weakref
from collections.abc import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PretrainedConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ..model.configuration_vaswani import VaswaniConfig

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2, 3, as VaswaniConfig expects


def train_tokenizer(
    texts: Iterable[list[str]],
    vocab_size: int = VaswaniConfig.vocab_size,
    min_frequency: int = 2,
    model_max_length: int = 1024,
) -> PreTrainedTokenizerFast:
    """Learn a byte-level BPE vocabulary from batches of sentences of both languages (§5.1).

    Args:
        texts: batches (lists) of sentences; pass source and target sentences so that the
            vocabulary is shared. Only one batch is held in memory at a time.
        vocab_size: number of tokens, the four special tokens and the 256 bytes included (the model's
            default, about 37,000 as §5.1 for WMT14 English-German; about 8,000 suits Multi30k).
        min_frequency: pairs seen fewer times than this are not merged.
        model_max_length: longest input, in tokens, that `truncation=True` keeps.

    Returns:
        A fast tokenizer with `<pad>`, `<s>`, `</s>`, `<unk>` at ids 0 to 3 that appends `</s>`
        to every sequence; `save_pretrained` writes it for `AutoTokenizer.from_pretrained`.
        Decoding gives back any text except for NFC normalization and special-token strings
        (see the module docstring).

    Raises:
        ValueError: `vocab_size` leaves no room for merges (it must exceed 260), or `texts` is empty.
    """
    if vocab_size <= len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be larger than 260 (4 special tokens + 256 bytes), got {vocab_size}.")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    seen = _count_batches(texts)
    tokenizer.train_from_iterator(seen, trainer=trainer)
    if not seen.count:
        raise ValueError("Cannot train a tokenizer on an empty corpus: no sentences were given.")
    eos_id = tokenizer.token_to_id("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


class _count_batches:
    """Iterates over batches of sentences and counts the sentences, to tell an empty corpus apart."""

    def __init__(self, batches: Iterable[list[str]]) -> None:
        self.batches = batches
        self.count = 0

    def __iter__(self) -> Iterator[list[str]]:
        for batch in self.batches:
            self.count += len(batch)
            yield batch


# `resize_token_embeddings(n, pad_to_multiple_of=m)` rounds the vocabulary up to a multiple of m (8 to 128 for
# tensor cores): rows beyond the tokenizer's that no tokenizer gives.
_MOST_PADDING = 128


def check_tokenizer_matches(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, where: str = "") -> None:
    """Refuse a tokenizer that is not the model's: its size and special ids must fit the model's config.

    A tokenizer with more tokens than `config.vocab_size` makes the embedding lookup fail on the
    first id beyond it (on GPUs as a device-side assert); one with fewer (another model's, put
    beside this one) reads and writes other tokens than the model learned; special ids that disagree
    with the config make the model pad, start or stop on the wrong token. All of these translate
    garbage without an error.

    See docs/robustness.md, "Bad input".

    Args:
        config: the model's configuration (`vocab_size`, `pad_token_id`, `eos_token_id`, `bos_token_id`,
            `decoder_start_token_id`).
        tokenizer: the tokenizer to check.
        where: the model's directory or Hub id, for the message.

    Raises:
        ValueError: the tokenizer has more tokens than `config.vocab_size`, or fewer (but for a vocabulary
            rounded up to a multiple of 8 to 128 by `resize_token_embeddings`); it lacks the pad or eos token of
            the config, or has them, or bos, at other ids (a bos either side leaves unset is not compared); or
            `decoder_start_token_id` is no special token of the tokenizer.
    """
    where = f" in {where}" if where else ""
    size = len(tokenizer)
    if size > config.vocab_size:
        raise ValueError(
            f"The tokenizer{where} has {size} tokens but the model has embeddings for "
            f"config.vocab_size={config.vocab_size}: use the tokenizer the model was trained with, or call "
            "model.resize_token_embeddings(len(tokenizer)) and fine-tune."
        )
    if size < config.vocab_size and not (config.vocab_size % 8 == 0 and config.vocab_size - size < _MOST_PADDING):
        raise ValueError(
            f"The tokenizer{where} has {size} tokens but the model's config.vocab_size is {config.vocab_size}: use "
            "the tokenizer the model was trained with (a larger vocabulary is taken only as one rounded up to a "
            "multiple of 8 to 128, as resize_token_embeddings(..., pad_to_multiple_of=...) gives it)."
        )
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        tokenizer_id, config_id = getattr(tokenizer, name), getattr(config, name, None)
        if tokenizer_id is None and config_id is not None and name != "bos_token_id":
            token = name.removesuffix("_id")
            raise ValueError(
                f"The tokenizer{where} has no {token} but the model's config has {name}={config_id}: use the "
                "tokenizer the model was trained with."
            )
        if tokenizer_id is not None and config_id is not None and tokenizer_id != config_id:
            raise ValueError(
                f"The tokenizer{where} has {name}={tokenizer_id} but the model's config has {name}={config_id}: "
                "use the tokenizer the model was trained with, or correct config.json and generation_config.json."
            )
    start = getattr(config, "decoder_start_token_id", None)
    if start is not None and start not in tokenizer.all_special_ids:
        raise ValueError(
            f"The model's config has decoder_start_token_id={start} but the tokenizer{where} has "
            f"{tokenizer.convert_ids_to_tokens(start)!r} there, no special token: use the tokenizer the model was "
            "trained with, or correct config.json and generation_config.json."
        )


_TOKENIZER_LOCKS: "weakref.WeakKeyDictionary[PreTrainedTokenizerBase, threading.Lock]" = weakref.WeakKeyDictionary()
_TOKENIZER_LOCKS_LOCK = threading.Lock()


def _new_locks_after_fork() -> None:
    # A process forked while another thread held a lock would inherit it held, for ever: the child starts afresh.
    global _TOKENIZER_LOCKS_LOCK
    _TOKENIZER_LOCKS.clear()
    _TOKENIZER_LOCKS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_locks_after_fork)


def tokenizer_lock(tokenizer: PreTrainedTokenizerBase) -> threading.Lock:
    """The lock this package's calls of `tokenizer` hold, one per tokenizer object.

    A call of a fast tokenizer first sets its truncation and padding on the Rust backend, which
    every user of the object shares, then encodes: two threads calling it with other settings
    (`translate` pads its batches, its length check does not) can encode with each other's
    settings. Calls that hold this lock cannot; a caller's own calls of the same object with other
    settings still can (give each thread its own `copy.deepcopy(tokenizer)` then).

    See README.md, "Using a trained model".
    """
    with _TOKENIZER_LOCKS_LOCK:
        return _TOKENIZER_LOCKS.setdefault(tokenizer, threading.Lock())
