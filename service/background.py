"""A thread of the service's own that runs until it is told to stop."""

from __future__ import annotations

import threading


class Background:
    """A daemon thread running :meth:`run`, which looks at ``stopping`` between its
    waits (and waits on it, so that :meth:`stop` ends a wait at once)."""

    def __init__(self, name: str) -> None:
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)

    def run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Tell :meth:`run` to end, and wait until it has (if it started)."""
        self.stopping.set()
        if self._thread.is_alive():
            self._thread.join()
