"""Rank and world size: torch.distributed, then RANK / WORLD_SIZE, then the arguments."""

from __future__ import annotations

import socket
import warnings
from pathlib import Path

import pytest

from steptally.client.reporter import IdentityError, Reporter
from steptally.client.reporter.identity import resolve_identity

SPEC = {"metrics": {"a": "sum"}}


def test_arguments_alone() -> None:
    ident = resolve_identity(3, 8, env={})
    assert (ident.rank, ident.world_size) == (3, 8)


def test_environment_alone() -> None:
    ident = resolve_identity(env={"RANK": "5", "WORLD_SIZE": "6"})
    assert (ident.rank, ident.world_size) == (5, 6)


def test_environment_and_arguments_combine_when_they_agree() -> None:
    ident = resolve_identity(rank=None, world_size=4, env={"RANK": "2"})
    assert (ident.rank, ident.world_size) == (2, 4)
    assert resolve_identity(2, 4, env={"RANK": "2", "WORLD_SIZE": "4"}).rank == 2


@pytest.mark.parametrize(
    ("rank", "world", "env", "words"),
    [
        (None, None, {}, "rank and world size is unknown"),
        (0, None, {}, "world size is unknown"),
        (None, 2, {}, "rank is unknown"),
        (1, 4, {"RANK": "2"}, "rank is 2 according to RANK but 1 according to rank="),
        (1, 4, {"WORLD_SIZE": "8"}, "world size is 8 according to WORLD_SIZE"),
        (4, 4, {}, "rank 4 is out of range for a world size of 4"),
        (-1, 4, {}, "rank -1 is out of range"),
        (0, 0, {}, "world size must be at least 1"),
        (None, None, {"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        (True, 2, {}, "rank must be an integer"),
    ],
)
def test_missing_or_contradictory_identity_is_a_clear_error(
    rank: int | None, world: int | None, env: dict[str, str], words: str
) -> None:
    with pytest.raises(IdentityError, match=words):
        resolve_identity(rank, world, env=env)


def test_reporter_resolves_at_construction(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with Reporter("http://x", run="r", spec=SPEC, spool_dir=str(tmp_path)) as reporter:
        assert (reporter.rank, reporter.world_size) == (1, 3)
    monkeypatch.delenv("RANK")
    with pytest.raises(IdentityError, match="rank is unknown"):
        Reporter("http://x", run="r", spec=SPEC, spool_dir=str(tmp_path))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_initialised_torch_distributed_wins_and_must_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
        torch = pytest.importorskip("torch")
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    try:
        ident = resolve_identity()
        assert (ident.rank, ident.world_size) == (0, 1)
        with pytest.raises(IdentityError, match=r"1 according to torch\.distributed but 2"):
            resolve_identity(world_size=2)
        with pytest.raises(IdentityError, match=r"torch\.distributed but 3 according to RANK"):
            resolve_identity(env={"RANK": "3"})
    finally:
        dist.destroy_process_group()
