"""``steptally serve --workers N``: the parent accepts, and deals each connection out.

A reporter keeps its connection for the whole run, so how a job's connections are
split between the workers, when they are opened, is how its load is split from then
on. With one listening socket shared by all the workers (uvicorn's way), the worker
that woke first accepted whatever was queued: 32 connections opened at once went 31 to
one worker and 1 to the other. With a socket of each worker's own bound to the port
with ``SO_REUSEPORT``, the kernel spreads them by a hash of their addresses, which for
a job's 8 connections still gave one worker 7 of them as often as not.

So here the parent owns the one listening socket and a thread of its own
(:class:`Dealer`) accepts each connection and passes it (``SCM_RIGHTS``, over a Unix
socket pair per worker) to the worker that holds the fewest connections it was dealt
and has not closed (each worker says so on its pair when one closes), the next one in
turn among equals: N connections go N/N to each worker, whenever they are opened. A
worker (:class:`Receiver`, uvicorn's server with no listener of its own) serves each
connection it is handed as if it had accepted it. A worker that dies is started
again on its pair, and the connections dealt to it meanwhile wait there for it.

The pairs also carry the workers' word to each other (:class:`Peers`): without Redis
no worker hears the steps another finalises, so its event streams read the database
for them (a degraded hub, :mod:`steptally.service.usecase.events`). A worker that
finalises steps says so on its pair, the parent passes the word on to every other
worker, and each wakes its streams, which read the new steps at once instead of at
their next poll of the database, on SQLite as on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import selectors
import socket
import threading
from collections.abc import Callable, Sequence

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess
from uvicorn.supervisors.multiprocess import Process

from steptally.service.background import Background

LOG = logging.getLogger("uvicorn.error")  # where uvicorn's supervisor says the same
#: a worker's note on its pair that a connection it was dealt has closed
CLOSED = b"-"
#: a worker's note that it finalised steps, and the parent's word of it to the others
FINALISED = b"f"
#: the parent's message that carries a connection
CONNECTION = b"+"


class Peers:
    """A worker's word with the other workers, through the parent: :meth:`announce`
    that it finalised steps; :meth:`heard` calls each listener when another one did."""

    def __init__(self, channel: socket.socket) -> None:
        self.channel = channel  # the worker's end of its pair
        self._listeners: list[Callable[[], None]] = []

    def announce(self) -> None:
        """From any thread; never blocks (a pair that is full already holds a word the
        parent has yet to read, and the others' streams poll all the same)."""
        with contextlib.suppress(OSError):
            self.channel.send(FINALISED, socket.MSG_DONTWAIT)

    def on_heard(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def heard(self) -> None:
        for listener in self._listeners:
            listener()


_peers: Peers | None = None


def worker_peers() -> Peers | None:
    """This process's word with the other workers: None unless it is a worker of
    ``steptally serve --workers N``."""
    return _peers


def listener(host: str, port: int, backlog: int) -> socket.socket:
    """The service's listening socket. Raises ``OSError`` when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class Dealer(Background):
    """The parent's accepting thread: each connection to the worker holding the fewest.
    Stopped, it accepts no more connections (those queued stay in the socket's backlog)."""

    def __init__(self, sock: socket.socket, workers: int) -> None:
        super().__init__("steptally-dealer")
        self.sock = sock
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(workers)]
        self.ends = [ours for ours, _ in pairs]  # the parent's end of each pair
        self.theirs = [theirs for _, theirs in pairs]  # kept open for a worker started again
        self.held = [0] * workers  # connections dealt to each and not yet closed
        self._held_lock = threading.Lock()  # the dealer's thread, and the supervisor's
        self._next = 0

    def close(self) -> None:
        self.stop()
        for s in [self.sock, *self.ends, *self.theirs]:
            s.close()

    def _read_notes(self, i: int) -> None:
        """Worker ``i``'s notes: its closes counted, its finalisations passed on to the
        other workers (one word, however many it noted)."""
        finalised = False
        with contextlib.suppress(OSError):  # none waiting (or the pair unreadable)
            while notes := self.ends[i].recv(4096, socket.MSG_DONTWAIT):
                with self._held_lock:
                    self.held[i] -= notes.count(CLOSED)
                finalised = finalised or FINALISED in notes
        if finalised:
            for j, end in enumerate(self.ends):
                if j != i:  # a full pair holds a word not yet read: this one can go
                    with contextlib.suppress(OSError):
                        end.send(FINALISED, socket.MSG_DONTWAIT)

    def forget(self, i: int) -> None:
        """Worker ``i`` died, and its connections with it (the closes it noted first
        are read, so that none counts against its replacement)."""
        self._read_notes(i)
        with self._held_lock:
            self.held[i] = 0

    def pick(self) -> int:
        """The worker to deal the next connection to (after reading the notes waiting:
        a close noted as the connection came in counts)."""
        for i in range(len(self.ends)):
            self._read_notes(i)
        n = len(self.held)
        order = [(self._next + k) % n for k in range(n)]
        chosen = min(order, key=lambda i: self.held[i])  # the first in turn among equals
        self._next = (chosen + 1) % n
        return chosen

    def run(self) -> None:
        """Accept connections and read the workers' notes as they come."""
        self.sock.setblocking(False)
        with selectors.DefaultSelector() as selector:
            selector.register(self.sock, selectors.EVENT_READ, -1)
            for i, end in enumerate(self.ends):
                selector.register(end, selectors.EVENT_READ, i)
            while not self.stopping.is_set():  # looked at every 0.5 s at least
                for key, _ in selector.select(0.5):
                    if key.data < 0:
                        self._accept()
                    else:
                        self._read_notes(key.data)

    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:  # reset by its client before the accept
            return
        except OSError as exc:  # out of descriptors: go on
            LOG.warning("cannot accept a connection: %s", exc)
            self.stopping.wait(0.05)
            return
        with conn:
            i = self.pick()
            try:
                socket.send_fds(self.ends[i], [CONNECTION], [conn.fileno()])
                with self._held_lock:
                    self.held[i] += 1
            except Exception as exc:  # this connection is lost; the next ones are not
                LOG.warning("cannot pass a connection to worker %d: %s", i, exc)


class Receiver(uvicorn.Server):
    """A worker's server: no listener of its own; it serves each connection the parent
    passes on its pair as uvicorn serves one it accepted (the same protocol, state and
    shutdown), notes on the pair each one that closes, and tells ``peers`` of the other
    workers' finalisations."""

    def __init__(self, config: uvicorn.Config, peers: Peers) -> None:
        super().__init__(config)
        self.peers = peers
        self.channel = peers.channel

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])
        if not self.started:
            return
        loop = asyncio.get_running_loop()
        self.channel.setblocking(False)
        loop.add_reader(self.channel.fileno(), self._take, loop)

    def _protocol(self, loop: asyncio.AbstractEventLoop) -> asyncio.Protocol:
        protocol: asyncio.Protocol = self.config.http_protocol_class(  # type: ignore[call-arg]
            config=self.config,
            server_state=self.server_state,
            app_state=self.lifespan.state,
            _loop=loop,
        )
        lost = protocol.connection_lost

        def connection_lost(exc: Exception | None) -> None:
            with contextlib.suppress(OSError):  # the parent stopping: nobody to tell
                self.channel.send(CLOSED)
            lost(exc)

        protocol.connection_lost = connection_lost  # type: ignore[method-assign]
        return protocol

    def _take(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            message, fds, _, _ = socket.recv_fds(self.channel, 16, 64)
        except BlockingIOError:
            return
        except OSError as exc:
            LOG.error("no more connections from the parent: %s", exc)
            message, fds = b"", []
        if not message:  # the parent's end closed: it is stopping
            loop.remove_reader(self.channel.fileno())
            return
        if message == FINALISED:
            self.peers.heard()
        for fd in fds:
            sock = socket.socket(fileno=fd)
            loop.create_task(loop.connect_accepted_socket(lambda: self._protocol(loop), sock))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        with contextlib.suppress(Exception):  # not started, or already closed
            asyncio.get_running_loop().remove_reader(self.channel.fileno())
        await super().shutdown(sockets)


class Worker(Process):
    """uvicorn's worker process, serving what the parent deals it on ``channel``, on
    core ``cpu`` alone if given (with every thread it starts)."""

    def __init__(self, config: uvicorn.Config, channel: socket.socket, cpu: int | None) -> None:
        super().__init__(config, [channel])
        self.cpu = cpu

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            assert _peers is not None
            self._server = Receiver(self.config, _peers)
        return self._server

    def target(self, sockets: list[socket.socket] | None = None) -> None:  # pragma: no cover
        global _peers
        assert sockets
        if self.cpu is not None:  # before any thread starts: each inherits it
            os.sched_setaffinity(0, [self.cpu])
        _peers = Peers(sockets[0])  # before the app is built: it looks for them
        super().target(sockets=None)


class Spread(Multiprocess):
    """uvicorn's supervisor (start, watch, restart and stop the workers) with a
    :class:`Dealer` in front of them: worker ``i`` is started, and started again, on
    pair ``i`` (and on ``cpus[i]``, round robin, when given)."""

    def __init__(
        self, config: uvicorn.Config, sock: socket.socket, cpus: Sequence[int] | None = None
    ) -> None:
        super().__init__(config, [])
        self.dealer = Dealer(sock, config.workers)
        self.cpus = cpus

    def worker(self, i: int) -> Worker:
        """Worker ``i``, not yet started."""
        cpu = self.cpus[i % len(self.cpus)] if self.cpus else None
        return Worker(self.config, self.dealer.theirs[i], cpu)

    def init_processes(self) -> None:
        for i in range(len(self.dealer.theirs)):
            process = self.worker(i)
            process.start()
            self.processes.append(process)
        self.dealer.start()

    def keep_subprocess_alive(self) -> None:
        """As uvicorn's: a worker that does not answer is killed and started again, on
        its own pair; one that failed to start stops the whole service."""
        if self.should_exit.is_set():
            return
        for i, process in enumerate(self.processes):
            if process.is_alive(timeout=self.config.timeout_worker_healthcheck):
                continue
            process.kill()
            process.join()
            if process.exitcode == STARTUP_FAILURE:
                LOG.error("worker %s failed to start; stopping", process.pid)
                self.should_exit.set()
            if self.should_exit.is_set():
                return
            LOG.info("worker %s died; starting another in its place", process.pid)
            self.dealer.forget(i)
            process = self.worker(i)
            process.start()
            self.processes[i] = process

    def restart_all(self) -> None:
        """SIGHUP: each worker replaced by a new one on its pair, which serves the pair's
        new connections as soon as it is up, before the old one stops."""
        for i, old in enumerate(self.processes):
            if self.should_exit.is_set():
                return
            new = self.worker(i)
            new.start()
            if not new.wait_until_ready(self.config.timeout_worker_healthcheck, self.should_exit):
                new.kill()
                new.join()
                LOG.error("worker %s was not ready in time; restart stopped", new.pid)
                return
            old.terminate()
            old.join()
            self.processes[i] = new

    def handle_ttin(self) -> None:
        LOG.warning("SIGTTIN ignored: start the service again with another --workers")

    def handle_ttou(self) -> None:
        LOG.warning("SIGTTOU ignored: start the service again with another --workers")

    def terminate_all(self) -> None:
        self.dealer.stop()
        super().terminate_all()

    def run(self) -> None:
        try:
            super().run()
        finally:
            self.dealer.close()
