"""Scoring a test set, as `vaswani-transformer evaluate` does: translate it, report sacreBLEU, record it in the card.

The translations are written only where they overwrite neither the test set nor a file of the model
(`check_translations_file`); the score goes into a local model's card only where it describes the model as saved
(`model_card.choose_score_card`).
"""

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..data.corpora import iter_lines
from ..exchange.model_card import ScoreCard, choose_score_card
from ..utils.files import ensure_writable
from .config import InferenceConfig
from .engines import Engine, load_engine
from .translation import corpus_bleu, translate

# What loading a model reads and what training writes beside it. Translations may join a model's directory (the
# recipe writes its test sets' there), but never replace or add one of these, by name or through a link.
_MODEL_FILES = (
    "*.json",
    "*.jsonl",
    "*.safetensors",
    "*.bin",
    "*.py",
    "*.md",
    "*.png",
    "checkpoints/*",
    "ctranslate2/*",
)


@dataclass(frozen=True)
class Evaluation:
    """What `evaluate_test_set` measured and did.

    Attributes:
        report: `bleu_report`'s scores.
        card: where the score was recorded, or why it was not (`ScoreCard.note`).
    """

    report: dict
    card: ScoreCard


def evaluate_test_set(
    model: str,
    source: str,
    reference: str,
    config: InferenceConfig | None = None,
    *,
    output: str | None = None,
    num_workers: int = 1,
    model_card: bool = True,
    dataset_name: str | None = None,
    split: str | None = None,
    on_report: Callable[[dict], object] | None = None,
) -> Evaluation:
    """Translate a test set line by line (each line one sentence, never split), score it, record the score.

    Whatever can be refused is refused before the model translates: unaligned or empty files, an `output` that
    would overwrite them or the model, a model card that cannot be written. See README.md, "Command line".

    Args:
        model: a model directory or Hub id.
        source, reference: the test set, one sentence per line, aligned by line (files or pipes).
        config: engine, device, decoding, batches (not `split_sentences` or `input_format`: a test set is read
            line by line, as its references are); default `InferenceConfig()`.
        output: a file for the translations, one per line; None writes none.
        num_workers: CPU processes translating batches side by side (`translation.map_in_workers`).
        model_card: whether the score may go into a local model's card (`model_card.choose_score_card` says
            whether it does: only a score of the model's own decoding, §6.1, on a named test set).
        dataset_name, split: what the card records the score under; default the source file's folder and stem.
        on_report: called with the report as soon as it is measured, before the card is written, so that a card
            that fails to be written loses no score (`evaluate` prints it).

    Returns:
        The report and where it was recorded.

    Raises:
        ValueError: the files differ in length or are empty, `output` is the source, the reference or a file
            of the model, or from `translation.translate`.
        OSError: `output` or the model card cannot be written, or from `engines.load_engine`.
    """
    config = config or InferenceConfig()
    sources, references = read_test_set(source, reference)
    if output:
        check_translations_file(output, model, {"--source": source, "--reference": reference})
    engine = load_engine(model, config)
    card = ScoreCard(None)
    if model_card:  # before the translations, not after them
        own = _decodes_as_saved(engine, config)
        card = choose_score_card(model, source, own_decoding=own, dataset_name=dataset_name, split=split)
    options = dict(batch_size=config.batch_size_for(), long_inputs=config.long_inputs, num_workers=num_workers)
    hypotheses = translate(engine, engine.tokenizer, sources, **options, split_sentences=False, progress=True)
    if output:
        Path(output).write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    report = bleu_report(hypotheses, references)
    if on_report is not None:
        on_report(report)
    card.record(report["bleu"], report["signature"])
    return Evaluation(report, card)


def read_test_set(source: str, reference: str) -> tuple[list[str], list[str]]:
    """The lines of a test set's source and reference files (or pipes).

    Raises:
        ValueError: the two differ in length, or are empty; a line is not UTF-8 (`corpora.iter_lines`).
        OSError: a file is missing or a directory.
    """
    sources, references = list(iter_lines(source)), list(iter_lines(reference))
    if len(sources) != len(references):
        raise ValueError(
            f"{source} has {len(sources)} lines but {reference} has {len(references)}; they must be aligned."
        )
    if not sources:
        raise ValueError(f"{source} is empty: give a test set with one sentence per line.")
    return sources, references


def check_translations_file(output: str, model: str, inputs: dict[str, str]) -> Path:
    """Refuse an output file for translations that would overwrite an input or the model, and prove it writable.

    See docs/robustness.md, "Bad input".

    Args:
        output: the file the translations go to (`--output`).
        model: the model directory (or Hub id, which has no local files to protect).
        inputs: the files read, by the option that names them (`{"--source": path}`), for the message.

    Returns:
        `output` as a `Path`.

    Raises:
        ValueError: `output` is one of `inputs`, or a file of the model (`_MODEL_FILES`), by name or
            through a link, hard or symbolic.
        OSError: `output` cannot be written (`files.ensure_writable`).
    """
    for option, path in inputs.items():
        if Path(output).exists() and os.path.samefile(output, path):  # links, hard or symbolic, too
            raise ValueError(
                f"--output {output} is the {option} file: the translations would overwrite it. Name another file."
            )
    _refuse_a_file_of_the_model(output, model)
    return ensure_writable(output, is_file=True)


def _refuse_a_file_of_the_model(output: str, model: str) -> None:
    model_dir = Path(model).resolve()
    if not model_dir.is_dir():
        return
    target = Path(output).resolve()
    named = model_dir in target.parents and any(target.relative_to(model_dir).match(p) for p in _MODEL_FILES)
    linked = target.is_file() and any(
        os.path.samefile(target, file) for pattern in _MODEL_FILES for file in model_dir.glob(pattern) if file.is_file()
    )
    if named or linked:
        raise ValueError(
            f"--output {output} is a file of the model in {model} ({', '.join(_MODEL_FILES)}), or a link to one: the "
            "translations would overwrite the model. Name another file."
        )


def _decodes_as_saved(engine: Engine, config: InferenceConfig) -> bool:
    # The model's own generate(): the torch engine (CTranslate2's gives nearly always, not always, the same
    # translations) with the generation config's beam size and length penalty.
    own = engine.generation_config
    return config.engine == "torch" and all(getattr(own, name) == v for name, v in config.generate_kwargs.items())


def bleu_report(hypotheses: list[str], references: list[str]) -> dict:
    """sacreBLEU of translations, cased and lowercased, as `evaluate` prints it.

    Papers on small test sets (Multi30k) often report BLEU on lowercased, tokenized text; it reads higher.

    Returns:
        `{"bleu", "signature", "sentences", "bleu_lowercased", "signature_lowercased"}`: BLEU 0 to 100, rounded to
        two decimals, with sacreBLEU's signatures (13a tokenization).

    Raises:
        ValueError: the lists differ in length or are empty (`translation.corpus_bleu`).
    """
    bleu = corpus_bleu(hypotheses, references)
    lowercased = corpus_bleu(hypotheses, references, lowercase=True)
    report = {"bleu": round(bleu["score"], 2), "signature": bleu["signature"], "sentences": len(hypotheses)}
    report.update(bleu_lowercased=round(lowercased["score"], 2), signature_lowercased=lowercased["signature"])
    return report
