"""The engines (inference.py): one interface, the model's generate() or its CTranslate2 export, loaded from a config."""

import pytest
import torch

from vaswani_transformer.inference.config import InferenceConfig
from vaswani_transformer.inference.engines import Engine, TorchEngine, load_engine


def test_the_torch_engine_gives_generates_translations_in_order_and_blank_lines_without_the_model(
    trained_model_dir, test_sentences
):
    sources = list(test_sentences[0][:3])
    engine = load_engine(str(trained_model_dir), InferenceConfig(device="cpu", num_beams=2, length_penalty=1.0))
    assert isinstance(engine, TorchEngine) and engine.name == "torch" and engine.runs_in_cpu_workers
    model, tokenizer = engine.model, engine.tokenizer
    with torch.inference_mode():
        ids = model.generate(**tokenizer(sources, return_tensors="pt", padding=True), num_beams=2, length_penalty=1.0)
    expected = [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]
    calls = []
    batch = engine._translate_batch
    engine._translate_batch = lambda sentences, count: calls.append(sentences) or batch(sentences, count)
    assert engine.translate([sources[0], " ", sources[1], "", sources[2]]) == [
        expected[0], "", expected[1], "", expected[2]
    ]  # fmt: skip
    assert calls == [sources]  # one batch, blank lines left out
    assert engine.translate(["", "  "]) == ["", ""] and calls == [sources]


def test_an_engine_is_what_the_config_names_with_the_models_limit(trained_model_dir, tmp_path):
    engine = load_engine(str(trained_model_dir))  # the default config: torch, the model's own decoding
    assert isinstance(engine, Engine) and engine.generate_kwargs == {}
    assert engine.source_limit == engine.tokenizer.model_max_length
    assert engine.generation_config.num_beams == engine.model.generation_config.num_beams
    pytest.importorskip("ctranslate2")
    config = InferenceConfig(engine="ctranslate2", ctranslate2_dir=str(tmp_path / "ct2"))
    engine = load_engine(str(trained_model_dir), config)
    assert engine.name == "ctranslate2" and not engine.runs_in_cpu_workers
    assert engine.source_limit <= engine.tokenizer.model_max_length and engine.translate([" "]) == [""]
