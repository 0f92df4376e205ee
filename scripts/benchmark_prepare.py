"""The benchmark's models and data: a tokenizer, Multi30k batches, and per preset three engines of identical weights."""

import argparse
import json
from pathlib import Path

from benchmark_common import TRAINED
from benchmark_train import real_tokens


def prepare(args: argparse.Namespace, workdir: Path) -> dict:
    """Tokenizer, shared data files and, per preset, the three models with identical weights."""
    import torch
    from transformers import AutoTokenizer

    from vaswani_transformer import VaswaniConfig, VaswaniForConditionalGeneration
    from vaswani_transformer.data.corpora import TokenBatchSampler, corpus_fingerprint, load_parallel_corpus
    from vaswani_transformer.exchange.ctranslate2 import write_ctranslate2_export
    from vaswani_transformer.exchange.marian import to_marian
    from vaswani_transformer.training.config import TrainingConfig
    from vaswani_transformer.training.corpus import prepare_corpus

    # The tokenizer and token ids as `train` prepares them, with its default max_length; the test set as text.
    config = TrainingConfig(
        data=str(args.data_dir), source_lang="en", target_lang="de", output_dir=str(workdir), max_steps=1,
        vocab_size=args.vocab_size, data_cache_dir=str(workdir / "data"),
    )  # fmt: skip
    prepared = prepare_corpus(config, None, corpus_fingerprint(config.data, "en", "de"))
    tokenizer = prepared.tokenizer
    corpus = load_parallel_corpus(args.data_dir, "en", "de")

    # Training batches: the first sentence pairs of the training set, batched as `train` batches them.
    train = prepared.train.select(range(args.train_sentences))
    sampler = TokenBatchSampler(train["source_length"], train["target_length"], args.max_tokens, seed=0)
    batches = []
    for indices in list(sampler)[: args.train_warmup + args.train_steps]:
        rows = train.select(indices)
        source = tokenizer.pad({"input_ids": rows["input_ids"]}, return_tensors="pt")
        labels = tokenizer.pad({"input_ids": rows["labels"]}, return_tensors="pt")
        labels = labels["input_ids"].masked_fill(labels["attention_mask"] == 0, -100)
        batches.append({"input_ids": source["input_ids"], "attention_mask": source["attention_mask"], "labels": labels})
    torch.save(batches, workdir / "train_batches.pt")

    sources = corpus["test_2016_flickr"]["en"][: args.decode_batches * 32]
    decode = [tokenizer(sources[i : i + 32], padding=True, return_tensors="pt") for i in range(0, len(sources), 32)]
    torch.save([dict(batch) for batch in decode], workdir / "decode_batches.pt")
    tokens = [[tokenizer.convert_ids_to_tokens(tokenizer(s)["input_ids"]) for s in sources[i : i + 32]]
              for i in range(0, len(sources), 32)]  # fmt: skip
    (workdir / "decode_tokens.json").write_text(json.dumps(tokens))

    info = {"vocab_size": len(tokenizer), "presets": {}}
    with_ct2 = any(engine.startswith("ct2") for engine in args.engines)  # the export needs ctranslate2 installed
    for preset in args.presets:
        torch.manual_seed(0)
        model = VaswaniForConditionalGeneration(VaswaniConfig.from_preset(preset, vocab_size=len(tokenizer))).eval()
        directory = workdir / preset
        model.save_pretrained(directory / "ours")
        tokenizer.save_pretrained(directory / "ours")
        to_marian(model).save_pretrained(directory / "marian")
        if with_ct2:
            write_ctranslate2_export(directory / "ours", directory / "ct2", force=True)
        info["presets"][preset] = {"parameters": sum(p.numel() for p in model.parameters())}
    if args.model:
        directory = workdir / TRAINED
        trained_tokenizer = AutoTokenizer.from_pretrained(args.model)
        trained = VaswaniForConditionalGeneration.from_pretrained(args.model).eval()
        trained.save_pretrained(directory / "ours")
        trained_tokenizer.save_pretrained(directory / "ours")
        to_marian(trained).save_pretrained(directory / "marian")
        if with_ct2:
            write_ctranslate2_export(directory / "ours", directory / "ct2", force=True)
        test = corpus["test_2016_flickr"]["en"][: args.translate_batches * 32]
        test_batches = [test[i : i + 32] for i in range(0, len(test), 32)]
        encoded = [dict(trained_tokenizer(batch, padding=True, return_tensors="pt")) for batch in test_batches]
        torch.save(encoded, directory / "translate_batches.pt")
        test_tokens = [[trained_tokenizer.convert_ids_to_tokens(trained_tokenizer(s)["input_ids"]) for s in batch]
                       for batch in test_batches]  # fmt: skip
        (directory / "translate_tokens.json").write_text(json.dumps(test_tokens))
        references = corpus["test_2016_flickr"]["de"][: len(test)]
        (directory / "translate_references.json").write_text(json.dumps(references))
        info["translate_sentences"] = len(test)
    info["train_tokens_per_step"] = sum(real_tokens(b) for b in batches[args.train_warmup :]) / max(
        1, len(batches) - args.train_warmup
    )
    return info
