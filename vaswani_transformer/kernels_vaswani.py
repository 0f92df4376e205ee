"""Choosing kernels by measuring them: once per process and model, when the model is made or first trains.

Which library computes a float32 product fastest on a CPU, and in which precision attention trains
fastest, depends on the processor (docs/performance.md, "Products through oneDNN" and "Mixed precision
on CPUs"), so each is timed here on the machine at hand, never inferred from its vendor.
`VaswaniPreTrainedModel` calls `choose_kernels` when it is made or loaded, and again, for the
choices that only training needs, when it is put in training mode. The forward pass reads the choice from
its modules (`ops_vaswani.Linear.kernels`, `MultiHeadAttention.float32_attention_dtypes`) and never
measures. Only PyTorch is imported here: the module is copied into saved models for `trust_remote_code`.
"""

import functools
import math
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .ops_vaswani import (
    ONEDNN_FLOOR,
    ONEDNN_LINEAR,
    Linear,
    ProductKernels,
    linear,
    onednn_product,
    plain_dispatch,
    transposed_product,
)

# The environment variable that pins the size from which products take oneDNN, instead of measuring it.
ONEDNN_MIN_PRODUCT_ENV = "VASWANI_ONEDNN_MIN_PRODUCT"
# Weight gradients are timed with at most this many rows, and operands of at most this many elements: beyond them
# the two libraries' times grow alike, and timing a large model's or vocabulary's products would take seconds.
_WEIGHT_GRADIENT_MAX_ROWS = 2**12
_WEIGHT_GRADIENT_MAX_ELEMENTS = 2**22
_MEASUREMENT_LOCK = threading.Lock()


def _best_seconds(call: Callable[[], object], repeats: int) -> float:
    # The fastest of `repeats` timed calls, after one untimed call that warms caches and allocators up. The
    # measurements of this module use constant operands: the values do not change the time, and the global random
    # generator stays untouched.
    call()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


# Linear maps (§3.2.2, §3.3, §3.4): MKL or oneDNN -----------------------------------------------------


def _product_cost(product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple[float, float]:
    # Seconds per call and per multiply-add of one library's float32 products, from a small product, whose time
    # is mostly the call's, and a large one, whose time is mostly its multiply-adds (best of 7 each).
    timings = []
    for rows, width in ((8, 128), (256, 512)):
        input = torch.full((rows, width), 0.5, dtype=torch.float32, device="cpu")
        weight = torch.full((width, width), 0.25, dtype=torch.float32, device="cpu")
        timings.append((rows * width * width, _best_seconds(functools.partial(product, input, weight), 7)))
    (small, small_seconds), (large, large_seconds) = timings
    per_multiply_add = max(large_seconds - small_seconds, 0.0) / (large - small)
    return small_seconds - per_multiply_add * small, per_multiply_add


@functools.cache
def _measured_onednn_min_product() -> float:
    if ONEDNN_LINEAR is None:
        return math.inf
    try:
        with torch.no_grad():
            mkl_call, mkl_multiply_add = _product_cost(F.linear)
            onednn_call, onednn_multiply_add = _product_cost(onednn_product)
    except RuntimeError:  # a oneDNN that cannot run on this CPU
        return math.inf
    if onednn_multiply_add >= mkl_multiply_add:
        return math.inf
    crossing = max(onednn_call - mkl_call, 0.0) / (mkl_multiply_add - onednn_multiply_add)
    return float(2 ** round(math.log2(max(crossing, ONEDNN_FLOOR))))


def _pinned_min_product() -> float | None:
    pinned = os.environ.get(ONEDNN_MIN_PRODUCT_ENV)
    if pinned is None:
        return None
    try:
        return float(pinned)
    except ValueError:
        raise ValueError(
            f"{ONEDNN_MIN_PRODUCT_ENV}={pinned!r} is not a number of multiply-adds: give one, e.g. 8388608, "
            "or inf to keep every product on MKL, or unset it to measure."
        ) from None


def onednn_min_product() -> float:
    """The fewest multiply-adds from which oneDNN computes a float32 product faster than MKL on this CPU.

    For the projections of §3.2.2, §3.3 and §3.4 (`ops_vaswani.linear`). A oneDNN call costs more than an MKL
    one; how much faster its multiply-adds are than MKL's depends on the processor, from several times to not at
    all (docs/performance.md, "Products through oneDNN"). So the size from which oneDNN pays is measured, once
    per process, with the threads PyTorch uses then: each library's time per call and per multiply-add, from one
    small and one large product (about 20 ms in all), give the size at which their times cross, rounded to a
    power of two so that the noise of one measurement seldom moves it. Where the two libraries are close,
    separate processes may still measure neighbouring powers: the environment variable
    `VASWANI_ONEDNN_MIN_PRODUCT` (a number of multiply-adds, or `inf` for never) pins the size instead, for runs
    that must agree to the bit (docs/robustness.md, "Determinism").

    Returns:
        Multiply-adds (rows x in_features x out_features): a power of two from 2^18 when measured, `math.inf`
        where oneDNN's multiply-adds are not faster than MKL's or PyTorch has no oneDNN.

    Raises:
        ValueError: `VASWANI_ONEDNN_MIN_PRODUCT` is set to something other than a number.
    """
    pinned = _pinned_min_product()
    if pinned is not None:
        return pinned
    with _MEASUREMENT_LOCK:  # one measurement, even when the first models are made in several threads at once
        return _measured_onednn_min_product()


@functools.cache
def _measured_onednn_weight_gradient(rows: int, m: int, n: int, accumulate: bool) -> bool:
    a = torch.full((rows, m), 0.5, dtype=torch.float32, device="cpu")
    b = torch.full((rows, n), 0.25, dtype=torch.float32, device="cpu")
    total = torch.zeros(m, n, dtype=torch.float32, device="cpu")
    if accumulate:  # as the fused loss sums its chunks: oneDNN's product, then an addition; MKL's product adds itself
        onednn = lambda: total.add_(transposed_product(a, b, onednn_product))  # noqa: E731
        mkl = functools.partial(total.addmm_, a.t(), b)
    else:
        onednn = functools.partial(transposed_product, a, b, onednn_product)
        mkl = functools.partial(torch.mm, a.t(), b)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        onednn_seconds, mkl_seconds = _best_seconds(onednn, 3), _best_seconds(mkl, 3)
    # Leaning to MKL, PyTorch's own library: where oneDNN would gain less than a tenth, the noise would decide.
    return onednn_seconds <= 0.9 * mkl_seconds


def onednn_weight_gradient(m: int, n: int, accumulate: bool = False) -> bool:
    """Whether oneDNN computes the weight gradient of an `(m, n)` weight faster than MKL on this CPU.

    The gradient is a^T b of `(rows, m)` and `(rows, n)` float32 operands (added to a running sum where
    `accumulate`, as the fused loss of §5.4 sums its chunks). MKL takes the transposed operand as it is; oneDNN
    first copies one into a contiguous block, which for d_model x d_model weights can cost more than its faster
    multiply-adds save (docs/performance.md, "Products through oneDNN"). So each shape is timed both ways once
    per process, at a training batch's rows (4,096, fewer for wide weights: about 0.1 s per shape). Where
    `VASWANI_ONEDNN_MIN_PRODUCT` pins the size from which products take oneDNN, nothing is timed and oneDNN
    computes every gradient, so that runs agree to the bit.

    Raises:
        ValueError: `VASWANI_ONEDNN_MIN_PRODUCT` is set to something other than a number.
    """
    if _pinned_min_product() is not None:
        return True
    rows = min(_WEIGHT_GRADIENT_MAX_ROWS, 2 ** int(math.log2(max(1, _WEIGHT_GRADIENT_MAX_ELEMENTS // max(m, n)))))
    with _MEASUREMENT_LOCK:
        return _measured_onednn_weight_gradient(rows, m, n, accumulate)


# Attention (§3.2.1): which kernel, and in which precision --------------------------------------------


@functools.cache
def _measured_float32_attention_is_faster(dtype: torch.dtype) -> bool:
    # PyTorch's fused attention for the CPU, forward and backward at a training size, in each dtype (best of 5).
    def seconds(operand_dtype: torch.dtype) -> float:
        operands = [
            torch.full((16, 4, 32, 32), 0.5, dtype=operand_dtype, device="cpu", requires_grad=True) for _ in range(3)
        ]
        return _best_seconds(lambda: F.scaled_dot_product_attention(*operands, is_causal=True).sum().backward(), 5)

    with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False):
        float32 = seconds(torch.float32)
        try:
            return float32 < seconds(dtype)
        except RuntimeError:  # no kernel for this dtype on this CPU
            return True


def float32_attention_is_faster(dtype: torch.dtype) -> bool:
    """Whether attention (§3.2.1, Eq. 1) trains faster in float32 than in `dtype` on this CPU.

    Under autocast PyTorch runs its fused attention kernel in the lower precision, whose backward pass
    can take several times float32's on a CPU (docs/performance.md, "Mixed precision on CPUs"). Where
    float32 is faster, `MultiHeadAttention` computes attention in float32 under CPU autocast
    (`attention_in_float32`), as autocast keeps softmax and layer norms in float32, and the
    projections still run in `dtype`. Measured once per process and dtype: the kernel's forward and
    backward at a training size (16 sentences x 4 heads x 32 positions x 32 dimensions), in both
    dtypes, best of 5 each (about 30 ms in all).

    Args:
        dtype: the lower precision, `torch.bfloat16` or `torch.float16`.

    Returns:
        True where float32 is faster, or where the kernel cannot run in `dtype` here.
    """
    with _MEASUREMENT_LOCK:  # one measurement, even when the first models train in several threads at once
        return _measured_float32_attention_is_faster(dtype)


def attention_in_float32(query: torch.Tensor, float32_dtypes: frozenset[torch.dtype]) -> bool:
    """Whether attention (§3.2.1, Eq. 1) on `query` should run in float32 rather than under CPU autocast.

    True under CPU autocast in one of `float32_dtypes` (those for which `float32_attention_is_faster`, as
    `choose_kernels` found them): with or without gradients alike, so that a checkpointed layer's recomputation
    computes what its first pass did. Not while compiling (Inductor chooses its own kernels) or tracing, nor
    under `torch.func` transforms or modes that watch the dispatcher.

    Args:
        query: `(batch, heads, queries, d_k)`, for its device.
        float32_dtypes: the autocast dtypes in which attention runs in float32 instead.
    """
    return (
        bool(float32_dtypes)
        and not torch.compiler.is_compiling()
        and query.device.type == "cpu"
        and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") in float32_dtypes
        and plain_dispatch()
    )


def eager_attention_is_faster(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, *, decoding: bool = False
) -> bool:
    """Whether Eq. 1 spelled out (§3.2.1) is faster here than PyTorch's fused attention kernel.

    A rule, not a measurement. On the CPU the fused kernel has a fixed cost per call above Eq. 1
    spelled out for a few queries (docs/performance.md, "Attention for few queries"): one query per
    sentence at every decoding step, a sentence's num_beams queries in beam search, short sentences
    at translation time. In training the two take as long. On CUDA it is faster in the decoding
    steps (§6.1) of float16 and bfloat16 while cuDNN's attention is enabled: PyTorch may take that
    kernel, which builds a plan for every new shape, and as the keys grow by one position a step and
    finished sentences leave the batch, nearly every step would wait for a plan (docs/gpu.md,
    "Decoding"). Where the SDPA mask builder left a causal mask to the kernel's `is_causal` (mask
    None), the eager path would not mask, so that case stays with the kernel.

    Args:
        query: `(batch, heads, queries, d_k)`.
        key: `(batch, heads, keys, d_k)`.
        mask: the attention mask, or None.
        is_causal: whether the attention is masked decoder self-attention.
        decoding: whether the layer decodes incrementally (it has a cache).

    Returns:
        True on the CPU for one query, or, without gradients, for at most 1,024 query-key pairs
        with a mask or without causal masking (the kernel's own causal mask is not replaced); on
        CUDA, without gradients, for a decoding step in float16 or bfloat16 while cuDNN's attention is
        enabled (PyTorch's default; not after `training.avoid_cudnn_attention` has turned it off),
        with a mask, in encoder-decoder attention, or for one query. The CUDA rule was measured on one
        kind of GPU (docs/gpu.md): on a GPU where PyTorch prefers another kernel, Eq. 1 is spelled out
        there too, though no plan stalls it.
    """
    maskable = mask is not None or not is_causal
    if query.device.type == "cuda":
        return (
            decoding
            and not torch.is_grad_enabled()
            and (maskable or query.shape[2] == 1)
            and query.dtype in (torch.float16, torch.bfloat16)
            and torch.backends.cuda.cudnn_sdp_enabled()
        )
    if query.device.type != "cpu":
        return False
    if query.shape[2] == 1:
        return True
    return not torch.is_grad_enabled() and query.shape[2] * key.shape[2] <= 1024 and maskable


# Mixed precision (§5.3) ------------------------------------------------------------------------------


def bfloat16_products_are_faster() -> bool:
    """Whether this CPU computes the products of training (§3.2.2, §3.3, §3.4) clearly faster in bfloat16.

    A CPU with bfloat16 instructions (AVX512_BF16, AMX) computes them about twice as fast as float32;
    one without converts the operands and is slower (docs/performance.md, "Mixed precision on CPUs").
    Measured on each call: a product of a training step's size (4,096 x 256 by 256 x 1,024), in
    float32 as the model computes it (`linear`, with this CPU's choice of library) and in bfloat16 under
    autocast, best of 5 each (about 0.1 s); "clearly" is at most 0.8 of float32's time, since bfloat16 also
    rounds.

    Returns:
        True where the bfloat16 product takes at most 0.8 of the float32 product's time.
    """
    input, weight = torch.full((4096, 256), 0.5, device="cpu"), torch.full((1024, 256), 0.25, device="cpu")
    kernels = ProductKernels(onednn_min_product())

    def bfloat16_product() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.linear(input, weight)

    def float32_product() -> torch.Tensor:
        return linear(input, weight, None, kernels)

    with torch.no_grad():
        return _best_seconds(bfloat16_product, 5) <= 0.8 * _best_seconds(float32_product, 5)


# The choice, made once per model ----------------------------------------------------------------------


def choose_kernels(model: nn.Module, training: bool = False) -> None:
    """Set on every module of `model` the kernels measured fastest on this CPU (see the module's docstring).

    Every `ops_vaswani.Linear` gets `kernels`: the product size from which its float32 products take oneDNN
    (`onednn_min_product`) and, with `training`, whether its weight gradient does too (`onednn_weight_gradient`,
    for the pre-softmax projection as the fused loss of §5.4 accumulates it). With `training`, every module with a
    `float32_attention_dtypes` attribute (`MultiHeadAttention`) gets the autocast dtypes in which attention trains
    faster in float32 (`float32_attention_is_faster`). Each measurement runs once per process; a module whose
    choice is unchanged keeps the same object, so that `torch.compile` sees nothing new. Under TorchScript
    tracing, `torch.func` transforms or modes that watch the dispatcher (fake tensors) nothing is measured or set.

    Args:
        model: a model, or any module holding `Linear` layers.
        training: also choose the kernels only training runs (the first `train()` call).

    Raises:
        ValueError: `VASWANI_ONEDNN_MIN_PRODUCT` is set to something other than a number.
    """
    if not plain_dispatch():
        return
    min_product = onednn_min_product()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    float32_dtypes = None
    if training:
        float32_dtypes = frozenset(d for d in (torch.bfloat16, torch.float16) if float32_attention_is_faster(d))
    for module in model.modules():
        if isinstance(module, Linear):
            weight_gradient = module.kernels.onednn_weight_gradient
            if training:
                weight_gradient = min_product < math.inf and onednn_weight_gradient(
                    module.out_features, module.in_features, accumulate=module is head
                )
            chosen = ProductKernels(min_product, weight_gradient)
            if chosen != module.kernels:
                module.kernels = chosen
        if float32_dtypes is not None and hasattr(module, "float32_attention_dtypes"):
            if float32_dtypes != module.float32_attention_dtypes:
                module.float32_attention_dtypes = float32_dtypes
