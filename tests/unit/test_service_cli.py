"""The ``steptally`` command's own checks, before it does any work."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner
from uvicorn.config import STARTUP_FAILURE

from steptally.service.cli import app


def test_demo_without_torch_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    result = CliRunner().invoke(app, ["demo", "--url", "http://127.0.0.1:9"])
    assert result.exit_code == 2
    assert "pip install 'steptally[torch]'" in result.output


class _Writes:
    """A stream that keeps each ``write`` call apart, as each is one system call on a
    pipe that other processes write to at the same moment."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_worker_that_cannot_start_says_so_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    # every worker meets the same bad setting at once: a line written in two pieces would
    # interleave with the others' on the shared stderr
    from steptally.service.serving import worker_app

    monkeypatch.setenv("STEPTALLY_SWEEP_INTERVAL_S", "never")
    stderr = _Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    with pytest.raises(SystemExit) as exited:
        worker_app()
    assert exited.value.code == STARTUP_FAILURE
    assert stderr.calls == [
        "steptally: a worker cannot start: invalid setting sweep_interval_s: "
        "Input should be a valid number, unable to parse string as a number\n"
    ]
