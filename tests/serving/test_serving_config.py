"""ServingConfig: the options `serve` adds to the inference options, and the refusal of limits that bound nothing."""

import math
from dataclasses import fields

import pytest

from vaswani_transformer.cli import build_parser, main
from vaswani_transformer.serving.config import ServingConfig

BOUNDLESS = [{"sentence_limit": 0}, *({"request_timeout": t} for t in (0, -1, math.inf, math.nan))]


@pytest.mark.parametrize("setting", BOUNDLESS)
def test_serving_config_refuses_a_sentence_limit_or_request_timeout_that_bounds_nothing(setting):
    name = next(iter(setting))
    with pytest.raises(ValueError, match=f"--{name.replace('_', '-')} must be"):
        ServingConfig(**setting)


def test_serve_options_are_the_serving_config_fields_and_bad_values_fail_in_one_line(capsys):
    # Parsed without FastAPI: the command line reads serve's defaults from ServingConfig alone.
    parse = build_parser().parse_args
    defaults, config_fields = ServingConfig(), [option.name for option in fields(ServingConfig)]
    args = parse(["serve", "model"])
    assert {name: getattr(args, name) for name in config_fields} == vars(defaults)
    args = parse(["serve", "model", "--port", "0", "--no-access-log", "--threads", "1"])
    chosen = ServingConfig(**{name: getattr(args, name) for name in config_fields})
    assert (chosen.port, chosen.access_log, chosen.threads) == (0, False, 1)
    assert chosen.char_limit == defaults.char_limit and chosen.batch_wait_ms == defaults.batch_wait_ms
    refused = [("--char-limit", "0"), ("--batch-wait-ms", "-1"), ("--batch-wait-ms", "inf"), ("--threads", "0")]
    refused.append(("--file-size-limit", "0"))
    for option, value in refused:
        assert main(["serve", "no-such-model", option, value]) == 2


@pytest.mark.parametrize(("cores", "threads", "expected"), [(2, None, 1), (1, None, 1), (16, None, 15), (2, 2, 2)])
def test_the_default_threads_leave_one_core_of_those_the_process_may_use(monkeypatch, cores, threads, expected):
    # The core left over answers HTTP and keeps a neighbour process from stalling the model (docs/serving.md).
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert ServingConfig(threads=threads).cpu_threads() == expected


def test_keys_are_optional_and_proxies_untrusted_by_default_and_a_bad_requirement_fails_in_one_line(capsys):
    defaults = ServingConfig()
    assert (defaults.require_api_key, defaults.require_api_key_origin, defaults.forwarded_allow_ips) == (
        False,
        None,
        None,
    )
    for options, words in (
        (["--require-api-key"], "--require-api-key requires keys: give them with --api-keys FILE."),
        (["--require-api-key-origin", "https://ours"], "--require-api-key-origin requires keys"),
        (["--api-keys", "keys.json", "--require-api-key-origin", "(https"], "must be a regular expression"),
    ):
        assert main(["serve", "no-such-model", *options]) == 2
        error = capsys.readouterr().err
        assert words in error and len(error.strip().splitlines()) == 1, error
