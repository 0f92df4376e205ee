"""The same seed on CPU gives bit-identical weights, and a loaded model the same translations whatever the load
(docs/robustness.md, "Determinism")."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import MINI_MODEL
from safetensors.torch import load_file

from vaswani_transformer.training.config import TrainingConfig
from vaswani_transformer.training.run import train


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


TRANSLATE = """
import json, sys
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
import vaswani_transformer
torch.set_num_threads(2)
model = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1]).eval()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
sources = json.loads(sys.argv[2])
translations = []
for start in range(0, len(sources), 64):
    batch = tokenizer(sources[start : start + 64], padding=True, return_tensors="pt")
    translations += tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True)
print(json.dumps(translations))
"""


@pytest.mark.heavy
def test_a_model_loaded_beside_two_busy_neighbours_translates_as_one_loaded_alone(trained_model_dir, multi30k_dir):
    # Loading measures nothing (no kernel is chosen by timing it), so a loaded CPU on two threads changes no
    # translation: 256 held-out sentences, the paper's beam search, in a process alone and in one beside two
    # processes that keep every core busy.
    held_out = (multi30k_dir / "test_2016_flickr.en").read_text(encoding="utf-8").splitlines()[:256]
    sources = json.dumps(held_out)

    def translate() -> list[str]:
        run = subprocess.run([sys.executable, "-c", TRANSLATE, str(trained_model_dir), sources], capture_output=True)
        assert run.returncode == 0, run.stderr.decode()
        return json.loads(run.stdout)

    alone = translate()
    neighbours = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        beside_neighbours = translate()
    finally:
        for neighbour in neighbours:
            neighbour.kill()
            neighbour.wait()
    assert len(alone) == 256 and len(set(alone)) > 50  # real, varied translations (of a small test model)
    assert beside_neighbours == alone
