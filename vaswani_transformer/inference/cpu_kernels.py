"""Faster CPU kernels, opt-in and outside the model: float32 linear maps through oneDNN, chosen by a pinned setting.

PyTorch computes float32 products on the CPU with MKL, which leaves the vector units of some processors partly idle
(AVX-512 on AMD's); oneDNN, also inside PyTorch, uses them (docs/performance.md, "Products through oneDNN"). The
model itself (`vaswani_transformer.model`) always computes with PyTorch's own kernels: loading a model measures
nothing, and a model gives the same translation in every process. Where the user asks for it, with
`VASWANI_ONEDNN_MIN_PRODUCT` (a number of multiply-adds), the engines of this package swap the model's `nn.Linear`
layers for `OneDNNLinear`, which sends every float32 product of at least that size to oneDNN. The setting is a
stated rule, the same in every process, and the run's log names it (`describe_products`). oneDNN rounds
differently from MKL: the translations are those of the same setting, not those of PyTorch's own kernels.

The operator is `torch.ops.mkldnn._linear_pointwise`, the one `torch.compile` emits for linear layers on the CPU:
PyTorch's private API, which is why it stays out of the code saved with every model.
"""

import math
import os
import time
from collections.abc import Callable, Collection

import torch
import torch.nn.functional as F
from torch import nn

# The environment variable that opts in: products of at least this many multiply-adds take oneDNN.
ONEDNN_MIN_PRODUCT_ENV = "VASWANI_ONEDNN_MIN_PRODUCT"
# Products below this many multiply-adds take MKL whatever the setting: there oneDNN's extra cost per call exceeds
# the whole product's time on every CPU measured.
ONEDNN_FLOOR = 2**18


def _onednn_linear_op() -> Callable | None:
    try:
        return torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None
    except (AttributeError, RuntimeError):  # a PyTorch built without oneDNN
        return None


ONEDNN_LINEAR = _onednn_linear_op()


def pinned_onednn_min_product() -> float | None:
    """The size from which float32 products take oneDNN, as `VASWANI_ONEDNN_MIN_PRODUCT` pins it; None if unset.

    Returns:
        Multiply-adds (rows x in_features x out_features), `math.inf` for never, or None where the variable is
        unset (PyTorch's own kernels, the default).

    Raises:
        ValueError: the variable holds something other than a number.
    """
    pinned = os.environ.get(ONEDNN_MIN_PRODUCT_ENV)
    if pinned is None:
        return None
    try:
        return float(pinned)
    except ValueError:
        raise ValueError(
            f"{ONEDNN_MIN_PRODUCT_ENV}={pinned!r} is not a number of multiply-adds: give one, e.g. 262144, "
            "or unset it to compute with PyTorch's own kernels."
        ) from None


def _plain_dispatch() -> bool:
    # No TorchScript tracing, torch.func transform or mode that watches the dispatcher (FLOP counters, fake
    # tensors): under those a oneDNN call would not be traced, transformed or counted as PyTorch's own.
    return (
        not torch.jit.is_tracing()
        and not torch._C._are_functorch_transforms_active()
        and not torch._C._len_torch_dispatch_stack()
    )


def _uses_onednn(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, min_product: float) -> bool:
    # Where oneDNN's operator has no rule, F.linear: torch.compile (which chooses its own kernels, and is asked first:
    # a size compared while tracing would become a guard), autocast, other dtypes and devices, and
    # `torch.backends.mkldnn.flags(enabled=False)`.
    return (
        not torch.compiler.is_compiling()
        and input.numel() * weight.shape[0] >= max(ONEDNN_FLOOR, min_product)
        and ONEDNN_LINEAR is not None
        and torch.backends.mkldnn.enabled
        and input.device.type == weight.device.type == "cpu"
        and input.dim() >= 2
        and input.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and not torch.is_autocast_enabled("cpu")
        and _plain_dispatch()
    )


def onednn_product(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b by oneDNN, asking nothing: `(*, in)` by `(out, in)` gives `(*, out)`.

    Raises:
        RuntimeError: the shapes do not fit, or the CPU cannot run oneDNN's kernel (from oneDNN).
    """
    return ONEDNN_LINEAR(input, weight, bias, "none", [], "")


def _transposed_product(a: torch.Tensor, b: torch.Tensor, min_product: float) -> torch.Tensor:
    # a^T b of (rows, m) and (rows, n), a weight gradient (m, n), as a linear map: oneDNN copies the transposed first
    # operand into a contiguous one, so the narrower of a and b takes that place.
    if a.shape[1] > b.shape[1]:
        return onednn_linear(b.t(), a.t(), None, min_product).t()
    return onednn_linear(a.t(), b.t(), None, min_product)


class _OneDNNLinearFunction(torch.autograd.Function):
    # x W^T + b by oneDNN, and its gradients as linear maps again (so that they can be differentiated in turn).

    @staticmethod
    def forward(
        ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, min_product: float
    ) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.min_product = min_product
        return onednn_product(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:  # dL/dx = dL/dy W: a linear map whose weight is W^T
            grad_input = onednn_linear(grad_output, weight.t(), None, ctx.min_product)
        if ctx.needs_input_grad[1]:  # dL/dW = (dL/dy)^T x
            grad_rows, input_rows = grad_output.flatten(0, -2), input.flatten(0, -2)
            if _uses_onednn(input_rows.t(), grad_rows.t(), None, ctx.min_product):
                grad_weight = _transposed_product(grad_rows, input_rows, ctx.min_product)
            else:
                grad_weight = grad_rows.t() @ input_rows
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.flatten(0, -2).sum(0)
        return grad_input, grad_weight, grad_bias, None


def onednn_linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, min_product: float
) -> torch.Tensor:
    """y = x W^T + b, as `F.linear`, through oneDNN for float32 CPU products of at least `min_product` multiply-adds.

    Every projection of the model is one: W^Q, W^K, W^V and W^O (§3.2.2), W_1 and W_2 (§3.3, Eq. 2) and the
    pre-softmax projection (§3.4). The same function and gradients as `F.linear` to float32 rounding. Smaller
    products, other dtypes and devices, autocast, `torch.compile`, TorchScript tracing, `torch.func` transforms and
    `torch.backends.mkldnn.flags(enabled=False)` take `F.linear`.

    Args:
        input: `(*, in_features)`.
        weight: `(out_features, in_features)`.
        bias: `(out_features,)`, or None.
        min_product: multiply-adds (rows x in_features x out_features) from which a product takes oneDNN.

    Returns:
        `(*, out_features)`.

    Raises:
        RuntimeError: the shapes do not fit (from the product).
    """
    if not _uses_onednn(input, weight, bias, min_product):
        return F.linear(input, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias)):
        return _OneDNNLinearFunction.apply(input, weight, bias, min_product)
    return onednn_product(input, weight, bias)


class OneDNNLinear(nn.Linear):
    """`nn.Linear` computed by `onednn_linear`: the same parameters and state dict (§3.2.2, §3.3, §3.4).

    Maps `(*, in_features)` to `(*, out_features)`; raises RuntimeError if the input's last dimension is not
    `in_features`. `min_product` is the size from which its products take oneDNN (`use_onednn_products` sets it).
    """

    min_product: float = math.inf

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return onednn_linear(input, self.weight, self.bias, self.min_product)


def use_onednn_products(model: nn.Module, min_product: float, keep: Collection[nn.Module] = ()) -> int:
    """Compute every `nn.Linear` of `model` through oneDNN from `min_product` multiply-adds (`OneDNNLinear`).

    The layers keep their parameters, hooks and state dict; only their class changes, so a model saved afterwards
    is the model it was. Layers of other `nn.Linear` subclasses (quantized ones) are left alone.

    Args:
        model: any module; every layer of exactly `nn.Linear`'s class is swapped.
        min_product: multiply-adds from which a product takes oneDNN; `math.inf` for never.
        keep: layers to leave as they are.

    Returns:
        The number of layers swapped.
    """
    swapped = 0
    for module in model.modules():
        if (type(module) is nn.Linear or type(module) is OneDNNLinear) and not any(module is k for k in keep):
            module.__class__ = OneDNNLinear
            module.min_product = min_product
            swapped += 1
    return swapped


def use_pinned_products(model: nn.Module, keep: Collection[nn.Module] = ()) -> str | None:
    """Apply `VASWANI_ONEDNN_MIN_PRODUCT` to `model` (see the module's docstring), and say so where it is set.

    Args:
        model: the model, whose `nn.Linear` layers take oneDNN's products where the variable asks for them.
        keep: layers to leave as they are (training keeps the pre-softmax projection, which its fused loss of
            §5.4 computes itself).

    Returns:
        None where the model keeps PyTorch's own kernels (the variable unset or `inf`, or no oneDNN in this
        PyTorch); else a line for the run's log that names the setting.

    Raises:
        ValueError: the variable holds something other than a number.
    """
    min_product = pinned_onednn_min_product()
    if min_product is None or min_product == math.inf or ONEDNN_LINEAR is None:
        return None
    use_onednn_products(model, min_product, keep)
    return (
        f"{ONEDNN_MIN_PRODUCT_ENV}={min_product:.0f}: float32 CPU products of that many multiply-adds and more go "
        "through oneDNN, which rounds differently from PyTorch's own kernels"
    )


def _best_seconds(call: Callable[[], object], repeats: int) -> float:
    # The fastest of `repeats` timed calls, after one untimed call that warms caches and allocators up.
    call()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def bfloat16_products_are_faster() -> bool:
    """Whether this CPU computes the products of training (§3.2.2, §3.3, §3.4) clearly faster in bfloat16.

    For `train --mixed-precision auto`, decided once when a run starts (never when a model loads). A CPU with
    bfloat16 instructions (AVX512_BF16, AMX) computes them about twice as fast as float32; one without converts the
    operands and is slower (docs/performance.md, "Mixed precision on CPUs"). Measured on each call: a product of a
    training step's size (4,096 x 256 by 256 x 1,024), in float32 and in bfloat16 under autocast, best of 5 each
    (about 0.1 s); "clearly" is at most 0.8 of float32's time, since bfloat16 also rounds.

    Returns:
        True where the bfloat16 product takes at most 0.8 of the float32 product's time.
    """
    input, weight = torch.full((4096, 256), 0.5, device="cpu"), torch.full((1024, 256), 0.25, device="cpu")

    def bfloat16_product() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.linear(input, weight)

    with torch.no_grad():
        return _best_seconds(bfloat16_product, 5) <= 0.8 * _best_seconds(lambda: F.linear(input, weight), 5)
