"""``?partial=true``: wrong items are listed in ``rejected``; the rest lands, all or nothing."""

from __future__ import annotations

from typing import Any

from steptally.service.api.schemas import IngestAnswer

from .conftest import Api


def _partial(
    api: Api,
    fragments: list[tuple[int, int, int, dict[str, Any]]],
    commits: list[tuple[int, int, int]] = [],  # noqa: B006 - never mutated
) -> dict[str, Any]:
    body = {
        "fragments": [{"step": s, "rank": r, "seq": q, "values": v} for s, r, q, v in fragments],
        "commits": [{"step": s, "rank": r, "fragments": n} for s, r, n in commits],
    }
    response = api.client.post("/v1/runs/r/fragments?partial=true", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    IngestAnswer.model_validate(answer)
    return answer


def test_one_conflicting_fragment_among_six_steps_leaves_five(api: Api) -> None:
    api.register(world_size=1)
    api.send([(2, 0, 0, {"a": 1.0, "n": 1})])
    frags = [(s, 0, 0, {"a": float(s) if s != 2 else 9.0, "n": 1}) for s in range(6)]
    answer = _partial(api, frags, [(s, 0, 1) for s in range(6)])
    assert (answer["accepted"], answer["duplicates"], answer["commits"]) == (5, 0, 6)
    assert answer["rejected"] == [
        {
            "where": "fragments[2]",
            "step": 2,
            "rank": 0,
            "seq": 0,
            "code": "fragment_conflict",
            "message": answer["rejected"][0]["message"],
        }
    ]
    assert "already received with different values" in answer["rejected"][0]["message"]
    assert [api.value(s, "a") for s in range(6)] == [0.0, 1.0, 1.0, 3.0, 4.0, 5.0]
    assert {api.step(s)["status"] for s in range(6)} == {"complete"}


def test_every_kind_of_wrong_item_is_listed_once(api: Api) -> None:
    api.register(world_size=2)
    api.send([(0, 0, 0, {"a": 1.0})], [(0, 0, 1), (0, 1, 0)])  # step 0 complete
    answer = _partial(
        api,
        [
            (1, 0, 0, {"a": 1.0, "n": 1}),  # lands
            (1, 5, 0, {"a": 1.0}),  # rank out of range
            (1, 1, 0, {"a": 1.0, "n": 0.5}),  # a count that is not an integer
            (0, 0, 1, {"a": 1.0}),  # step 0 is complete
            (1, 0, 0, {"a": 2.0, "n": 1}),  # the same key as [0], other values
        ],
        [(1, 0, 1), (1, 0, 2), (1, 7, 1)],
    )
    codes = [(r["where"], r["code"]) for r in answer["rejected"]]
    assert codes == [
        ("fragments[1].rank", "rank_out_of_range"),
        ("fragments[2].values.n", "invalid_value"),
        ("fragments[4]", "fragment_conflict"),
        ("commits[1]", "commit_conflict"),
        ("commits[2].rank", "rank_out_of_range"),
        ("fragments[3]", "step_complete"),
    ]
    assert (answer["accepted"], answer["commits"]) == (1, 1)
    step = api.step(1)
    assert (step["fragments"]["received"], step["ranks_committed"]) == (1, [0])
    assert api.step(0)["fragments"]["received"] == 1


def test_strict_ingest_is_unchanged_and_whole_body_errors_stay_4xx(api: Api) -> None:
    api.register(world_size=1)
    api.send([(0, 0, 0, {"a": 1.0})])
    strict = api.send([(1, 0, 0, {"a": 1.0}), (0, 0, 0, {"a": 2.0})])
    assert strict.status_code == 409
    assert "rejected" not in api.send([(1, 0, 0, {"a": 1.0})]).json()
    bad = api.client.post("/v1/runs/r/fragments?partial=true", content=b"{")
    assert (bad.status_code, bad.json()["error"]["code"]) == (400, "bad_json")
    body = {"fragments": [{"step": 3, "rank": 0, "seq": 0, "values": {"zz": 1.0}}]}
    unknown = api.client.post("/v1/runs/r/fragments?partial=true", json=body)
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (422, "unknown_metric")
    assert api.client.get("/v1/runs/r/steps/3").status_code == 404


def test_all_rejected_stores_nothing(api: Api) -> None:
    api.register(world_size=1)
    answer = _partial(api, [(0, 4, 0, {"a": 1.0})], [(0, 4, 1)])
    assert (answer["accepted"], answer["commits"], len(answer["rejected"])) == (0, 0, 2)
    assert api.client.get("/v1/runs/r/steps/0").status_code == 404
