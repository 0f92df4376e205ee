"""The Hugging Face Hub: publishing a saved translator (`push_translator`), and telling a Hub id from a local path."""

import json
import os
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.utils import filter_repo_objects, validate_repo_id

from ..utils.files import TRAINING_LOCK_NAME
from .model_card import write_model_card


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
        output_dir: a directory written by `train` or `saving.save_translator`.
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
