"""Saving a translator so that it loads anywhere (with the package, without it, as a pipeline) and publishing it."""

import json
import os
from pathlib import Path

import yaml
from huggingface_hub import CommitOperationAdd, EvalResult, HfApi, ModelCard, ModelCardData
from huggingface_hub.utils import filter_repo_objects, validate_repo_id
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .files import TRAINING_LOCK_NAME, give_umask_mode, read_log

MODEL_CARD_TEMPLATE = Path(__file__).parent / "model_card_template.md"


def save_translator(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, output_dir: str | Path) -> Path:
    """Write model (safetensors), config, generation config, tokenizer and the code to load them.

    The model's `save_pretrained` copies its code, the translation pipeline's included, so
    `trust_remote_code=True` loads the directory without this package. The tokenizer is saved without the
    truncation and padding settings that its last call left in its fast backend.

    See README.md, "Using a trained model".

    Args:
        model: the model to save.
        tokenizer: its tokenizer (its backend's truncation and padding are switched off; every
            call of a transformers tokenizer sets its own).
        output_dir: created if missing; files already there are overwritten.

    Returns:
        `output_dir` as a `Path`.
    """
    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    give_umask_mode(*output_dir.glob("*.safetensors"))
    # Otherwise tokenizer.json records whatever the last call used (e.g. truncation at
    # --max-length + 1 from training, or nothing when `datasets` took the tokenized corpus from
    # its cache), and tools that read the file directly would apply it.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        backend.no_truncation()
        backend.no_padding()
    tokenizer.save_pretrained(output_dir)
    return output_dir


def check_model_exists(model: str) -> None:
    """Refuse a model given as a local path (absolute, or starting with ".", "~") that does not exist.

    Anything else may be a Hub id, which `from_pretrained` looks up; a path with a typo would
    otherwise get the Hub's complaint about repository ids instead of its own name.

    See docs/robustness.md, "Bad input".

    Raises:
        OSError: `model` is such a path and does not exist; the message names it.
    """
    if not Path(model).expanduser().exists() and (Path(model).is_absolute() or model.startswith((".", "~"))):
        raise OSError(f"{model} does not exist; give a model directory written by `train`, or a Hub id.")


# `push`'s commit message unless the user gives one.
COMMIT_MESSAGE = "Upload Transformer translator"


def push_translator(
    output_dir: str | Path,
    repo_id: str,
    private: bool | None = None,
    commit_message: str = COMMIT_MESSAGE,
    token: str | None = None,
) -> str:
    """`vaswani-transformer push`: upload a saved translator directory to a Hub model repository.

    Everything in the directory goes, in one commit: weights (safetensors), config, generation config,
    tokenizer, the code for `trust_remote_code` users, the model card (`README.md`) and the run's
    settings (`training_config.json`, with its local paths cut to their last part: the corpus
    directory's name, not where it lies on this machine); training leftovers (`checkpoints/`, the
    lock of a run) do not. The endpoint and token are `huggingface_hub`'s (`HF_ENDPOINT`, `HF_TOKEN`,
    `hf auth login`).

    Args:
        output_dir: a directory written by `train` or `save_translator`.
        repo_id: "org/name"; the repository is created if it does not exist.
        private: create the repository private (True) or public (False); None, as transformers'
            `push_to_hub`: public unless the organisation makes new repositories private.
        commit_message: message of the upload commit.
        token: overrides the stored or environment token.

    Returns:
        The URL of the commit.

    Raises:
        ValueError: `output_dir` holds no saved model (no config.json or model.safetensors).
        huggingface_hub.errors.HFValidationError: `repo_id` is no repository id (before anything is written).
        huggingface_hub.errors.HfHubHTTPError: the Hub refused (authentication, permissions); the card is
            rewritten only once the repository exists.
    """
    output_dir = Path(output_dir)
    missing = [name for name in ("config.json", "model.safetensors") if not (output_dir / name).is_file()]
    if missing:
        raise ValueError(
            f"{output_dir} is not a saved model: {', '.join(missing)} missing. Push the output directory of "
            "`vaswani-transformer train` (or of save_pretrained)."
        )
    validate_repo_id(repo_id)
    api = HfApi(token=token)
    # The repository first: a push refused there (an id, the network, a token) leaves the local card as it was.
    api.create_repo(repo_id, private=private, exist_ok=True)
    write_model_card(output_dir, model_id=repo_id)  # its usage snippet names the repository
    names = [path.relative_to(output_dir).as_posix() for path in sorted(output_dir.rglob("*")) if path.is_file()]
    ignored = ["checkpoints/*", "ctranslate2/*", "*.tmp", TRAINING_LOCK_NAME, ".cache/*", ".git/*"]
    operations = [
        CommitOperationAdd(name, _shareable(output_dir / name) if name == "training_config.json" else output_dir / name)
        for name in filter_repo_objects(names, ignore_patterns=ignored)
    ]
    return api.create_commit(repo_id, operations, commit_message=commit_message).commit_url


def _shareable(record_path: Path) -> bytes | Path:
    # training_config.json without this machine's paths: each local one (the corpus, its files, the output and
    # tokenizer directories) by its last part; Hub ids and the rest as written. A record that is no JSON goes as is.
    try:
        record = json.loads(record_path.read_text())
    except ValueError:
        return record_path
    if not isinstance(record, dict):
        return record_path

    def name(value):
        local = isinstance(value, str) and (os.path.isabs(value) or os.path.exists(value))
        return Path(value).name if local else value

    for key in ("data", "output_dir", "tokenizer"):
        if key in record:
            record[key] = name(record[key])
    if isinstance(record.get("files"), dict):  # {split: [source file, target file]}
        record["files"] = {split: [name(path) for path in pair] for split, pair in record["files"].items()}
    return (json.dumps(record, indent=2) + "\n").encode()


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
        model_dir: a directory written by `train` or `save_translator`.
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
    try:
        existing = ModelCard.load(card_path).data if card_path.is_file() else ModelCardData()
    except yaml.YAMLError as error:  # a hand-edited card: one line that says where, not a traceback
        first = str(error).splitlines()[0]
        message = f"{card_path} has metadata that is no YAML ({first}); fix its front matter or remove it."
        raise ValueError(message) from None
    results = (existing.eval_results or []) if keep_results else []
    if eval_result is not None:
        key = (eval_result.dataset_type, eval_result.dataset_split, eval_result.metric_type)
        results = [r for r in results if (r.dataset_type, r.dataset_split, r.metric_type) != key] + [eval_result]

    # Without the run's settings (a converted model, a copy), what the card said: `serve` reads the languages there.
    languages = [training.get("source_lang"), training.get("target_lang")] if training else existing.language
    languages = [languages] if isinstance(languages, str) else languages
    source_lang, target_lang = languages if languages and len(languages) == 2 else ("source", "target")
    dataset = _dataset_name(training.get("data")) if training else next(iter(existing.datasets or []), None)
    model_name = model_id.split("/")[-1] if model_id else model_dir.resolve().name
    card_data = ModelCardData(
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
    card = ModelCard.from_template(
        card_data,
        template_path=MODEL_CARD_TEMPLATE,
        model_name=model_name,
        model_id=model_id or str(model_dir),
        source_lang=source_lang,
        target_lang=target_lang,
        dataset=dataset or "an unknown corpus",
        architecture=(
            f"N = {config['encoder_layers']} + {config['decoder_layers']} layers, d_model = {config['d_model']}, "
            f"d_ff = {config['d_ff']}, h = {config['num_attention_heads']}, "
            f"{config['vocab_size']:,}-token shared BPE vocabulary"
        ),
        recipe=_recipe(training, _last_log_line(model_dir / "training_log.jsonl"), config),
        decoding=_decoding(_read_json(model_dir / "generation_config.json")),
        eval_results=results,
    )
    card.save(card_path)
    return card_path


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
