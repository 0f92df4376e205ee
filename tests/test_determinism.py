"""The same seed on CPU gives bit-identical weights after training (docs/robustness.md, "Determinism")."""

from pathlib import Path

import torch
from conftest import MINI_MODEL
from safetensors.torch import load_file

from vaswani_transformer.training import TrainingConfig, train


def _train_a_few_steps(files: dict, output_dir: Path, seed: int) -> Path:
    config = TrainingConfig(
        data="",
        files=files,
        source_lang="en",
        target_lang="de",
        output_dir=str(output_dir),
        model_overrides=MINI_MODEL,  # dropout stays 0.1: its masks must repeat too
        vocab_size=400,
        max_tokens=512,
        warmup_steps=10,
        max_steps=6,
        eval_steps=3,
        save_steps=3,
        average_last=2,
        seed=seed,
    )
    return train(config)


def test_the_same_seed_gives_bit_identical_weights_and_another_seed_does_not(multi30k_dir, tmp_path):
    files = {}
    for split, stem, count in (("train", "train", 300), ("validation", "val", 40)):
        for lang in ("en", "de"):
            lines = (multi30k_dir / f"{stem}.{lang}").read_text(encoding="utf-8").splitlines()[:count]
            (tmp_path / f"{stem}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
        files[split] = (str(tmp_path / f"{stem}.en"), str(tmp_path / f"{stem}.de"))
    first = _train_a_few_steps(files, tmp_path / "first", seed=3)
    second = _train_a_few_steps(files, tmp_path / "second", seed=3)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    other = _train_a_few_steps(files, tmp_path / "other", seed=4)
    weights, other_weights = load_file(first / "model.safetensors"), load_file(other / "model.safetensors")
    assert weights.keys() == other_weights.keys()
    assert not all(torch.equal(weights[name], other_weights[name]) for name in weights)
