"""`ServedModel`: one model of the server, its language pair, its own `MicroBatcher`, and the way a request's texts
become sentences, are checked against its limits, translated and put back together.

`serve` holds one per language pair (`serve en-de=DIR1 de-en=DIR2`); each batches its own requests on its own
worker thread. See docs/serving.md, "Several models".
"""

import asyncio
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from ..data.segmentation import Alignment, Pieces, fit_to_limit
from ..data.text_format import Prepared, split_text
from ..inference.alignment import Aligner, format_alignment
from ..inference.confidence import piece_scores, scored_texts
from ..inference.engines import Hypothesis
from ..inference.glossary import Glossary
from .batcher import MicroBatcher
from .detection import LanguageDetector
from .requests import Limits, RequestError

# One text's sentences, and the function that puts their translations back (`text_format.split_text`).
_Split = tuple[list[str], Callable[[list[str]], str]]


@dataclass
class Translated:
    """The answer of one `ServedModel.translate`: one translation per text, its alternatives, and what was done.

    Attributes:
        texts: the translated texts, in order.
        alternatives: for each text, up to the alternatives asked for, each other than the text's translation.
        confidences: for each text, the confidence of its translation (`inference.confidence.scored_texts`), None
            for a text with nothing to translate.
        alternative_confidences: for each text, the confidence of each of its `alternatives`, in their order.
        alignments: for each text, its word alignment in Pharaoh's format (`alignment.format_alignment`), where
            asked for; else None.
        sentences: the sentences translated (pieces of over-long ones included), for `/metrics`.
    """

    texts: list[str]
    alternatives: list[list[str]]
    confidences: list[float | None]
    alternative_confidences: list[list[float | None]]
    alignments: list[str] | None
    sentences: int


@dataclass
class ServedModel:
    """One language pair of the server and what translates it.

    Attributes:
        source, target: the pair's ISO 639-1 codes.
        batcher: the model's own `MicroBatcher`, whose results are `Engine.scored_hypotheses`'.
        tokenizer: the model's tokenizer, copied (a fast tokenizer must not be called by two threads at once; this
            copy is called only on the event loop's thread).
        limits: what one request may ask for.
        split_sentences: whether texts are split into sentences (`InferenceConfig.split_sentences`).
        beams: the beam size, which bounds the alternatives (`Engine.hypotheses`).
        aligner: aligns translations to their sources, for HTML's markup and `alignments` (`alignment.aligner_for`).
        info: what `GET /health` says of the model (name, engine, batching).
    """

    source: str
    target: str
    batcher: MicroBatcher
    tokenizer: PreTrainedTokenizerBase
    limits: Limits
    split_sentences: bool
    beams: int
    aligner: Aligner
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokenizer = copy.deepcopy(self.tokenizer)

    def _count(self, sentences: list[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer(sentences, verbose=False)["input_ids"]] if sentences else []

    async def translate(
        self,
        texts: list[str],
        text_format: str,
        alternatives: int,
        is_list: bool,
        field: str = "q",
        glossary: Glossary | None = None,
        alignments: bool = False,
    ) -> Translated:
        """Translate a request's texts, sentence by sentence, with up to `alternatives` other translations each.

        `field` is what the refusals call the texts: `q` (`q[i]` for a list), or `file` (`POST /translate_file`).
        A sentence that holds a source term of `glossary` gets its target term (`Engine.scored_hypotheses`); the
        request's sentences are batched with other requests' all the same, each with its own request's glossary.
        HTML's inline markup is carried over by the word alignment of its sentences and their translations
        (`markup.split_html`, `self.aligner`), as `translate --input page.html` carries it; `alignments` (text
        only) gives each text's alignment too (`Translated.alignments`, as `translate --alignments` prints it).

        Text i's alternative k is the text rebuilt from the (k + 1)-th best translation of each of its sentences
        (the best where a sentence has no more), dropped where it equals the translation or an earlier alternative,
        as LibreTranslate drops them.

        See docs/serving.md, "The API".

        Raises:
            RequestError: markup that cannot be parsed, too many sentences, a sentence over the model's limit (with
                long_inputs "error"), alternatives over the beam, a glossary the model cannot take (400); a
                shutting-down server or a request past its deadline (503); a failed translation (500).
        """
        splits = self._split(texts, text_format)
        sentences = [sentence for found, _ in splits for sentence in found]
        self._check_counts(sum(bool(sentence.strip()) for sentence in sentences), alternatives, field)
        owner = [i for i, (found, _) in enumerate(splits) for _sentence in found]  # the text of each sentence
        pieces = self._fit(sentences, [f"{field}[{i}]" if is_list else field for i in owner])
        work = [k for k, piece in enumerate(pieces.texts) if piece.strip()]  # layout stays as it is
        self._check_glossary(glossary, [pieces.texts[k] for k in work])
        found: list[list[Hypothesis]] = [[Hypothesis("", None)] for _ in pieces.texts]
        hypotheses = await self._hypotheses(pieces, work, alternatives + 1, glossary)
        for k, each in zip(work, hypotheses, strict=True):
            found[k] = each
        ranked = [[each[min(rank, len(each) - 1)] for each in found] for rank in range(alternatives + 1)]
        # HTML's markup takes every rank's alignment, `alignments` the best's alone.
        aligned = await self._align(pieces.texts, ranked[: len(ranked) if text_format == "html" else int(alignments)])
        prepared = Prepared(pieces, [len(each) for each, _ in splits], [rebuild for _, rebuild in splits], sentences)
        versions = [
            prepared.finish([h.text for h in hypotheses], aligned[rank] if rank < len(aligned) else None)
            for rank, hypotheses in enumerate(ranked)
        ]
        # A text's confidence as `translate --scores` gives a line's: over all its tokens (`confidence.scored_texts`).
        scores = []
        for version, found in zip(versions, ranked, strict=True):
            pieces_scored = piece_scores(found, self._count([hypothesis.text for hypothesis in found]))
            scores.append([text.confidence for text in scored_texts(prepared, version, pieces_scored)])
        out, others, other_scores = [], [], []
        for i, best in enumerate(versions[0]):
            out.append(best.text)
            kept = [r for r in range(1, len(versions)) if versions[r][i].text not in {v[i].text for v in versions[:r]}]
            others.append([versions[r][i].text for r in kept])
            other_scores.append([scores[r][i] for r in kept])
        formatted = [format_alignment(each.alignment or []) for each in versions[0]] if alignments else None
        return Translated(out, others, scores[0], other_scores, formatted, len(work))

    def _split(self, texts: list[str], text_format: str) -> list[_Split]:
        # Each text's sentences, and the function that puts their translations back into the text.
        try:
            return [split_text(text, text_format, self.source, self.split_sentences) for text in texts]
        except ValueError as error:  # markup the HTML parser cannot read
            raise RequestError(f"Invalid request: {error}") from error

    def _check_counts(self, sentences: int, alternatives: int, field: str) -> None:
        # Refused before any tokenizing: more sentences than the limit, more alternatives than the beam search finds.
        if sentences > self.limits.sentence_limit:
            raise RequestError(
                f"Invalid request: {field} has {sentences} sentences, more than the limit of "
                f"{self.limits.sentence_limit} (--sentence-limit); send them in several requests"
            )
        if alternatives + 1 > max(self.beams, 1):
            raise RequestError(
                f"Invalid request: alternatives must be at most {self.beams - 1} with this server's beam search of "
                f"{self.beams} (--num-beams)"
            )

    def _check_glossary(self, glossary: Glossary | None, sentences: list[str]) -> None:
        # What the engine would fail on, refused before the request is queued: a target term with a special token,
        # terms without beam search.
        if glossary is None:
            return
        try:
            terms = glossary.target_ids(sentences, self.tokenizer)
        except ValueError as error:
            raise RequestError(f"Invalid request: {error}") from None
        if any(terms) and self.beams < 2:
            raise RequestError(
                f"Invalid request: a glossary needs beam search of at least 2 beams; this server's is {self.beams} "
                "(--num-beams)"
            )

    def _fit(self, sentences: list[str], fields: list[str]) -> Pieces:
        # The sentences cut to the model's limit; with long_inputs "error", the refusal of the first over it, named by
        # its field; with "truncate", whole (the engine cuts them).
        lengths = self._count(sentences)
        limit = self.limits.source_limit if self.limits.long_inputs != "truncate" else None
        if limit is not None and self.limits.long_inputs == "error" and lengths and max(lengths) > limit:
            where = fields[next(k for k, length in enumerate(lengths) if length > limit)]
            raise RequestError(
                f"Invalid request: {where} has a sentence of {max(lengths)} tokens, more than the model's limit of "
                f"{limit}; split it into shorter sentences"
            )
        return fit_to_limit(sentences, lengths, limit, lambda text: self._count([text])[0])

    async def _hypotheses(
        self, pieces: Pieces, work: list[int], count: int, glossary: Glossary | None
    ) -> list[list[Hypothesis]]:
        # Up to `count` translations of the pieces `work`, best first, from the batcher, its failures as refusals.
        try:
            future = self.batcher.submit(
                [pieces.texts[k] for k in work],
                [pieces.lengths[k] for k in work],
                self.limits.request_timeout,
                count,
                glossary,
            )
        except RuntimeError as error:  # the server is shutting down
            raise RequestError(str(error), 503) from None
        try:
            return await asyncio.wrap_future(future)
        except TimeoutError as error:  # busier than one request's deadline allows: 503, as overload
            raise RequestError(
                f"{error}: the server's limit (--request-timeout); send fewer sentences, or retry later",
                503,
                {"Retry-After": str(math.ceil(self.limits.request_timeout))},
            ) from None
        except Exception as error:
            raise RequestError(f"translation failed: {error}", 500) from error

    async def _align(self, sources: list[str], ranked: list[list[Hypothesis]]) -> list[list[Alignment]]:
        # Each rank's word alignments to `sources`, a batch of the batcher's size at a time, off the event loop (the
        # model is only read; the aligner locks its tokenizer).
        sources_all = [source for _ in ranked for source in sources]
        targets = [h.text for hypotheses in ranked for h in hypotheses]
        size = self.batcher.batch_size
        found: list[Alignment] = []
        try:
            for start in range(0, len(targets), size):
                end = start + size
                found += await asyncio.to_thread(self.aligner.align, sources_all[start:end], targets[start:end])
        except Exception as error:
            raise RequestError(f"aligning the translations failed: {error}", 500) from error
        return [found[r * len(sources) : (r + 1) * len(sources)] for r in range(len(ranked))]


def choose_model(
    models: dict[tuple[str, str], ServedModel], detector: LanguageDetector, source: str, target: str, text: str
) -> tuple[ServedModel, dict | None]:
    """The model of a request's pair (checked by `serving_requests.parse_languages`) and, for `source` "auto", the
    language detected in `text` (LibreTranslate's `detectedLanguage`, `{"confidence", "language"}`), else None.

    See docs/serving.md, "Language detection".

    Raises:
        RequestError: `text` was detected as a language no served model translates into `target` (400).
    """
    if source != "auto":
        return models[(source, target)], None
    detected = detector.detect(text)[0]  # one language for the request, as LibreTranslate detects
    if (detected["language"], target) not in models:
        raise RequestError(
            f"the text was detected as {detected['language']!r}, which this server does not translate into "
            f"{target!r} (GET /languages)"
        )
    return models[(detected["language"], target)], detected
