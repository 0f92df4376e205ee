"""`access.py`: API keys and request limits, counted as LibreTranslate's limiter counts them, without a server."""

import json
from collections import Counter

import pytest

pytest.importorskip("limits")

from vaswani_transformer.serving.access import INVALID_KEYS_PER_MINUTE, Access, KeyLimits, load_api_keys  # noqa: E402
from vaswani_transformer.serving.requests import RequestError  # noqa: E402

KEYS = {"right-key": KeyLimits(req_limit=100), "small-key": KeyLimits(char_limit=20)}


def answers(access: Access, keys: list[object], client: str, origin: str | None = None) -> list[int]:
    """The status of each request of `client` with one of `keys`: 200 where `check` lets it through."""
    statuses = []
    for key in keys:
        try:
            access.check(key, client, origin)
            statuses.append(200)
        except RequestError as error:
            statuses.append(error.status)
    return statuses


@pytest.mark.parametrize(("req_limit", "refused"), [(5, 5), (None, INVALID_KEYS_PER_MINUTE)])
def test_wrong_keys_count_against_the_address_and_guessing_is_throttled(req_limit, refused):
    access = Access(KEYS, req_limit, 5000)
    guesses = [f"guess-{i}" for i in range(300)]
    # 300 guesses in a burst: a few are told the key is wrong, the rest are throttled.
    assert Counter(answers(access, guesses, "10.0.0.1")) == {403: refused, 429: 300 - refused}
    # Once throttled, the right key cannot be told from a wrong one at that address; elsewhere it is served.
    assert answers(access, ["right-key"], "10.0.0.1") == [429]
    assert answers(access, ["right-key", None], "10.0.0.2") == [200, 200]


def test_a_keys_own_limits_and_the_servers_apply_where_keys_are_optional():
    access = Access(KEYS, 2, 5000)
    assert access.check("small-key", "10.0.0.1") == 20 and access.check("right-key", "10.0.0.1") == 5000
    assert answers(access, [None, "", None], "10.0.0.1") == [200, 200, 429]  # without a key: the address's 2
    assert answers(access, ["right-key"] * 3, "10.0.0.1") == [200] * 3  # the key's 100 a minute, counted apart
    # Without --api-keys, a key is ignored as LibreTranslate ignores it: counted by the address, never refused.
    assert answers(Access(None, None, 5000), ["anything", None], "10.0.0.1") == [200, 200]


def test_a_key_is_required_of_every_request_or_of_those_from_other_origins():
    required = Access(KEYS, None, 5000, require_key=True)
    assert answers(required, [None, "", "right-key"], "10.0.0.1", "http://127.0.0.1:5000") == [400, 400, 200]
    with pytest.raises(RequestError, match="this server requires an API key"):
        required.check(None, "10.0.0.1")
    # LibreTranslate's --require-api-key-origin: a page of the origin named is served without a key.
    by_origin = Access(KEYS, None, 5000, key_origin=r"https://ours\.example$")
    assert answers(by_origin, [None], "10.0.0.1", "https://ours.example") == [200]
    assert answers(by_origin, [None, None], "10.0.0.1", "https://ours.example.evil") == [400, 400]
    assert answers(by_origin, [None, "right-key", "wrong-key"], "10.0.0.1") == [400, 200, 403]


def test_a_bad_keys_file_is_refused_without_printing_a_key(tmp_path):
    path = tmp_path / "keys.json"
    for settings, words in (({"req_limit": 0}, "req_limit of key 2"), ({"cost": 1}, "key 2 takes only")):
        path.write_text(json.dumps({"first-secret": {}, "second-secret": settings}))
        with pytest.raises(ValueError, match=words) as refused:
            load_api_keys(path)
        assert "secret" not in str(refused.value)
