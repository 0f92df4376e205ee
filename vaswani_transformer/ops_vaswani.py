"""Low-level kernels of the Transformer: its linear maps, residual dropout and label-smoothed loss.

Each computes what its plain PyTorch counterpart computes (`F.linear`, `F.dropout`, the
projection followed by `F.cross_entropy(label_smoothing=...)`), to float rounding, with fewer
passes over memory on the CPU; each falls back to that counterpart where it would not help. How each works,
and why it is faster, is in the project's `docs/performance.md` under the section named in its
docstring. Only PyTorch is imported here: the module is copied into saved models for
`trust_remote_code` loading.
"""

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

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
ONEDNN_LINEAR = _onednn_linear_op()


# Products below this many multiply-adds take MKL without asking: there oneDNN's extra cost per call exceeds the
# whole product's time on every CPU measured.
ONEDNN_FLOOR = 2**18


@dataclass(frozen=True)
class ProductKernels:
    """Which library computes a linear map's float32 products on the CPU: MKL (PyTorch's own) or oneDNN.

    Chosen for each `Linear` of a model by `kernels_vaswani.choose_kernels`, by measuring, once; the
    kernels here only read it. The default, `MKL_ONLY`, is PyTorch's own behaviour.

    Attributes:
        onednn_min_product: multiply-adds (rows x in_features x out_features) from which a product takes
            oneDNN; `math.inf` for never.
        onednn_weight_gradient: whether the weight gradient of a product that took oneDNN takes it too.
    """

    onednn_min_product: float = math.inf
    onednn_weight_gradient: bool = False


MKL_ONLY = ProductKernels()


def plain_dispatch() -> bool:
    """Whether PyTorch runs operators as they are: no TorchScript tracing, `torch.func` transform or watching mode.

    Under those (FLOP counters and fake tensors watch the dispatcher) a kernel chosen by a measurement would not
    be traced, transformed or counted as PyTorch's own, and a measurement would time nothing real.
    """
    return (
        not torch.jit.is_tracing()
        and not torch._C._are_functorch_transforms_active()
        and not torch._C._len_torch_dispatch_stack()
    )


def _uses_onednn(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: ProductKernels) -> bool:
    # Where oneDNN's operator has no rule, F.linear: TorchScript tracing, torch.func transforms, torch.compile (which
    # chooses its own kernels), autocast, and modes that watch the dispatcher (FLOP counters, fake tensors); and
    # where the user turned oneDNN off (`torch.backends.mkldnn.flags`). Compilation is asked first: a size compared
    # while tracing would become a guard, and a recompilation.
    return (
        not torch.compiler.is_compiling()
        and input.numel() * weight.shape[0] >= max(ONEDNN_FLOOR, kernels.onednn_min_product)
        and ONEDNN_LINEAR is not None
        and torch.backends.mkldnn.enabled
        and input.device.type == weight.device.type == "cpu"
        and input.dim() >= 2
        and input.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and not torch.is_autocast_enabled("cpu")
        and plain_dispatch()
    )


def onednn_product(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b by oneDNN, asking nothing, for callers that chose it: `(*, in)` by `(out, in)` gives `(*, out)`.

    Raises:
        RuntimeError: the shapes do not fit, or the CPU cannot run oneDNN's kernel (from oneDNN).
    """
    return ONEDNN_LINEAR(input, weight, bias, "none", [], "")


def transposed_product(a: torch.Tensor, b: torch.Tensor, product: Callable) -> torch.Tensor:
    """a^T b of `(rows, m)` and `(rows, n)`, a weight gradient `(m, n)`, through `product`: (x, W) -> x W^T.

    Computed as a^T (b^T)^T, or (b^T a)^T: oneDNN copies the transposed first operand into a contiguous one, so the
    narrower of a and b takes that place.
    """
    return product(b.t(), a.t()).t() if a.shape[1] > b.shape[1] else product(a.t(), b.t())


def _weight_gradient(grad_output: torch.Tensor, input: torch.Tensor, kernels: ProductKernels) -> torch.Tensor:
    # dL/dW = (dL/dy)^T x, of (rows, out_features) and (rows, in_features), by the library chosen for its shape;
    # through `linear`, so that it can be differentiated in turn.
    if kernels.onednn_weight_gradient and _uses_onednn(input.t(), grad_output.t(), None, kernels):
        return transposed_product(grad_output, input, lambda x, w: linear(x, w, None, kernels))
    return grad_output.t() @ input


class OneDNNLinear(torch.autograd.Function):
    """x W^T + b (§3.2.2, §3.3, §3.4) and its gradients, the products computed by oneDNN: see `linear`.

    `apply(input, weight, bias, kernels)` takes `(*, in_features)` float32 CPU input, an `(out_features,
    in_features)` weight, an `(out_features,)` bias or None and the layer's `ProductKernels`, and returns
    `(*, out_features)`. The gradients are linear maps again, computed by `linear`, so they can be
    differentiated in turn; the weight's by MKL unless `kernels.onednn_weight_gradient`.
    Raises RuntimeError (from oneDNN) if the shapes do not fit.
    """

    @staticmethod
    def forward(
        ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: ProductKernels
    ) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.kernels = kernels
        return onednn_product(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:  # dL/dx = dL/dy W: a linear map whose weight is W^T
            grad_input = linear(grad_output, weight.t(), None, ctx.kernels)
        if ctx.needs_input_grad[1]:
            grad_weight = _weight_gradient(grad_output.flatten(0, -2), input.flatten(0, -2), ctx.kernels)
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.flatten(0, -2).sum(0)
        return grad_input, grad_weight, grad_bias, None


def linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, kernels: ProductKernels = MKL_ONLY
) -> torch.Tensor:
    """y = x W^T + b, as `torch.nn.functional.linear`, through oneDNN for float32 products on the CPU.

    Every projection of the model is one: W^Q, W^K, W^V and W^O (§3.2.2), W_1 and W_2 (§3.3, Eq. 2)
    and the pre-softmax projection (§3.4). The same function and gradients as `F.linear` to float32
    rounding, but its products run faster where MKL, PyTorch's usual library for them, leaves the
    CPU's vector units partly idle (docs/performance.md, "Products through oneDNN"). Products
    smaller than `kernels.onednn_min_product`, other dtypes and devices, autocast,
    `torch.compile`, TorchScript tracing, `torch.func` transforms, and
    `torch.backends.mkldnn.flags(enabled=False)` take `F.linear`.

    Args:
        input: `(*, in_features)`.
        weight: `(out_features, in_features)`.
        bias: `(out_features,)`, or None.
        kernels: the libraries chosen for this map (`kernels_vaswani.choose_kernels`); by default MKL alone.

    Returns:
        `(*, out_features)`.

    Raises:
        RuntimeError: the shapes do not fit (from the product).
    """
    if not _uses_onednn(input, weight, bias, kernels):
        return F.linear(input, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias)):
        return OneDNNLinear.apply(input, weight, bias, kernels)
    return onednn_product(input, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` computed by `linear` (§3.2.2, §3.3, §3.4): the same parameters, initialisation and state dict.

    Maps `(*, in_features)` to `(*, out_features)`; raises RuntimeError if the input's last dimension is not
    `in_features`. `kernels` holds the libraries `kernels_vaswani.choose_kernels` chose for its products.
    """

    kernels: ProductKernels = MKL_ONLY

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias, self.kernels)


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

    `apply(hidden, weight, bias, labels, epsilon, drop_ignored, kernels)` takes `(positions, d_model)` hidden
    states, the `(V, d_model)` weight, a `(V,)` bias or None, `(positions,)` labels (-100 ignored),
    epsilon, a bool and the projection's `ProductKernels`, and returns the summed loss in nats, a scalar in at
    least float32. Its gradients are constants of the forward pass: differentiating them again raises
    RuntimeError (`once_differentiable`). Under bfloat16 autocast its products take bfloat16 operands, as the
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
        kernels: ProductKernels,
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
            onednn = _uses_onednn(computed_hidden, weight, bias, kernels)
            onednn_weight_gradients = onednn and kernels.onednn_weight_gradient
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
                    logits = onednn_product(computed_hidden[rows], weight, bias)
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
                grad_computed[rows] = (onednn_product if onednn else F.linear)(grad.to(weight.dtype), weight.t())
                if onednn_weight_gradients:  # added separately: oneDNN's product cannot accumulate
                    grad_weight += transposed_product(grad, computed_hidden[rows], onednn_product)
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
        return *grads, None, None, None, None


def linear_label_smoothed_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    epsilon: float,
    bias: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    kernels: ProductKernels = MKL_ONLY,
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
        kernels: the projection's libraries (its `Linear.kernels`); by default MKL alone.

    Returns:
        The scalar loss, in nats per target token.

    Raises:
        RuntimeError: the shapes of `hidden` and `weight` do not fit (from the matrix product).
    """
    bias = bias.flatten() if bias is not None else None
    # Ignored positions are left out on the CPU only: elsewhere it would cost a host synchronisation per step.
    drop_ignored = hidden.device.type == "cpu"
    loss = LinearLabelSmoothedCrossEntropy.apply(
        hidden.flatten(0, 1), weight, bias, labels.flatten(), epsilon, drop_ignored, kernels
    )
    return loss / (labels.ne(-100).sum() if num_items_in_batch is None else num_items_in_batch)
