"""API keys and request limits, as LibreTranslate defines them (`--api-keys`, `--req-limit`, `--char-limit`,
`--require-api-key-origin`): a wrong key is refused with 403, a client past its requests per minute with 429, a
request without a key, where one is required, with 400.

The counting is the `limits` library's moving window (https://limits.readthedocs.io), the one flask-limiter,
LibreTranslate's limiter, counts with. See docs/serving.md, "Keys and limits".
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

from limits import RateLimitItemPerMinute
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from .requests import RequestError

# Wrong keys one client address may send in a minute; past them, any request of that address with a key is answered
# 429 before its key is looked up, so that guessing learns nothing (the right key is throttled as a wrong one).
INVALID_KEYS_PER_MINUTE = 10


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
    for number, (key, settings) in enumerate(data.items(), 1):
        settings = settings or {}
        # A key is named by its place in the file: no part of it is printed, so none reaches a log.
        if not isinstance(settings, dict) or set(settings) - {"req_limit", "char_limit"}:
            raise ValueError(f"--api-keys {path}: key {number} takes only req_limit and char_limit")
        for name, value in settings.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--api-keys {path}: {name} of key {number} must be a whole number of 1 or more")
        keys[key] = KeyLimits(settings.get("req_limit"), settings.get("char_limit"))
    return keys


class Access:
    """Checks a request's API key and counts its requests per minute, as LibreTranslate's `access_check` and its
    limiter (flask-limiter, counting by address) do.

    A request with a known key is counted against the key's own limit (else `req_limit`), per key. Any other is
    counted by its client's address against `req_limit`: one without a key is served, unless a key is required
    (`require_key`, or `key_origin` and an `Origin` header it does not match: 400); one with a key that is not known
    is refused (403, "Invalid API key") where keys are on, and its key ignored where they are off, as LibreTranslate
    ignores it. A wrong key also counts against `INVALID_KEYS_PER_MINUTE` of its address; past them, every request
    of that address with a key is answered 429, the right key too, so that keys cannot be guessed faster.

    Args:
        keys: from `load_api_keys`; None for no keys.
        req_limit: requests per minute of one client; None for no limit.
        char_limit: characters per request where a key sets none.
        require_key: whether a request without a known key is refused (LibreTranslate's `--under-attack`).
        key_origin: a regular expression (`re.match`) of the `Origin` headers whose requests need no key
            (LibreTranslate's `--require-api-key-origin`: a browser sends its page's origin; any other client can
            write any); None for none.
    """

    def __init__(
        self,
        keys: dict[str, KeyLimits] | None,
        req_limit: int | None,
        char_limit: int,
        require_key: bool = False,
        key_origin: str | None = None,
    ) -> None:
        self.key_origin = re.compile(key_origin) if key_origin is not None else None
        self.keys, self.req_limit, self.char_limit, self.require_key = keys, req_limit, char_limit, require_key
        self._limiter = MovingWindowRateLimiter(MemoryStorage())
        self._invalid = RateLimitItemPerMinute(INVALID_KEYS_PER_MINUTE)

    def check(self, api_key: object, client: str, origin: str | None = None) -> int:
        """Count one request of `client` (its address) with `api_key` (the field, or None) and `origin` (its `Origin`
        header, or None); its character limit.

        See docs/serving.md, "Keys and limits".

        Raises:
            RequestError: past the requests of one minute, or the wrong keys of one minute where it has a key (429,
                with Retry-After); a key that is not known (403); no key where one is required (400).
        """
        given = self.keys is not None and api_key not in (None, "")
        slowdown = {"Retry-After": "60"}
        if given and not self._limiter.test(self._invalid, f"invalid:{client}"):
            raise RequestError(
                f"Slowdown: {INVALID_KEYS_PER_MINUTE} invalid API keys from this address in 1 minute; retry in a "
                "minute",
                429,
                slowdown,
            )
        known = given and isinstance(api_key, str) and api_key in self.keys
        limits = self.keys[api_key] if known else KeyLimits()
        if given and not known:
            self._limiter.hit(self._invalid, f"invalid:{client}")  # before the limit, which may refuse it anyway
        per_minute = limits.req_limit or self.req_limit
        who = f"key:{api_key}" if known else f"ip:{client}"
        if per_minute is not None and not self._limiter.hit(RateLimitItemPerMinute(per_minute), who):
            raise RequestError(f"Slowdown: {per_minute} per 1 minute", 429, slowdown)
        if given and not known:
            raise RequestError("Invalid API key", 403)
        if not known and (self.require_key or self.key_origin and not self.key_origin.match(origin or "")):
            raise RequestError(
                "Invalid request: this server requires an API key: send it as the api_key field of the body (ask the "
                "server's operator for one)"
            )
        return limits.char_limit or self.char_limit
