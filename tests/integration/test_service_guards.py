"""Guarded extremes end to end: an empty mask's neutral ±inf never becomes a value."""

from __future__ import annotations

from typing import Any


def test_guarded_extremes_skip_fragments_whose_guard_is_zero(api: Any) -> None:
    body = {
        "name": "g",
        "world_size": 2,
        "metrics": {"hi": "max", "lo": "min", "n": "count", "x": "sum"},
        "guards": {"hi": "n", "lo": "n"},
        "step_timeout_s": 60,
    }
    created = api.client.post("/v1/runs", json=body)
    assert created.status_code == 201, created.text
    assert created.json()["guards"] == {"hi": "n", "lo": "n"}
    frags = [
        (0, 0, 0, {"hi": "-Infinity", "lo": "Infinity", "n": 0, "x": 1.0}),
        (0, 0, 1, {"hi": 3.5, "lo": -1.25, "n": 2}),
        (0, 1, 0, {"x": 2.0}),  # neither the extreme nor its guard
        (1, 0, 0, {"hi": "-Infinity", "lo": "Infinity", "n": 0}),
        (1, 1, 0, {"hi": "Infinity", "n": 1}),  # a real infinity over a non-empty mask
    ]
    commits = [(0, 0, 2), (0, 1, 1), (1, 0, 1), (1, 1, 1)]
    assert api.send(frags, commits, run="g").status_code == 200
    assert api.value(0, "hi", run="g") == 3.5
    assert api.value(0, "lo", run="g") == -1.25
    assert api.value(1, "hi", run="g") == "Infinity"
    lo1 = api.step(1, run="g")["metrics"]["lo"]
    assert lo1["value"] is None and "no fragment" in lo1["reason"]
    again = dict(body, guards={"hi": "n"})
    conflict = api.client.post("/v1/runs", json=again)
    assert conflict.status_code == 409
    assert "guard" in conflict.json()["error"]["message"]
    assert api.value(0, "x", run="g") == 3.0
