"""The kernels of `ops_vaswani.py` against plain PyTorch: linear maps, residual dropout, the loss (§3.4, §5.4)."""

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import random_model, seq2seq_batch
from torch import nn

from vaswani_transformer import ops_vaswani
from vaswani_transformer.ops_vaswani import (
    label_smoothed_cross_entropy,
    linear,
    linear_label_smoothed_cross_entropy,
    residual_dropout,
)

needs_onednn = pytest.mark.skipif(ops_vaswani._ONEDNN_LINEAR is None, reason="PyTorch built without oneDNN")


def _count_onednn_calls(monkeypatch):
    calls, operator = {"n": 0}, ops_vaswani._ONEDNN_LINEAR

    def counted(*args):
        calls["n"] += 1
        return operator(*args)

    monkeypatch.setattr(ops_vaswani, "_ONEDNN_LINEAR", counted)
    return calls


def _measured_weight_gradients(monkeypatch, onednn: bool) -> list:
    # Unpins the library of weight gradients and has its measurement answer `onednn`; returns the shapes it was asked.
    monkeypatch.delenv(ops_vaswani.ONEDNN_MIN_PRODUCT_ENV, raising=False)
    monkeypatch.setattr(ops_vaswani, "onednn_min_product", lambda: 2**21)
    asked = []
    monkeypatch.setattr(ops_vaswani, "_measured_onednn_weight_gradient", lambda *shape: asked.append(shape) or onednn)
    return asked


def _float32_leaves(*tensors):
    return [t.detach().float().requires_grad_() if t is not None else None for t in tensors]


@needs_onednn
@pytest.mark.parametrize("strided", [False, True])
def test_linear_through_onednn_gives_the_products_and_gradients_of_f_linear(strided):
    torch.manual_seed(0)
    input = torch.randn(37, 4, 256, dtype=torch.float64).transpose(0, 1) if strided else torch.randn(4, 37, 256)
    leaves = [t.double().requires_grad_() for t in (input, torch.randn(512, 256) / 16, torch.randn(512))]
    upstream = torch.randn(4, 37, 512, dtype=torch.float64)
    reference = F.linear(*leaves)
    expected = (reference, *torch.autograd.grad(reference, leaves, upstream))
    ours = _float32_leaves(*leaves)
    output = linear(*ours)
    assert type(output.grad_fn).__name__ == "OneDNNLinearBackward"  # the oneDNN path was taken
    for got, want in zip((output, *torch.autograd.grad(output, ours, upstream.float())), expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6 * want.abs().max().item())
    with torch.no_grad():
        assert torch.equal(linear(*ours), output)


@needs_onednn
def test_linear_leaves_small_products_other_dtypes_and_autocast_to_f_linear(monkeypatch):
    def backward_of(input, weight):
        return type(linear(input, weight).grad_fn).__name__

    large = torch.randn(64, 256, requires_grad=True), torch.randn(256, 256)  # 2^22 multiply-adds
    assert backward_of(*large) == "OneDNNLinearBackward"
    assert backward_of(large[0][:8], large[1]) == "MmBackward0"  # 2^19: oneDNN's call costs more than it saves
    assert backward_of(large[0].double(), large[1].double()) == "MmBackward0"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(*large).dtype == torch.bfloat16
    monkeypatch.setenv(ops_vaswani.ONEDNN_MIN_PRODUCT_ENV, "inf")  # as where oneDNN's products are not faster
    assert backward_of(*large) == "MmBackward0"


@needs_onednn
def test_the_size_from_which_onednn_pays_is_measured_without_touching_the_random_generator(monkeypatch):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    size = ops_vaswani._measured_onednn_min_product.__wrapped__()  # measured afresh, not the process's cached size
    assert torch.equal(torch.rand(3), expected)  # dropout masks and initialisations do not depend on it
    assert size == math.inf or (math.log2(size).is_integer() and size >= 2**18)
    monkeypatch.delenv(ops_vaswani.ONEDNN_MIN_PRODUCT_ENV)
    ops_vaswani.onednn_min_product()
    hits = ops_vaswani._measured_onednn_min_product.cache_info().hits
    ops_vaswani.onednn_min_product()
    assert ops_vaswani._measured_onednn_min_product.cache_info().hits == hits + 1  # measured once per process
    monkeypatch.setenv(ops_vaswani.ONEDNN_MIN_PRODUCT_ENV, "one")
    with pytest.raises(ValueError, match="VASWANI_ONEDNN_MIN_PRODUCT='one' is not a number"):
        ops_vaswani.onednn_min_product()


@needs_onednn
def test_products_under_a_dispatch_mode_take_f_linear():
    from torch.utils.flop_counter import FlopCounterMode

    input, weight = torch.randn(64, 256), torch.randn(256, 256)  # 2^22 multiply-adds: oneDNN's, outside the mode
    with FlopCounterMode(display=False) as counter:
        linear(input, weight)
    assert counter.get_total_flops() == 2 * 64 * 256 * 256  # counted: oneDNN's operator would not be


@needs_onednn
@pytest.mark.parametrize("onednn_weight_gradients", [None, False])  # as the tests pin it, and measured MKL's
def test_linear_through_onednn_can_be_differentiated_twice(monkeypatch, onednn_weight_gradients):
    if onednn_weight_gradients is not None:
        _measured_weight_gradients(monkeypatch, onednn_weight_gradients)
    torch.manual_seed(0)
    leaves = [
        (torch.randn(*shape, dtype=torch.float64) / scale).requires_grad_()
        for shape, scale in (((64, 256), 1), ((256, 256), 16))
    ]
    probe = torch.randn(64, 256, dtype=torch.float64)

    def second_order(linear_map, input, weight):
        (grad_input,) = torch.autograd.grad((linear_map(input, weight) ** 2).sum(), input, create_graph=True)
        return torch.autograd.grad((grad_input * probe).sum(), weight)[0]

    expected = second_order(F.linear, *leaves)
    ours = _float32_leaves(*leaves)
    assert type(linear(*ours).grad_fn).__name__ == "OneDNNLinearBackward"
    torch.testing.assert_close(second_order(linear, *ours).double(), expected, rtol=0, atol=1e-5 * expected.abs().max())


@needs_onednn
def test_every_projection_of_a_training_step_goes_through_onednn_and_computes_what_f_linear_computes(
    tokenizer, test_sentences, monkeypatch
):
    model = random_model(tokenizer, d_model=256, d_ff=1024, num_attention_heads=4).train()
    projections = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert projections and all(type(m) is ops_vaswani.Linear for m in projections)
    batch = seq2seq_batch(tokenizer, *test_sentences)

    def loss_and_gradients():
        torch.manual_seed(0)
        loss = model(**batch).loss
        return loss, torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])

    with torch.backends.mkldnn.flags(enabled=False):  # the user's switch: F.linear everywhere
        expected = loss_and_gradients()
    calls = _count_onednn_calls(monkeypatch)
    loss, gradients = loss_and_gradients()
    # 2 encoder layers of 4 + 2 projections and 2 decoder layers of 4 + 4 + 2, each a product forward and two
    # backward (every input needs its gradient: the embeddings are trained), then the fused loss's 3 products.
    assert calls["n"] == 3 * (2 * 6 + 2 * 10) + 3
    torch.testing.assert_close(loss, expected[0], rtol=1e-5, atol=0)
    for ours, theirs in zip(gradients, expected[1], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4 * theirs.abs().max().item())


@needs_onednn
@pytest.mark.parametrize("onednn", [True, False])
def test_weight_gradients_take_the_library_measured_faster_for_their_shape(monkeypatch, onednn):
    torch.manual_seed(0)
    leaves = [t.double().requires_grad_() for t in (torch.randn(3, 37, 256), torch.randn(512, 256) / 16)]
    upstream = torch.randn(3, 37, 512, dtype=torch.float64)
    expected = torch.autograd.grad(F.linear(*leaves), leaves, upstream)
    asked = _measured_weight_gradients(monkeypatch, onednn)
    calls = _count_onednn_calls(monkeypatch)
    ours = _float32_leaves(*leaves)
    gradients = torch.autograd.grad(linear(*ours), ours, upstream.float())
    assert asked == [(128, 512, 256, False)]  # 111 rows, timed as the nearest power of two
    assert calls["n"] == (3 if onednn else 2)  # the product, dL/dx, and dL/dW where oneDNN is faster for it
    for got, want in zip(gradients, expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6 * want.abs().max().item())


@needs_onednn
def test_the_weight_gradients_library_is_timed_once_per_shape_unless_pinned(monkeypatch):
    measured = ops_vaswani._measured_onednn_weight_gradient.__wrapped__
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert isinstance(measured(256, 512, 128, True), bool)  # timed afresh, both libraries
    assert torch.equal(torch.rand(3), expected)  # constant operands: the random generator stays untouched
    asked = []
    recorded = functools.cache(lambda *shape: asked.append(shape) or measured(*shape))
    monkeypatch.setattr(ops_vaswani, "_measured_onednn_weight_gradient", recorded)
    monkeypatch.setenv(ops_vaswani.ONEDNN_MIN_PRODUCT_ENV, str(2**21))
    assert ops_vaswani._onednn_weight_gradient(2048, 1024, 256) is True  # pinned: oneDNN, nothing timed
    monkeypatch.delenv(ops_vaswani.ONEDNN_MIN_PRODUCT_ENV)
    for rows in (200, 256, 300, 5000, 8192):
        ops_vaswani._onednn_weight_gradient(rows, 256, 64)
    ops_vaswani._onednn_weight_gradient(3000, 8000, 256, accumulate=True)
    # Rows to the nearest power of two, at most 2^12, and fewer for wide operands (2^22 elements at most).
    assert asked == [(256, 256, 64, False), (4096, 256, 64, False), (512, 8000, 256, True)]


@needs_onednn
@pytest.mark.parametrize("onednn_weight_gradients", [None, False])  # as the tests pin it, and measured MKL's
def test_fused_loss_through_onednn_gives_the_value_and_gradients_of_float64_logits(
    monkeypatch, onednn_weight_gradients
):
    torch.manual_seed(0)
    hidden = torch.randn(2, 300, 64, dtype=torch.float64) / 4
    weight, bias = torch.randn(8000, 64, dtype=torch.float64) / 8, torch.randn(8000, dtype=torch.float64)
    labels = torch.randint(0, 8000, (2, 300))
    labels[1, 200:] = -100
    leaves = [t.requires_grad_() for t in (hidden, weight, bias)]
    reference = label_smoothed_cross_entropy(F.linear(*leaves), labels, 0.1)
    expected = (reference, *torch.autograd.grad(reference, leaves))
    ours = _float32_leaves(*leaves)
    if onednn_weight_gradients is not None:
        asked = _measured_weight_gradients(monkeypatch, onednn_weight_gradients)
    calls = _count_onednn_calls(monkeypatch)
    loss = linear_label_smoothed_cross_entropy(ours[0], ours[1], labels, 0.1, bias=ours[2])
    # 2 chunks (262 positions a chunk, 500 kept): the logits, dL/dh and, where oneDNN's is faster, dL/dW of each
    assert calls["n"] == 2 * (2 if onednn_weight_gradients is False else 3)
    if onednn_weight_gradients is not None:
        assert asked == [(256, 8000, 64, True)]  # one choice for the batch, from a chunk's shape
    for got, want in zip((loss, *torch.autograd.grad(loss, ours)), expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("drop_ignored", [True, False])  # the CPU's way, and the accelerators'
def test_under_bf16_autocast_the_fused_loss_projects_in_bf16_as_the_materialised_logits_do(monkeypatch, drop_ignored):
    torch.manual_seed(0)
    hidden = torch.randn(2, 300, 64, requires_grad=True)  # 600 positions: three chunks of the CPU's 256
    weight = torch.randn(8000, 64, requires_grad=True)
    bias = torch.randn(8000, requires_grad=True)
    labels = torch.randint(0, 8000, (2, 300))
    labels[1, 250:] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(hidden, weight, bias)
    reference = label_smoothed_cross_entropy(logits, labels, epsilon=0.1, num_items_in_batch=1)
    expected = torch.autograd.grad(reference, (hidden, weight, bias))
    linear_dtypes, product = [], F.linear

    def recorded(input, *args, **kwargs):
        linear_dtypes.append(input.dtype)
        return product(input, *args, **kwargs)

    monkeypatch.setattr(F, "linear", recorded)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = ops_vaswani.LinearLabelSmoothedCrossEntropy.apply(
            hidden.flatten(0, 1), weight, bias, labels.flatten(), 0.1, drop_ignored
        )
    assert fused.dtype == torch.float32 and set(linear_dtypes) == {torch.bfloat16}
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-2)
    for ours, theirs in zip(torch.autograd.grad(fused, (hidden, weight, bias)), expected, strict=True):
        assert ours.dtype == torch.float32  # float32 leaves get float32 gradients, accumulated in float32
        assert (ours - theirs).norm() / theirs.norm() < 0.01


def test_whether_attention_trains_faster_in_float32_is_measured_once_without_touching_the_random_generator():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert ops_vaswani._measured_float32_attention_is_faster.__wrapped__(torch.bfloat16) in (True, False)
    assert torch.equal(torch.rand(3), expected)
    ops_vaswani.float32_attention_is_faster(torch.bfloat16)
    hits = ops_vaswani._measured_float32_attention_is_faster.cache_info().hits
    ops_vaswani.float32_attention_is_faster(torch.bfloat16)
    assert ops_vaswani._measured_float32_attention_is_faster.cache_info().hits == hits + 1  # measured once


def test_the_attention_measurement_inside_a_checkpointed_layer_does_not_recompute_the_layer():
    # Gradient checkpointing records the tensors saved inside a layer's forward pass; the measurement's own
    # backward pass must not set off the recomputation of the layer, which would measure again.
    calls = []

    def layer(x):
        calls.append(1)
        ops_vaswani._measured_float32_attention_is_faster.__wrapped__(torch.bfloat16)
        return x * x

    x = torch.ones(3, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    assert len(calls) == 1
    y.sum().backward()  # now, and only now, the layer runs again
    assert len(calls) == 2 and torch.equal(x.grad, torch.full((3,), 2.0))


def test_label_smoothed_loss_equals_a_hand_computed_value():
    # Vocabulary of 3, epsilon 0.1: the target distribution is 0.9 one-hot + 0.1 / 3 everywhere.
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]]])
    labels = torch.tensor([[0, -100]])  # the second position is padding
    log_z = math.log(math.exp(2.0) + math.exp(0.0) + math.exp(-1.0))
    log_p = [2.0 - log_z, 0.0 - log_z, -1.0 - log_z]
    expected = -(0.9 + 0.1 / 3) * log_p[0] - (0.1 / 3) * (log_p[1] + log_p[2])
    loss = label_smoothed_cross_entropy(logits, labels, epsilon=0.1)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    summed = label_smoothed_cross_entropy(logits, labels, epsilon=0.1, num_items_in_batch=4)
    assert summed.item() == pytest.approx(expected / 4, rel=1e-6)


@pytest.mark.parametrize("drop_ignored", [True, False])  # the CPU's way, and the accelerators'
def test_fused_projection_and_loss_give_the_value_and_gradients_of_materialised_logits(drop_ignored):
    def fused_loss(hidden, weight, labels, epsilon, bias=None, items=None):
        bias = bias.flatten() if bias is not None else None
        loss = ops_vaswani.LinearLabelSmoothedCrossEntropy.apply(
            hidden.flatten(0, 1), weight, bias, labels.flatten(), epsilon, drop_ignored
        )
        return loss / (labels.ne(-100).sum() if items is None else items)

    torch.manual_seed(0)
    # 20,000 classes: the CPU chunk is 256 positions, so 3 x 200 positions take three chunks.
    hidden = torch.randn(3, 200, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(20_000, 16, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 20_000, dtype=torch.float64)
    labels = torch.randint(0, 20_000, (3, 200))
    labels[0, 150:] = -100
    for epsilon, logit_bias, items in ((0.0, None, None), (0.1, bias, None), (0.3, None, 1000)):
        fused = fused_loss(hidden, weight, labels, epsilon, logit_bias, items)
        logits = F.linear(hidden, weight) + (0 if logit_bias is None else logit_bias)
        reference = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=epsilon, reduction="sum")
        reference = reference / (labels.ne(-100).sum() if items is None else items)
        torch.testing.assert_close(fused, reference)
        expected = torch.autograd.grad(reference, (hidden, weight))
        for ours, theirs in zip(torch.autograd.grad(fused, (hidden, weight)), expected, strict=True):
            torch.testing.assert_close(ours, theirs)
    small = (hidden[:1, :5, :4].detach().requires_grad_(), weight[:11, :4].detach().requires_grad_())
    small_labels = labels[:1, :5] % 11
    assert torch.autograd.gradcheck(lambda h, w: fused_loss(h, w, small_labels, 0.1), small)


def test_fused_loss_gives_a_trainable_bias_its_gradient_and_refuses_double_backward():
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(13, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (2, 7))
    labels[1, 4:] = -100
    fused = linear_label_smoothed_cross_entropy(hidden, weight, labels, 0.1, bias)
    logits = F.linear(hidden, weight, bias)
    reference = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=0.1)
    (ours,) = torch.autograd.grad(fused, bias, retain_graph=True)
    (theirs,) = torch.autograd.grad(reference, bias)
    torch.testing.assert_close(ours, theirs)
    # Its gradients are constants of the forward pass: differentiating them again must fail, not give 0.
    scale = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    (grad_hidden,) = torch.autograd.grad(fused * scale, hidden, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_hidden.sum().backward()


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_residual_dropout_drops_each_element_independently_at_rate_p_and_keeps_expectations(p):
    x = torch.rand(1000, 4001) + 0.5  # an odd number of elements: not a whole number of 64-bit draws
    torch.manual_seed(0)
    y = residual_dropout(x, p, training=True)
    dropped = y == 0
    n = dropped.numel()
    assert abs(dropped.float().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)
    # Independent elements: those 1 to 4 apart (sharing a 64-bit draw or not) are dropped together at rate p^2.
    flat = dropped.flatten()
    for offset in (1, 2, 3, 4):
        together = (flat[:-offset] & flat[offset:]).float().mean().item()
        assert abs(together - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / n), offset
    scale = 1 / (1 - round(p * 2**16) / 2**16)
    torch.testing.assert_close(y[~dropped], x[~dropped] * scale)
    assert abs(1 / scale - (1 - p)) < 2**-17
    # The same masks from the same seed; the identity outside training.
    torch.manual_seed(0)
    torch.testing.assert_close(residual_dropout(x, p, training=True), y)
    assert residual_dropout(x, p, training=False) is x
    # The gradient is the mask times the scale.
    leaf = x.clone().requires_grad_()
    torch.manual_seed(0)
    residual_dropout(leaf, p, training=True).sum().backward()
    torch.testing.assert_close(leaf.grad, (~dropped).float() * scale)


def test_eq_1_is_spelled_out_on_the_cpu_for_few_queries_and_never_in_place_of_the_kernels_causal_mask():
    def query_key(queries, keys):
        return torch.zeros(2, 4, queries, 8), torch.zeros(2, 4, keys, 8)

    mask = torch.ones(1, 1, 4, 16, dtype=torch.bool)
    assert ops_vaswani.eager_attention_is_faster(*query_key(1, 500), None, is_causal=True)  # one query: always
    with torch.no_grad():
        assert ops_vaswani.eager_attention_is_faster(*query_key(4, 16), mask, is_causal=True)
        assert ops_vaswani.eager_attention_is_faster(*query_key(32, 32), None, is_causal=False)  # 1,024 pairs
        assert not ops_vaswani.eager_attention_is_faster(*query_key(32, 33), None, is_causal=False)
        # The kernel's own causal mask (mask None) is not replaced by Eq. 1 unmasked.
        assert not ops_vaswani.eager_attention_is_faster(*query_key(4, 4), None, is_causal=True)
    # In training the two take as long: the kernel.
    assert not ops_vaswani.eager_attention_is_faster(*query_key(4, 16), mask, is_causal=True)


def test_attention_measures_its_precision_even_under_a_callers_inference_mode():
    # The measurement times a backward pass: under the caller's inference mode no tensor could require gradients.
    ops_vaswani._measured_float32_attention_is_faster.cache_clear()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        choice = ops_vaswani.attention_in_float32(torch.zeros(2, 4, 40, 8))
    assert ops_vaswani._measured_float32_attention_is_faster.cache_info().currsize == 1
    assert choice == ops_vaswani.float32_attention_is_faster(torch.bfloat16)  # measured, then kept
