"""The training task: tokens per second of a training step of ours and of HF Marian, in fresh processes or taking turns.

Both engines compute the same loss on the same Multi30k batches (`benchmark_prepare`): ours its output projection
fused with the label-smoothed cross entropy (`ops_vaswani.linear_label_smoothed_cross_entropy`), Marian
`F.cross_entropy(..., label_smoothing=0.1)` on its logits (Marian's own loss is unsmoothed); both apply dropout in
the same places at the same rate and step with a fused Adam. `scripts/profile_gpu.py` runs `training_step` and
`child_train_turns` as they are.
"""

import argparse
import statistics
import time
from collections.abc import Callable

from benchmark_common import on_device, synchronize


def training_step(engine: str, args: argparse.Namespace) -> Callable[[dict], "torch.Tensor"]:  # noqa: F821
    """Load `engine` ("ours" or "marian") for training; return a function that runs one step on a batch: its loss.

    Raises:
        OSError: the preset's model is missing from the work folder (from `from_pretrained`).
    """
    import torch
    import torch.nn.functional as F

    from vaswani_transformer.model.modeling_vaswani import shift_tokens_right
    from vaswani_transformer.training.devices import avoid_cudnn_attention

    torch.manual_seed(0)
    if engine == "ours":
        from vaswani_transformer import VaswaniForConditionalGeneration
        from vaswani_transformer.inference.cpu_kernels import use_pinned_products

        model = VaswaniForConditionalGeneration.from_pretrained(args.workdir / "ours")
        use_pinned_products(model, keep=[model.get_output_embeddings()])  # as `train` does

        def loss_of(batch):
            return model(**batch).loss  # the projection fused with the label-smoothed cross entropy
    else:
        from transformers import MarianMTModel

        model = MarianMTModel.from_pretrained(args.workdir / "marian")
        config = model.config

        def loss_of(batch):
            # Marian's own loss is unsmoothed: the same function as ours is PyTorch's smoothed cross entropy.
            decoder_input_ids = shift_tokens_right(batch["labels"], config.pad_token_id, config.decoder_start_token_id)
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            logits = model(**inputs, decoder_input_ids=decoder_input_ids).logits
            return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), label_smoothing=0.1)

    model.to(args.device).train()
    if args.device == "cuda":
        avoid_cudnn_attention()  # for both engines, as `train` does: the batches change shape at every step
    if args.compile:  # both engines, as `train --compile` compiles ours: dynamic shapes for token batches
        loss_of = torch.compile(loss_of, dynamic=True)
    # Fused for both: `vaswani_transformer.training.run` uses it, and so does the HF Trainer (`adamw_torch_fused`).
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    # Mixed precision as Accelerate runs it: float32 weights, autocast, a gradient scaler for float16.
    autocast = torch.autocast(args.device, dtype=getattr(torch, args.dtype), enabled=args.dtype != "float32")
    scaler = torch.amp.GradScaler(args.device, enabled=args.dtype == "float16")

    def step(batch: dict) -> "torch.Tensor":
        with autocast:
            loss = loss_of(batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def real_tokens(batch: dict) -> int:
    """A training batch's non-padding source + target tokens."""
    return int(batch["attention_mask"].sum() + batch["labels"].ne(-100).sum())


def child_train(engine: str, args: argparse.Namespace) -> dict:
    """Training throughput of `engine` ("ours" or "marian"): real source + target tokens per second, and the model
    FLOPs per second (`flops.training_flops`, the same for both engines) with the MFU where the GPU's peak is known."""
    import torch

    from vaswani_transformer import VaswaniConfig
    from vaswani_transformer.training.flops import peak_flops, training_flops

    step = training_step(engine, args)
    config = VaswaniConfig.from_pretrained(args.workdir / "ours")
    batches = [on_device(batch, args) for batch in torch.load(args.workdir.parent / "train_batches.pt")]
    tokens, flops, elapsed = 0, 0.0, 0.0
    for index, batch in enumerate(batches):
        synchronize(args)
        start = time.perf_counter()
        loss = step(batch)
        synchronize(args)
        if index >= args.train_warmup:
            elapsed += time.perf_counter() - start
            tokens += real_tokens(batch)
            flops += training_flops(config, batch["attention_mask"], batch["labels"])
    peak = peak_flops(torch.device(args.device), getattr(torch, args.dtype))
    return {
        "tokens": tokens, "seconds": elapsed, "tokens_per_second": tokens / elapsed, "final_loss": loss.item(),
        "model_tflops_per_second": flops / elapsed / 1e12, "mfu": flops / elapsed / peak if peak else None,
    }  # fmt: skip


def child_train_turns(args: argparse.Namespace) -> dict:
    """Training throughput of ours and Marian in one process, taking turns step by step (which goes first alternates).

    A machine whose speed drifts between the fresh processes of `child_train` (other tenants of a virtual
    machine) slows both engines alike here. Returns each engine's tokens per second, the ratio ours / Marian
    and the median of the per-step ratios.

    Raises:
        OSError: a preset's model is missing from the work folder (from `training_step`).
    """
    import torch

    steps = {engine: training_step(engine, args) for engine in ("ours", "marian")}
    batches = [on_device(batch, args) for batch in torch.load(args.workdir.parent / "train_batches.pt")]
    seconds, step_ratios, tokens = {"ours": 0.0, "marian": 0.0}, [], 0
    for index, batch in enumerate(batches):
        taken = {}
        for engine in ("ours", "marian") if index % 2 == 0 else ("marian", "ours"):
            synchronize(args)
            start = time.perf_counter()
            steps[engine](batch)
            synchronize(args)
            taken[engine] = time.perf_counter() - start
        if index >= args.train_warmup:
            for engine, elapsed in taken.items():
                seconds[engine] += elapsed
            tokens += real_tokens(batch)
            step_ratios.append(taken["marian"] / taken["ours"])
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": {engine: tokens / elapsed for engine, elapsed in seconds.items()},
        "ratio": seconds["marian"] / seconds["ours"],
        "step_ratio_median": statistics.median(step_ratios),
    }
