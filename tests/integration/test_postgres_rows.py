"""PostgreSQL keeps a reporter's fragment bundle and partial state in their rows
(migration 0010): a body of 8 × 32 float64 writes no TOAST row, where PostgreSQL's
default moved each 2 kB bundle out of line (bench/README.md, Scale). A row wider than
a page's worth still goes out of line."""

from __future__ import annotations

import base64
import random
import struct

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from steptally.service.app import create_app
from steptally.service.settings import Settings

pytestmark = pytest.mark.postgres


def _body(names: list[str], rank: int, fragments: int) -> dict[str, object]:
    rnd = random.Random(rank)
    values = [rnd.uniform(-1e3, 1e3) for _ in range(fragments * len(names))]
    raw = struct.pack(f"<{len(values)}d", *values)
    return {
        "columnar": {
            "metrics": names,
            "step": [0] * fragments,
            "rank": [rank] * fragments,
            "seq": list(range(fragments)),
            "values": base64.b64encode(raw).decode(),
        },
        "commits": [{"step": 0, "rank": rank, "fragments": fragments}],
    }


def _toast_rows(engine: sa.Engine, table: str) -> int:
    with engine.connect() as conn:
        toast = conn.execute(
            sa.text("SELECT reltoastrelid::regclass::text FROM pg_class WHERE relname = :t"),
            {"t": table},
        ).scalar_one()
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {toast}")).scalar_one())


@pytest.mark.parametrize(("metrics", "inline"), [(32, True), (160, False)])
def test_a_bundle_stays_in_its_row_up_to_a_pages_worth(
    postgres_url: str, metrics: int, inline: bool
) -> None:
    from tests.integration.conftest import _empty

    _empty(postgres_url)
    names = [f"m{i:03d}" for i in range(metrics)]
    engine = sa.create_engine(postgres_url)
    app = create_app(Settings(database_url=postgres_url), sweep=False)
    try:
        with TestClient(app) as client:
            spec = {"name": "wide", "world_size": 4, "metrics": dict.fromkeys(names, "sum")}
            assert client.post("/v1/runs", json=spec).status_code == 201
            for rank in range(4):
                answer = client.post("/v1/runs/wide/fragments", json=_body(names, rank, 8))
                assert answer.status_code == 200, answer.text
                assert answer.json()["accepted"] == 8
            step = client.get("/v1/runs/wide/steps/0").json()
            assert step["status"] == "complete"
        with engine.connect() as conn:
            sizes = conn.execute(sa.text("SELECT octet_length(values_f64) FROM fragments"))
            assert sorted(sizes.scalars()) == [8 * 8 * metrics] * 4
        bundles_out_of_line = _toast_rows(engine, "fragments")
        if inline:
            assert bundles_out_of_line == 0
            assert _toast_rows(engine, "partials") == 0
        else:  # 8 × 160 float64 = 10 kB: wider than a page's worth, out of line as before
            assert bundles_out_of_line >= 4
    finally:
        engine.dispose()
