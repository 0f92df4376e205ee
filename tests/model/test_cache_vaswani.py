"""The beam-search cache (`cache_vaswani.py`): each beam attends to its own hypothesis, nothing moved."""

import pytest
import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from vaswani_transformer import VaswaniConfig
from vaswani_transformer.model.cache_vaswani import BeamSearchCache
from vaswani_transformer.model.layers_vaswani import MultiHeadAttention


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa", "flash_attention_2"])
def test_beam_search_cache_attends_as_the_reordered_dynamic_cache(attn_implementation):
    # Each beam attends to its own hypothesis' keys and values, whether they move after every step
    # (DynamicCache, eager attention) or stay where they were written (BeamSearchCache): one row per
    # sentence at the first step, then 4 beams reordered at random for 70 steps, past the first capacity
    # (32 positions) and, with SDPA, past the eager path's 1,024 scores to the fused kernel; one sentence
    # leaves on the way. A sentence's beams are one row of queries, masked by `append_position` as beam search masks
    # them. Flash attention takes no such mask (nor runs here): the eager path stands in.
    torch.manual_seed(0)
    config = VaswaniConfig(d_model=16, num_attention_heads=2, d_ff=32, encoder_layers=1, decoder_layers=1)
    attention = MultiHeadAttention(config, is_causal=True).eval()
    batch, beams = 3, 4
    beam_cache = BeamSearchCache(1, batch, beams, 1, torch.device("cpu"))
    ours = EncoderDecoderCache(beam_cache, DynamicCache())
    reference = EncoderDecoderCache(DynamicCache(), DynamicCache())
    rows_per_sentence = 1
    for step in range(70):
        hidden_states = torch.randn(batch * rows_per_sentence, 1, 16)
        with torch.no_grad():
            config._attn_implementation = attn_implementation
            beams_as_queries = hidden_states.view(batch, rows_per_sentence, 16)
            mask = beam_cache.append_position()
            got = attention(beams_as_queries, attention_mask=mask, past_key_values=ours)[0]
            config._attn_implementation = "eager"
            want = attention(hidden_states, past_key_values=reference)[0]
        torch.testing.assert_close(got.view(-1, 1, 16), want)
        kept = torch.tensor([0, 2]) if step == 40 else torch.arange(batch)
        parents = torch.randint(0, rows_per_sentence, (len(kept), beams))
        beam_idx = (kept[:, None] * rows_per_sentence + parents).view(-1)
        ours.self_attention_cache.reorder_cache(beam_idx)
        reference.self_attention_cache.reorder_cache(beam_idx)
        batch, rows_per_sentence = len(kept), beams
    assert beam_cache.batch_size == 2
    assert ours.get_seq_length() == reference.get_seq_length() == 70
    # What would leave the ancestry and the slots apart is refused.
    for unsupported in (
        beam_cache.reset,
        lambda: beam_cache.batch_select_indices(torch.tensor([0])),
        lambda: beam_cache.layers[0].reorder_cache(torch.tensor([0])),
        lambda: beam_cache.layers[0].crop(-1),
        lambda: beam_cache.layers[0].get_mask_sizes(1),
    ):
        with pytest.raises(NotImplementedError, match="DynamicCache"):
            unsupported()
