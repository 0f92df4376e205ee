"""The kernels of `ops_vaswani.py` against plain PyTorch: residual dropout and the label-smoothed loss (§5.4)."""

import math

import pytest
import torch
import torch.nn.functional as F

from vaswani_transformer.model import ops_vaswani
from vaswani_transformer.model.ops_vaswani import (
    label_smoothed_cross_entropy,
    linear_label_smoothed_cross_entropy,
    residual_dropout,
)


def _float32_leaves(*tensors):
    return [t.detach().float().requires_grad_() if t is not None else None for t in tensors]


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
