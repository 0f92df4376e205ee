"""Engines: what turns a batch of sentences into their translations, the model's `generate()` or its CTranslate2 export.

`translate`, `evaluate` and `serve` load one with `load_engine` from an `InferenceConfig`, and drive it through
`Engine.translate`, `Engine.hypotheses` and `Engine.scored_hypotheses` alone: which engine runs is decided here,
once, never in the code that batches and reports. Both decode as the paper does (§6.1): beam 4, GNMT length penalty
0.6, output at most input length + 50; both take a glossary (`glossary.Glossary`, constrained beam search) and give
each translation a confidence (`Hypothesis`).
"""

import json
import logging
import pickle
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..data.tokenizer import check_tokenizer_matches, tokenizer_lock
from ..exchange.ctranslate2 import ensure_ctranslate2_export, export_settings, import_ctranslate2, pickled_code_refused
from ..exchange.hub import check_model_exists
from ..model.compat_vaswani import VERY_LARGE_INTEGER
from ..model.generation_vaswani import (
    PAPER_MAX_LENGTH_B,
    VaswaniGenerationMixin,
    check_length_penalty,
    check_num_beams,
    gnmt_length_penalty,
)
from .config import InferenceConfig
from .cpu_kernels import use_pinned_products
from .glossary import Glossary, suffix_ids

logger = logging.getLogger(__name__)


def load_translator(model_dir: str, device: str | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a saved model (in eval mode) and its tokenizer from a directory or Hub id, and check that they fit.

    The model computes with PyTorch's own kernels unless `VASWANI_ONEDNN_MIN_PRODUCT` opts in to oneDNN's
    (`cpu_kernels.use_pinned_products`), which the log then says. See docs/robustness.md, "Bad input".

    Args:
        model_dir: what `from_pretrained` accepts.
        device: "cpu", "cuda", "cuda:1", ...; None picks CUDA when available.

    Raises:
        OSError: the directory does not exist or holds no tokenizer, its weights file is damaged or a pickle of
            more than tensors (refused, never run), or neither a directory nor the Hub holds such a model.
        ValueError: `device` is no torch device or CUDA on a machine without it, `config.json` holds impossible values
            (from `VaswaniConfig`), the tokenizer does not match the model (see `check_tokenizer_matches`), or
            `VASWANI_ONEDNN_MIN_PRODUCT` is not a number.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"device {device!r} is no torch device; give e.g. cpu, cuda or cuda:0.") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {device!r}: this PyTorch sees no CUDA GPU; use --device cpu, or a CUDA build of torch."
        )
    local = Path(model_dir).expanduser()
    if local.is_dir() and not any((local / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise OSError(f"{model_dir} holds no tokenizer (tokenizer.json); save one beside the model, as `train` does.")
    check_model_exists(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    except SafetensorError as error:
        raise OSError(f"{model_dir}: model.safetensors is damaged ({error}); copy or download it again.") from error
    except pickle.UnpicklingError as error:
        raise pickled_code_refused(model_dir) from error
    except OSError as error:
        if local.is_dir():
            raise
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise OSError(
            f"{model_dir} is not a directory here, and loading it from the Hub failed: {first_line}"
        ) from error
    check_tokenizer_matches(model.config, tokenizer, model_dir)
    if kernels := use_pinned_products(model):
        logger.warning("%s: %s.", model_dir, kernels)
    return model.to(device).eval(), tokenizer


def source_length_limit(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The longest source, in tokens with `</s>`, that `translate` gives the model, or None for no limit.

    The tokenizer's `model_max_length` (training sets it to the longest training sentence,
    `--max-length`) and, for learned positions (Table 3 row E), `max_position_embeddings`, beyond
    which the model has no position vector. Sinusoidal positions (§3.5) set no limit of their own.
    """
    limits = [tokenizer.model_max_length] if tokenizer.model_max_length < VERY_LARGE_INTEGER else []
    if getattr(model.config, "position_embedding_type", None) == "learned":
        limits.append(model.config.max_position_embeddings)
    return min(limits, default=None)


@dataclass(frozen=True)
class Hypothesis:
    """A translation and its confidence: the mean log-probability of its tokens.

    `confidence` is log P(Y|X) / |Y|, in nats: the model's log-probability of the translation's tokens (`</s>`
    included, with the decoder start as context), divided by their number, |Y|, without the length penalty that ranked
    it; 0 is certainty, and lower is less sure. It is None for a blank source, which no model translates.

    Attributes:
        text: the translation, detokenized.
        confidence: log P(Y|X) / |Y|, or None.
    """

    text: str
    confidence: float | None


# A glossary for every sentence of a call, or one for each (None for a sentence without).
Glossaries = Glossary | Sequence[Glossary | None] | None


class Engine:
    """A translator of batches: the interface both engines share.

    Attributes:
        name: "torch" or "ctranslate2", as `--engine` names it.
        tokenizer: the model's tokenizer, which measures sources against `source_limit`.
        generation_config: the model's `GenerationConfig` (its own decoding, §6.1).
        source_limit: the longest source, in tokens with `</s>`, the engine reads whole; None for no limit.
        limit_name: what sets `source_limit`, for messages.
        runs_in_cpu_workers: whether `translation.map_in_workers` may fork it into CPU processes.
        beam_size: the beam search's beams where they differ from the generation config's; None for its own.
    """

    name: str
    tokenizer: PreTrainedTokenizerBase
    generation_config: GenerationConfig
    source_limit: int | None
    limit_name: str
    runs_in_cpu_workers: bool = False
    beam_size: int | None = None

    def translate(self, sentences: list[str], glossary: Glossaries = None) -> list[str]:
        """One translation per sentence, in order, from one batch; blank sentences give "" without the model.

        Sources over `source_limit` are truncated to it: callers refuse them first where they must. With a
        `glossary`, see `scored_hypotheses`.

        See docs/serving.md, "Engines".
        """
        return [found[0] for found in self.hypotheses(sentences, 1, glossary)]

    def hypotheses(self, sentences: list[str], count: int, glossary: Glossaries = None) -> list[list[str]]:
        """The `count` best translations of each sentence (n-best of the beam search), best first, from one batch.

        The best is `translate`'s: the beam search is the same, only more of its finished hypotheses are kept.
        A blank sentence gives `[""]` without the model. With a `glossary`, see `scored_hypotheses`.

        See docs/serving.md, "Alternatives".

        Raises:
            ValueError: `count` below 1 or above the beam size (the search finds no more).
        """
        return [[h.text for h in found] for found in self._search(sentences, count, glossary, scores=False)]

    def scored_hypotheses(
        self, sentences: list[str], count: int = 1, glossary: Glossaries = None
    ) -> list[list[Hypothesis]]:
        """`hypotheses`, each with its confidence (`Hypothesis`): the first of each is `translate`'s translation.

        With a `glossary` (one for all sentences, or one per sentence, None for none), a sentence that holds a
        source term (`Glossary.matches`) is translated by constrained beam search, which puts the target terms into
        every hypothesis, each as a whole word (`glossary.suffix_ids`), unless the length limit ends it first
        (`model.constraints_vaswani.ConstrainedBeamSearch`); a sentence that holds none is translated exactly as
        without a glossary.

        Raises:
            ValueError: `count` below 1 or above the beam size (the search finds no more); `glossary` a list of
                another length than `sentences`; a target term with a special token (`Glossary.target_ids`); a
                sentence with a term and a beam size of 1 (greedy search).
        """
        return self._search(sentences, count, glossary, scores=True)

    def _search(self, sentences: list[str], count: int, glossary: Glossaries, scores: bool) -> list[list[Hypothesis]]:
        beams = self.generation_config.num_beams if self.beam_size is None else self.beam_size
        if not 1 <= count <= max(beams or 1, 1):
            raise ValueError(f"{count} hypotheses asked for: the beam search of {beams} beams gives 1 to {beams}.")
        kept = [i for i, sentence in enumerate(sentences) if sentence.strip()]
        terms = self._glossary_ids(sentences, glossary, kept)
        if terms is not None and (beams or 1) < 2:
            raise ValueError(f"A glossary needs beam search of at least 2 beams (num_beams, --num-beams); got {beams}.")
        found: list[list[Hypothesis]] = [[Hypothesis("", None)] for _ in sentences]
        if kept:
            batch = self._translate_batch([sentences[i] for i in kept], count, terms, scores)
            for i, each in zip(kept, batch, strict=True):
                found[i] = each
        return found

    def _glossary_ids(self, sentences: list[str], glossary: Glossaries, kept: list[int]) -> list | None:
        # `generate`'s glossary_ids for the sentences `kept`, or None where none holds a term (the call without).
        if glossary is None:
            return None
        per_sentence = [glossary] * len(sentences) if isinstance(glossary, Glossary) else list(glossary)
        if len(per_sentence) != len(sentences):
            raise ValueError(
                f"{len(per_sentence)} glossaries for {len(sentences)} sentences: give one glossary, or one per "
                "sentence (None for none)."
            )
        terms: list[list[list[int]]] = [[] for _ in kept]
        for each in {id(g): g for g in per_sentence if g is not None}.values():
            mine = [n for n, i in enumerate(kept) if per_sentence[i] is each]
            for n, ids in zip(mine, each.target_ids([sentences[kept[n]] for n in mine], self.tokenizer), strict=True):
                terms[n] = ids
        return terms if any(terms) else None

    def _translate_batch(
        self, sentences: list[str], count: int, terms: list[list[list[int]]] | None, scores: bool
    ) -> list[list[Hypothesis]]:
        # The `count` best of each non-blank sentence; `terms` as `generate`'s glossary_ids, None for none; the
        # confidences where `scores` (or where they come at no cost), else None.
        raise NotImplementedError


class TorchEngine(Engine):
    """Translates with the model's own `generate()` (§6.1: beam 4, GNMT length penalty 0.6, input length + 50).

    Args:
        model, tokenizer: from `load_translator`.
        generate_kwargs: overrides of the generation config, e.g. `{"num_beams": 1}`.

    Raises:
        ValueError: a beam size below 1 or a length penalty that is no finite number.
    """

    name = "torch"

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, generate_kwargs: dict | None = None
    ) -> None:
        self.model, self.tokenizer, self.generate_kwargs = model, tokenizer, dict(generate_kwargs or {})
        check_num_beams(self.generate_kwargs.get("num_beams"))
        if self.generate_kwargs.get("length_penalty") is not None:
            check_length_penalty(self.generate_kwargs["length_penalty"])
        self.generation_config = model.generation_config
        self.source_limit = source_length_limit(model, tokenizer)
        learned = self.source_limit is not None and self.source_limit < tokenizer.model_max_length
        self.limit_name = "max_position_embeddings" if learned else "the tokenizer's model_max_length"
        self.runs_in_cpu_workers = model.device.type == "cpu"
        self.beam_size = self.generate_kwargs.get("num_beams")
        self._suffix_ids: list[int] | None = None  # the tokenizer's word continuations, for glossaries

    @torch.inference_mode()
    def _translate_batch(
        self, sentences: list[str], count: int, terms: list[list[list[int]]] | None, scores: bool
    ) -> list[list[Hypothesis]]:
        # The model's beam search gives each sequence's confidence with it (`BeamSearchOutput`); transformers' loops
        # (greedy search, sampling) do not, and a forward pass over their output gives it where it is asked for.
        limit = self.source_limit
        with tokenizer_lock(self.tokenizer):
            inputs = self.tokenizer(
                sentences, return_tensors="pt", padding=True, truncation=limit is not None, max_length=limit
            ).to(self.model.device)
        more = {"num_return_sequences": count} if count > 1 else {}
        if terms is not None:
            if not isinstance(self.model, VaswaniGenerationMixin):
                raise ValueError(
                    f"A glossary needs this package's constrained beam search, which {type(self.model).__name__} "
                    "lacks: translate with a model of this package."
                )
            if self._suffix_ids is None:  # the same for every call: made once
                self._suffix_ids = suffix_ids(self.tokenizer)
            more |= {"glossary_ids": terms, "glossary_suffix_ids": self._suffix_ids}
        output = self.model.generate(**inputs, **self.generate_kwargs, **more, return_dict_in_generate=True)
        confidence = getattr(output, "sequences_confidence", None)
        if confidence is None and scores:
            confidence = teacher_forced_confidence(self.model, inputs, output.sequences, self.generation_config)
        values = [None] * len(output.sequences) if confidence is None else confidence.tolist()
        texts = [text.strip() for text in self.tokenizer.batch_decode(output.sequences, skip_special_tokens=True)]
        found = [Hypothesis(text, value) for text, value in zip(texts, values, strict=True)]
        return [found[start : start + count] for start in range(0, len(found), count)]


def teacher_forced_confidence(
    model: PreTrainedModel, inputs: dict, sequences: torch.LongTensor, generation_config: GenerationConfig
) -> torch.Tensor:
    """log P(Y|X) / |Y| of each output sequence, from one forward pass of the model over it (teacher forcing).

    What `Hypothesis.confidence` is, for outputs whose search did not keep it (greedy search, sampling): the mean
    of the model's log-probabilities of each sequence's tokens after the decoder start, up to and including its first
    `</s>` (all of them for a sequence the length limit cut).

    Args:
        model: the model that generated `sequences`.
        inputs: its `input_ids` and `attention_mask`, `(batch, source_len)`.
        sequences: `(batch * count, output_len)` `generate()`'s output, the decoder start first, `count` a sentence.
        generation_config: gives the `</s>` id(s).

    Returns:
        `(batch * count,)` float32 confidences.
    """
    count = sequences.shape[0] // inputs["input_ids"].shape[0]
    source = {name: inputs[name].repeat_interleave(count, dim=0) for name in ("input_ids", "attention_mask")}
    logits = model(**source, decoder_input_ids=sequences[:, :-1]).logits
    targets = sequences[:, 1:]
    log_probs = logits.float().log_softmax(dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    ends = torch.isin(targets, torch.as_tensor(generation_config.eos_token_id, device=targets.device))
    counted = (ends.cumsum(dim=1) - ends.long()) == 0  # up to the first </s>, which is counted
    return (log_probs * counted).sum(dim=1) / counted.sum(dim=1).clamp(min=1)


class CTranslate2Engine(Engine):
    """Translates with CTranslate2 from the model's export (`write_ctranslate2_export`), as `generate()` decodes (§6.1).

    Beam size `num_beams` of the generation config (4), and its length penalty alpha (0.6). With
    `length_penalty_type="gnmt"` (the paper's, which CTranslate2 lacks) CTranslate2 searches with
    no length normalisation and returns its `num_beams` finished hypotheses with their
    log-probabilities, and the engine keeps the best by log P(Y|X) / ((5 + |Y|) / 6) ** alpha, |Y|
    counting `</s>`, as our beam search ranks them: both search by the beams' log-probabilities, stop
    a sentence once `num_beams` hypotheses have ended (`early_stopping=True`) and apply the penalty
    only to finished ones. With "hf", CTranslate2's own score / |Y| ** alpha is transformers'. The
    two searches still differ in details (which candidates may end at a step, ties), so a few
    sentences in a hundred may come out otherwise (docs/serving.md counts them on Multi30k). The
    output is at most the batch's longest source + `max_length_b` (50) tokens,
    where `generate()` limits each sentence by its own source, and at most the generation config's
    `max_new_tokens`, as with `generate()`; sources and outputs at most the export's
    `max_positions` (recorded beside it; 1,024 for exports that predate the record).

    Confidence (`Hypothesis`) comes from CTranslate2's `return_scores`: its score is log P(Y|X) / |Y| ** p, p
    the `length_penalty` it searched with (0 for "gnmt", alpha for "hf") and |Y| its hypothesis' tokens with `</s>`
    (which it leaves out of the hypothesis: one more than they have, or as many for a hypothesis that
    `max_decoding_length` cut), so that the confidence is that score * |Y| ** p / |Y|.

    Glossaries: CTranslate2 has no lexical constraints (its `target_prefix` forces only the start of a translation,
    issue OpenNMT/CTranslate2#739 asks for constrained beam search), so a sentence that holds a glossary term is
    translated by the model itself, with `TorchEngine`'s constrained beam search at this engine's beam size and
    length penalty (the model is loaded from `model` when the first such sentence comes). The batch is translated
    by CTranslate2 as without a glossary, so that every other sentence gets exactly the same translation.

    Args:
        ct2_dir: a directory written by `write_ctranslate2_export`.
        tokenizer: the model's tokenizer (CTranslate2 reads and writes token strings).
        generation_config: the model's `GenerationConfig`.
        num_beams: overrides the generation config's beam size.
        device: "cpu" or "cuda".
        length_penalty: overrides the generation config's alpha (in its `length_penalty_type`).
        model: the model directory or Hub id the export was made from, for sentences with glossary terms.

    Raises:
        ImportError: ctranslate2 is not installed.
        ValueError: a beam size below 1, or a length penalty that is not a finite number.
    """

    name = "ctranslate2"

    def __init__(
        self,
        ct2_dir: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        generation_config: GenerationConfig,
        num_beams: int | None = None,
        device: str = "cpu",
        length_penalty: float | None = None,
        model: str | None = None,
    ) -> None:
        ctranslate2, _ = import_ctranslate2()
        self.tokenizer, self.generation_config = tokenizer, generation_config
        self.translator = ctranslate2.Translator(str(ct2_dir), device=device, intra_threads=torch.get_num_threads())
        self.beam_size = check_num_beams(num_beams) or generation_config.num_beams or 1
        if length_penalty is None:
            length_penalty = generation_config.length_penalty if generation_config.length_penalty is not None else 1.0
        self.length_penalty = check_length_penalty(length_penalty)
        self.gnmt = getattr(generation_config, "length_penalty_type", None) == "gnmt" and self.beam_size > 1
        b = getattr(generation_config, "max_length_b", None)
        self.extra_length = b if b is not None else PAPER_MAX_LENGTH_B
        # The export's position table bounds sources and outputs alike; generate()'s max_new_tokens every batch.
        self.max_positions = export_settings(Path(ct2_dir))["max_positions"]
        self.max_output = min(generation_config.max_new_tokens or self.max_positions, self.max_positions)
        self.source_limit = min(tokenizer.model_max_length, self.max_positions)
        self.limit_name = "the CTranslate2 export's limit"
        self.model, self.device = model, device
        self._constrained: TorchEngine | None = None  # loaded for the first sentence with glossary terms
        self._loading = threading.Lock()

    def _translate_batch(
        self, sentences: list[str], count: int, terms: list[list[list[int]]] | None, scores: bool
    ) -> list[list[Hypothesis]]:
        with tokenizer_lock(self.tokenizer):
            ids = self.tokenizer(sentences, truncation=True, max_length=self.source_limit, verbose=False)["input_ids"]
        tokens = [self.tokenizer.convert_ids_to_tokens(row) for row in ids]
        max_decoding_length = min(max(map(len, tokens)) + self.extra_length, self.max_output)
        searched_penalty = 0.0 if self.gnmt else self.length_penalty
        results = self.translator.translate_batch(
            tokens,
            beam_size=self.beam_size,
            length_penalty=searched_penalty,
            num_hypotheses=self.beam_size if self.gnmt else count,
            return_scores=True,
            max_decoding_length=max_decoding_length,
            max_input_length=self.source_limit,  # CTranslate2 would otherwise cut sources at 1,024 tokens
            max_batch_size=len(tokens),
        )
        translations = []
        for result in results:
            # |Y|: CTranslate2 leaves </s> out of its hypotheses, and counts it in its score's length.
            lengths = [len(h) + (len(h) < max_decoding_length) for h in result.hypotheses]
            scored = list(zip(result.hypotheses, result.scores, lengths, strict=True))
            if self.gnmt:  # ranked with </s> counted, as our beam search ranks the hypotheses that end with it
                penalty = self.length_penalty
                scored.sort(key=lambda h: -h[1] / gnmt_length_penalty(len(h[0]) + 1, penalty))
            best = scored[:count]
            texts = [
                self.tokenizer.decode(self.tokenizer.convert_tokens_to_ids(h), skip_special_tokens=True)
                for h, *_ in best
            ]
            confidences = [score * length**searched_penalty / length for _, score, length in best]
            translations.append([Hypothesis(t.strip(), c) for t, c in zip(texts, confidences, strict=True)])
        if terms is not None:
            constrained = [i for i, each in enumerate(terms) if each]
            redone = self._constrained_engine()._translate_batch(
                [sentences[i] for i in constrained], count, [terms[i] for i in constrained], scores
            )
            for i, each in zip(constrained, redone, strict=True):
                translations[i] = each
        return translations

    def _constrained_engine(self) -> TorchEngine:
        # The model itself, at this engine's beam size and length penalty, for sentences with glossary terms.
        with self._loading:
            if self._constrained is None:
                if self.model is None:
                    raise ValueError(
                        "A glossary needs the model itself beside its CTranslate2 export (CTranslate2 has no "
                        "constrained decoding): make the engine with load_ctranslate2_engine, or give model=."
                    )
                translator, _ = load_translator(self.model, self.device)
                decoding = {"num_beams": self.beam_size, "length_penalty": self.length_penalty}
                self._constrained = TorchEngine(translator, self.tokenizer, decoding)
            return self._constrained


def load_ctranslate2_engine(
    model: str,
    device: str | None = None,
    num_beams: int | None = None,
    ct2_dir: str | Path | None = None,
    length_penalty: float | None = None,
) -> CTranslate2Engine:
    """`CTranslate2Engine` of `model` (exported on first use: `ensure_ctranslate2_export`) and its tokenizer.

    Args:
        model: a model directory or Hub id.
        device: "cpu" (default) or "cuda".
        num_beams: beam size; default the model's generation config (4, §6.1).
        ct2_dir: where the export lives; default `MODEL_DIR/ctranslate2/` (for a Hub id, see
            `ensure_ctranslate2_export`).
        length_penalty: alpha (§6.1) in the generation config's form; default the config's.

    Raises:
        ImportError: ctranslate2 is missing.
        OSError, ValueError: from `ensure_ctranslate2_export`; ValueError: a beam size below 1, a length penalty
            that is not finite, a device other than cpu, or cuda where CTranslate2 sees no GPU (refused
            before any export).
    """
    check_num_beams(num_beams)
    if length_penalty is not None:
        check_length_penalty(length_penalty)
    device = device or "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: the CTranslate2 engine runs on cpu or cuda.")
    ctranslate2, _ = import_ctranslate2()
    if device == "cuda" and ctranslate2.get_cuda_device_count() == 0:
        raise ValueError("device 'cuda': CTranslate2 sees no CUDA GPU here; use --device cpu.")
    exported = ensure_ctranslate2_export(model, ct2_dir)
    tokenizer = AutoTokenizer.from_pretrained(model)
    generation_config = GenerationConfig.from_pretrained(model)
    return CTranslate2Engine(exported, tokenizer, generation_config, num_beams, device, length_penalty, model)


def load_engine(model: str, config: InferenceConfig | None = None) -> Engine:
    """The engine `config` names, for a model directory or Hub id, with its decoding and device.

    See docs/serving.md, "Engines".

    Args:
        model: a model directory or Hub id.
        config: engine, device, `num_beams`, `length_penalty` and the CTranslate2 export's place; default
            `InferenceConfig()` (the torch engine, the model's own decoding).

    Raises:
        ImportError: ctranslate2 is missing (engine "ctranslate2").
        OSError, ValueError: from `load_translator` or `load_ctranslate2_engine`.
    """
    config = config or InferenceConfig()
    if config.engine == "ctranslate2":
        return load_ctranslate2_engine(
            model, config.device, config.num_beams, config.ctranslate2_dir, config.length_penalty
        )
    translator, tokenizer = load_translator(model, config.device)
    return TorchEngine(translator, tokenizer, config.generate_kwargs)


def _model_file(model: str, filename: str) -> Path | None:
    """`filename` of a local model directory or Hub repository, or None where it has none."""
    if Path(model).is_dir():
        path = Path(model) / filename
        return path if path.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(model, filename))
    except (OSError, EntryNotFoundError):  # no such file, or no Hub and no cached copy
        return None


def model_languages(model: str, source_lang: str | None = None, target_lang: str | None = None) -> tuple[str, str]:
    """The language pair a model translates: (source, target), ISO 639-1 codes such as ("en", "de").

    Read from `config.json` (`VaswaniConfig.source_lang`, `target_lang`), else from `training_config.json`
    (`source_lang`, `target_lang`, written by `train`), else from the model card's `language: [source, target]`
    (`model_card.write_model_card`); `source_lang` and `target_lang`, when given, override what the files say (e.g.
    for a converted Marian model, which has none of them).

    See docs/serving.md, "Serving a translator over HTTP".

    Args:
        model: a model directory or Hub id.
        source_lang, target_lang: codes that take precedence over the files.

    Raises:
        OSError: `model` is a local path that does not exist (`hub.check_model_exists`).
        ValueError: a language is given by neither the arguments nor the files.
    """
    check_model_exists(model)
    if source_lang and target_lang:
        return source_lang, target_lang
    found: tuple[str | None, str | None] = (None, None)
    for name in ("config.json", "training_config.json"):
        if None in found and (config_file := _model_file(model, name)) is not None:
            saved = json.loads(config_file.read_text(encoding="utf-8"))
            found = (saved.get("source_lang"), saved.get("target_lang"))
    if None in found and (card_file := _model_file(model, "README.md")) is not None:
        from huggingface_hub import ModelCard

        language = ModelCard.load(card_file).data.language
        if isinstance(language, list) and len(language) == 2:  # a pair; more would be ambiguous
            found = (language[0], language[1])
    source, target = source_lang or found[0], target_lang or found[1]
    if not source or not target:
        raise ValueError(
            f"the languages of {model} are unknown: it has no training_config.json with source_lang and "
            "target_lang and no model card with `language: [source, target]`; pass --source-lang and --target-lang."
        )
    return source, target
