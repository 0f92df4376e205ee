"""The opt-in oneDNN products (`cpu_kernels.py`) against `F.linear`, and the pinned setting that chooses them."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import random_model, seq2seq_batch
from torch import nn

from vaswani_transformer.inference import cpu_kernels
from vaswani_transformer.inference.cpu_kernels import (
    OneDNNLinear,
    onednn_linear,
    use_onednn_products,
    use_pinned_products,
)

needs_onednn = pytest.mark.skipif(cpu_kernels.ONEDNN_LINEAR is None, reason="PyTorch built without oneDNN")
MIN_PRODUCT = 2**21  # products of at least 2^21 multiply-adds through oneDNN


def _count_onednn_calls(monkeypatch):
    calls, operator = {"n": 0}, cpu_kernels.ONEDNN_LINEAR

    def counted(*args):
        calls["n"] += 1
        return operator(*args)

    monkeypatch.setattr(cpu_kernels, "ONEDNN_LINEAR", counted)
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
    output = onednn_linear(*ours, MIN_PRODUCT)
    assert type(output.grad_fn).__name__ == "_OneDNNLinearFunctionBackward"  # the oneDNN path was taken
    for got, want in zip((output, *torch.autograd.grad(output, ours, upstream.float())), expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6 * want.abs().max().item())
    with torch.no_grad():
        assert torch.equal(onednn_linear(*ours, MIN_PRODUCT), output)


@needs_onednn
def test_linear_leaves_small_products_other_dtypes_and_autocast_to_f_linear():
    def backward_of(input, weight, min_product=MIN_PRODUCT):
        return type(onednn_linear(input, weight, None, min_product).grad_fn).__name__

    large = torch.randn(64, 256, requires_grad=True), torch.randn(256, 256)  # 2^22 multiply-adds
    assert backward_of(*large) == "_OneDNNLinearFunctionBackward"
    assert backward_of(large[0][:16], large[1]) == "MmBackward0"  # 2^20: below the size asked for
    assert backward_of(large[0][:2], large[1], min_product=0) == "MmBackward0"  # 2^17: below the floor
    assert backward_of(large[0].double(), large[1].double()) == "MmBackward0"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert onednn_linear(*large, None, MIN_PRODUCT).dtype == torch.bfloat16
    assert backward_of(*large, min_product=math.inf) == "MmBackward0"


@needs_onednn
def test_products_under_a_dispatch_mode_take_f_linear():
    from torch.utils.flop_counter import FlopCounterMode

    input, weight = torch.randn(64, 256), torch.randn(256, 256)  # 2^22 multiply-adds: oneDNN's, outside the mode
    with FlopCounterMode(display=False) as counter:
        onednn_linear(input, weight, None, MIN_PRODUCT)
    assert counter.get_total_flops() == 2 * 64 * 256 * 256  # counted: oneDNN's operator would not be


@needs_onednn
def test_linear_through_onednn_can_be_differentiated_twice():
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
        return onednn_linear(input, weight, None, MIN_PRODUCT)

    expected = second_order(F.linear, *leaves)
    ours = _float32_leaves(*leaves)
    torch.testing.assert_close(
        second_order(ours_linear, *ours).double(), expected, rtol=0, atol=1e-5 * expected.abs().max()
    )


@needs_onednn
def test_weight_gradients_of_large_products_take_onednn(monkeypatch):
    torch.manual_seed(0)
    leaves = [t.double().requires_grad_() for t in (torch.randn(3, 37, 256), torch.randn(512, 256) / 16)]
    upstream = torch.randn(3, 37, 512, dtype=torch.float64)
    expected = torch.autograd.grad(F.linear(*leaves), leaves, upstream)
    calls = _count_onednn_calls(monkeypatch)
    ours = _float32_leaves(*leaves)
    gradients = torch.autograd.grad(onednn_linear(*ours, None, 2**18), ours, upstream.float())
    assert calls["n"] == 3  # the product, dL/dx and dL/dW
    for got, want in zip(gradients, expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6 * want.abs().max().item())


@needs_onednn
def test_swapped_layers_keep_their_parameters_and_compute_what_f_linear_computes(tokenizer, test_sentences):
    model = random_model(tokenizer, d_model=256, d_ff=1024, num_attention_heads=4)
    projections = [m for m in model.modules() if isinstance(m, nn.Linear)]
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    batch = seq2seq_batch(tokenizer, *test_sentences)
    with torch.no_grad():
        expected = model(**batch).logits
    assert use_onednn_products(model, MIN_PRODUCT) == len(projections)
    assert all(type(m) is OneDNNLinear for m in projections)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied (§3.4)
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, expected, rtol=0, atol=1e-4 * expected.abs().max().item())


def test_the_pinned_setting_alone_swaps_the_layers_and_says_so(tokenizer, monkeypatch):
    model = random_model(tokenizer)
    for unset in (None, "inf"):
        if unset is None:
            monkeypatch.delenv(cpu_kernels.ONEDNN_MIN_PRODUCT_ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_kernels.ONEDNN_MIN_PRODUCT_ENV, unset)
        assert use_pinned_products(model) is None  # PyTorch's own kernels: nothing to say
        assert not any(type(m) is OneDNNLinear for m in model.modules())
    monkeypatch.setenv(cpu_kernels.ONEDNN_MIN_PRODUCT_ENV, "a lot")
    with pytest.raises(ValueError, match="is not a number of multiply-adds"):
        use_pinned_products(model)
    if cpu_kernels.ONEDNN_LINEAR is not None:
        monkeypatch.setenv(cpu_kernels.ONEDNN_MIN_PRODUCT_ENV, str(MIN_PRODUCT))
        head = model.get_output_embeddings()
        assert "VASWANI_ONEDNN_MIN_PRODUCT=2097152" in use_pinned_products(model, keep=[head])
        assert type(head) is nn.Linear  # kept, as training keeps it for its fused loss
        assert all(type(m) is OneDNNLinear for m in model.modules() if isinstance(m, nn.Linear) and m is not head)


@needs_onednn
def test_a_training_step_with_the_pinned_products_keeps_the_fused_loss_and_its_value(
    tokenizer, test_sentences, monkeypatch
):
    model = random_model(tokenizer, d_model=256, d_ff=1024, num_attention_heads=4)  # eval: no dropout
    batch = seq2seq_batch(tokenizer, *test_sentences)
    expected = model(**batch).loss
    monkeypatch.setenv(cpu_kernels.ONEDNN_MIN_PRODUCT_ENV, str(MIN_PRODUCT))
    use_pinned_products(model, keep=[model.get_output_embeddings()])
    calls = _count_onednn_calls(monkeypatch)
    output = model(**batch)
    assert output.logits is None  # the fused projection and loss (§3.4, §5.4) still ran
    assert calls["n"] > 0
    torch.testing.assert_close(output.loss, expected, rtol=1e-5, atol=0)
