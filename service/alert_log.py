"""A webhook receiver for Alertmanager that logs every notification: the compose
stack's stand-in for a chat bridge or an incident tool (``steptally alert-log``).

Alertmanager posts a JSON document (version 4) per group of alerts; each alert is
logged as one line — its status, name, run, rule and summary — and the last
``keep`` alerts are served at ``GET /alerts`` (newest last), so a person (or a test)
can see what was sent.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("steptally.alert_log")


class Alert(BaseModel):
    model_config = ConfigDict(extra="allow")

    status: str
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: str | None = None  # Alertmanager's field names
    endsAt: str | None = None


class Notification(BaseModel):
    """What Alertmanager's webhook_configs send."""

    model_config = ConfigDict(extra="allow")

    version: str = "4"
    status: str
    receiver: str = ""
    groupKey: str = ""
    alerts: list[Alert] = Field(default_factory=list)


def line(alert: Alert) -> str:
    """One alert as the log shows it."""
    labels = alert.labels
    where = " ".join(f"{k}={labels[k]}" for k in ("run", "rule", "instance") if k in labels)
    summary = alert.annotations.get("summary", "")
    return f"{alert.status.upper()} {labels.get('alertname', '?')} {where} {summary}".strip()


def create_app(keep: int = 1000) -> FastAPI:
    app = FastAPI(title="Steptally alert log", docs_url=None, redoc_url=None)
    received: deque[dict[str, Any]] = deque(maxlen=keep)
    lock = threading.Lock()

    @app.post("/{path:path}", status_code=200)
    def notify(path: str, body: Notification) -> dict[str, int]:
        with lock:
            for alert in body.alerts:
                log.warning("%s", line(alert))
                received.append({"receiver": body.receiver, **alert.model_dump()})
        return {"alerts": len(body.alerts)}

    @app.get("/alerts")
    def alerts() -> list[dict[str, Any]]:
        with lock:
            return list(received)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
