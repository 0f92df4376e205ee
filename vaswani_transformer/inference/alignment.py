"""Word alignments of translations, from the model's encoder-decoder attention (Garg et al., 2019).

fairseq's `--print-alignment` and Marian's `--alignment` read them off the attention of a chosen decoder layer: for
each target token, the source token it attends to most, averaged over the heads (Garg et al., 2019, "Jointly Learning
to Align and Translate with Transformer Models", §2: a late layer's average aligns best without training for it).
Here the attention comes from one teacher-forced forward pass of the torch model over the source and the translation
chosen, so that it is the same whichever engine decoded (torch or CTranslate2, whose beam search keeps no attention
by default), and costs one forward pass a batch, not a change to the search. Subword tokens are merged into words
(`segmentation.word_spans`), as both tools report them. The same attention read the other way (for each source
token, the target token that attends to it most) confirms the pairs both directions agree on, as symmetrized
alignments do (Koehn et al., 2003, "Statistical Phrase-Based Translation", §3: the intersection is precise): where a
source word has such pairs only those are kept, elsewhere the target-to-source ones. On the markup benchmark that
put a `<b>` around exactly the aligned word more often than fairseq's target-to-source pairs alone
(docs/translating-documents.md, "Word alignments").

See docs/translating-documents.md, "Word alignments".
"""

import bisect
import logging

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..data.segmentation import Alignment, word_spans
from ..data.tokenizer import tokenizer_lock
from .engines import Engine, TorchEngine, load_translator, source_length_limit

logger = logging.getLogger(__name__)

# The decoder layer whose encoder-decoder attention aligns, from the bottom (0); -1 is the last, which the markup
# benchmark measured best on the main job's model (docs/translating-documents.md, "Word alignments").
ALIGNMENT_LAYER = -1


class Aligner:
    """Aligns the words of sentences and their translations with a model's encoder-decoder attention.

    For each target token (`</s>` aside), the source token (`</s>` and padding aside) with the most attention, at
    the step that predicts it, in decoder layer `layer`, averaged over the heads (fairseq's
    `extract_hard_alignment`); and for each source token, the target token that gives it the most. Each pair of
    tokens is a pair of the words they belong to. A source word with pairs both directions give keeps those alone;
    another keeps its target-to-source pairs (see the module docstring). A word may be aligned to none.

    Thread-safe: the model is only read, and the tokenizer is called under its lock (`tokenizer_lock`).

    Args:
        model, tokenizer: a translator (`engines.load_translator`); attention "sdpa" (the default) or "eager",
            which give the weights (`output_attentions=True`); a fast tokenizer, whose offsets map tokens to words.
        layer: the decoder layer, from 0; negative counts from the top (-1, the last).

    Raises:
        ValueError: `layer` is not a layer of the model, or the tokenizer is a slow one (no offsets).
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, layer: int = ALIGNMENT_LAYER
    ) -> None:
        if not tokenizer.is_fast:
            raise ValueError(
                f"Aligning words takes a fast tokenizer, whose offsets map tokens to words; {type(tokenizer).__name__} "
                "is a slow one (a converted Marian model's)."
            )
        layers = model.config.decoder_layers
        if not -layers <= layer < layers:
            raise ValueError(
                f"alignment layer {layer} is no decoder layer: the model has {layers} (0 to {layers - 1})."
            )
        self.model, self.tokenizer, self.layer = model, tokenizer, layer
        self.source_limit = source_length_limit(model, tokenizer)

    @torch.inference_mode()
    def align(self, sources: list[str], targets: list[str]) -> list[Alignment]:
        """The word alignment of each source and its translation, in one forward pass.

        Args:
            sources: sentences.
            targets: their translations, aligned with `sources`.

        Returns:
            For each pair, its (source word, target word) pairs, sorted (Pharaoh's "i-j", both from 0, words as
            `segmentation.word_spans` counts them); `[]` where either side has no words.

        Raises:
            ValueError: the lists differ in length, or the model gives no attention weights (an attention
                implementation other than "sdpa" or "eager").
        """
        if len(sources) != len(targets):
            raise ValueError(f"{len(sources)} sources but {len(targets)} translations: give one translation each.")
        kept = [k for k, (source, target) in enumerate(zip(sources, targets, strict=True)) if word_spans(source)]
        kept = [k for k in kept if word_spans(targets[k])]
        found: list[Alignment] = [[] for _ in sources]
        if not kept:
            return found
        limit = self.source_limit
        with tokenizer_lock(self.tokenizer):
            source = self.tokenizer(
                [sources[k] for k in kept], padding=True, truncation=limit is not None, max_length=limit,
                return_offsets_mapping=True, return_tensors="pt",
            )  # fmt: skip
            target = self.tokenizer(
                [targets[k] for k in kept], padding=True, return_offsets_mapping=True, return_tensors="pt"
            )
        device = self.model.device
        labels = target["input_ids"].to(device)
        output = self.model(
            input_ids=source["input_ids"].to(device),
            attention_mask=source["attention_mask"].to(device),
            decoder_input_ids=self.model.prepare_decoder_input_ids_from_labels(labels),
            output_attentions=True,
            use_cache=False,
        )
        if not output.cross_attentions or output.cross_attentions[self.layer] is None:
            raise ValueError(
                "the model gave no attention weights: load it with attn_implementation='sdpa' or 'eager' to align."
            )
        # (batch, target tokens, source tokens): row q is the step that predicts target token q.
        weights = output.cross_attentions[self.layer].float().mean(dim=1).cpu()
        special = set(self.tokenizer.all_special_ids)
        valid_source = source["attention_mask"].bool() & ~_is_special(source["input_ids"], special)
        valid_target = target["attention_mask"].bool() & ~_is_special(target["input_ids"], special)
        source_best = weights.masked_fill(~valid_source[:, None, :], float("-inf")).argmax(dim=-1)  # per target token
        target_best = weights.masked_fill(~valid_target[:, :, None], float("-inf")).argmax(dim=-2)  # per source token
        for row, k in enumerate(kept):
            source_words = _token_words(source["offset_mapping"][row], valid_source[row], word_spans(sources[k]))
            target_words = _token_words(target["offset_mapping"][row], valid_target[row], word_spans(targets[k]))
            best_source, best_target = source_best[row].tolist(), target_best[row].tolist()
            forward = {(i, j) for q, js in enumerate(target_words) for j in js for i in source_words[best_source[q]]}
            backward = {(i, j) for p, ii in enumerate(source_words) for i in ii for j in target_words[best_target[p]]}
            agreed = forward & backward
            confirmed = {i for i, _ in agreed}
            found[k] = sorted(agreed | {(i, j) for i, j in forward if i not in confirmed})
        return found


def _is_special(ids: torch.Tensor, special: set[int]) -> torch.Tensor:
    return torch.isin(ids, torch.tensor(sorted(special), dtype=ids.dtype))


def _token_words(offsets: torch.Tensor, valid: torch.Tensor, words: list[tuple[int, int]]) -> list[list[int]]:
    # For each token, the words its characters overlap (none for special tokens, padding or whitespace alone).
    ends = [end for _, end in words]
    found = []
    for (start, end), keep in zip(offsets.tolist(), valid.tolist(), strict=True):
        first = bisect.bisect_right(ends, start)
        found.append([i for i in range(first, len(words)) if words[i][0] < end] if keep and end > start else [])
    return found


def format_alignment(pairs: Alignment) -> str:
    """Pharaoh's format, as fairseq and Marian print alignments: "0-0 1-2 2-1" (source word - target word)."""
    return " ".join(f"{i}-{j}" for i, j in pairs)


def aligner_for(engine: Engine, model: str | None = None, device: str | None = None) -> Aligner:
    """The aligner of an engine's translations: the torch engine's own model, else the torch model loaded from
    `model` (the CTranslate2 engine keeps no attention), on `device` (default: CUDA where available).

    Raises:
        ValueError: another engine without `model`; or from `engines.load_translator`.
        OSError: from `engines.load_translator`.
    """
    if isinstance(engine, TorchEngine):
        return Aligner(engine.model, engine.tokenizer)
    if model is None:
        raise ValueError(
            f"Aligning the {engine.name} engine's translations takes the torch model: give its directory or Hub id."
        )
    translator, tokenizer = load_translator(model, device)
    return Aligner(translator, tokenizer)


def needed_aligner(engine: Engine, aligner: Aligner | None, text_format: str, alignments: bool) -> Aligner | None:
    """The aligner a translation call needs (`translation.translate`'s arguments), or None: HTML's markup and
    `alignments` take one, by default the torch engine's own model (`aligner_for`).

    Without one for HTML (another engine, or a slow tokenizer, as a converted Marian model's, and no `aligner`), one
    warning (logged) says that the markup is placed by word order.

    Raises:
        ValueError: `alignments` for HTML, or without an aligner for an engine other than torch's or for a slow
            tokenizer.
    """
    if alignments and text_format == "html":
        raise ValueError("alignments count the words of text: translate HTML without them (its markup takes them).")
    if not alignments and text_format != "html":
        return None
    if aligner is None and isinstance(engine, TorchEngine) and engine.tokenizer.is_fast:
        aligner = aligner_for(engine)
    if aligner is None and not engine.tokenizer.is_fast:
        why = f"{type(engine.tokenizer).__name__} is a slow tokenizer: it gives no offsets to map tokens to words"
        if alignments:
            raise ValueError(f"Cannot align words: {why}. Translate without alignments.")
        logger.warning(f"Inline markup is placed by word order: {why}.")
        return None
    if aligner is None and alignments:
        raise ValueError(
            "alignments come from the torch model's attention: give aligner=alignment.aligner_for(engine, model_dir) "
            f"to align the {engine.name} engine's translations."
        )
    if aligner is None:
        logger.warning(
            f"No aligner for the {engine.name} engine: inline markup is placed by word order; give "
            "aligner=alignment.aligner_for(engine, model_dir) to place it by the words' alignment."
        )
    return aligner
