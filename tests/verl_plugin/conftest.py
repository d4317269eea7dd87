"""The verl plugin's tests run in verl's own venv (``make test-verl``): verl pins an
older transformers than TRL's. verl warns about engines it cannot load on a machine
without them (megatron, veomni, ...) and about the missing accelerator; those are verl's
own and not errors of this project."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.filterwarnings("ignore::UserWarning:verl"))
        item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
        item.add_marker(pytest.mark.filterwarnings("ignore::FutureWarning"))
