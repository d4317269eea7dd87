"""The ``steptally`` command's own checks, before it does any work."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from steptally.service.cli import app


def test_demo_without_torch_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    result = CliRunner().invoke(app, ["demo", "--url", "http://127.0.0.1:9"])
    assert result.exit_code == 2
    assert "pip install 'steptally[torch]'" in result.output
