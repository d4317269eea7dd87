"""The service in a background thread of this process (for ``steptally demo --serve``)."""

from __future__ import annotations

import threading
import time
from types import TracebackType

import uvicorn

from steptally.service.app import create_app
from steptally.service.settings import Settings
from steptally.service.store.migration import upgrade


class EmbeddedServer:
    """Migrates the configured database, then serves it until closed."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.url = f"http://{settings.host}:{settings.port}"
        config = uvicorn.Config(
            create_app(settings), host=settings.host, port=settings.port, log_level="warning"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="steptally-serve")

    def __enter__(self) -> EmbeddedServer:
        upgrade(self.settings.database_url)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the service did not start on {self.url}")
            time.sleep(0.05)
        return self

    def wait(self) -> None:
        """Block until Ctrl-C."""
        try:
            while self._thread.is_alive():
                self._thread.join(0.5)
        except KeyboardInterrupt:
            pass

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.should_exit = True
        self._thread.join(10)
