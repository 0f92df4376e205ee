"""Saving a translator so that it loads anywhere: with the package, without it (`trust_remote_code`), as a pipeline."""

from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..utils.files import give_umask_mode


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
