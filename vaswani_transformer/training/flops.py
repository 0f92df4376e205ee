"""Model FLOPs of a training step and the model-FLOPs utilisation (MFU) that `train` logs.

MFU is the arithmetic the model needs, over what the device could have done in the same time at its
peak rate (Chowdhery et al., 2022, "PaLM", Appendix B): recomputation, padding and optimizer work
are not counted, so it says how well the device is used, not how busy it is.

How the model's arithmetic is counted, per sentence pair of S source and T target tokens (padding
excluded), with d = d_model, N_e and N_d layers and V the vocabulary, one multiply-add being 2 FLOPs:

- encoder layer (§3.1): Q, K, V and output projections 4 d^2 and the feed-forward network (§3.3)
  2 d d_ff per source token; attention (§3.2.1, Eq. 1), Q K^T and the weighted sum of V, 2 S^2 d;
- decoder layer: 4 d^2 + 2 d d_ff per target token for self-attention and feed-forward, 2 d^2 per
  target token (Q and output) and 2 d^2 per source token (K and V) for encoder-decoder attention;
  attention 2 T^2 d (masked self-attention counted whole, as PaLM counts it) and 2 T S d;
- the pre-softmax projection (§3.4): d V per target token; embedding look-ups cost nothing.

A training step is 3 forward passes' worth: the backward pass computes two products for each one of
the forward pass (gradients of the inputs and of the weights). d_k and d_v other than d_model / h
(Table 3, rows A and B) are counted with their widths.
"""

import torch

from ..model.configuration_vaswani import VaswaniConfig

# Dense peak throughput, in FLOP/s, of the matrix units for 16-bit floating point (bfloat16 and float16),
# from the makers' datasheets (without sparsity), looked up by the name CUDA reports. float32 has no entry:
# whether its products run on the matrix units (TF32) depends on settings, so its peak is not one number.
PEAK_16_BIT_FLOPS = {
    "H200 NVL": 835.0e12,  # before "H200": the first name found in CUDA's counts
    "H200": 989.4e12,
    "H100 NVL": 835.0e12,
    "H100 PCIe": 756.0e12,
    "H100": 989.4e12,  # SXM5 ("NVIDIA H100 80GB HBM3")
    "A100": 312.0e12,
}


def forward_flops(config: VaswaniConfig, source_lengths: torch.Tensor, target_lengths: torch.Tensor) -> float:
    """FLOPs of one forward pass over a batch of sentence pairs (§3), counted as the module's docstring says.

    Args:
        config: the model's sizes (d_model, d_ff, layers, heads, d_k, d_v, vocab_size).
        source_lengths: `(sentences,)` source tokens of each pair, padding excluded.
        target_lengths: `(sentences,)` target tokens of each pair, padding excluded.

    Returns:
        The number of floating-point operations (2 per multiply-add).
    """
    d, d_ff = config.d_model, config.d_ff
    heads, d_k, d_v = config.num_attention_heads, config.key_dim, config.value_dim
    source, target = source_lengths.double(), target_lengths.double()
    s, t = float(source.sum()), float(target.sum())
    s2, t2, st = float((source * source).sum()), float((target * target).sum()), float((source * target).sum())
    projections = heads * (2 * d_k + d_v) * d + heads * d_v * d  # Q, K, V and output, per token
    feed_forward = 2 * d * d_ff
    encoder = config.encoder_layers * (s * (projections + feed_forward) + s2 * heads * (d_k + d_v))
    cross = t * heads * (d_k + d_v) * d + s * heads * (d_k + d_v) * d  # Q and output; K and V
    decoder = config.decoder_layers * (
        t * (projections + feed_forward) + cross + t2 * heads * (d_k + d_v) + st * heads * (d_k + d_v)
    )
    output = t * d * config.vocab_size
    return 2.0 * (encoder + decoder + output)


def training_flops(config: VaswaniConfig, attention_mask: torch.Tensor, labels: torch.Tensor) -> float:
    """FLOPs of forward and backward over one training batch: 3 x `forward_flops` of its real tokens.

    See docs/gpu.md, "Training at the paper's batch".

    Args:
        config: the model's sizes.
        attention_mask: `(sentences, source_len)`, 1 on source tokens, 0 on padding.
        labels: `(sentences, target_len)` target ids, -100 on padding.

    Returns:
        The number of floating-point operations.
    """
    return 3.0 * forward_flops(config, attention_mask.sum(-1), labels.ne(-100).sum(-1))


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak FLOP/s for products in `dtype`; None when it is not known.

    Known: the 16-bit (bfloat16, float16) matrix-unit peaks of the GPUs in `PEAK_16_BIT_FLOPS`
    (datasheet figures); `train --peak-tflops` gives any other device's.

    See docs/gpu.md, "Training at the paper's batch".

    Args:
        device: where the model trains.
        dtype: the dtype of the products (mixed precision's, else the weights').

    Returns:
        FLOP/s, or None for CPUs, float32 and GPUs not in the table.
    """
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for model, peak in PEAK_16_BIT_FLOPS.items() if model in name), None)
