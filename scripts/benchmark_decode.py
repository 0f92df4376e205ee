"""The decoding tasks: generated tokens per second of beam search and greedy search, every engine forced to one length.

Untrained weights would stop at random lengths, so every engine produces exactly `--decode-length` tokens per
sentence (HF: min_new_tokens = max_new_tokens; CTranslate2: min_decoding_length = max_decoding_length); each child
checks the lengths it produced.
"""

import argparse
import json
import time
from pathlib import Path

from benchmark_common import on_device, synchronize


def ct2_translator(
    engine: str, directory: Path, args: argparse.Namespace, workers: int = 1
) -> "ctranslate2.Translator":  # noqa: F821
    """CTranslate2 on `--device`: "ct2" computes in `--dtype`, "ct2-int8" in int8 (int8_<dtype> on a GPU).

    `workers` above 1: that many workers (`inter_threads`) sharing `--threads` threads.

    Raises:
        ValueError, RuntimeError: from CTranslate2, for a compute type the device lacks or missing CUDA
            libraries (its PyPI wheel needs CUDA 12's cuBLAS).
    """
    import ctranslate2

    compute_type = args.dtype if engine == "ct2" else "int8" if args.dtype == "float32" else f"int8_{args.dtype}"
    return ctranslate2.Translator(
        str(directory),
        device=args.device,
        compute_type=compute_type,
        inter_threads=workers,
        intra_threads=max(1, args.threads // workers),
    )


def child_decode_torch(engine: str, task: str, args: argparse.Namespace) -> dict:
    """Generated tokens per second of `generate()` ("ours" or "marian"), beam 4 or greedy, best of the repeats."""
    import torch
    from transformers import GenerationConfig

    if engine == "ours":
        from vaswani_transformer import VaswaniForConditionalGeneration
        from vaswani_transformer.inference.cpu_kernels import use_pinned_products

        model = VaswaniForConditionalGeneration.from_pretrained(args.workdir / "ours")
        use_pinned_products(model)  # as `translate` loads it: oneDNN's products where VASWANI_ONEDNN_MIN_PRODUCT asks
    else:
        from transformers import MarianMTModel

        model = MarianMTModel.from_pretrained(args.workdir / "marian")
    model.to(args.device, getattr(torch, args.dtype)).eval()
    config = model.config
    # One decoding configuration for both: same search, same processors, exactly decode_length tokens.
    model.generation_config = GenerationConfig(
        num_beams=1 if task == "greedy" else 4,
        do_sample=False,
        early_stopping=task != "beam-es-false",
        length_penalty=1.0,
        min_new_tokens=args.decode_length,
        max_new_tokens=args.decode_length,
        decoder_start_token_id=config.decoder_start_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        suppress_tokens=[config.pad_token_id, config.bos_token_id],
    )
    batches = [on_device(batch, args) for batch in torch.load(args.workdir.parent / "decode_batches.pt")]
    with torch.inference_mode():
        model.generate(**batches[0])  # warm-up: first-call allocations and lazy initialisation
        times, tokens = [], 0
        for _ in range(args.repeats):
            synchronize(args)
            start = time.perf_counter()
            outputs = [model.generate(**batch) for batch in batches]
            synchronize(args)
            times.append(time.perf_counter() - start)
    for output in outputs:
        generated = output[:, 1:]
        lengths = (generated.ne(config.pad_token_id) & generated.ne(config.eos_token_id)).sum(-1)
        assert bool((lengths == args.decode_length).all()), lengths
        tokens += int(lengths.sum())
    best = min(times)
    return {"tokens": tokens, "seconds": best, "tokens_per_second": tokens / best, "all_seconds": times}


def child_decode_ct2(engine: str, task: str, args: argparse.Namespace) -> dict:
    """Generated tokens per second of CTranslate2's `translate_batch` (see `ct2_translator`), best of the repeats."""
    translator = ct2_translator(engine, args.workdir / "ct2", args)
    batches = json.loads((args.workdir.parent / "decode_tokens.json").read_text())
    options = dict(
        beam_size=4 if task == "beam" else 1,
        min_decoding_length=args.decode_length,
        max_decoding_length=args.decode_length,
    )
    translator.translate_batch(batches[0], **options)  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = [translator.translate_batch(batch, **options) for batch in batches]
        times.append(time.perf_counter() - start)
    lengths = [len(result.hypotheses[0]) for output in outputs for result in output]
    assert set(lengths) == {args.decode_length}, set(lengths)
    best = min(times)
    return {"tokens": sum(lengths), "seconds": best, "tokens_per_second": sum(lengths) / best, "all_seconds": times}
