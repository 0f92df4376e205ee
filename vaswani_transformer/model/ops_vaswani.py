"""Low-level kernels of the Transformer's training: residual dropout and the label-smoothed loss (§5.4).

Each computes what its plain PyTorch counterpart computes (`F.dropout`, the projection followed by
`F.cross_entropy(label_smoothing=...)`), to float rounding, with fewer passes over memory on the CPU; each falls
back to that counterpart where it would not help. How each works, and why it is faster, is in the project's
`docs/performance.md` under the section named in its docstring. Only PyTorch's public API is used here: the module
is copied into saved models for `trust_remote_code` loading.
"""

import contextlib

import torch
import torch.nn.functional as F

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
    epsilon and a bool, and returns the summed loss in nats, a scalar in at
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
            loss, *gradients = _chunked_loss_and_gradients(hidden, weight, bias, labels, epsilon, drop_ignored)
            ctx.save_for_backward(*gradients)
            return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Scaled in float32 first, then cast: a loss scale (float16 training) acts before any rounding.
        grads = [g * grad_output if g is not None else None for g in ctx.saved_tensors]
        grads = [g.to(dtype) if g is not None else None for g, dtype in zip(grads, ctx.dtypes, strict=True)]
        return *grads, None, None, None


def _chunked_loss_and_gradients(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    epsilon: float,
    drop_ignored: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    # `LinearLabelSmoothedCrossEntropy.forward`'s work, a chunk of positions at a time: the summed loss and the
    # gradients of the hidden states, W and b (None without a bias), in at least float32.
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
    mixed = hidden.dtype != dtype or weight.dtype != dtype  # mixed precision: products in the hidden states' dtype
    # Every chunk's logits go to one reused buffer: a product into a fresh block pays for faulting its pages in
    # anew (docs/performance.md, "Fused projection and loss").
    logits_buffer = hidden.new_empty(min(chunk, len(computed_hidden)), vocab_size, dtype=dtype)
    grad_weight = torch.zeros_like(weight, dtype=dtype)
    grad_bias = torch.zeros(vocab_size, dtype=dtype, device=hidden.device) if bias is not None else None
    for start in range(0, computed_hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        logits = logits_buffer[: len(computed_hidden[rows])]
        if mixed:
            logits.copy_(F.linear(computed_hidden[rows], weight, bias))
        elif bias is not None:
            torch.addmm(bias, computed_hidden[rows], weight.t(), out=logits)
        else:
            torch.mm(computed_hidden[rows], weight.t(), out=logits)
        losses, grad = _smoothed_loss_and_logits_gradient(logits, computed_labels[rows], epsilon)
        if weights is not None:
            losses = losses * weights[rows, 0]
            grad.mul_(weights[rows])
        loss += losses.sum()
        # G W, a linear map whose weight is W^T
        grad_computed[rows] = F.linear(grad.to(weight.dtype), weight.t())
        if mixed:  # the product in the hidden states' dtype, accumulated in float32
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
    return loss, grad_hidden, grad_weight, grad_bias


def _smoothed_loss_and_logits_gradient(
    logits: torch.Tensor, labels: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # One chunk's losses, logsumexp - (1 - epsilon) * logit_y - epsilon * mean(logits), `(rows,)`, and their
    # gradient with respect to the logits, p - epsilon / V - (1 - epsilon) * one_hot(y), `(rows, V)`, computed in
    # the logits' own storage. `labels` is `(rows, 1)`.
    vocab_size = logits.shape[-1]
    target_logit = logits.gather(-1, labels).squeeze(-1)
    mean_logit = logits.mean(dim=-1)
    # logsumexp and the softmax from one pass of exp, in place: the logits are spent.
    max_logit = logits.amax(dim=-1, keepdim=True)
    probabilities = logits.sub_(max_logit).exp_()
    normaliser = probabilities.sum(dim=-1, keepdim=True)
    log_z = (max_logit + normaliser.log()).squeeze(-1)
    losses = log_z - (1.0 - epsilon) * target_logit - epsilon * mean_logit
    grad = probabilities.div_(normaliser).sub_(epsilon / vocab_size)
    grad.scatter_add_(-1, labels, grad.new_full((grad.shape[0], 1), epsilon - 1.0))
    return losses, grad


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
