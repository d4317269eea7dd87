"""The private TRL methods the drop-in GRPOTrainer overrides are the ones it was tested
against: a TRL release that renames or reorders their parameters fails here, loudly,
before it can silently stop the reporting."""

from __future__ import annotations

import importlib.metadata
import inspect
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("trl")

from packaging.requirements import Requirement

from steptally.integrations import trl as adapter

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_trl_is_in_the_tested_range() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [Requirement(r) for r in extras["optional-dependencies"]["trl"]]
    (trl_pin,) = [p for p in pins if p.name == "trl"]
    installed = importlib.metadata.version("trl")
    assert trl_pin.specifier.contains(installed), f"trl {installed} is outside {trl_pin}"
    assert Requirement(adapter.TESTED_RANGE) == trl_pin  # what its warning names


def test_the_overridden_methods_have_the_signatures_relied_on() -> None:
    assert adapter.signature_problems() == []
    for name, expected in adapter.OVERRIDDEN.items():
        found = tuple(inspect.signature(getattr(adapter.TRLGRPOTrainer, name)).parameters)
        assert found[: len(expected)] == expected
        assert name in vars(adapter.GRPOTrainer)  # really overridden


def test_a_changed_signature_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def moved(self: object, inputs: object, model: object) -> None: ...

    monkeypatch.setattr(adapter.TRLGRPOTrainer, "_compute_loss", moved)
    (problem,) = adapter.signature_problems()
    assert "_compute_loss" in problem and "('self', 'inputs', 'model')" in problem
