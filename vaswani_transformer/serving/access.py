"""API keys and request limits, as LibreTranslate defines them (`--api-keys`, `--req-limit`, `--char-limit`):
a wrong key is refused with 403, a client past its requests per minute with 429.

The counting is the `limits` library's moving window (https://limits.readthedocs.io), the one flask-limiter,
LibreTranslate's limiter, counts with. See docs/serving.md, "Keys and limits".
"""

import json
from dataclasses import dataclass
from pathlib import Path

from limits import RateLimitItemPerMinute
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from .requests import RequestError


@dataclass(frozen=True)
class KeyLimits:
    """What one API key may do: requests per minute and characters per request; None for the server's own limits."""

    req_limit: int | None = None
    char_limit: int | None = None


def load_api_keys(path: str | Path) -> dict[str, KeyLimits]:
    """The API keys of a JSON file: `{"KEY": {"req_limit": 60, "char_limit": 5000}, ...}` (either limit optional).

    LibreTranslate keeps the same two limits per key in its database (`ltmanage keys add --char-limit N REQ_LIMIT`).

    See docs/serving.md, "Keys and limits".

    Raises:
        OSError: the file cannot be read.
        ValueError: no JSON object of keys, or a limit that is not a whole number of at least 1 (named).
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"--api-keys {path}: not JSON ({error})") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f'--api-keys {path}: expected a JSON object of keys, {{"KEY": {{"req_limit": 60}}}}')
    keys = {}
    for key, settings in data.items():
        settings = settings or {}
        if not isinstance(settings, dict) or set(settings) - {"req_limit", "char_limit"}:
            raise ValueError(f"--api-keys {path}: key {key[:4]}... takes only req_limit and char_limit")
        for name, value in settings.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--api-keys {path}: {name} of key {key[:4]}... must be a whole number of 1 or more")
        keys[key] = KeyLimits(settings.get("req_limit"), settings.get("char_limit"))
    return keys


class Access:
    """Checks a request's API key and counts its requests per minute, as LibreTranslate's `access_check` does.

    A request without a key is counted by its client's address against `req_limit`; one with a known key against
    the key's own limit (else `req_limit`); one with an unknown key is refused (403, "Invalid API key") where keys
    are on, and its key ignored where they are off, as LibreTranslate ignores it.

    Args:
        keys: from `load_api_keys`; None for no keys.
        req_limit: requests per minute of one client; None for no limit.
        char_limit: characters per request where a key sets none.
    """

    def __init__(self, keys: dict[str, KeyLimits] | None, req_limit: int | None, char_limit: int) -> None:
        self.keys, self.req_limit, self.char_limit = keys, req_limit, char_limit
        self._limiter = MovingWindowRateLimiter(MemoryStorage())

    def check(self, api_key: object, client: str) -> int:
        """Count one request of `client` (its address) with `api_key` (the field, or None); its character limit.

        See docs/serving.md, "Keys and limits".

        Raises:
            RequestError: a key that is not known (403), or past the requests of one minute (429, with Retry-After).
        """
        limits = KeyLimits()
        if self.keys is not None and api_key not in (None, ""):
            if not isinstance(api_key, str) or api_key not in self.keys:
                raise RequestError("Invalid API key", 403)
            limits = self.keys[api_key]
        per_minute = limits.req_limit or self.req_limit
        if per_minute is not None:
            item = RateLimitItemPerMinute(per_minute)
            known = self.keys is not None and isinstance(api_key, str) and api_key in self.keys
            who = f"key:{api_key}" if known else f"ip:{client}"
            if not self._limiter.hit(item, who):
                raise RequestError(f"Slowdown: {per_minute} per 1 minute", 429, {"Retry-After": "60"})
        return limits.char_limit or self.char_limit
