"""Model FLOPs and MFU (flops.py): the count of §3's products, checked against PyTorch's own FLOP counter."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vaswani_transformer import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani_transformer.training.flops import forward_flops, peak_flops, training_flops


@pytest.mark.parametrize("widths", [{}, {"d_k": 8, "d_v": 24}])  # d_model / h, and Table 3's rows A and B
def test_forward_flops_are_what_pytorch_counts_in_the_model_products(widths):
    # Eager attention: PyTorch's counter does not see inside the CPU's fused attention kernel.
    torch.manual_seed(0)
    config = VaswaniConfig(
        vocab_size=300, d_model=64, d_ff=128, encoder_layers=2, decoder_layers=3, num_attention_heads=4,
        attn_implementation="eager", **widths,
    )  # fmt: skip
    model = VaswaniForConditionalGeneration(config).eval()
    source, labels = torch.randint(4, 300, (3, 11)), torch.randint(4, 300, (3, 7))
    mask = torch.ones_like(source)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=source, attention_mask=mask, labels=labels)
    assert forward_flops(config, mask.sum(-1), labels.ne(-100).sum(-1)) == counter.get_total_flops()


def test_padding_adds_no_flops_and_a_training_step_counts_three_forward_passes():
    config = VaswaniConfig(vocab_size=100, d_model=32, d_ff=64, encoder_layers=2, decoder_layers=2)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    labels = torch.tensor([[5, 6, 7], [8, -100, -100]])
    alone = [forward_flops(config, torch.tensor([s]), torch.tensor([t])) for s, t in ((5, 3), (2, 1))]
    assert training_flops(config, mask, labels) == pytest.approx(3 * sum(alone))
    assert forward_flops(config, torch.tensor([5]), torch.tensor([3])) > forward_flops(
        config, torch.tensor([5]), torch.tensor([2])
    )


def test_peak_is_known_for_listed_gpus_in_16_bit_only(monkeypatch):
    assert peak_flops(torch.device("cpu"), torch.bfloat16) is None
    cuda = torch.device("cuda", 0)
    names = [("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
             ("NVIDIA H200", 989.4e12), ("NVIDIA H200 NVL", 835e12)]  # fmt: skip
    for name, peak in names:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_flops(cuda, torch.bfloat16) == peak_flops(cuda, torch.float16) == peak
        assert peak_flops(cuda, torch.float32) is None  # TF32 or not: no single peak
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert peak_flops(cuda, torch.bfloat16) is None
