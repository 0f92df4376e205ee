"""The translation tasks: sentences per second of beam search with a trained model, and the BLEU of each engine.

Every sentence ends where the engine ends it, as in real use; `translate-workers` runs the batches in worker
processes of one thread each (`translation.map_in_workers`, as `translate --num-workers` does) or in CTranslate2's
`inter_threads` workers.
"""

import argparse
import json
import time

from benchmark_common import on_device
from benchmark_decode import ct2_translator


def child_translate(engine: str, args: argparse.Namespace, workers: int = 1) -> dict:
    """Sentences per second of beam search with a trained model, every sentence ending where the engine ends it.

    `workers` above 1: the batches go to that many processes of one thread each (`map_in_workers`), or to
    CTranslate2's `inter_threads` workers.
    """
    from transformers import AutoTokenizer

    # corpus_bleu: also registers the tokenizer (no trust_remote_code prompt)
    from vaswani_transformer.inference.translation import corpus_bleu, map_in_workers

    options = dict(num_beams=4, length_penalty=1.0, max_new_tokens=128)
    tokenizer = AutoTokenizer.from_pretrained(args.workdir / "ours")
    if engine.startswith("ct2"):
        translator = ct2_translator(engine, args.workdir / "ct2", args, workers)
        batches = json.loads((args.workdir / "translate_tokens.json").read_text())

        def run_all(batches):  # submitted together, so that `inter_threads` workers take batches side by side
            search = dict(beam_size=4, length_penalty=1.0, max_decoding_length=128, asynchronous=True)
            results = [translator.translate_batch(batch, **search) for batch in batches]
            return [result.result().hypotheses[0] for batch in results for result in batch]

        def to_ids(hypothesis):  # CTranslate2 gives tokens, without </s>
            return tokenizer.convert_tokens_to_ids(hypothesis) + [tokenizer.eos_token_id]
    else:
        import torch
        from transformers import GenerationConfig

        if engine == "ours":
            from vaswani_transformer import VaswaniForConditionalGeneration as Model
        else:
            from transformers import MarianMTModel as Model
        model = Model.from_pretrained(args.workdir / engine).to(args.device, getattr(torch, args.dtype)).eval()
        if engine == "ours":  # as `translate` loads it: oneDNN's products where VASWANI_ONEDNN_MIN_PRODUCT asks
            from vaswani_transformer.inference.cpu_kernels import use_pinned_products

            use_pinned_products(model)
        config = model.config
        model.generation_config = GenerationConfig(
            **options,
            early_stopping=True,
            decoder_start_token_id=config.decoder_start_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
            suppress_tokens=[config.pad_token_id, config.bos_token_id],
        )
        batches = [on_device(batch, args) for batch in torch.load(args.workdir / "translate_batches.pt")]

        def run(batch):
            with torch.inference_mode():
                generated = model.generate(**batch)[:, 1:]
            return generated.tolist()

        def run_all(batches):
            return [output for outputs in map_in_workers(run, batches, workers) for output in outputs]

        if workers > 1:  # every repeat forks new workers: from a warm process, as CTranslate2's workers stay warm
            run(batches[0])

        def to_ids(row):  # up to and with the first </s>: what follows is filling (with </s> where <pad> is 0)
            return row[: row.index(config.eos_token_id) + 1] if config.eos_token_id in row else row

    run_all(batches[:1])  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = run_all(batches)  # read back: no GPU work left queued
        times.append(time.perf_counter() - start)
    outputs = [to_ids(output) for output in outputs]
    references = json.loads((args.workdir / "translate_references.json").read_text())
    translations = tokenizer.batch_decode(outputs, skip_special_tokens=True)
    best = min(times)
    return {"sentences": len(outputs), "tokens": sum(map(len, outputs)), "seconds": best,
            "sentences_per_second": len(outputs) / best, "tokens_per_second": sum(map(len, outputs)) / best,
            "bleu": corpus_bleu(translations, references)["score"], "all_seconds": times}  # fmt: skip
