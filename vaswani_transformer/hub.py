"""Saving a translator so that it loads anywhere: with the package, without it, and as a pipeline."""

import shutil
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from . import pipeline_translation

# `pipeline("translation", model=..., trust_remote_code=True)` finds the class through this entry of
# config.json (transformers 5 removed its own translation task).
CUSTOM_PIPELINES = {
    "translation": {"impl": "pipeline_translation.TranslationPipeline", "pt": ["AutoModelForSeq2SeqLM"]}
}


def save_translator(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, output_dir: str | Path) -> Path:
    """Write model (safetensors), config, generation config, tokenizer and the code to load them.

    `save_pretrained` copies the modeling and configuration files (the classes are registered for
    the Auto classes), so `trust_remote_code=True` loads the directory without this package; the
    translation pipeline's file is copied beside them.

    Args:
        model: the model to save.
        tokenizer: its tokenizer.
        output_dir: created if missing; files already there are overwritten.

    Returns:
        `output_dir` as a `Path`.
    """
    output_dir = Path(output_dir)
    model.config.custom_pipelines = CUSTOM_PIPELINES
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    shutil.copy(pipeline_translation.__file__, output_dir / "pipeline_translation.py")
    return output_dir
