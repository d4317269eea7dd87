"""SQLite's writers: every process's writers take turns on one lock file, and a writer's
commits are made durable by one sync of the WAL per group, before any answer."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from steptally.client.algebra import MetricSpec
from steptally.client.wire import decode_batch
from steptally.service.domain.batch import prepare
from steptally.service.domain.run import RunDraft
from steptally.service.store import dialect
from steptally.service.store.dialect import WriterLock
from steptally.service.store.migration import upgrade
from steptally.service.store.sql import SqlStore


def test_writers_of_two_processes_take_turns(tmp_path: Path) -> None:
    # two locks on one database stand for two processes: flock holds per open file
    database = str(tmp_path / "db.sqlite3")
    first, second = WriterLock(database), WriterLock(database)
    order: list[str] = []
    with first:
        waiter = threading.Thread(target=lambda: second.__enter__() and order.append("second"))
        waiter.start()
        time.sleep(0.2)
        order.append("first done")
    waiter.join(5)
    second.__exit__()
    assert order == ["first done", "second"]
    assert Path(f"{database}-writer.lock").exists()


def test_a_database_in_memory_queues_on_the_thread_lock_alone() -> None:
    lock = WriterLock(":memory:")
    with lock:
        pass
    assert lock._path is None


def test_a_group_is_synced_once_before_its_batches_are_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite3'}"
    upgrade(url)
    store = SqlStore.from_url(url)
    events: list[str] = []
    synced = dialect.os.fdatasync

    def fdatasync(fd: int) -> None:
        events.append("sync")
        synced(fd)

    monkeypatch.setattr(dialect.os, "fdatasync", fdatasync)
    try:
        spec = MetricSpec.build({"a": "sum"}, {})
        run, _ = store.register_run("r", lambda _: RunDraft(1, spec, 60.0), 0.0)
        body: dict[str, Any] = {
            "fragments": [{"step": 0, "rank": 0, "seq": 0, "values": {"a": 1.5}}],
            "commits": [{"step": 0, "rank": 0, "fragments": 1}],
        }
        future = store.submit(run, prepare(run, decode_batch(body), False), 1.0)
        future.add_done_callback(lambda _: events.append("answered"))
        assert future.result(10).finalised[0].status.value == "complete"
        assert events == ["sync", "answered"]
        writer = next(iter(store._held))  # the writer thread's own connection
        raw = writer.connection.driver_connection
        assert raw is not None and raw.execute("PRAGMA synchronous").fetchone() == (1,)  # NORMAL
        with store.engine.connect() as other:  # every other connection syncs each commit
            assert other.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
    finally:
        store.close()
