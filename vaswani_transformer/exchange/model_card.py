"""The model card (`README.md`) of a saved translator: its Hub metadata, its recipe, and the scores measured on it.

`write_model_card` renders the card from `model_card_template.md`; `choose_score_card` decides whether a test-set
score (`vaswani-transformer evaluate`) goes into it, and `ScoreCard.record` writes it there.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..utils.files import ensure_writable, read_log

MODEL_CARD_TEMPLATE = Path(__file__).parent / "model_card_template.md"


def write_model_card(
    model_dir: str | Path,
    model_id: str | None = None,
    eval_result: EvalResult | None = None,
    keep_results: bool = True,
) -> Path:
    """Write (or rewrite) `README.md`, the model card, of a saved translator directory.

    The card has the Hub's metadata (languages, license, datasets, metrics, `pipeline_tag:
    translation`, `library_name`, and a `model-index` of the measured scores), intended use, the
    training recipe (from `training_config.json` and `training_log.jsonl` when present), the
    evaluation results and limitations. Results already in the card are kept; `eval_result`
    replaces one for the same dataset, split and metric. Without `training_config.json` the
    languages and dataset come from the card already there, and a license the card names is kept
    (else Apache-2.0). The card's text is written anew from the template `model_card_template.md`:
    notes added by hand do not survive.

    Args:
        model_dir: a directory written by `train` or `saving.save_translator`.
        model_id: the Hub id the usage example loads; default: `model_dir` as given (the title is its name).
        eval_result: a new score, e.g. from `vaswani-transformer evaluate`.
        keep_results: False when the weights changed (`average`): the scores measured on the old ones go.

    Returns:
        The path of the card.

    Raises:
        OSError: `model_dir` has no config.json.
        ValueError: the card there has metadata that is no YAML (its first line is named).
    """
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    training = _read_json(model_dir / "training_config.json")
    card_path = model_dir / "README.md"
    existing = _existing_card_data(card_path)
    results = _merged_results((existing.eval_results or []) if keep_results else [], eval_result)
    # Without the run's settings (a converted model, a copy), what the card said: `serve` reads the languages there.
    languages = [training.get("source_lang"), training.get("target_lang")] if training else existing.language
    languages = [languages] if isinstance(languages, str) else languages
    source_lang, target_lang = languages if languages and len(languages) == 2 else ("source", "target")
    dataset = _dataset_name(training.get("data")) if training else next(iter(existing.datasets or []), None)
    model_name = model_id.split("/")[-1] if model_id else model_dir.resolve().name
    card = ModelCard.from_template(
        _card_metadata(existing, model_name, languages, dataset, results),
        template_path=MODEL_CARD_TEMPLATE,
        model_name=model_name,
        model_id=model_id or str(model_dir),
        source_lang=source_lang,
        target_lang=target_lang,
        dataset=dataset or "an unknown corpus",
        architecture=_architecture(config),
        recipe=_recipe(training, _last_log_line(model_dir / "training_log.jsonl"), config),
        decoding=_decoding(_read_json(model_dir / "generation_config.json")),
        eval_results=results,
    )
    card.save(card_path)
    return card_path


def _existing_card_data(card_path: Path) -> ModelCardData:
    # The metadata of the card already there, or none.
    try:
        return ModelCard.load(card_path).data if card_path.is_file() else ModelCardData()
    except yaml.YAMLError as error:  # a hand-edited card: one line that says where, not a traceback
        first = str(error).splitlines()[0]
        message = f"{card_path} has metadata that is no YAML ({first}); fix its front matter or remove it."
        raise ValueError(message) from None


def _merged_results(results: list[EvalResult], new: EvalResult | None) -> list[EvalResult]:
    # A new score replaces the one of its dataset, split and metric.
    if new is None:
        return results
    key = (new.dataset_type, new.dataset_split, new.metric_type)
    return [r for r in results if (r.dataset_type, r.dataset_split, r.metric_type) != key] + [new]


def _card_metadata(
    existing: ModelCardData,
    model_name: str,
    languages: list[str] | None,
    dataset: str | None,
    results: list[EvalResult],
) -> ModelCardData:
    # The Hub's metadata: what the Hub lists the model under, and its model-index of scores.
    return ModelCardData(
        model_name=model_name,
        language=languages or None,
        license=existing.license or "apache-2.0",  # the package's, unless the card names the weights' own
        license_name=existing.license_name,  # that of a license "other"
        license_link=existing.license_link,
        library_name="transformers",
        pipeline_tag="translation",
        tags=["translation", "vaswani_transformer", "transformer"],
        datasets=[dataset] if dataset else None,
        metrics=["sacrebleu"],
        eval_results=results or None,
    )


def _architecture(config: dict) -> str:
    # The model's size in the paper's symbols (Table 3).
    return (
        f"N = {config['encoder_layers']} + {config['decoder_layers']} layers, d_model = {config['d_model']}, "
        f"d_ff = {config['d_ff']}, h = {config['num_attention_heads']}, "
        f"{config['vocab_size']:,}-token shared BPE vocabulary"
    )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _last_log_line(path: Path) -> dict:
    # The last whole record: a run killed while appending one leaves half a line after it.
    records = read_log(path) if path.is_file() else []
    return records[-1] if records else {}


def _dataset_name(data: str | None) -> str | None:
    # A local corpus directory is named by its folder, a Hub dataset by its id.
    if not data:
        return None
    return Path(data).name if Path(data).exists() else data


def _decoding(generation: dict) -> str:
    # The search the saved generation config asks for, in the paper's terms (§6.1).
    beams = generation.get("num_beams", 1)
    if beams == 1:
        search = "greedy search"
    elif generation.get("length_penalty_type") == "gnmt":
        search = f"beam size {beams}, length penalty ((5 + |Y|) / 6)^{generation.get('length_penalty', 1.0)} (§6.1)"
    else:
        search = f"beam size {beams}, length penalty |Y|^{generation.get('length_penalty', 1.0)}"
    a, b = generation.get("max_length_a"), generation.get("max_length_b")
    if a == 1.0 and b is not None:
        search += f", at most input length + {b} tokens"
    return search


def _checkpoint_spacing(training: dict) -> str:
    # How far apart the averaged checkpoints were written: by steps, by minutes or by both clocks.
    steps, minutes = training.get("save_steps"), training.get("save_minutes")
    clocks = ([f"{steps} steps"] if steps else []) + ([f"{minutes:g} minutes"] if minutes else [])
    return " or ".join(clocks)


def _averaging(training: dict) -> str:
    # The checkpoints the weights average: those recorded by whoever averaged them last (the run's end, or
    # `average --last M`), else the run's setting.
    steps = training.get("averaged_steps") or []
    if len(steps) == 1:
        return f"none (the checkpoint of step {steps[0]:,} alone)"
    which = f" (steps {steps[0]:,} to {steps[-1]:,})" if steps else ""
    return f"last {len(steps) or training['average_last']} checkpoints{which}, {_checkpoint_spacing(training)} apart"


def _recipe(training: dict, last_log: dict, config: dict) -> list[tuple[str, str]]:
    if not training:
        return [("Training", "not recorded (no training_config.json)")]
    rows = [
        ("Model size", f"{training['preset']} preset, {training.get('model_overrides') or 'no overrides'}"),
        ("Batch", f"{training['max_tokens']:,} padded tokens per side and device, sentences of similar length (§5.1)"),
        (
            "Optimizer",
            f"Adam, beta1 {training['adam_beta1']}, beta2 {training['adam_beta2']}, "
            f"eps {training['adam_epsilon']} (§5.3)",
        ),
        (
            "Learning rate",
            f"{training['learning_rate_scale']} x d_model^-0.5 x min(step^-0.5, step x "
            f"{training['warmup_steps']}^-1.5) (§5.3, Eq. 3)",
        ),
        ("Regularisation", f"dropout {config['dropout']}, label smoothing {config['label_smoothing']} (§5.4)"),
        ("Precision", training["mixed_precision"]),
        ("Checkpoint averaging", _averaging(training)),
    ]
    choice = training.get("decoding_choice")
    if choice:
        penalty = "greedy" if choice["length_penalty"] is None else f"length penalty {choice['length_penalty']}"
        rows.append(
            (
                "Decoding",
                f"beam {choice['num_beams']}, {penalty}: the best of {len(choice['tried'])} settings by sacreBLEU "
                f"on {choice['sentences']:,} validation sentences ({choice['bleu']}) (§6.1)",
            )
        )
    if last_log:
        trained = f"{last_log['step']:,} steps ({last_log['epoch'] + 1} epochs)"
        if "validation_loss" in last_log:
            trained += f", final validation loss {last_log['validation_loss']:.3f} nats/token"
        rows.append(("Trained", trained))
    return rows


@dataclass(frozen=True)
class ScoreCard:
    """Where a test-set score goes: the model card to rewrite, or why no card is (see `choose_score_card`).

    Attributes:
        path: the model's `README.md`, proved writable; None when the score is not recorded.
        dataset, split: the names the score is recorded under (the card's `model-index`); None without `path`.
        note: why a local model's card is left as it is, one line for the user; None when it is rewritten or
            was not asked for.
    """

    path: Path | None
    dataset: str | None = None
    split: str | None = None
    note: str | None = None

    def record(self, bleu: float, signature: str) -> Path | None:
        """Write a sacreBLEU score into the card (as `write_model_card`'s `eval_result`), if it is recorded.

        Args:
            bleu: the score, 0 to 100, recorded to two decimals.
            signature: sacreBLEU's signature of the score (its tokenization, casing, version).

        Returns:
            The card's path, or None when the score is not recorded.

        Raises:
            OSError, ValueError: from `write_model_card`.
        """
        if self.path is None:
            return None
        result = EvalResult(
            task_type="translation",
            dataset_type=self.dataset,
            dataset_name=self.dataset,
            dataset_split=self.split,
            metric_type="sacrebleu",
            metric_name="sacreBLEU",
            metric_value=round(bleu, 2),
            metric_config=signature,
        )
        return write_model_card(self.path.parent, eval_result=result)


def choose_score_card(
    model: str | Path,
    source: str | Path,
    *,
    own_decoding: bool,
    dataset_name: str | None = None,
    split: str | None = None,
) -> ScoreCard:
    """Whether a score of `model` on the test set `source` goes into the model's card, checked before translating.

    A card describes the model as saved, so only a local model directory's card records a score, only of the
    model's own `generate()` (its generation config's beam size and length penalty, the torch engine), and only of
    a test set with names: by default the source file's folder (dataset) and stem (split); a pipe has neither,
    and needs both given. The card is proved writable here, before hours of translation, not after them.

    Args:
        model: the model directory or Hub id evaluated (a Hub id's card is never rewritten).
        source: the test set's source file, or a pipe (`<(...)`).
        own_decoding: whether the translations are the model's own `generate()`'s.
        dataset_name, split: the names to record the score under; default the source file's folder and stem.

    Returns:
        The card to write (`ScoreCard.record`), or none, with a note where a local model's card is left as it is.

    Raises:
        OSError: the card is to be written but cannot be; the message says to pass `--no-model-card` instead.
    """
    if not Path(model).is_dir():
        return ScoreCard(None)
    if not own_decoding:
        return ScoreCard(None, note="The model card is left as it is: this score is not of the model's own generate().")
    if not Path(source).is_file() and not (dataset_name and split):
        return ScoreCard(None, note="The model card is left as it is: a pipe's score needs --dataset-name and --split.")
    card = Path(model) / "README.md"
    try:
        ensure_writable(card, is_file=True)
    except OSError as error:
        raise OSError(
            f"the score goes into the model card {card}, which cannot be written "
            f"({getattr(error.__cause__, 'strerror', None) or error}): pass --no-model-card, or fix the permissions"
        ) from error
    dataset = dataset_name or Path(source).resolve().parent.name
    return ScoreCard(card, dataset=dataset, split=split or Path(source).stem)
