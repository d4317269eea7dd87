"""``steptally serve --workers N``: N processes serve one database, and the steps they
share are finalised once with the exact values."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from support.served import ServedService

from tests.integration.test_events import Stream


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_two_workers_serve_and_share_steps(
    db_url: str, serve: Callable[..., ServedService]
) -> None:
    service = serve(db_url, "--workers", "2")
    assert service.proc is not None
    spec = {"name": "w", "world_size": 2, "metrics": {"a": "sum", "n": "count"}}
    try:
        assert len(_children(service.proc.pid)) >= 2  # the workers (and uvicorn's helpers)
        with httpx.Client(base_url=service.url, timeout=10) as http:
            assert http.post("/v1/runs", json=spec).status_code in (200, 201)
            for rank, seq, value in ((0, 0, 1e17), (1, 0, 3.0), (0, 1, -1e17)):
                fragment = {"step": 0, "rank": rank, "seq": seq, "values": {"a": value, "n": 1}}
                answer = http.post("/v1/runs/w/fragments", json={"fragments": [fragment]})
                assert answer.status_code == 200, answer.text
            commits = [
                {"step": 0, "rank": 0, "fragments": 2},
                {"step": 0, "rank": 1, "fragments": 1},
            ]
            answer = http.post("/v1/runs/w/fragments", json={"commits": commits})
            assert answer.status_code == 200, answer.text
            answer = answer.json()
            assert answer["finalised"] == [{"step": 0, "status": "complete", "revision": 1}]
            step = http.get("/v1/runs/w/steps/0").json()
    finally:
        service.stop(signal.SIGTERM)  # the parent stops its workers
    assert step["status"] == "complete"
    assert step["metrics"]["a"]["value"] == 3.0  # exact: adding in order gives 0.0
    assert step["metrics"]["n"]["value"] == 3


def _one_rank_step(step: int) -> dict[str, Any]:
    """The body that completes ``step`` of a one-rank run of metric ``a``."""
    return {
        "fragments": [{"step": step, "rank": 0, "seq": 0, "values": {"a": 1.0}}],
        "commits": [{"step": step, "rank": 0, "fragments": 1}],
    }


def test_a_stream_on_one_worker_sends_every_workers_finalisations_once(
    db_url: str, serve: Callable[..., ServedService]
) -> None:
    """Without Redis no worker hears the others: their streams read the database, so
    the steps another worker finalises arrive live, in order, once."""
    service = serve(db_url, "--workers", "2")
    spec = {"name": "w", "world_size": 1, "metrics": {"a": "sum"}}
    try:
        assert httpx.post(f"{service.url}/v1/runs", json=spec).status_code in (200, 201)
        stream = Stream(f"{service.url}/v1/runs/w/events")
        try:
            for step in range(12):  # a new connection each: either worker answers
                body = _one_rank_step(step)
                assert httpx.post(f"{service.url}/v1/runs/w/fragments", json=body).is_success
            got = [orjson.loads(e["data"])["step"] for e in stream.take(12)]
            assert stream.nothing_more(1.0)
        finally:
            stream.close()
    finally:
        service.stop(signal.SIGTERM)
    assert got == list(range(12))


def _server_inodes(port: int) -> dict[int, int]:
    """The inode of the server's socket of each connection to ``port``, by the client's
    port (``/proc/net/tcp``: IPv4, established)."""
    found: dict[int, int] = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
        if state == "01" and int(local.split(":")[1], 16) == port:
            found[int(remote.split(":")[1], 16)] = inode
    return found


def _sockets_of(pid: int) -> set[int]:
    inodes: set[int] = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def _owners(port: int, clients: list[socket.socket], workers: list[int]) -> list[int | None]:
    """The worker serving each client's connection (each must have had an answer); None
    for one the server no longer holds (closed after its keep-alive time, 5 s idle)."""
    inodes = _server_inodes(port)
    held = {pid: _sockets_of(pid) for pid in workers}
    return [
        next((pid for pid, s in held.items() if inodes.get(c.getsockname()[1]) in s), None)
        for c in clients
    ]


def _connect(port: int, n: int) -> list[socket.socket]:
    """``n`` connections opened at once, then a request on each, answered."""
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    request = f"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n".encode()
    for c in clients:
        c.settimeout(30)
        c.sendall(request)
    for c in clients:
        assert c.recv(65536).startswith(b"HTTP/1.1 200")
    return clients


def test_connections_are_dealt_to_the_worker_holding_the_fewest(
    db_url: str, serve: Callable[..., ServedService]
) -> None:
    """32 clients connect at once, as a job's reporters do when it starts: 16 go to
    each worker. With the one listening socket the workers shared before, the first to
    wake took most of such a burst (31 to 1, 30 to 2) and served most of the load for
    the rest of the run. Connections that close make room: the next ones go to the
    worker that lost them."""
    service = serve(db_url, "--workers", "2")
    assert service.proc is not None
    clients: list[socket.socket] = []
    try:
        workers = _workers(service.proc.pid)
        assert len(workers) == 2
        clients = _connect(service.port, 32)
        owners = _owners(service.port, clients, workers)
        first = Counter(owners)
        gone = [c for c, pid in zip(clients, owners, strict=True) if pid == workers[0]][:10]
        for c in gone:
            c.close()
        clients = [c for c in clients if c not in gone]
        time.sleep(0.5)  # the closes noted
        more = _connect(service.port, 10)
        then = Counter(_owners(service.port, more, workers))
        clients += more
    finally:
        for c in clients:
            c.close()
        service.stop(signal.SIGTERM)
    assert first == {workers[0]: 16, workers[1]: 16}
    assert then == {workers[0]: 10}


def _workers(parent: int) -> list[int]:
    return [  # not multiprocessing's resource tracker
        pid
        for pid in _children(parent)
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def test_a_worker_that_dies_is_replaced_on_its_socket(
    db_url: str, serve: Callable[..., ServedService]
) -> None:
    """A worker killed outright: the connections dealt to it in the meantime wait on its
    pair, and the worker started in its place answers them."""
    service = serve(db_url, "--workers", "2")
    assert service.proc is not None
    try:
        first = _workers(service.proc.pid)
        os.kill(first[0], signal.SIGKILL)
        clients = _connect(service.port, 32)  # every one answered
        try:
            now = _workers(service.proc.pid)
            replaced = next(pid for pid in now if pid not in first)
            # the replacement's connections were answered last, once it had started: the
            # other worker's may have idled past their keep-alive meanwhile (None)
            served = _owners(service.port, clients, now).count(replaced)
        finally:
            for c in clients:
                c.close()
    finally:
        service.stop(signal.SIGTERM)
    assert sorted(now) == sorted([first[1], replaced])
    assert served >= 8  # its share at least, held for it while it started


def test_workers_on_a_port_another_program_holds_do_not_start(db_url: str) -> None:
    """A port that another program listens on is refused, in one line."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ServedService.cli("migrate", "--database-url", db_url)
        done = ServedService.cli(
            "serve", "--database-url", db_url, "--port", str(port), "--workers", "2", check=False
        )
    stderr = done.stderr.decode().splitlines()
    assert done.returncode == 2
    assert stderr == [
        f"steptally: cannot listen on 127.0.0.1:{port}: Address already in use",
        "steptally: cannot serve: the 2 workers did not start (see above)",
    ]


def test_sighup_replaces_each_worker_on_its_pair(
    db_url: str, serve: Callable[..., ServedService]
) -> None:
    """SIGHUP (uvicorn's restart): each worker is replaced by a new one, which serves
    the connections dealt to its pair from then on, 4 and 4 of 8."""
    service = serve(db_url, "--workers", "2")
    assert service.proc is not None
    clients: list[socket.socket] = []
    try:
        before = _workers(service.proc.pid)
        service.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while not set(after := _workers(service.proc.pid)).isdisjoint(before) or len(after) < 2:
            assert time.monotonic() < deadline, "the workers were not replaced"
            time.sleep(0.1)
        clients = _connect(service.port, 8)
        share = Counter(_owners(service.port, clients, after))
    finally:
        for c in clients:
            c.close()
        service.stop(signal.SIGTERM)
    assert share == dict.fromkeys(after, 4)


def _poll_an_hour(tmp_path: Path) -> dict[str, str]:
    """The environment of a service whose event streams poll the database once an hour
    (patched into its worker processes, or into the process itself with ``alone``)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\n"
        "worker = any('multiprocessing' in a for a in sys.argv)\n"
        "if worker or os.environ.get('POLL_AN_HOUR') == 'all':\n"
        "    import steptally.service.usecase.events as events\n"
        "    events.POLL_S = 3600.0\n"
    )
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def _six_steps_heard(stream_url: str, post_url: str) -> list[int]:
    """The steps a stream of ``stream_url`` hears while 6 one-rank steps are posted to
    ``post_url`` to a new run: the stream's connection is opened first, the posts' after it."""
    run = f"w{uuid.uuid4().hex[:8]}"  # the database may hold other tests' runs
    spec = {"name": run, "world_size": 1, "metrics": {"a": "sum"}}
    assert httpx.post(f"{post_url}/v1/runs", json=spec).status_code in (200, 201)
    stream = Stream(f"{stream_url}/v1/runs/{run}/events")
    try:
        time.sleep(0.5)  # the stream's connection dealt first
        with httpx.Client(base_url=post_url, timeout=10) as http:
            for step in range(6):
                assert http.post(f"/v1/runs/{run}/fragments", json=_one_rank_step(step)).is_success
        got = [orjson.loads(e["data"])["step"] for e in stream.take(6, timeout=20)]
        assert stream.nothing_more(1.0)
    finally:
        stream.close()
    return got


def test_a_stream_hears_another_workers_finalisations_at_once(db_url: str, tmp_path: Path) -> None:
    """Without Redis, a worker that finalises steps says so to the parent, which tells
    the other workers, and their streams read the steps then. Here the workers' poll of
    the database is an hour, and the stream's worker finalises nothing itself (the
    stream holds one connection, the posts another, dealt to the other worker): every
    step still arrives, in order, once, on SQLite as on PostgreSQL."""
    service = ServedService(db_url, tmp_path / "serve.log")
    service.env = _poll_an_hour(tmp_path)
    service.start("--workers", "2")
    try:
        got = _six_steps_heard(service.url, service.url)
        workers = _workers(service.proc.pid) if service.proc else []
    finally:
        service.stop(signal.SIGTERM)
    assert len(workers) == 2
    assert got == list(range(6))


def test_a_stream_hears_another_replicas_finalisations_at_their_commit(
    postgres_url: str, tmp_path: Path
) -> None:
    """Replicas of one PostgreSQL database without Redis (``STEPTALLY_EVENTS_POLL``):
    each finalisation is announced with its commit (``NOTIFY``), and every replica's
    streams read it then. The replicas' poll of the database is an hour; the stream is
    on one replica, the posts go to the other: every step arrives, in order, once."""
    env = {**_poll_an_hour(tmp_path), "POLL_AN_HOUR": "all", "STEPTALLY_EVENTS_POLL": "true"}
    replicas = [ServedService(postgres_url, tmp_path / f"serve{i}.log") for i in range(2)]
    try:
        for replica in replicas:
            replica.env = env
            replica.start()
        got = _six_steps_heard(replicas[0].url, replicas[1].url)
    finally:
        for replica in replicas:
            replica.stop(signal.SIGTERM)
    assert got == list(range(6))


def _cores_of_threads(pid: int) -> list[set[int]]:
    """The cores each thread of process ``pid`` may run on (a thread that ends between
    the listing and the reading is left out)."""
    cores = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            cores.append(os.sched_getaffinity(int(tid)))
    return cores


def test_one_process_runs_on_the_cores_it_is_given(
    tmp_path: Path, serve: Callable[..., ServedService]
) -> None:
    """``--cpus``: every thread of the process, the writers started by the first batch
    included, runs on the cores given, and nowhere else."""
    core = max(os.sched_getaffinity(0))
    service = serve(f"sqlite:///{tmp_path}/one.sqlite3", "--cpus", str(core))
    assert service.proc is not None
    spec = {"name": "p", "world_size": 1, "metrics": {"a": "sum"}}
    try:
        assert httpx.post(f"{service.url}/v1/runs", json=spec).status_code in (200, 201)
        answer = httpx.post(f"{service.url}/v1/runs/p/fragments", json=_one_rank_step(0))
        assert answer.status_code == 200, answer.text
        threads = _cores_of_threads(service.proc.pid)
    finally:
        service.stop(signal.SIGTERM)
    assert len(threads) >= 2  # the event loop and the writer
    assert all(cores == {core} for cores in threads)


def test_each_worker_runs_alone_on_its_core_and_its_replacement_too(
    tmp_path: Path, serve: Callable[..., ServedService]
) -> None:
    """``--workers 2 --cpus a,b``: worker 0 on a, worker 1 on b, every thread of each;
    a worker killed is replaced on its core."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs a machine with two cores this process may run on")
    a, b = allowed[-2:]
    service = serve(f"sqlite:///{tmp_path}/two.sqlite3", "--workers", "2", "--cpus", f"{a},{b}")
    assert service.proc is not None
    try:
        first = _workers(service.proc.pid)
        before = {pid: _cores_of_threads(pid) for pid in first}
        on_b = next(pid for pid, threads in before.items() if threads[0] == {b})
        os.kill(on_b, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while len(now := [p for p in _workers(service.proc.pid) if p not in first]) < 1:
            assert time.monotonic() < deadline, "the worker was not replaced"
            time.sleep(0.1)
        # a new process imports the service before it pins itself (seconds on a slow
        # machine): wait for it to run its threads, then every one must be on b
        while len(after := _cores_of_threads(now[0])) < 2 or any(c != {b} for c in after):
            assert time.monotonic() < deadline, f"the replacement's threads: {after}"
            time.sleep(0.1)
        time.sleep(0.5)  # the threads it starts next
        after = _cores_of_threads(now[0])
    finally:
        service.stop(signal.SIGTERM)
    assert sorted(threads[0] == {a} for threads in before.values()) == [False, True]
    assert all(len({frozenset(c) for c in threads}) == 1 for threads in before.values())
    assert all(cores == {b} for cores in after), after


def test_cores_the_process_may_not_run_on_are_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/refused.sqlite3"
    ServedService.cli("migrate", "--database-url", url)
    shown = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    done = ServedService.cli("serve", "--database-url", url, "--cpus", "4095", check=False)
    assert done.returncode == 2
    assert done.stderr.decode().splitlines() == [
        f"steptally: cannot serve on core 4095: this process may run on cores {shown}"
    ]
    done = ServedService.cli("serve", "--database-url", url, "--cpus", "1,0-1", check=False)
    assert done.returncode == 2
    assert done.stderr.decode().splitlines() == [
        "steptally: invalid setting cpus: Value error, core 1 is listed twice"
    ]
