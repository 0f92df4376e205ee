"""Loading a saved model: weights that the model its `config.json` describes lacks, or has in other sizes, refused.

`VaswaniPreTrainedModel._finalize_model_loading` calls `check_weights_fit` once `from_pretrained` has read the
weights, before transformers would initialise the missing ones with a warning only (a model that translates
garbage) or stop with a report for weights of other sizes. The saved code does the same without the package.
"""

import re
from typing import Any

from transformers import PreTrainedModel

from .configuration_vaswani import VaswaniConfig

# The config fields that set the length of some weight's axis, and the layer a weight belongs to.
_SIZE_FIELDS = ("vocab_size", "d_model", "d_ff", "d_k", "d_v", "max_position_embeddings")
_LAYER = re.compile(r"(?:^|\.)(encoder|decoder)\.layers\.(\d+)\.")


def check_weights_fit(model: PreTrainedModel, loading_info: Any, where: str, sizes_may_differ: bool = False) -> None:
    """Refuse weights that the model `config.json` describes lacks, or has in other sizes.

    Args:
        model: the model `from_pretrained` built from `config.json`, the weights read into it.
        loading_info: transformers' report of that reading (`LoadStateDictInfo`): `missing_keys`,
            `unexpected_keys`, and `mismatched_keys` as (name, shape in the file, shape in the model).
        where: the model's directory or Hub id, for the message.
        sizes_may_differ: `from_pretrained`'s `ignore_mismatched_sizes`: weights of other shapes are initialised
            anew, as the caller asked, not refused.

    Raises:
        ValueError: the file lacks a weight of the model (the tied copies of the shared embedding, §3.4, are
            never stored), holds one the model has not (but those `_keys_to_ignore_on_load_unexpected` names), or
            one of another shape. The message names the field of config.json and both values where the weights
            tell them (layers, d_ff, vocab_size, ...), and the first few weights.
    """
    # Names of weights stored under another name: those transformers ties once they are read (the output projection,
    # §3.4) and the parameters of a module that has several names (the embedding the two stacks share).
    tied, seen = set(getattr(model, "all_tied_weights_keys", None) or {}), set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            tied.add(name)
        seen.add(id(parameter))
    missing = sorted(set(loading_info.missing_keys) - tied)
    ignored = model._keys_to_ignore_on_load_unexpected or ()
    unexpected = sorted(name for name in loading_info.unexpected_keys if not any(re.search(p, name) for p in ignored))
    mismatched = [] if sizes_may_differ else sorted(loading_info.mismatched_keys)
    if mismatched:
        problem = _size_that_differs(model.config, mismatched)
    elif missing or unexpected:
        kinds = (("missing", missing), ("left over", unexpected))
        listed = "; ".join(f"{kind}: {_first_few(names)}" for kind, names in kinds if names)
        problem = f"{_layers_that_differ(model.config, missing, unexpected)} ({listed})"
    else:
        return
    raise ValueError(f"{where}: {problem}; use the config.json saved with these weights.")


def _size_that_differs(config: VaswaniConfig, mismatched: list[tuple[str, tuple, tuple]]) -> str:
    # The first axis whose length in the model is the value of exactly one size field names that field.
    first = None
    for name, in_file, in_model in mismatched:
        shapes = f"{name}: {tuple(in_file)} in the file, {tuple(in_model)} in the model"
        first = first or shapes
        for file_length, model_length in zip(in_file, in_model, strict=False):
            fields = [field for field in _SIZE_FIELDS if getattr(config, field, None) == model_length]
            if file_length != model_length and len(fields) == 1:
                said = f"config.json has {fields[0]}={model_length} but the weights have {fields[0]}={file_length}"
                return f"{said} ({shapes})"
    return f"the weights do not fit config.json ({first})"


def _layers_that_differ(config: VaswaniConfig, missing: list[str], unexpected: list[str]) -> str:
    # Layers the file lacks from the first on, or has beyond the last: the file's stack has that many.
    for stack in ("encoder", "decoder"):
        lacking = {int(m[2]) for name in missing if (m := _LAYER.search(name)) and m[1] == stack}
        over = {int(m[2]) for name in unexpected if (m := _LAYER.search(name)) and m[1] == stack}
        if lacking or over:
            field = f"{stack}_layers"
            in_file = min(lacking) if lacking else max(over) + 1
            return f"config.json has {field}={getattr(config, field)} but the weights have {field}={in_file}"
    return "the weights do not fit config.json"


def _first_few(names: list[str], count: int = 3) -> str:
    return ", ".join(names[:count]) + (f" and {len(names) - count} more" if len(names) > count else "")
