"""The rows of Table 3, scaled to a base model (experiments/table3.py)."""

import pytest

from vaswani_transformer import VaswaniConfig
from vaswani_transformer.experiments.table3 import UNSCALED_FIELD, select_rows, table3_rows


def test_the_rows_of_transformer_tiny_are_those_of_the_issue():
    rows = table3_rows(VaswaniConfig.from_preset("tiny"))
    heads = [(row.overrides["num_attention_heads"], row.overrides["d_k"]) for row in rows.values() if row.group == "A"]
    assert heads == [(1, 128), (2, 64), (8, 16), (16, 8)]
    assert [row.overrides for row in rows.values() if row.group == "B"] == [{"d_k": 16}, {"d_k": 64}]
    assert [row.overrides for row in rows.values() if row.group == "C"] == [
        {"encoder_layers": 2, "decoder_layers": 2}, {"encoder_layers": 6, "decoder_layers": 6},
        {"d_model": 64, "d_ff": 128, "d_k": 16, "d_v": 16}, {"d_model": 256, "d_ff": 512, "d_k": 64, "d_v": 64},
        {"d_ff": 128}, {"d_ff": 512},
    ]  # fmt: skip
    assert [row.overrides for row in rows.values() if row.group == "D"] == [
        {"dropout": 0.0},
        {"dropout": 0.2},
        {"label_smoothing": 0.0},
        {"label_smoothing": 0.2},
    ]
    assert rows["E"].overrides == {"position_embedding_type": "learned"}
    assert list(rows)[0] == "base" and rows["base"].overrides == {}
    for row in rows.values():  # every row is a model that can be built
        VaswaniConfig.from_preset("tiny", **row.overrides)


def test_the_paper_base_gives_the_papers_rows_a():
    rows = table3_rows(VaswaniConfig.from_preset("base"))
    assert [row.overrides["num_attention_heads"] for row in rows.values() if row.group == "A"] == [1, 4, 16, 32]


def test_rows_are_chosen_by_name_or_group_and_the_base_always_runs():
    rows = table3_rows(VaswaniConfig.from_preset("tiny"))
    assert [row.name for row in select_rows(rows, "A1,D")] == ["base", "A1", "D1", "D2", "D3", "D4"]
    with pytest.raises(ValueError, match="'Z9' is no row of Table 3"):
        select_rows(rows, "Z9")


def test_unscaled_rows_drop_the_scale_at_the_base_d_k_and_at_twice_it():
    rows = table3_rows(VaswaniConfig.from_preset("tiny"))
    assert rows["U1"].overrides == {UNSCALED_FIELD: False}
    assert rows["U2"].overrides == {UNSCALED_FIELD: False, "d_k": 64} == {**rows["B2"].overrides, UNSCALED_FIELD: False}
