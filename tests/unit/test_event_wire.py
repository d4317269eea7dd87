"""An event is encoded once, by the first stream that sends it; every other stream of
the run sends the same bytes (``service/api/events.py``: ``wire``)."""

from __future__ import annotations

import orjson
import pytest
from sse_starlette import ServerSentEvent

from steptally.service.api import events
from steptally.service.usecase.events import EventCursor, StepEvent


def test_an_event_is_encoded_once_and_its_bytes_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    encoded: list[ServerSentEvent] = []
    encode = ServerSentEvent.encode

    def counted(self: ServerSentEvent) -> bytes:
        encoded.append(self)
        return encode(self)

    monkeypatch.setattr(ServerSentEvent, "encode", counted)
    step = {"run": "r", "step": 7, "metrics": {"a": {"value": 0.1 + 0.2}}, "é": [1, 2]}
    event = StepEvent(EventCursor(1733.25, 7, 2), step)
    first = events.wire(event)
    assert events.wire(event) is first  # the second stream's bytes: the same object
    assert len(encoded) == 1
    lines = first.decode().split("\r\n")
    assert lines[:2] == ["id: 1733.25:7:2", "event: step"]
    assert lines[2].startswith("data: ") and orjson.loads(lines[2][6:]) == step
    assert lines[3:] == ["", ""]
    # another event of the same step (a revision) is encoded on its own
    again = StepEvent(EventCursor(1733.5, 7, 3), step)
    assert events.wire(again) != first and len(encoded) == 2
    assert event == StepEvent(EventCursor(1733.25, 7, 2), step)  # bytes kept aside
