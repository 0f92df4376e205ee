"""Low-level kernels of the Transformer: its linear maps, residual dropout and label-smoothed loss.

Each computes what its plain PyTorch counterpart computes (`F.linear`, `F.dropout`, the
projection followed by `F.cross_entropy(label_smoothing=...)`), to float rounding, with fewer
passes over memory on the CPU; each falls back to that counterpart where it would not help. How each works,
and why it is faster, is in the project's `docs/performance.md` under the section named in its
docstring. Only PyTorch is imported here: the module is copied into saved models for
`trust_remote_code` loading.
"""

import contextlib
import functools
import math
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Linear maps x W^T + b: every projection of §3.2.2, §3.3 and §3.4 ---------------------------------


def _onednn_linear_op() -> Callable | None:
    try:
        return torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None
    except (AttributeError, RuntimeError):  # a PyTorch built without oneDNN
        return None


# PyTorch computes float32 products on the CPU with MKL, which leaves the vector units of some processors partly
# idle (AVX-512 on AMD's); oneDNN, also inside PyTorch, uses them (docs/performance.md, "Products through oneDNN").
# PyTorch sends only bfloat16 and float16 products to oneDNN; this operator is the one `torch.compile` emits for
# linear layers on the CPU.
_ONEDNN_LINEAR = _onednn_linear_op()


# Products below this many multiply-adds take MKL without asking: there oneDNN's extra cost per call exceeds the
# whole product's time on every CPU measured, and the measurement below is not set off by small models.
_ONEDNN_FLOOR = 2**18
# The environment variable that pins the size from which products take oneDNN, instead of measuring it.
ONEDNN_MIN_PRODUCT_ENV = "VASWANI_ONEDNN_MIN_PRODUCT"
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
    if _ONEDNN_LINEAR is None:
        return math.inf
    try:
        with torch.no_grad():
            mkl_call, mkl_multiply_add = _product_cost(F.linear)
            onednn_call, onednn_multiply_add = _product_cost(_onednn_product)
    except RuntimeError:  # a oneDNN that cannot run on this CPU
        return math.inf
    if onednn_multiply_add >= mkl_multiply_add:
        return math.inf
    crossing = max(onednn_call - mkl_call, 0.0) / (mkl_multiply_add - onednn_multiply_add)
    return float(2 ** round(math.log2(max(crossing, _ONEDNN_FLOOR))))


def onednn_min_product() -> float:
    """The fewest multiply-adds from which oneDNN computes a float32 product faster than MKL on this CPU.

    For the projections of §3.2.2, §3.3 and §3.4 (`linear`). A oneDNN call costs more than an MKL one; how
    much faster its multiply-adds are than MKL's depends on the processor, from several times to not at all
    (docs/performance.md, "Products through oneDNN"). So the size from which oneDNN pays
    is measured, once per process, when the first product of at least 2^18 multiply-adds comes, with the
    threads PyTorch uses then: each library's time per call and per multiply-add, from one small and one
    large product (about 20 ms in all), give the size at which their times cross, rounded to a power of two
    so that the noise of one measurement seldom moves it. Where the two libraries are close, separate
    processes may still measure neighbouring powers, and products near them round differently: the
    environment variable `VASWANI_ONEDNN_MIN_PRODUCT` (a number of multiply-adds, or `inf` for never) pins
    the size instead, for runs that must agree to the bit (docs/robustness.md, "Determinism"); pinned, every
    weight gradient from that size goes to oneDNN too, where otherwise each shape's is timed against MKL's.

    Returns:
        Multiply-adds (rows x in_features x out_features): a power of two from 2^18 when measured, `math.inf`
        where oneDNN's multiply-adds are not faster than MKL's or PyTorch has no oneDNN.

    Raises:
        ValueError: `VASWANI_ONEDNN_MIN_PRODUCT` is set to something other than a number.
    """
    pinned = os.environ.get(ONEDNN_MIN_PRODUCT_ENV)
    if pinned is not None:
        try:
            return float(pinned)
        except ValueError:
            raise ValueError(
                f"{ONEDNN_MIN_PRODUCT_ENV}={pinned!r} is not a number of multiply-adds: give one, e.g. 8388608, "
                "or inf to keep every product on MKL, or unset it to measure."
            ) from None
    with _MEASUREMENT_LOCK:  # one measurement, even when the first products come from several threads at once
        return _measured_onednn_min_product()


def _plain_dispatch() -> bool:
    # Not under TorchScript tracing, `torch.func` transforms, or modes that watch the dispatcher (FLOP counters,
    # fake tensors): there a kernel chosen by a measurement would not be traced, transformed or counted as PyTorch's
    # own, and a measurement would time nothing real.
    return (
        not torch.jit.is_tracing()
        and not torch._C._are_functorch_transforms_active()
        and not torch._C._len_torch_dispatch_stack()
    )


def _uses_onednn(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    # Where oneDNN's operator has no rule, F.linear: TorchScript tracing, torch.func transforms, torch.compile (which
    # chooses its own kernels), autocast, and modes that watch the dispatcher (FLOP counters, fake tensors); and
    # where the user turned oneDNN off (`torch.backends.mkldnn.flags`). Compilation is asked first: a size compared
    # while tracing would become a guard, and a recompilation. Then the fixed floor, which spares most products of
    # a decoding step the rest; the measured size last, so that its measurement never runs inside a trace or mode.
    return (
        not torch.compiler.is_compiling()
        and input.numel() * weight.shape[0] >= _ONEDNN_FLOOR
        and _ONEDNN_LINEAR is not None
        and torch.backends.mkldnn.enabled
        and input.device.type == weight.device.type == "cpu"
        and input.dim() >= 2
        and input.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and not torch.is_autocast_enabled("cpu")
        and _plain_dispatch()
        and input.numel() * weight.shape[0] >= onednn_min_product()
    )


def _onednn_product(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x W^T + b by oneDNN, asking nothing: for callers that chose it already.
    return _ONEDNN_LINEAR(input, weight, bias, "none", [], "")


def _transposed_product(a: torch.Tensor, b: torch.Tensor, product: Callable) -> torch.Tensor:
    # a^T b of (rows, m) and (rows, n), a weight gradient, by oneDNN through `product` (`linear` or `_onednn_product`):
    # a^T (b^T)^T, or (b^T a)^T. oneDNN copies the transposed first operand into a contiguous one, so the narrower of
    # a and b takes that place.
    return product(b.t(), a.t()).t() if a.shape[1] > b.shape[1] else product(a.t(), b.t())


# Weight gradients are timed with at most this many rows, and operands of at most this many elements: beyond them
# the two libraries' times grow alike, and timing a large model's or vocabulary's products would take seconds.
_WEIGHT_GRADIENT_MAX_ROWS = 2**12
_WEIGHT_GRADIENT_MAX_ELEMENTS = 2**22


@functools.cache
def _measured_onednn_weight_gradient(rows: int, m: int, n: int, accumulate: bool) -> bool:
    a = torch.full((rows, m), 0.5, dtype=torch.float32, device="cpu")
    b = torch.full((rows, n), 0.25, dtype=torch.float32, device="cpu")
    total = torch.zeros(m, n, dtype=torch.float32, device="cpu")
    # `_onednn_product`, never `linear`: the caller holds _MEASUREMENT_LOCK, which `linear` may take again.
    if accumulate:  # as the fused loss sums its chunks: oneDNN's product, then an addition; MKL's product adds itself
        onednn = lambda: total.add_(_transposed_product(a, b, _onednn_product))  # noqa: E731
        mkl = functools.partial(total.addmm_, a.t(), b)
    else:
        onednn = functools.partial(_transposed_product, a, b, _onednn_product)
        mkl = functools.partial(torch.mm, a.t(), b)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        onednn_seconds, mkl_seconds = _best_seconds(onednn, 3), _best_seconds(mkl, 3)
    # Leaning to MKL, PyTorch's own library: where oneDNN would gain less than a tenth, the noise would decide.
    return onednn_seconds <= 0.9 * mkl_seconds


def _onednn_weight_gradient(rows: int, m: int, n: int, accumulate: bool = False) -> bool:
    # Whether oneDNN computes the weight gradient a^T b of (rows, m) and (rows, n) float32, a product that
    # `_uses_onednn` sends to it, faster than MKL on this CPU (added to a running sum where `accumulate`). MKL takes
    # the transposed operand as it is; oneDNN first copies one into a contiguous block, which for d_model x d_model
    # weights can cost more than its faster multiply-adds save (docs/performance.md, "Products through oneDNN").
    # So each shape is timed both ways once per process, the first time it comes, its rows rounded to a power of
    # two and capped. Where `VASWANI_ONEDNN_MIN_PRODUCT` pins the size from which products take oneDNN, nothing is
    # timed and oneDNN computes them all, so that runs agree to the bit.
    if os.environ.get(ONEDNN_MIN_PRODUCT_ENV) is not None:
        return True
    cap = min(_WEIGHT_GRADIENT_MAX_ROWS, 2 ** int(math.log2(max(1, _WEIGHT_GRADIENT_MAX_ELEMENTS // max(m, n)))))
    rows = min(2 ** round(math.log2(max(rows, 1))), cap)
    with _MEASUREMENT_LOCK:
        return _measured_onednn_weight_gradient(rows, m, n, accumulate)


def _weight_gradient(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    # dL/dW = (dL/dy)^T x, of (rows, out_features) and (rows, in_features), by the library faster for its shape;
    # through `linear`, so that it can be differentiated in turn.
    rows, m, n = len(input), grad_output.shape[1], input.shape[1]
    if _uses_onednn(input.t(), grad_output.t()) and _onednn_weight_gradient(rows, m, n):
        return _transposed_product(grad_output, input, linear)
    return grad_output.t() @ input


class OneDNNLinear(torch.autograd.Function):
    """x W^T + b (§3.2.2, §3.3, §3.4) and its gradients, the products computed by oneDNN: see `linear`.

    `apply(input, weight, bias)` takes `(*, in_features)` float32 CPU input, an `(out_features,
    in_features)` weight and an `(out_features,)` bias or None, and returns `(*, out_features)`.
    The gradients are linear maps again, computed by `linear`, so they can be differentiated in turn;
    the weight's by MKL instead where that is faster for its shape (`_onednn_weight_gradient`).
    Raises RuntimeError (from oneDNN) if the shapes do not fit.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        return _onednn_product(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:  # dL/dx = dL/dy W: a linear map whose weight is W^T
            grad_input = linear(grad_output, weight.t())
        if ctx.needs_input_grad[1]:
            grad_weight = _weight_gradient(grad_output.flatten(0, -2), input.flatten(0, -2))
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.flatten(0, -2).sum(0)
        return grad_input, grad_weight, grad_bias


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b, as `torch.nn.functional.linear`, through oneDNN for float32 products on the CPU.

    Every projection of the model is one: W^Q, W^K, W^V and W^O (§3.2.2), W_1 and W_2 (§3.3, Eq. 2)
    and the pre-softmax projection (§3.4). The same function and gradients as `F.linear` to float32
    rounding, but its products run faster where MKL, PyTorch's usual library for them, leaves the
    CPU's vector units partly idle (docs/performance.md, "Products through oneDNN"). Products
    smaller than `onednn_min_product()` (measured on this CPU), other dtypes and devices, autocast,
    `torch.compile`, TorchScript tracing, `torch.func` transforms, and
    `torch.backends.mkldnn.flags(enabled=False)` take `F.linear`.

    Args:
        input: `(*, in_features)`.
        weight: `(out_features, in_features)`.
        bias: `(out_features,)`, or None.

    Returns:
        `(*, out_features)`.

    Raises:
        RuntimeError: the shapes do not fit (from the product).
    """
    if not _uses_onednn(input, weight, bias):
        return F.linear(input, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias)):
        return OneDNNLinear.apply(input, weight, bias)
    return _onednn_product(input, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` computed by `linear` (§3.2.2, §3.3, §3.4): the same parameters, initialisation and state dict.

    Maps `(*, in_features)` to `(*, out_features)`; raises RuntimeError if the input's last dimension is not
    `in_features`.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)


# §3.2.1 Attention: which kernel, and in which precision ---------------------------------------------


def eager_attention_is_faster(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, *, decoding: bool = False
) -> bool:
    """Whether Eq. 1 spelled out (§3.2.1) is faster here than PyTorch's fused attention kernel.

    On the CPU the fused kernel has a fixed cost per call above Eq. 1 spelled out for a few queries
    (docs/performance.md, "Attention for few queries"): one query per sentence at every decoding
    step, a sentence's num_beams queries in beam search, short sentences at translation time. In
    training the two take as long. On CUDA it is faster in the decoding steps (§6.1) of float16 and
    bfloat16 while cuDNN's attention is enabled: PyTorch may take that kernel, which builds a plan
    for every new shape, and as the keys grow by one position a step and finished sentences leave
    the batch, nearly every step would wait for a plan (docs/gpu.md, "Decoding"). Where the SDPA
    mask builder left a causal mask to the kernel's `is_causal` (mask None), the eager path would
    not mask, so that case stays with the kernel.

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


@functools.cache
def _measured_float32_attention_is_faster(dtype: torch.dtype) -> bool:
    # PyTorch's fused attention for the CPU, forward and backward at a training size, in each dtype (best of 5).
    # Identity hooks on saved tensors: inside a forward pass under gradient checkpointing, the checkpoint's own
    # hooks would otherwise take these tensors, and this backward pass would recompute the layer, and so call
    # this measurement again.
    def seconds(operand_dtype: torch.dtype) -> float:
        operands = [torch.full((16, 4, 32, 32), 0.5, dtype=operand_dtype, requires_grad=True) for _ in range(3)]
        return _best_seconds(lambda: F.scaled_dot_product_attention(*operands, is_causal=True).sum().backward(), 5)

    identity = lambda tensor: tensor  # noqa: E731
    with (
        torch.inference_mode(False),  # under a caller's inference mode, no tensor could require gradients
        torch.enable_grad(),
        torch.autocast("cpu", enabled=False),
        torch.autograd.graph.saved_tensors_hooks(identity, identity),
    ):
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
    with _MEASUREMENT_LOCK:  # one measurement, even when the first steps come from several threads at once
        return _measured_float32_attention_is_faster(dtype)


def attention_in_float32(query: torch.Tensor) -> bool:
    """Whether attention (§3.2.1, Eq. 1) on `query` should run in float32 rather than under CPU autocast.

    True under CPU autocast where `float32_attention_is_faster` for autocast's dtype: with or
    without gradients alike, so that a checkpointed layer's recomputation computes what its first
    pass did. Not while compiling (Inductor chooses its own kernels) or tracing, nor under `torch.func`
    transforms or modes that watch the dispatcher, whose timings would mean nothing.

    Args:
        query: `(batch, heads, queries, d_k)`, for its device.

    Returns:
        True where `MultiHeadAttention` should give the kernel float32 operands with autocast off.
    """
    return (
        not torch.compiler.is_compiling()
        and query.device.type == "cpu"
        and torch.is_autocast_enabled("cpu")
        and _plain_dispatch()
        and float32_attention_is_faster(torch.get_autocast_dtype("cpu"))
    )


def bfloat16_products_are_faster() -> bool:
    """Whether this CPU computes the products of training (§3.2.2, §3.3, §3.4) clearly faster in bfloat16.

    A CPU with bfloat16 instructions (AVX512_BF16, AMX) computes them about twice as fast as float32;
    one without converts the operands and is slower (docs/performance.md, "Mixed precision on CPUs").
    Measured on each call: a product of a training step's size (4,096 x 256 by 256 x 1,024), in
    float32 as the model computes it (`linear`) and in bfloat16 under autocast, best of 5 each (about
    0.1 s); "clearly" is at most 0.8 of float32's time, since bfloat16 also rounds.

    Returns:
        True where the bfloat16 product takes at most 0.8 of the float32 product's time.
    """
    input, weight = torch.full((4096, 256), 0.5), torch.full((1024, 256), 0.25)

    def bfloat16_product() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.linear(input, weight)

    with torch.no_grad():
        return _best_seconds(bfloat16_product, 5) <= 0.8 * _best_seconds(lambda: linear(input, weight), 5)


# §5.4 Residual dropout ----------------------------------------------------------------------------


def residual_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Zero each element with probability p and scale the others by 1 / (1 - p) (§5.4, "Residual Dropout").

    `F.dropout`, except in training on the CPU outside `torch.compile`. There PyTorch draws each element's
    Bernoulli variable with a call of its own into the generator, a noticeable share of a training step
    (docs/performance.md, "Residual dropout"); here each element takes 16 bits of 64-bit random draws instead, a
    quarter of a call, and is dropped when they fall among the lowest round(p * 2^16) of the 2^16 values. The
    rate is thus p to within 2^-17, and the kept elements are scaled by the inverse of the exact rate kept, so
    that every element keeps its expected value.

    Args:
        x: any shape.
        p: dropout probability, in [0, 1].
        training: drop only when True (the module's `training`).

    Returns:
        A tensor of the shape and dtype of `x`.

    Raises:
        ValueError: p is outside [0, 1] (from `F.dropout`).
    """
    if not training and 0.0 <= p <= 1.0:  # what F.dropout returns in evaluation, without a call for each sublayer
        return x
    dropped = round(p * 2**16)
    # torch.compile cannot trace the in-place draw, and generates its own dropout kernel.
    if not training or x.device.type != "cpu" or not 0 < dropped < 2**16 or torch.compiler.is_compiling():
        return F.dropout(x, p=p, training=training)
    # `random_(-2^63, None)` draws all 64 bits; `random_()` leaves the sign bit 0, which the top 16-bit lane needs.
    draws = torch.empty(-(-x.numel() // 4), dtype=torch.int64, device=x.device).random_(-(2**63), None)
    keep = draws.view(torch.int16)[: x.numel()].view(x.shape) >= dropped - 2**15
    return x * keep * (2**16 / (2**16 - dropped))


# §5.4 The label-smoothed loss, and its fusion with the pre-softmax projection (§3.4) --------------


def label_smoothed_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, epsilon: float, num_items_in_batch: int | torch.Tensor | None = None
) -> torch.Tensor:
    """Cross entropy against the smoothed targets (1 - epsilon) * one_hot(y) + epsilon / vocab_size (§5.4).

    This is the label smoothing of Szegedy et al. (2016) that the paper cites, computed in at least
    float32 by `torch.nn.functional.cross_entropy(label_smoothing=epsilon)`. Training computes the
    same loss without the logits: `linear_label_smoothed_cross_entropy`.

    Args:
        logits: `(batch, target_len, vocab_size)`.
        labels: `(batch, target_len)` target ids; -100 marks positions to ignore (padding).
        epsilon: epsilon_ls in [0, 1).
        num_items_in_batch: divide the summed loss by this number of target tokens (for gradient
            accumulation and data parallelism, where the tokens of the whole update count); by
            default the mean over this batch's non-ignored tokens.

    Returns:
        The scalar loss, in nats per target token.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # a softmax over tens of thousands of classes needs float32's range
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=epsilon, reduction="sum")
    return loss / (labels.ne(-100).sum() if num_items_in_batch is None else num_items_in_batch)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    # Autocast's dtype where it is on for this kind of device; None where it is off, or knows no such device (meta).
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None


class LinearLabelSmoothedCrossEntropy(torch.autograd.Function):
    """The summed label-smoothed cross entropy (§5.4) of logits = hidden W^T + b (§3.4), and its gradients, by chunks.

    With log-probabilities log p = logits - logsumexp(logits), the loss of one position is
    logsumexp - (1 - epsilon) * logit_y - epsilon * mean(logits), and its gradient with respect to
    the logits is p - epsilon / V - (1 - epsilon) * one_hot(y). Both are computed in the forward
    pass, a chunk of positions at a time, and the chunk's logits gradient is turned at once into
    the gradients of the hidden states, W and b, so that the (positions x V) logits never exist
    whole: for a batch of 25,000 target tokens on one device and a 37,000-token vocabulary (the
    paper's sizes) they would take 3.7 GB in float32, and their gradient as much again. Ignored
    positions (padding) add nothing to the loss and get zero gradients. With `drop_ignored` their logits
    are never computed; without, they are computed and weighted 0, which spares the host the number of
    positions kept: a synchronisation that on an accelerator would stall the queue of kernels.

    `apply(hidden, weight, bias, labels, epsilon, drop_ignored)` takes `(positions, d_model)` hidden
    states, the `(V, d_model)` weight, a `(V,)` bias or None, `(positions,)` labels (-100 ignored),
    epsilon and a bool, and returns the summed loss in nats, a scalar in at least float32. Its
    gradients are constants of the forward pass: differentiating them again raises RuntimeError
    (`once_differentiable`). Under bfloat16 autocast its products take bfloat16 operands, as the
    projection alone would under autocast, while the softmax and the gradients stay in float32.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        epsilon: float,
        drop_ignored: bool,
    ) -> torch.Tensor:
        ctx.dtypes = hidden.dtype, weight.dtype, bias.dtype if bias is not None else None
        device = hidden.device.type
        autocast_dtype = _autocast_dtype(device)
        if autocast_dtype == torch.bfloat16:
            # The projection in bfloat16, as the projection alone would run under autocast; the softmax and the
            # gradients, accumulated over the chunks, stay in float32.
            hidden, weight, bias = (
                t.bfloat16() if t is not None and t.dtype == torch.float32 else t for t in (hidden, weight, bias)
            )
        # Autocast off inside: the operands' dtypes decide every product (under float16 autocast, products of
        # unscaled gradients would underflow).
        with torch.autocast(device, enabled=False) if autocast_dtype is not None else contextlib.nullcontext():
            vocab_size = weight.shape[0]
            # On the CPU, chunks of about 8 MiB of float32 logits; on accelerators, large chunks keep the kernel
            # launches few. At least 256 positions a chunk keep the matrix products efficient.
            budget = 2**21 if hidden.device.type == "cpu" else 2**27
            chunk = max(256, budget // vocab_size)
            dtype = torch.promote_types(weight.dtype, torch.float32)  # a softmax over the vocabulary needs float32
            keep = labels.ne(-100)
            computed_hidden = hidden[keep] if drop_ignored else hidden
            computed_labels = (labels[keep] if drop_ignored else labels.masked_fill(~keep, 0))[:, None]
            weights = None if drop_ignored else keep[:, None].to(dtype)
            loss = torch.zeros((), dtype=dtype, device=hidden.device)
            grad_computed = torch.empty_like(computed_hidden, dtype=dtype)
            mixed = (
                hidden.dtype != dtype or weight.dtype != dtype
            )  # mixed precision: products in the hidden states' dtype
            # One library for every chunk, chosen for the whole batch, and one for the weight gradient's products: the
            # last, shorter chunk rounds as the others.
            onednn = _uses_onednn(computed_hidden, weight, bias)
            onednn_weight_gradients = onednn and _onednn_weight_gradient(
                min(chunk, len(computed_hidden)), vocab_size, computed_hidden.shape[1], accumulate=True
            )
            # Without oneDNN every chunk's logits go to one reused buffer: MKL's product into a fresh block pays for
            # faulting its pages in anew (docs/performance.md, "Fused projection and loss"); oneDNN's does not.
            logits_buffer = (
                None if onednn else hidden.new_empty(min(chunk, len(computed_hidden)), vocab_size, dtype=dtype)
            )
            grad_weight = torch.zeros_like(weight, dtype=dtype)
            grad_bias = torch.zeros(vocab_size, dtype=dtype, device=hidden.device) if bias is not None else None
            for start in range(0, computed_hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                if onednn:
                    logits = _onednn_product(computed_hidden[rows], weight, bias)
                else:
                    logits = logits_buffer[: len(computed_hidden[rows])]
                    if mixed:
                        logits.copy_(F.linear(computed_hidden[rows], weight, bias))
                    elif bias is not None:
                        torch.addmm(bias, computed_hidden[rows], weight.t(), out=logits)
                    else:
                        torch.mm(computed_hidden[rows], weight.t(), out=logits)
                target_logit = logits.gather(-1, computed_labels[rows]).squeeze(-1)
                mean_logit = logits.mean(dim=-1)
                # logsumexp and the softmax from one pass of exp, in place: the logits are spent.
                max_logit = logits.amax(dim=-1, keepdim=True)
                probabilities = logits.sub_(max_logit).exp_()
                normaliser = probabilities.sum(dim=-1, keepdim=True)
                log_z = (max_logit + normaliser.log()).squeeze(-1)
                losses = log_z - (1.0 - epsilon) * target_logit - epsilon * mean_logit
                grad = probabilities.div_(normaliser).sub_(epsilon / vocab_size)
                grad.scatter_add_(-1, computed_labels[rows], grad.new_full((grad.shape[0], 1), epsilon - 1.0))
                if weights is not None:
                    losses = losses * weights[rows, 0]
                    grad.mul_(weights[rows])
                loss += losses.sum()
                # G W, a linear map whose weight is W^T
                grad_computed[rows] = (_onednn_product if onednn else F.linear)(grad.to(weight.dtype), weight.t())
                if onednn_weight_gradients:  # added separately: oneDNN's product cannot accumulate
                    grad_weight += _transposed_product(grad, computed_hidden[rows], _onednn_product)
                elif mixed:  # the product in the hidden states' dtype, accumulated in float32
                    grad_weight += grad.t().to(hidden.dtype) @ computed_hidden[rows]
                else:
                    # Accumulated by MKL's product itself: a separate addition would pass over all of W's gradient
                    # again (docs/performance.md, "Fused projection and loss").
                    grad_weight.addmm_(grad.t(), computed_hidden[rows])
                if grad_bias is not None:
                    grad_bias += grad.sum(dim=0)
            grad_hidden = grad_computed
            if drop_ignored:  # back to every position, zero where ignored
                grad_hidden = torch.zeros_like(hidden, dtype=dtype).index_put_((keep,), grad_computed)
            ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
            return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Scaled in float32 first, then cast: a loss scale (float16 training) acts before any rounding.
        grads = [g * grad_output if g is not None else None for g in ctx.saved_tensors]
        grads = [g.to(dtype) if g is not None else None for g, dtype in zip(grads, ctx.dtypes, strict=True)]
        return *grads, None, None, None


def linear_label_smoothed_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    epsilon: float,
    bias: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """The label-smoothed cross entropy (§5.4) of the logits hidden W^T + b (§3.4), without materialising them.

    The same value and gradients as the pre-softmax projection followed by
    `label_smoothed_cross_entropy`, in float32 logits (from bfloat16 products under bfloat16 autocast;
    `LinearLabelSmoothedCrossEntropy`),
    with memory for a chunk of the (positions x vocab_size) logits instead of all of them and their gradient
    (docs/performance.md, "Fused projection and loss").

    Args:
        hidden: `(batch, target_len, d_model)` decoder output.
        weight: `(vocab_size, d_model)` pre-softmax projection (tied to the embeddings).
        labels: `(batch, target_len)` target ids; -100 marks positions to ignore (padding).
        epsilon: epsilon_ls in [0, 1).
        bias: `(vocab_size,)` or `(1, vocab_size)` fixed logit bias (imported Marian models), or None.
        num_items_in_batch: as in `label_smoothed_cross_entropy`.

    Returns:
        The scalar loss, in nats per target token.

    Raises:
        RuntimeError: the shapes of `hidden` and `weight` do not fit (from the matrix product).
    """
    bias = bias.flatten() if bias is not None else None
    # Ignored positions are left out on the CPU only: elsewhere it would cost a host synchronisation per step.
    drop_ignored = hidden.device.type == "cpu"
    loss = LinearLabelSmoothedCrossEntropy.apply(
        hidden.flatten(0, 1), weight, bias, labels.flatten(), epsilon, drop_ignored
    )
    return loss / (labels.ne(-100).sum() if num_items_in_batch is None else num_items_in_batch)
