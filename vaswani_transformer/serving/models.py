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

from ..data.segmentation import Pieces, fit_to_limit
from ..data.text_format import split_text
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
        sentences: the sentences translated (pieces of over-long ones included), for `/metrics`.
    """

    texts: list[str]
    alternatives: list[list[str]]
    sentences: int


@dataclass
class ServedModel:
    """One language pair of the server and what translates it.

    Attributes:
        source, target: the pair's ISO 639-1 codes.
        batcher: the model's own `MicroBatcher`.
        tokenizer: the model's tokenizer, copied (a fast tokenizer must not be called by two threads at once; this
            copy is called only on the event loop's thread).
        limits: what one request may ask for.
        split_sentences: whether texts are split into sentences (`InferenceConfig.split_sentences`).
        beams: the beam size, which bounds the alternatives (`Engine.hypotheses`).
        info: what `GET /health` says of the model (name, engine, batching).
    """

    source: str
    target: str
    batcher: MicroBatcher
    tokenizer: PreTrainedTokenizerBase
    limits: Limits
    split_sentences: bool
    beams: int
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tokenizer = copy.deepcopy(self.tokenizer)

    def _count(self, sentences: list[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer(sentences, verbose=False)["input_ids"]] if sentences else []

    async def translate(
        self, texts: list[str], text_format: str, alternatives: int, is_list: bool, field: str = "q"
    ) -> Translated:
        """Translate a request's texts, sentence by sentence, with up to `alternatives` other translations each.

        `field` is what the refusals call the texts: `q` (`q[i]` for a list), or `file` (`POST /translate_file`).

        Text i's alternative k is the text rebuilt from the (k + 1)-th best translation of each of its sentences
        (the best where a sentence has no more), dropped where it equals the translation or an earlier alternative,
        as LibreTranslate drops them.

        See docs/serving.md, "The API".

        Raises:
            RequestError: markup that cannot be parsed, too many sentences, a sentence over the model's limit (with
                long_inputs "error"), alternatives over the beam (400); a shutting-down server or a request past its
                deadline (503); a failed translation (500).
        """
        splits = self._split(texts, text_format)
        sentences = [sentence for found, _ in splits for sentence in found]
        work = [i for i, sentence in enumerate(sentences) if sentence.strip()]  # layout stays as it is
        self._check_counts(len(work), alternatives, field)
        owner = [i for i, (found, _) in enumerate(splits) for _sentence in found]  # the text of each sentence
        pieces = self._fit([sentences[i] for i in work], [f"{field}[{owner[i]}]" if is_list else field for i in work])
        found = await self._hypotheses(pieces, alternatives + 1)
        ranked = _ranked(found, alternatives + 1, pieces, work, len(sentences))
        out, others = _rebuild(splits, ranked)
        return Translated(out, others, len(pieces.texts))

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

    async def _hypotheses(self, pieces: Pieces, count: int) -> list[list[str]]:
        # Up to `count` translations of each piece, best first, from the batcher, its failures as refusals.
        try:
            future = self.batcher.submit(pieces.texts, pieces.lengths, self.limits.request_timeout, count)
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


def _ranked(found: list[list[str]], ranks: int, pieces: Pieces, work: list[int], sentences: int) -> list[list[str]]:
    # For each rank, one translation per sentence of the request: its pieces' translations of that rank (the last a
    # piece has where it has fewer) joined, "" for a sentence of layout alone.
    ranked = []
    for rank in range(ranks):
        per_piece = [each[min(rank, len(each) - 1)] for each in found]
        translations = [""] * sentences
        for i, translation in zip(work, pieces.join(per_piece, len(work)), strict=True):
            translations[i] = translation
        ranked.append(translations)
    return ranked


def _rebuild(splits: list[_Split], ranked: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    # Each text put back from its sentences' best translations, and its alternatives: the text put back from each
    # lower rank, those equal to a higher one dropped.
    out, others, start = [], [], 0
    for found_sentences, rebuild in splits:
        end = start + len(found_sentences)
        versions = [rebuild(translations[start:end]) for translations in ranked]
        out.append(versions[0])
        others.append([v for k, v in enumerate(versions) if k and v not in versions[:k]])
        start = end
    return out, others


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
