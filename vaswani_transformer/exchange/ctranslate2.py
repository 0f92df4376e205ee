"""Export for serving: a saved `VaswaniForConditionalGeneration` as a CTranslate2 model.

CTranslate2 is a C++ inference engine for Transformers; its converters turn Hugging Face models
into its own format. It has no converter for this model, but it has one for HF `MarianMTModel`,
and `marian.to_marian` builds the Marian model that computes exactly our function. This module
registers, through CTranslate2's own extension point (`register_loader`), a loader for
`VaswaniConfig` that hands that Marian copy to CTranslate2's Marian loader with three changes,
each needed for CTranslate2 to decode as our `generate()` does:

- the decoder starts from the embedding of `decoder_start_token_id` (`<s>`), as ours does (§3.1,
  "shifted right"); CTranslate2's Marian loader starts it from a zero vector instead, which only
  matches Marian's convention of starting from `<pad>`;
- every vocabulary row is kept: the Marian loader drops the last row, assuming it is Marian's
  `<pad>`, while our `<pad>` is id 0 and the last row is a real token;
- `<pad>` and `<s>` get a logit bias of -inf, so that the served model never generates them, as
  our generation config suppresses them.

Beam size, length penalty and length limits are options of CTranslate2's `translate_batch`, not
of the model: `beam_size=4` with `length_penalty=1.0` (its default) gives, nearly always, our
`generate()` with `length_penalty_type="hf"`. CTranslate2 has no GNMT length penalty (§6.1);
`engines.CTranslate2Engine`, which `--engine ctranslate2` of `translate`, `evaluate` and `serve` uses,
ranks CTranslate2's finished hypotheses by it instead, so that it nearly always translates as our
`generate()` does (the class says how nearly).
"""

import hashlib
import json
import logging
import pickle
import shutil
import tempfile
import threading
from pathlib import Path

import torch

from .hub import check_model_exists
from .marian import DEFAULT_MAX_POSITIONS, to_marian

logger = logging.getLogger(__name__)

# Beside an export: the size of its position table, which bounds what the engine may read and write.
EXPORT_SETTINGS_NAME = "vaswani_export.json"
# CTranslate2's loaders are registered in one table for the whole process, and ours carries the position table's
# size of the export in progress: exports from several threads take turns.
_EXPORT_LOCK = threading.Lock()


def pickled_code_refused(model: str | Path) -> OSError:
    """The one-line error for PyTorch weights of `model` whose pickle holds more than tensors (code to run).

    torch.load(weights_only=True), which transformers loads PyTorch weights with, refuses them in a message of
    20 lines. See docs/robustness.md, "Bad input".
    """
    return OSError(
        f"{model}: its PyTorch weights (pytorch_model*.bin) are a pickle of more than tensors, which could run code: "
        "refused, nothing in it was run; use weights saved as model.safetensors, from a source you trust"
    )


def import_ctranslate2() -> tuple:
    """`ctranslate2` and its `converters.transformers` module.

    Raises:
        ImportError: ctranslate2 is not installed; the message names the `serve` extra.
    """
    try:
        import ctranslate2
        import ctranslate2.converters.transformers as ct2_transformers
    except ImportError as error:
        raise ImportError(
            "Exporting to CTranslate2 needs the ctranslate2 package: pip install 'vaswani-transformer[serve]'."
        ) from error
    return ctranslate2, ct2_transformers


def _register_loader(max_positions: int) -> None:
    """Register (again) the CTranslate2 loader of `VaswaniConfig` models, with this position table size."""
    _, ct2 = import_ctranslate2()

    class VaswaniLoader(ct2.MarianMTLoader):
        @property
        def architecture_name(self) -> str:
            return "AutoModelForSeq2SeqLM"  # resolves to our class once the package is imported

        def get_model_spec(self, model):
            marian = to_marian(model, max_position_embeddings=max_positions)
            marian.config.normalize_before = False
            marian.config.normalize_embedding = False
            # BartLoader's spec, without MarianMTLoader's removal of the last vocabulary row.
            spec = ct2.BartLoader.get_model_spec(self, marian)
            bias = marian.final_logits_bias.squeeze(0).clone()
            bias[[t for t in (model.config.pad_token_id, model.config.bos_token_id) if t is not None]] = -torch.inf
            spec.decoder.projection.bias = bias
            return spec

        def set_decoder(self, spec, decoder):
            ct2.BartLoader.set_decoder(self, spec, decoder)  # no start_from_zero_embedding

        def set_config(self, config, model, tokenizer):
            vocabulary = self.get_vocabulary(model, tokenizer)
            if model.config.bos_token_id is not None:  # models imported from Marian have none
                config.bos_token = vocabulary[model.config.bos_token_id]
            config.eos_token = vocabulary[model.config.eos_token_id]
            config.unk_token = tokenizer.unk_token or vocabulary[model.config.eos_token_id]
            config.decoder_start_token = vocabulary[model.config.decoder_start_token_id]

        def get_vocabulary(self, model, tokenizer):
            tokens = ct2.ModelLoader.get_vocabulary(self, model, tokenizer)[: model.config.vocab_size]
            # Rows beyond the tokenizer's (embeddings resized to a round size) need distinct names.
            return tokens + [f"<unused_{i}>" for i in range(len(tokens), model.config.vocab_size)]

    ct2.register_loader("VaswaniConfig")(VaswaniLoader)


def write_ctranslate2_export(
    model_dir: str | Path,
    output_dir: str | Path,
    quantization: str | None = None,
    max_positions: int = DEFAULT_MAX_POSITIONS,
    force: bool = False,
) -> Path:
    """`vaswani-transformer export-ctranslate2`: convert a saved model to a CTranslate2 model directory, now.

    The conversion goes through `ctranslate2.converters.TransformersConverter`; the model directory
    must hold the tokenizer too (CTranslate2 stores the vocabulary as token strings). Serve it with
    `ctranslate2.Translator(output_dir).translate_batch(batch_of_token_lists, beam_size=4)`, where
    the tokens are `tokenizer.convert_ids_to_tokens(tokenizer(text).input_ids)` (with `</s>`).
    `ensure_ctranslate2_export` is the one to call for an export kept up to date with the model.

    See docs/performance.md, "Serving with CTranslate2".

    Args:
        model_dir: a directory written by `save_pretrained` (model and tokenizer), as `train` writes.
        output_dir: where the CTranslate2 model (`model.bin`, `config.json`, vocabulary) goes.
        quantization: weight type to store ("int8", "int8_float32", "float16", "bfloat16", ...);
            None keeps float32. CTranslate2 can also quantize when loading (`compute_type=`).
        max_positions: longest source or target, in tokens, the exported model can handle; recorded
            beside it (`vaswani_export.json`) for `CTranslate2Engine`.
        force: overwrite `output_dir` if it holds an earlier export.

    Returns:
        `output_dir`.

    Raises:
        ImportError: ctranslate2 is not installed.
        OSError: `model_dir` holds no model or no tokenizer, or PyTorch weights that are a pickle of more than
            tensors.
        ValueError: the model uses an option CTranslate2's Marian format cannot express (see
            `marian.to_marian`), `output_dir` exists and `force` is False, `output_dir` is or holds
            `model_dir` or holds something other than an export, or `max_positions` is below 1.
    """
    import vaswani_transformer  # noqa: F401  (AutoConfig and AutoModelForSeq2SeqLM must know our classes)

    model_dir, output_dir = Path(model_dir), Path(output_dir)
    _check_export_paths(model_dir, output_dir, force)
    if max_positions < 1:
        raise ValueError(f"max_positions must be a positive number of tokens, got {max_positions}.")
    _, ct2 = import_ctranslate2()
    # Taken before converting: weights replaced during the conversion must not be recorded as exported.
    settings = {"max_positions": max_positions, "weights_sha256": _weights_digest(model_dir)}
    with _EXPORT_LOCK:
        _register_loader(max_positions)
        converter = ct2.TransformersConverter(str(model_dir))
        try:
            exported = Path(converter.convert(str(output_dir), quantization=quantization, force=force))
        except pickle.UnpicklingError as error:
            raise pickled_code_refused(model_dir) from error
    (exported / EXPORT_SETTINGS_NAME).write_text(json.dumps(settings) + "\n")
    return exported


def _check_export_paths(model_dir: Path, output_dir: Path, force: bool) -> None:
    # A model with its tokenizer, exported where it deletes neither the model nor files of another kind.
    if not (model_dir / "config.json").is_file():
        raise OSError(f"{model_dir} holds no saved model (no config.json); pass a directory written by `train`.")
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise OSError(f"{model_dir} holds no tokenizer; CTranslate2 needs one: save it with tokenizer.save_pretrained.")
    if output_dir.resolve() == model_dir.resolve() or output_dir.resolve() in model_dir.resolve().parents:
        raise ValueError(f"{output_dir} holds the model {model_dir}, which the export would delete; give another one.")
    if output_dir.exists() and not force:
        raise ValueError(f"{output_dir} exists; remove it or pass --force to overwrite it.")
    _check_holds_no_other_files(output_dir)


def _check_holds_no_other_files(ct2_dir: Path) -> None:
    # An export may replace an earlier export, or an empty directory: nothing else.
    if ct2_dir.exists() and not (ct2_dir / "model.bin").is_file() and (not ct2_dir.is_dir() or any(ct2_dir.iterdir())):
        raise ValueError(f"{ct2_dir} exists and holds no CTranslate2 model; give a new or empty directory.")


def _weights_digest(model_dir: Path) -> str | None:
    # What an export was made from, by content: a model directory's weights may be replaced by others of the same
    # size and time (a copied checkpoint).
    digest = hashlib.sha256()
    files = sorted(model_dir.glob("*.safetensors"))
    for path in files:
        with path.open("rb") as stream:
            digest.update(hashlib.file_digest(stream, "sha256").digest())
    return digest.hexdigest() if files else None


def _made_from(ct2_dir: Path, digest: str | None) -> bool:
    # Whether `ct2_dir` holds an export of the weights whose `_weights_digest` is `digest`.
    return (
        (ct2_dir / "model.bin").is_file()
        and digest is not None
        and export_settings(ct2_dir).get("weights_sha256") == digest
    )


def export_settings(ct2_dir: Path) -> dict:
    """What an export records beside it (`vaswani_export.json`): its position table size, its weights' SHA-256."""
    # Exports made before the settings file was written used the default table and recorded no weights.
    settings = ct2_dir / EXPORT_SETTINGS_NAME
    return json.loads(settings.read_text()) if settings.is_file() else {"max_positions": DEFAULT_MAX_POSITIONS}


def ensure_ctranslate2_export(model: str, ct2_dir: str | Path | None = None) -> Path:
    """The CTranslate2 export of `model`, up to date: made on first use, and again when the model's weights change.

    See docs/serving.md, "Engines".

    Args:
        model: a model directory, or a Hub id (downloaded with `snapshot_download`).
        ct2_dir: where the export lives; default `MODEL_DIR/ctranslate2/`, and for a Hub id
            `HF_HOME/vaswani_transformer/ctranslate2/ORG--NAME--COMMIT/` (`HF_HOME` is huggingface_hub's,
            `~/.cache/huggingface` unless set): the Hub's cache holds the repository's files alone.

    Returns:
        The export's directory.

    Raises:
        ImportError: ctranslate2 is not installed.
        ValueError: `ct2_dir` exists and holds something other than a CTranslate2 model, or, given
            explicitly, an export of other weights (it is never overwritten then), or from
            `write_ctranslate2_export`.
        OSError: `model` is a local path that does not exist, the export's directory cannot be written (read-only,
            say; the message names `--ctranslate2-dir`), or from `write_ctranslate2_export`.

    An export is reused while the weights it was made from (their SHA-256, recorded beside it) are
    the model's; in the default place, an export of other weights, or one that predates the record,
    is made again.
    """
    check_model_exists(model)
    local, default = _model_files_and_default_export(model)
    target = Path(ct2_dir) if ct2_dir else default
    digest = _weights_digest(local)
    if _made_from(target, digest):
        return target
    _check_holds_no_other_files(target)
    if ct2_dir and digest is not None and (target / "model.bin").is_file():  # the user's: perhaps another model's
        raise ValueError(
            f"{target} holds a CTranslate2 export of other weights than {model}'s (or one too old to say); "
            f"replace it with `vaswani-transformer export-ctranslate2 {model} {target} --force`, or give another "
            "--ctranslate2-dir."
        )
    _export_into_place(model, local, target, digest)
    logger.info("Exported %s to CTranslate2 in %s", model, target)
    return target


def _model_files_and_default_export(model: str) -> tuple[Path, Path]:
    # The directory of the model's files (a Hub id's snapshot), and where its export lives unless the user says.
    if Path(model).is_dir():
        return Path(model), Path(model) / "ctranslate2"
    from huggingface_hub import constants, snapshot_download

    local = Path(snapshot_download(model))  # .../snapshots/COMMIT
    exports = Path(constants.HF_HOME) / "vaswani_transformer" / "ctranslate2"
    return local, exports / f"{model.replace('/', '--')}--{local.name}"


def _export_into_place(model: str, local: Path, target: Path, digest: str | None) -> None:
    # Into a private directory first, so that a process that dies half-way leaves no half export behind, and
    # two exports at once (threads or processes) never write into one.
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    except OSError as error:
        raise OSError(
            f"cannot write the CTranslate2 export of {model} into {target.parent} ({error.strerror or error}): give a "
            "writable directory for it with --ctranslate2-dir (ct2_dir=)"
        ) from error
    try:
        write_ctranslate2_export(local, partial, force=True)
        if not _made_from(target, digest):  # else another export of these weights finished first: keep it
            shutil.rmtree(target, ignore_errors=True)
            try:
                partial.rename(target)
            except OSError:
                # Another export of these weights took the place between the two lines above: use it.
                if not _made_from(target, digest):
                    raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
