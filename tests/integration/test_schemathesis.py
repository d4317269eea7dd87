"""Schemathesis against the app's own OpenAPI schema: whatever it sends, generated from
the documented parameters and bodies (valid and not), the service answers without a
server error. Deterministic (``derandomize``) and bounded (a fixed number of examples
per operation), on SQLite and PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from support.served import ServedService

from .conftest import Api

EXAMPLES = 100


SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def _check(case: Any, statuses: Counter[int]) -> None:
    if case.path.endswith("/events"):  # a stream without end: only its refusals are sent
        case.headers = {**(case.headers or {}), "Last-Event-ID": "not-a-cursor"}
    response = case.call_and_validate(checks=[not_a_server_error])
    statuses[response.status_code] += 1


def test_no_input_makes_a_server_error(app: FastAPI, api: Api) -> None:
    """Every operation of the schema, against an app holding a run with a step."""
    assert api.register(name="r", world_size=2, derived={"m": "a / n"}).status_code == 201
    assert api.send([(0, 0, 0, {"a": 1.5, "n": 2})], [(0, 0, 1)]).status_code == 200
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9
    statuses: Counter[int] = Counter()
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @SETTINGS
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case: Any) -> None:
                _check(case, statuses)

            try:
                check()
            except Unsatisfiable:  # nothing to make invalid (no parameters, no body)
                assert mode is GenerationMode.NEGATIVE
    assert sum(statuses.values()) >= 5 * len(operations)
    assert not any(status >= 500 for status in statuses)


ROOT = Path(__file__).resolve().parents[2]  # where schemathesis.toml is


def test_schemathesis_run_with_every_check_finds_nothing(
    db_url: str, serve: Callable[..., ServedService]
) -> None:
    """What a new user runs: the CLI with ``--checks all`` against a served service
    (schema conformance both ways, Allow headers, status codes, content types)."""
    service = serve(db_url)
    spec = {"name": "r", "world_size": 1, "metrics": {"a": "sum"}}
    assert httpx.post(f"{service.url}/v1/runs", json=spec).status_code == 201
    body = {"fragments": [{"step": 0, "rank": 0, "seq": 0, "values": {"a": 1.5}}]}
    assert httpx.post(f"{service.url}/v1/runs/r/fragments", json=body).status_code == 200
    cli = Path(sys.executable).parent / "schemathesis"
    args = ["run", f"{service.url}/openapi.json", "--checks", "all", "--no-color"]
    run = subprocess.run(
        [str(cli), *args, "--max-examples", "10", "--generation-deterministic"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout
