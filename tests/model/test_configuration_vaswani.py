"""`VaswaniConfig`: the presets of Table 3 and clear errors for impossible values."""

import pytest
import torch

from vaswani_transformer import VaswaniConfig, VaswaniForConditionalGeneration


def test_config_rejects_impossible_values_naming_the_field():
    with pytest.raises(ValueError, match="d_model.*num_attention_heads"):
        VaswaniConfig(d_model=100, num_attention_heads=8)
    with pytest.raises(ValueError, match="dropout"):
        VaswaniConfig(dropout=1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        VaswaniConfig(label_smoothing=-0.1)
    with pytest.raises(ValueError, match="d_ff"):
        VaswaniConfig(d_ff=0)
    with pytest.raises(ValueError, match="encoder_layers"):
        VaswaniConfig(encoder_layers=-2)
    with pytest.raises(ValueError, match="d_model must be even"):
        VaswaniConfig(d_model=33, num_attention_heads=1)
    with pytest.raises(ValueError, match="layer_norm_eps"):
        VaswaniConfig(layer_norm_eps=-1.0)
    with pytest.raises(ValueError, match="normalize_before must be a boolean"):
        VaswaniConfig(normalize_before="false")  # a string, and a true one
    with pytest.raises(ValueError, match="tie_word_embeddings must be a boolean"):
        VaswaniConfig(tie_word_embeddings="False")  # what `--model-option tie_word_embeddings=False` gives
    with pytest.raises(ValueError, match="Unknown preset"):
        VaswaniConfig.from_preset("huge")


def test_the_language_pair_is_saved_with_the_config_and_checked(tmp_path):
    VaswaniConfig.from_preset("tiny", source_lang="en", target_lang="de").save_pretrained(tmp_path)
    loaded = VaswaniConfig.from_pretrained(tmp_path)
    assert (loaded.source_lang, loaded.target_lang) == ("en", "de")
    assert VaswaniConfig().source_lang is None  # a model that does not say
    with pytest.raises(ValueError, match="VaswaniConfig.target_lang must be a language code such as 'en', or None"):
        VaswaniConfig(target_lang=" ")


@pytest.mark.parametrize("alias, value", [("hidden_size", 100), ("encoder_attention_heads", 7)])
def test_config_checks_values_given_by_transformers_names_too(alias, value):
    with pytest.raises(ValueError, match="d_model.*num_attention_heads"):
        VaswaniConfig(**{alias: value})


def test_from_pretrained_checks_its_overrides(tmp_path):
    VaswaniConfig.from_preset("tiny").save_pretrained(tmp_path)
    assert VaswaniConfig.from_pretrained(tmp_path, dropout=0.3).dropout == 0.3
    with pytest.raises(ValueError, match="dropout must be a probability"):
        VaswaniConfig.from_pretrained(tmp_path, dropout=1.5)


def test_presets_are_table_3():
    base, big = VaswaniConfig.from_preset("base"), VaswaniConfig.from_preset("big")
    assert (base.encoder_layers, base.d_model, base.d_ff, base.num_attention_heads, base.dropout) == (
        6,
        512,
        2048,
        8,
        0.1,
    )
    assert (big.encoder_layers, big.d_model, big.d_ff, big.num_attention_heads, big.dropout) == (6, 1024, 4096, 16, 0.3)
    assert (base.key_dim, base.value_dim, big.key_dim, big.value_dim) == (64, 64, 64, 64)
    model = VaswaniForConditionalGeneration(VaswaniConfig.from_preset("base"))
    # Table 3 reports 65M parameters for the base model with its 37,000-token vocabulary.
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(65e6, rel=0.05)


# Table 3: parameters x 10^6 of the base model and of the variations that change them. Rows (A)
# keep the count of the base model (d_k = d_v = d_model / h), so the paper leaves it blank.
TABLE_3 = {
    "base": ({}, 65),
    "A h=1": (dict(num_attention_heads=1), 65),
    "A h=32": (dict(num_attention_heads=32), 65),
    "B d_k=16": (dict(d_k=16), 58),
    "B d_k=32": (dict(d_k=32), 60),
    "C N=2": (dict(encoder_layers=2, decoder_layers=2), 36),
    "C N=4": (dict(encoder_layers=4, decoder_layers=4), 50),
    "C N=8": (dict(encoder_layers=8, decoder_layers=8), 80),
    "C d_ff=1024": (dict(d_ff=1024), 53),
    "C d_ff=4096": (dict(d_ff=4096), 90),
}


def test_table_3_variations_change_the_parameter_count_as_the_paper_reports():
    def millions(**overrides) -> float:
        with torch.device("meta"):  # shapes only
            model = VaswaniForConditionalGeneration(VaswaniConfig.from_preset("base", **overrides))
        return sum(p.numel() for p in model.parameters()) / 1e6

    base = millions()
    # The paper's counts include a vocabulary a few thousand tokens larger than the 37,000 it
    # states (about 2M more embedding parameters in every row), so compare differences from the
    # base model, each within the paper's rounding.
    for row, (overrides, reported) in TABLE_3.items():
        assert millions(**overrides) - base == pytest.approx(reported - 65, abs=1.0), row


def test_config_rejects_unknown_options():
    with pytest.raises(ValueError, match="position_embedding_type"):
        VaswaniConfig(position_embedding_type="rotary")
    with pytest.raises(ValueError, match="activation_function"):
        VaswaniConfig(activation_function="relu7")
    with pytest.raises(ValueError, match="d_k"):
        VaswaniConfig(d_k=0)
