"""Plotting: the attention maps of a translation (the paper's Figures 3 to 5)."""

from vaswani_transformer.inference.engines import load_translator
from vaswani_transformer.utils.plotting import attention_maps

SENTENCE = "A man is riding a bicycle down the street."


def test_attention_maps_show_the_source_as_translation_cut_it(trained_model_dir):
    model, tokenizer = load_translator(str(trained_model_dir), "cpu")
    model.set_attn_implementation("eager")
    long_source = " ".join([SENTENCE] * 80)
    assert len(tokenizer(long_source)["input_ids"]) > tokenizer.model_max_length
    output, source_tokens, _ = attention_maps(model, tokenizer, long_source, "Ein Hund.")
    assert output.cross_attentions[-1].shape[-1] == len(source_tokens) == tokenizer.model_max_length
