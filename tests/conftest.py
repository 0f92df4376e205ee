"""Shared fixtures: the Multi30k corpus from ../shared, a tokenizer trained on it, and one small trained model."""

import json
from pathlib import Path

import pytest
import torch

import vaswani_transformer  # noqa: F401  (registers the Auto classes)
from vaswani_transformer import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani_transformer.data import load_parallel_corpus, text_batches
from vaswani_transformer.tokenization import train_tokenizer

MULTI30K = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "multi30k"


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    if not (MULTI30K / "train.en").is_file():
        pytest.fail(f"The Multi30k corpus is expected at {MULTI30K} (the shared/ folder beside the repository).")
    return MULTI30K


@pytest.fixture(scope="session")
def corpus(multi30k_dir):
    return load_parallel_corpus(multi30k_dir, "en", "de")


@pytest.fixture(scope="session")
def tokenizer(corpus):
    return train_tokenizer(text_batches(corpus, ["en", "de"]), vocab_size=2000)


@pytest.fixture(scope="session")
def test_sentences(corpus):
    """Eight real English test sentences and their German references."""
    test = corpus["test_2016_flickr"].select(range(8))
    return test["en"], test["de"]


def tiny_model(tokenizer=None, seed: int = 0, **overrides) -> VaswaniForConditionalGeneration:
    """A randomly initialised 2+2-layer model, in eval mode, small enough for exact CPU tests."""
    torch.manual_seed(seed)
    options = dict(d_model=32, d_ff=64, encoder_layers=2, decoder_layers=2, num_attention_heads=4)
    options["vocab_size"] = len(tokenizer) if tokenizer is not None else 100
    config = VaswaniConfig(**{**options, **overrides})
    return VaswaniForConditionalGeneration(config).eval()


@pytest.fixture(scope="session")
def trained_model_dir(tmp_path_factory, multi30k_dir) -> Path:
    """A small model trained for 150 steps on Multi30k through the command line, saved with its tokenizer."""
    from vaswani_transformer.cli import main

    output_dir = tmp_path_factory.mktemp("trained")
    status = main(
        [
            "train", "--data-dir", str(multi30k_dir), "--source-lang", "en", "--target-lang", "de",
            "--output-dir", str(output_dir), "--preset", "small",
            "--model-option", "d_model=64", "--model-option", "d_ff=256", "--model-option", "num_attention_heads=4",
            "--model-option", "encoder_layers=2", "--model-option", "decoder_layers=2",
            "--vocab-size", "2000", "--max-tokens", "2048", "--warmup-steps", "50", "--learning-rate-scale", "0.2",
            "--max-steps", "150", "--eval-steps", "50", "--save-steps", "50", "--average-last", "2",
        ]
    )  # fmt: skip
    assert status == 0
    return output_dir


def read_log(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "training_log.jsonl").read_text().splitlines()]
