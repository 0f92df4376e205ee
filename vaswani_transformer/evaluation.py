"""Translate with beam search and score with sacreBLEU through `evaluate` (§6.1)."""

from collections.abc import Iterable, Iterator
from pathlib import Path

import evaluate
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

SACREBLEU_SCRIPT = str(Path(__file__).parent / "metrics" / "sacrebleu.py")


def load_translator(model_dir: str, device: str | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a saved model (in eval mode) and its tokenizer from a directory or Hub id.

    Args:
        model_dir: what `from_pretrained` accepts.
        device: "cpu", "cuda", "cuda:1", ...; None picks CUDA when available.

    Raises:
        OSError: the directory or repository does not hold a model (from `from_pretrained`).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).to(device).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@torch.inference_mode()
def translate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: list[str],
    batch_size: int = 64,
    progress: bool = False,
    **generate_kwargs,
) -> list[str]:
    """Translate sentences in batches of similar length with `model.generate()`.

    Sorting by length before batching keeps padding, and so wasted work, small; the output is in
    the input's order. Decoding follows the model's generation config (beam 4 and length penalty
    0.6 for models trained here, §6.1) unless `generate_kwargs` say otherwise.

    Args:
        model, tokenizer: from `load_translator`.
        sentences: source sentences; an empty string translates to an empty string.
        batch_size: sentences per `generate()` call.
        progress: show a progress bar (in sentences).
        **generate_kwargs: e.g. `num_beams=1` for greedy decoding.

    Returns:
        One translation per sentence, detokenized.
    """
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
    translations = [""] * len(sentences)
    with tqdm(total=len(sentences), unit="sent", desc="Translating", disable=not progress) as bar:
        for start in range(0, len(order), batch_size):
            indices = [i for i in order[start : start + batch_size] if sentences[i].strip()]
            if indices:
                inputs = tokenizer(
                    [sentences[i] for i in indices], return_tensors="pt", padding=True, truncation=True
                ).to(model.device)
                output_ids = model.generate(**inputs, **generate_kwargs)
                for i, text in zip(indices, tokenizer.batch_decode(output_ids, skip_special_tokens=True), strict=True):
                    translations[i] = text.strip()
            bar.update(min(batch_size, len(order) - start))
    return translations


def translate_stream(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    lines: Iterable[str],
    batch_size: int = 64,
    **generate_kwargs,
) -> Iterator[str]:
    """Translate lines as they arrive (e.g. from stdin), `batch_size` at a time, in order.

    A line is translated as soon as its batch is full or the input ends; pass `batch_size=1` to
    answer every line at once in an interactive session.
    """
    batch: list[str] = []
    for line in lines:
        batch.append(line.rstrip("\n"))
        if len(batch) == batch_size:
            yield from translate(model, tokenizer, batch, batch_size, **generate_kwargs)
            batch = []
    if batch:
        yield from translate(model, tokenizer, batch, batch_size, **generate_kwargs)


def corpus_bleu(hypotheses: list[str], references: list[str], lowercase: bool = False, tokenize: str = "13a") -> dict:
    """sacreBLEU corpus BLEU through `evaluate`: cased, detokenized, 13a tokenization by default.

    Args:
        hypotheses: one translation per sentence.
        references: one reference per sentence, aligned with `hypotheses`.
        lowercase, tokenize: sacreBLEU options (e.g. `tokenize="intl"`).

    Returns:
        `{"score": BLEU (0-100), "signature": sacreBLEU signature, ...}`.

    Raises:
        ValueError: the lists differ in length.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references: they must be aligned.")
    metric = evaluate.load(SACREBLEU_SCRIPT)
    return metric.compute(
        predictions=hypotheses, references=[[r] for r in references], lowercase=lowercase, tokenize=tokenize
    )


def read_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 text file, without line ends.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is not valid UTF-8 (the line number is named).
    """
    lines = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                lines.append(raw.decode("utf-8").rstrip("\r\n"))
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}, line {number}: not valid UTF-8 ({error.reason}).") from None
    return lines
