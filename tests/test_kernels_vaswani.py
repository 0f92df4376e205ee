"""Choosing kernels by measuring (`kernels_vaswani.py`): once per process and model, never inside a forward pass."""

import functools
import math

import pytest
import torch
from conftest import random_model, seq2seq_batch

from vaswani_transformer import kernels_vaswani
from vaswani_transformer.layers_vaswani import MultiHeadAttention
from vaswani_transformer.ops_vaswani import ONEDNN_LINEAR, Linear, ProductKernels

needs_onednn = pytest.mark.skipif(ONEDNN_LINEAR is None, reason="PyTorch built without oneDNN")


def _untouched_random_generator(measure):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    result = measure()
    assert torch.equal(torch.rand(3), expected)  # dropout masks and initialisations do not depend on it
    return result


@needs_onednn
def test_the_size_from_which_onednn_pays_is_measured_once_without_touching_the_random_generator(monkeypatch):
    size = _untouched_random_generator(kernels_vaswani._measured_onednn_min_product.__wrapped__)  # afresh
    assert size == math.inf or (math.log2(size).is_integer() and size >= 2**18)
    monkeypatch.delenv(kernels_vaswani.ONEDNN_MIN_PRODUCT_ENV)
    kernels_vaswani.onednn_min_product()
    hits = kernels_vaswani._measured_onednn_min_product.cache_info().hits
    kernels_vaswani.onednn_min_product()
    assert kernels_vaswani._measured_onednn_min_product.cache_info().hits == hits + 1  # measured once per process
    monkeypatch.setenv(kernels_vaswani.ONEDNN_MIN_PRODUCT_ENV, "one")
    with pytest.raises(ValueError, match="VASWANI_ONEDNN_MIN_PRODUCT='one' is not a number"):
        kernels_vaswani.onednn_min_product()


@needs_onednn
def test_the_weight_gradients_library_is_timed_once_per_shape_unless_pinned(monkeypatch):
    measured = kernels_vaswani._measured_onednn_weight_gradient.__wrapped__
    assert isinstance(_untouched_random_generator(lambda: measured(256, 512, 128, True)), bool)  # both libraries
    asked = []
    recorded = functools.cache(lambda *shape: asked.append(shape) or measured(*shape))
    monkeypatch.setattr(kernels_vaswani, "_measured_onednn_weight_gradient", recorded)
    assert kernels_vaswani.onednn_weight_gradient(1024, 256) is True  # pinned by the tests: oneDNN, nothing timed
    monkeypatch.delenv(kernels_vaswani.ONEDNN_MIN_PRODUCT_ENV)
    for _ in range(2):
        kernels_vaswani.onednn_weight_gradient(256, 64)
        kernels_vaswani.onednn_weight_gradient(8000, 256, accumulate=True)
    # A training batch's rows: 2^12, fewer for wide operands (2^22 elements at most); each shape timed once.
    assert asked == [(4096, 256, 64, False), (512, 8000, 256, True)]


def test_whether_attention_trains_faster_in_float32_is_measured_once_even_under_inference_mode():
    measured = kernels_vaswani._measured_float32_attention_is_faster
    with torch.inference_mode():  # the measurement times a backward pass all the same
        assert _untouched_random_generator(lambda: measured.__wrapped__(torch.bfloat16)) in (True, False)
    kernels_vaswani.float32_attention_is_faster(torch.bfloat16)
    hits = measured.cache_info().hits
    kernels_vaswani.float32_attention_is_faster(torch.bfloat16)
    assert measured.cache_info().hits == hits + 1


def test_attention_runs_in_float32_under_cpu_autocast_only_in_the_dtypes_chosen():
    query = torch.zeros(2, 4, 40, 8)
    assert not kernels_vaswani.attention_in_float32(query, frozenset({torch.bfloat16}))  # no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kernels_vaswani.attention_in_float32(query, frozenset({torch.bfloat16}))
        assert not kernels_vaswani.attention_in_float32(query, frozenset({torch.float16}))
        assert not kernels_vaswani.attention_in_float32(query, frozenset())


def test_eq_1_is_spelled_out_on_the_cpu_for_few_queries_and_never_in_place_of_the_kernels_causal_mask():
    def query_key(queries, keys):
        return torch.zeros(2, 4, queries, 8), torch.zeros(2, 4, keys, 8)

    faster = kernels_vaswani.eager_attention_is_faster
    mask = torch.ones(1, 1, 4, 16, dtype=torch.bool)
    assert faster(*query_key(1, 500), None, is_causal=True)  # one query: always
    with torch.no_grad():
        assert faster(*query_key(4, 16), mask, is_causal=True)
        assert faster(*query_key(32, 32), None, is_causal=False)  # 1,024 pairs
        assert not faster(*query_key(32, 33), None, is_causal=False)
        # The kernel's own causal mask (mask None) is not replaced by Eq. 1 unmasked.
        assert not faster(*query_key(4, 4), None, is_causal=True)
    # In training the two take as long: the kernel.
    assert not faster(*query_key(4, 16), mask, is_causal=True)


def test_a_model_chooses_its_kernels_when_made_and_when_it_trains_and_never_measures_in_forward(
    tokenizer, test_sentences, monkeypatch
):
    model = random_model(tokenizer, d_model=64, d_ff=128, num_attention_heads=4)
    projections = [m for m in model.modules() if isinstance(m, Linear)]
    attentions = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    # Made: the products' library, from the size the tests pin; the weight gradients' only once it trains.
    assert all(m.kernels == ProductKernels(2**21, False) for m in projections)
    model.train()
    chosen = [m.kernels for m in projections]
    assert all(kernels == ProductKernels(2**21, True) for kernels in chosen)
    float32_dtypes = frozenset(
        d for d in (torch.bfloat16, torch.float16) if kernels_vaswani.float32_attention_is_faster(d)
    )
    assert all(m.float32_attention_dtypes == float32_dtypes for m in attentions)
    model.eval().train()  # chosen again: the same objects, so torch.compile sees nothing new
    assert all(m.kernels is kernels for m, kernels in zip(projections, chosen, strict=True))

    def measured(*args, **kwargs):
        raise AssertionError("a kernel was measured inside a forward or backward pass")

    for name in ("_best_seconds", "onednn_min_product", "onednn_weight_gradient", "float32_attention_is_faster"):
        monkeypatch.setattr(kernels_vaswani, name, measured)
    batch = seq2seq_batch(tokenizer, *test_sentences)
    for dtype in (None, torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            model(**batch).loss.backward()
    model.eval()
    with torch.no_grad():
        model.generate(**tokenizer(list(test_sentences[0][:2]), return_tensors="pt", padding=True), max_new_tokens=5)
