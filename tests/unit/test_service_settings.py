"""Settings and the error tree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from steptally.service import errors
from steptally.service.settings import Settings, cpu_list


def test_auth_is_off_and_the_rate_limit_on_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STEPTALLY_AUTH", raising=False)
    monkeypatch.setenv("STEPTALLY_DATABASE_URL", f"sqlite:///{tmp_path}/db.sqlite3")
    settings = Settings()
    assert (settings.auth, settings.rate_limit_per_s, settings.rate_limit_burst) == (
        False,
        10_000.0,
        20_000,
    )
    for text, on in (("on", True), ("off", False), ("1", True), ("true", True)):
        monkeypatch.setenv("STEPTALLY_AUTH", text)
        assert Settings().auth is on


def test_environment_prefix_and_sqlite_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "var" / "deep"
    monkeypatch.setenv("STEPTALLY_DATABASE_URL", f"sqlite:///{folder}/db.sqlite3")
    monkeypatch.setenv("STEPTALLY_PORT", "9001")
    settings = Settings()
    assert settings.port == 9001
    assert folder.is_dir()
    assert settings.max_body_bytes == 8 * 1024 * 1024
    assert (settings.sweep_interval_s, settings.default_step_timeout_s) == (1.0, 300.0)


def test_every_contract_code_has_its_status() -> None:
    expected = {
        "bad_json": 400,
        "unsupported_encoding": 400,
        "unauthenticated": 401,
        "forbidden": 403,
        "unknown_run": 404,
        "unknown_step": 404,
        "metric_not_found": 404,
        "spec_conflict": 409,
        "fragment_conflict": 409,
        "commit_conflict": 409,
        "step_complete": 409,
        "too_large": 413,
        "invalid_payload": 422,
        "invalid_spec": 422,
        "unknown_metric": 422,
        "invalid_value": 422,
        "rank_out_of_range": 422,
        "rate_limited": 429,
    }
    found = {}
    stack: list[type[errors.ServiceError]] = [errors.ServiceError]
    while stack:
        cls = stack.pop()
        found[cls.code] = cls.status
        stack.extend(cls.__subclasses__())
    assert {code: found.get(code) for code in expected} == expected


@pytest.mark.parametrize(
    ("text", "cores"), [("1", (1,)), ("0,2-3", (0, 2, 3)), ("3, 0-1", (3, 0, 1)), ("5-5", (5,))]
)
def test_a_cpu_list_names_its_cores_in_the_order_written(text: str, cores: tuple[int]) -> None:
    assert cpu_list(text) == cores


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "'' is not a core or a range of cores"),
        ("a", "'a' is not a core or a range of cores"),
        ("-1", "'-1' is not a core or a range of cores"),
        ("0-", "'0-' is not a core or a range of cores"),
        ("1,,2", "'' is not a core or a range of cores"),
        ("3-1", "the range '3-1' runs backwards"),
        ("0-1,1", "core 1 is listed twice"),
        ("0-70000", "core 70000 is past the last a machine has (65535)"),
    ],
)
def test_a_cpu_list_that_is_not_one_is_refused_with_why(
    text: str, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        cpu_list(text)
    monkeypatch.setenv("STEPTALLY_DATABASE_URL", f"sqlite:///{tmp_path}/db.sqlite3")
    monkeypatch.setenv("STEPTALLY_CPUS", text)
    with pytest.raises(ValueError, match=re.escape(why)):
        Settings()
