"""Loading a saved model (`loading_vaswani.py`): weights that do not fit the config are refused in one line."""

import json

import pytest
import torch
from conftest import load_each_without_package, random_model
from transformers import AutoModel, AutoModelForSeq2SeqLM

# config.json fields that shape the weights, changed after saving: (the change, what the refusal must name).
CONFIGS_THAT_DO_NOT_FIT = {
    "one more encoder layer": ({"encoder_layers": 3}, ["encoder_layers=3", "encoder_layers=2", "encoder.layers.2."]),
    "one fewer decoder layer": ({"decoder_layers": 1}, ["decoder_layers=1", "decoder_layers=2", "decoder.layers.1."]),
    "another d_ff": ({"d_ff": 128}, ["d_ff=128", "d_ff=64"]),
    "another vocab_size": ({"vocab_size": 120}, ["vocab_size=120", "vocab_size=100", "model.shared.weight"]),
}


def test_a_config_json_that_does_not_describe_the_weights_is_refused_in_one_line(tmp_path):
    # transformers initialises what the file lacks, drops what it has over and only warns: the model translated
    # garbage. Refused by the model's class, so with the package and through the saved code (remote code) alike.
    model = random_model()
    directories = []
    for name, (changes, _) in CONFIGS_THAT_DO_NOT_FIT.items():
        directory = tmp_path / name.replace(" ", "-")
        model.save_pretrained(directory)
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, **changes}))
        directories.append(directory)
    refusals, stderr = load_each_without_package(directories, cwd=tmp_path)
    assert "LOAD REPORT" not in stderr, "refused before transformers' report of what it would do"
    for directory, refused_remotely, (changes, names) in zip(
        directories, refusals, CONFIGS_THAT_DO_NOT_FIT.values(), strict=True
    ):
        with pytest.raises(ValueError) as refused:
            AutoModelForSeq2SeqLM.from_pretrained(directory)
        for message in (str(refused.value), refused_remotely):
            assert message is not None and "\n" not in message, (changes, message)
            assert str(directory) in message and all(name in message for name in names), (names, message)
    # Sizes that differ still load where the caller asks transformers to initialise them anew.
    loaded = AutoModelForSeq2SeqLM.from_pretrained(directories[2], ignore_mismatched_sizes=True)
    assert loaded.model.encoder.layers[0].feed_forward.fc1.weight.shape == (128, 32)


@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_weights_absent_from_the_file_because_they_are_tied_are_not_missing(tmp_path, tie_word_embeddings):
    model = random_model(tie_word_embeddings=tie_word_embeddings)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)
    assert (loaded.lm_head.weight is loaded.model.shared.weight) == tie_word_embeddings
    # The base model (AutoModel) from the same file: the output projection is the head's, left over by design.
    base = AutoModel.from_pretrained(tmp_path)
    torch.testing.assert_close(base.shared.weight, model.model.shared.weight)
