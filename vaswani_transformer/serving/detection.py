"""The language of a text, for LibreTranslate's `POST /detect` and `source=auto`, with Lingua
(https://github.com/pemistahl/lingua-py), which tells short texts apart among the languages it is given.

The detector knows the languages of the served models and any the server names besides (`--detect-language`):
fewer candidates are faster, lighter (each is a model of n-grams in memory) and more accurate.
See docs/serving.md, "Language detection".
"""

from lingua import IsoCode639_1, LanguageDetectorBuilder


class LanguageDetector:
    """Detects the language of texts among `languages` (ISO 639-1 codes), as LibreTranslate's `detect_languages`.

    Lingua's models of the languages load on the first detection (a few seconds each).

    Args:
        languages: the candidate codes, e.g. ["en", "de", "fr"].

    Raises:
        ValueError: fewer than one language, or a code Lingua does not know (named).
    """

    def __init__(self, languages: list[str]) -> None:
        codes = []
        for language in dict.fromkeys(languages):
            try:
                codes.append(IsoCode639_1.from_str(language))
            except ValueError:
                raise ValueError(
                    f"language {language!r}: the language detector (Lingua) knows no such ISO 639-1 code"
                ) from None
        if not codes:
            raise ValueError("the language detector needs at least one language to choose from")
        self.languages = list(dict.fromkeys(languages))
        # One language alone is what Lingua's builder refuses: a detector of one language always answers it.
        self._detector = LanguageDetectorBuilder.from_iso_codes_639_1(*codes).build() if len(codes) > 1 else None

    def detect(self, text: str) -> list[dict]:
        """The candidate languages of `text`, likeliest first: LibreTranslate's `[{"confidence", "language"}]`.

        `confidence` is Lingua's probability in percent (0 to 100, two decimals); candidates of no probability are
        left out, and a text of no letters gets the first language with confidence 0.

        See docs/serving.md, "Language detection".
        """
        if self._detector is None:
            return [{"confidence": 100.0, "language": self.languages[0]}]
        values = self._detector.compute_language_confidence_values(text)
        found = [
            {"confidence": round(100 * value.value, 2), "language": value.language.iso_code_639_1.name.lower()}
            for value in values
            if value.value > 0
        ]
        return found or [{"confidence": 0.0, "language": self.languages[0]}]
