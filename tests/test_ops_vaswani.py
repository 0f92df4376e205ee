"""The kernels of `ops_vaswani.py` against plain PyTorch: linear maps, residual dropout, the loss (§3.4, §5.4)."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import random_model, seq2seq_batch
from torch import nn

from vaswani_transformer import ops_vaswani
from vaswani_transformer.ops_vaswani import (
    MKL_ONLY,
    ProductKernels,
    label_smoothed_cross_entropy,
    linear,
    linear_label_smoothed_cross_entropy,
    residual_dropout,
)

needs_onednn = pytest.mark.skipif(ops_vaswani.ONEDNN_LINEAR is None, reason="PyTorch built without oneDNN")
# Products of at least 2^21 multiply-adds through oneDNN, weight gradients too (as the tests pin the size), or not.
ONEDNN = ProductKernels(onednn_min_product=2**21, onednn_weight_gradient=True)
ONEDNN_MKL_GRADIENTS = ProductKernels(onednn_min_product=2**21, onednn_weight_gradient=False)


def _count_onednn_calls(monkeypatch):
    calls, operator = {"n": 0}, ops_vaswani.ONEDNN_LINEAR

    def counted(*args):
        calls["n"] += 1
        return operator(*args)

    monkeypatch.setattr(ops_vaswani, "ONEDNN_LINEAR", counted)
    return calls


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
    output = linear(*ours, kernels=ONEDNN)
    assert type(output.grad_fn).__name__ == "OneDNNLinearBackward"  # the oneDNN path was taken
    for got, want in zip((output, *torch.autograd.grad(output, ours, upstream.float())), expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6 * want.abs().max().item())
    with torch.no_grad():
        assert torch.equal(linear(*ours, kernels=ONEDNN), output)


@needs_onednn
def test_linear_leaves_small_products_other_dtypes_and_autocast_to_f_linear():
    def backward_of(input, weight, kernels=ONEDNN):
        return type(linear(input, weight, kernels=kernels).grad_fn).__name__

    large = torch.randn(64, 256, requires_grad=True), torch.randn(256, 256)  # 2^22 multiply-adds
    assert backward_of(*large) == "OneDNNLinearBackward"
    assert backward_of(large[0][:8], large[1]) == "MmBackward0"  # 2^19: oneDNN's call costs more than it saves
    assert backward_of(large[0].double(), large[1].double()) == "MmBackward0"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(*large, kernels=ONEDNN).dtype == torch.bfloat16
    assert backward_of(*large, kernels=MKL_ONLY) == "MmBackward0"  # as where oneDNN's products are not faster


@needs_onednn
def test_products_under_a_dispatch_mode_take_f_linear():
    from torch.utils.flop_counter import FlopCounterMode

    input, weight = torch.randn(64, 256), torch.randn(256, 256)  # 2^22 multiply-adds: oneDNN's, outside the mode
    with FlopCounterMode(display=False) as counter:
        linear(input, weight, kernels=ONEDNN)
    assert counter.get_total_flops() == 2 * 64 * 256 * 256  # counted: oneDNN's operator would not be


@needs_onednn
@pytest.mark.parametrize("kernels", [ONEDNN, ONEDNN_MKL_GRADIENTS])
def test_linear_through_onednn_can_be_differentiated_twice(kernels):
    torch.manual_seed(0)
    leaves = [
        (torch.randn(*shape, dtype=torch.float64) / scale).requires_grad_()
        for shape, scale in (((64, 256), 1), ((256, 256), 16))
    ]
    probe = torch.randn(64, 256, dtype=torch.float64)

    def second_order(linear_map, input, weight):
        (grad_input,) = torch.autograd.grad((linear_map(input, weight) ** 2).sum(), input, create_graph=True)
        return torch.autograd.grad((grad_input * probe).sum(), weight)[0]

    def ours_linear(input, weight):
        return linear(input, weight, kernels=kernels)

    expected = second_order(F.linear, *leaves)
    ours = _float32_leaves(*leaves)
    assert type(ours_linear(*ours).grad_fn).__name__ == "OneDNNLinearBackward"
    torch.testing.assert_close(
        second_order(ours_linear, *ours).double(), expected, rtol=0, atol=1e-5 * expected.abs().max()
    )


@needs_onednn
def test_every_projection_of_a_training_step_goes_through_onednn_and_computes_what_f_linear_computes(
    tokenizer, test_sentences, monkeypatch
):
    model = random_model(tokenizer, d_model=256, d_ff=1024, num_attention_heads=4).train()
    projections = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert projections and all(type(m) is ops_vaswani.Linear for m in projections)
    assert all(m.kernels == ONEDNN for m in projections)  # chosen by train(), from the size the tests pin
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
def test_weight_gradients_take_the_library_chosen_for_the_layer(monkeypatch, onednn):
    torch.manual_seed(0)
    leaves = [t.double().requires_grad_() for t in (torch.randn(3, 37, 256), torch.randn(512, 256) / 16)]
    upstream = torch.randn(3, 37, 512, dtype=torch.float64)
    expected = torch.autograd.grad(F.linear(*leaves), leaves, upstream)
    calls = _count_onednn_calls(monkeypatch)
    ours = _float32_leaves(*leaves)
    kernels = ONEDNN if onednn else ONEDNN_MKL_GRADIENTS
    gradients = torch.autograd.grad(linear(*ours, kernels=kernels), ours, upstream.float())
    assert calls["n"] == (3 if onednn else 2)  # the product, dL/dx, and dL/dW where oneDNN is faster for it
    for got, want in zip(gradients, expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6 * want.abs().max().item())


@needs_onednn
@pytest.mark.parametrize("kernels", [ONEDNN, ONEDNN_MKL_GRADIENTS])
def test_fused_loss_through_onednn_gives_the_value_and_gradients_of_float64_logits(monkeypatch, kernels):
    torch.manual_seed(0)
    hidden = torch.randn(2, 300, 64, dtype=torch.float64) / 4
    weight, bias = torch.randn(8000, 64, dtype=torch.float64) / 8, torch.randn(8000, dtype=torch.float64)
    labels = torch.randint(0, 8000, (2, 300))
    labels[1, 200:] = -100
    leaves = [t.requires_grad_() for t in (hidden, weight, bias)]
    reference = label_smoothed_cross_entropy(F.linear(*leaves), labels, 0.1)
    expected = (reference, *torch.autograd.grad(reference, leaves))
    ours = _float32_leaves(*leaves)
    calls = _count_onednn_calls(monkeypatch)
    loss = linear_label_smoothed_cross_entropy(ours[0], ours[1], labels, 0.1, bias=ours[2], kernels=kernels)
    # 2 chunks (262 positions a chunk, 500 kept): the logits, dL/dh and, where chosen, dL/dW of each
    assert calls["n"] == 2 * (3 if kernels.onednn_weight_gradient else 2)
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
            hidden.flatten(0, 1), weight, bias, labels.flatten(), 0.1, drop_ignored, MKL_ONLY
        )
    assert fused.dtype == torch.float32 and set(linear_dtypes) == {torch.bfloat16}
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-2)
    for ours, theirs in zip(torch.autograd.grad(fused, (hidden, weight, bias)), expected, strict=True):
        assert ours.dtype == torch.float32  # float32 leaves get float32 gradients, accumulated in float32
        assert (ours - theirs).norm() / theirs.norm() < 0.01


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
            hidden.flatten(0, 1), weight, bias, labels.flatten(), epsilon, drop_ignored, MKL_ONLY
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
