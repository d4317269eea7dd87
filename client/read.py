"""Read runs from a notebook: every finalised step, exact, as a DataFrame or records.

    from steptally.client.read import Client

    client = Client("http://127.0.0.1:8000")            # token="..." with auth on
    run = client.run("grpo-7b")
    df = run.steps()                                     # pandas, one row per step
    df = run.steps(["kl", "probs_ratio"], start=1000, format="polars")
    for step in run.follow():                            # live, nothing missed
        print(step["step"], step["metrics"]["kl"]["value"])
    client.compare(["grpo-a", "grpo-b"], "kl")           # one column per run

What it promises:

* **Every step, no sampling.** ``steps()`` pages through ``GET /v1/runs/{run}/steps``
  with the service's cursor, whatever the run's length; a page whose cursor does not
  advance is an error (:class:`ReadError` ``cursor_stuck``), never an endless loop.
  Open steps are left out: a row is a finalised step (``complete`` or ``partial``) at
  its newest revision.
* **Exact values.** Each value is the float64 the service rounded once; JSON's
  shortest round-trip form carries it bit for bit, and the proto3 strings ``"NaN"``,
  ``"Infinity"``, ``"-Infinity"`` come back as those floats. An undefined value (a
  zero denominator, a metric no fragment carried) is null — ``None`` in records, null
  in polars, NaN in pandas, where NaN cannot be told from a NaN value — and its reason
  is kept: ``frame.attrs["undefined"]`` (pandas) or :meth:`Run.undefined` (any format).
* **Columns** per metric, in the spec's order, plus ``status``, ``revision``,
  ``ranks_missing`` (the number of ranks that never committed), ``finalised_at``.
* **Patient with a busy service.** 429 and 503 answers are retried after their
  ``Retry-After`` (at most ``max_wait_s`` in all per request); other errors raise
  :class:`ReadError` with the service's machine-readable ``code`` and its sentence.
* **A live stream that misses nothing.** :meth:`Run.follow` reads the run's event
  stream as a browser's ``EventSource`` does and reconnects with ``Last-Event-ID``
  whenever the stream ends or the connection drops, so every step finalised meanwhile
  arrives, each (step, revision) once.

pandas and polars are imported only when asked for (``pip install steptally[notebook]``).
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, Literal

import httpx

_loads: Callable[[bytes | str], Any]
try:  # the same values, parsed three times faster (orjson is in steptally[notebook])
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - the extra not installed
    _loads = json.loads

Format = Literal["pandas", "polars", "records"]
PAGE = 1000  # the service's largest page of steps
FINAL = ("complete", "partial")
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_RETRIED = (429, 503)
_SEEN_MAX = 100_000  # (step, revision) pairs a follower remembers, to drop a repeat


class ReadError(Exception):
    """The service refused a read, or answered what a reader cannot go on from."""

    def __init__(self, code: str, message: str, status: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status


def number(value: float | int | str | None) -> float | None:
    """A metric's JSON value as the float it stands for (None: undefined)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return _NON_FINITE[value]
        except KeyError:
            raise ReadError("bad_value", f"{value!r:.40} is not a number") from None
    return float(value)


def _retry_after(response: httpx.Response, default: float) -> float:
    text = response.headers.get("retry-after", "")
    try:
        return max(0.0, float(text))
    except ValueError:
        return default


def _error(response: httpx.Response) -> ReadError:
    try:
        body = response.json()
        detail = body.get("error", body) if isinstance(body, dict) else {}
        code = str(detail.get("code", f"http_{response.status_code}"))
        message = str(detail.get("message", response.text[:200]))
    except ValueError:
        code, message = f"http_{response.status_code}", response.text[:200]
    return ReadError(code, message, response.status_code)


class Client:
    """A reader of one Steptally service (``url``); ``token`` is a read token when the
    service has auth on. Close it, or use it as a context manager."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        max_wait_s: float = 120.0,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.max_wait_s = max_wait_s
        self._sleep = sleep
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def get(self, path: str, params: Any = None) -> Any:
        """``GET path`` as JSON, waiting out 429 and 503 by their ``Retry-After``."""
        waited = 0.0
        while True:
            response = self._http.get(path, params=params)
            if response.status_code == 200:
                return _loads(response.content)
            if response.status_code not in _RETRIED:
                raise _error(response)
            pause = _retry_after(response, 1.0)
            if waited + pause > self.max_wait_s:
                raise _error(response)
            self._sleep(pause)
            waited += pause

    def runs(self) -> list[dict[str, Any]]:
        """Every run (name order), as ``GET /v1/runs`` describes them."""
        out: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            params = {"limit": PAGE, **({"cursor": cursor} if cursor else {})}
            page = self.get("/v1/runs", params)
            out.extend(page["runs"])
            cursor = _advanced(cursor, page.get("next_cursor"), str)
            if cursor is None:
                return out

    def run(self, name: str) -> Run:
        """The run ``name`` (:class:`ReadError` ``unknown_run`` if there is none)."""
        return Run(self, self.get(f"/v1/runs/{name}"))

    def compare(
        self,
        runs: Sequence[str],
        metric: str,
        *,
        start: int | None = None,
        end: int | None = None,
        format: Format = "pandas",
    ) -> Any:
        """``metric`` of several runs side by side: a ``step`` column and one column per
        run (null where a run has no finalised step)."""
        by_run = {
            name: self.run(name).steps([metric], start=start, end=end, format="records")
            for name in runs
        }
        steps = sorted({row["step"] for rows in by_run.values() for row in rows})
        columns: dict[str, list[Any]] = {"step": steps}
        for name, rows in by_run.items():
            at = {row["step"]: row[metric] for row in rows}
            columns[name] = [at.get(s) for s in steps]
        return _frame(columns, format, {n: "float" for n in runs})


def _advanced(previous: Any, nxt: Any, kind: Callable[[Any], Any]) -> Any:
    """The next page's cursor, refusing one that does not move forward."""
    if nxt is None:
        return None
    if previous is not None and kind(nxt) <= kind(previous):
        raise ReadError(
            "cursor_stuck",
            f"the service answered the cursor {nxt!r} after {previous!r}: paging would not "
            "advance; report this to the service's operators",
        )
    return nxt


class Run:
    """One run of a :class:`Client`: its description in ``info``."""

    def __init__(self, client: Client, info: dict[str, Any]) -> None:
        self.client = client
        self.info = info
        self.name: str = info["name"]
        self._undefined: dict[tuple[int, str], str] = {}

    def __repr__(self) -> str:
        return f"Run({self.name!r}, last finalised step {self.info.get('last_finalised_step')})"

    @property
    def metrics(self) -> list[str]:
        """The spec's metrics, then its derived values, in the order the spec lists them."""
        return [*self.info.get("metrics", {}), *self.info.get("derived", {})]

    def step(self, n: int) -> dict[str, Any]:
        """Step ``n`` as ``GET /v1/runs/{run}/steps/{n}`` shows it (open steps too), each
        metric's ``value`` a float (None: undefined)."""
        return _decoded(self.client.get(f"/v1/runs/{self.name}/steps/{n}"))

    def undefined(self) -> dict[tuple[int, str], str]:
        """Why each undefined value of the last :meth:`steps` read is undefined, by
        (step, metric)."""
        return dict(self._undefined)

    def records(
        self,
        metrics: Sequence[str] | None = None,
        start: int | None = None,
        end: int | None = None,
    ) -> Iterator[dict[str, Any]]:
        """The finalised steps one by one, as :meth:`steps` ``format="records"`` rows."""
        names = list(metrics) if metrics else self.metrics
        params: dict[str, Any] = {"limit": PAGE, "metric": names}
        if start is not None:
            params["start"] = start
        if end is not None:
            params["end"] = end
        for page in self._pages(params):
            for step in page["steps"]:
                if step["status"] in FINAL:
                    yield self._row(step, names)

    def _pages(self, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The pages of steps in order; the next one is asked for (on a thread) as soon
        as its cursor is known, while the caller reads this one."""
        path = f"/v1/runs/{self.name}/steps"
        with ThreadPoolExecutor(1, "steptally-read") as pool:
            pending = pool.submit(self.client.get, path, params)
            cursor: str | None = None
            while True:
                page = pending.result()
                cursor = _advanced(cursor, page.get("next_cursor"), int)
                if cursor is not None:
                    pending = pool.submit(self.client.get, path, {**params, "cursor": cursor})
                yield page
                if cursor is None:
                    return

    def _row(self, step: dict[str, Any], names: list[str]) -> dict[str, Any]:
        n = step["step"]
        row: dict[str, Any] = {
            "step": n,
            "status": step["status"],
            "revision": step["revision"],
            "ranks_missing": _missing(step),
            "finalised_at": _when(step.get("finalised_at")),
        }
        metrics = step["metrics"]
        for name in names:
            shown = metrics[name]
            value = number(shown["value"])
            if value is None:
                self._undefined[(n, name)] = shown.get("reason") or "undefined"
            row[name] = value
        return row

    def steps(
        self,
        metrics: Sequence[str] | None = None,
        start: int | None = None,
        end: int | None = None,
        format: Format = "pandas",
    ) -> Any:
        """Every finalised step from ``start`` to ``end`` (inclusive; None: open ends),
        one row each: ``step``, ``status``, ``revision``, ``ranks_missing``,
        ``finalised_at`` and a column per metric (``metrics``, None: all of them)."""
        self._undefined = {}
        names = list(metrics) if metrics else self.metrics
        rows = list(self.records(names, start, end))
        if format == "records":
            return rows
        columns: dict[str, list[Any]] = {
            c: [r[c] for r in rows]
            for c in ("step", "status", "revision", "ranks_missing", "finalised_at", *names)
        }
        kinds = {"finalised_at": "time", **{n: "float" for n in names}}
        frame = _frame(columns, format, kinds)
        if format == "pandas":
            frame.attrs["undefined"] = self.undefined()
        return frame

    def breaches(
        self,
        rules: Sequence[str] | None = None,
        start: int | None = None,
        end: int | None = None,
        format: Format = "pandas",
    ) -> Any:
        """Every step that broke an alert rule of the run (``rules``, None: any), one row
        per (step, rule) in that order: ``step``, ``rule``, ``condition``, ``metric``,
        ``value`` (what was checked), ``threshold``, ``mean`` (a change rule's window),
        ``revision`` (the first that broke it) and ``finalised_at``."""
        params: dict[str, Any] = {"limit": PAGE}
        if rules:
            params["rule"] = list(rules)
        if start is not None:
            params["start"] = start
        if end is not None:
            params["end"] = end
        path = f"/v1/runs/{self.name}/breaches"
        found: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            page = self.client.get(path, {**params, **({"cursor": cursor} if cursor else {})})
            found.extend(page["breaches"])
            cursor = _advanced(cursor, page.get("next_cursor"), _breach_key)
            if cursor is None:
                break
        names = (
            "step", "rule", "condition", "metric", "value", "threshold", "mean", "revision",
            "finalised_at",
        )  # fmt: skip
        columns: dict[str, list[Any]] = {c: [b.get(c) for b in found] for c in names}
        for c in ("value", "threshold", "mean"):
            columns[c] = [number(v) for v in columns[c]]
        columns["finalised_at"] = [_when(t) for t in columns["finalised_at"]]
        kinds = {"finalised_at": "time", "value": "float", "threshold": "float", "mean": "float"}
        return _frame(columns, format, kinds)

    def follow(
        self, last_event_id: str | None = None, *, reconnect_s: float = 1.0
    ) -> Iterator[dict[str, Any]]:
        """Each step as it is finalised (each revision too), from now on (or after
        ``last_event_id``, an event id of this run's stream), until the caller stops.

        The stream is read as ``EventSource`` reads it: its first message's id, or the
        last event's, is sent as ``Last-Event-ID`` when it reconnects, after the server's
        ``retry`` (or ``reconnect_s``) — when the stream ends, the connection drops or
        the service is away — so the steps finalised meanwhile arrive, each once. The
        id to resume from is in ``.last_event_id`` of the iterator; closing the client
        ends it."""
        return Follower(self, last_event_id, reconnect_s)


class Follower(Iterator[dict[str, Any]]):
    """The iterator of :meth:`Run.follow`; ``last_event_id`` is where it stands."""

    def __init__(self, run: Run, last_event_id: str | None, reconnect_s: float) -> None:
        self.run = run
        self.last_event_id = last_event_id
        self.reconnects = 0  # how many times the stream was opened again
        self._retry_s = reconnect_s
        self._seen: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._events = self._forever()

    def __next__(self) -> dict[str, Any]:
        return next(self._events)

    def close(self) -> None:
        self._events.close()

    def _forever(self) -> Generator[dict[str, Any], None, None]:
        client = self.run.client
        url = f"/v1/runs/{self.run.name}/events"
        opened = False
        while not client._http.is_closed:  # a closed client ends the iteration
            headers = {"Last-Event-ID": self.last_event_id} if self.last_event_id else {}
            try:
                with client._http.stream(
                    "GET", url, headers=headers, timeout=httpx.Timeout(10, read=None)
                ) as response:
                    if response.status_code in _RETRIED:
                        pause = _retry_after(response, self._retry_s)
                    elif response.status_code != 200:
                        response.read()
                        raise _error(response)
                    else:
                        if opened:
                            self.reconnects += 1
                        opened = True
                        yield from self._read(response.iter_lines())
                        pause = self._retry_s
            except (httpx.TransportError, httpx.StreamError):
                pause = self._retry_s
            if client._http.is_closed:
                return
            client._sleep(pause)

    def _read(self, lines: Iterable[str]) -> Iterator[dict[str, Any]]:
        fields: dict[str, list[str]] = {}
        for line in lines:
            if line.startswith(":"):
                continue
            if line:
                name, _, value = line.partition(":")
                fields.setdefault(name, []).append(value.removeprefix(" "))
                continue
            event = self._dispatch(fields)
            fields = {}
            if event is not None:
                yield event

    def _dispatch(self, fields: Mapping[str, list[str]]) -> dict[str, Any] | None:
        if "id" in fields:  # kept even from a message without data, as EventSource does
            self.last_event_id = fields["id"][-1]
        if "retry" in fields and fields["retry"][-1].isdigit():
            self._retry_s = int(fields["retry"][-1]) / 1000
        if "data" not in fields or fields.get("event", ["message"])[-1] != "step":
            return None
        step = _decoded(_loads("\n".join(fields["data"])))
        key = (step["step"], step["revision"])
        if key in self._seen:
            return None
        self._seen[key] = None
        if len(self._seen) > _SEEN_MAX:
            self._seen.popitem(last=False)
        return step


def _breach_key(cursor: str) -> tuple[int, str]:
    step, _, rule = cursor.partition(":")
    return int(step), rule


def _missing(step: Mapping[str, Any]) -> int:
    count = step.get("ranks_missing_count")
    return int(count) if count is not None else len(step.get("ranks_missing") or ())


def _when(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


def _decoded(step: dict[str, Any]) -> dict[str, Any]:
    for shown in step.get("metrics", {}).values():
        shown["value"] = number(shown["value"])
    return step


def _frame(columns: dict[str, list[Any]], format: Format, kinds: Mapping[str, str]) -> Any:
    if format == "records":
        names = list(columns)
        rows = zip(*columns.values(), strict=True)
        return [dict(zip(names, values, strict=True)) for values in rows]
    if format == "pandas":
        return _pandas(columns, kinds)
    if format == "polars":
        return _polars(columns, kinds)
    raise ValueError(f"format must be 'pandas', 'polars' or 'records', not {format!r}")


def _pandas(columns: dict[str, list[Any]], kinds: Mapping[str, str]) -> Any:
    try:
        import numpy as np
        import pandas as pd
    except ImportError:
        raise ImportError("format='pandas' needs pandas: pip install steptally[notebook]") from None
    data: dict[str, Any] = {}
    for name, values in columns.items():
        kind = kinds.get(name)
        if kind == "float":
            data[name] = np.array([math.nan if v is None else v for v in values], np.float64)
        elif kind == "time":
            data[name] = pd.to_datetime(values, utc=True)
        else:
            data[name] = values
    return pd.DataFrame(data)


def _polars(columns: dict[str, list[Any]], kinds: Mapping[str, str]) -> Any:
    try:
        import polars as pl
    except ImportError:
        raise ImportError("format='polars' needs polars: pip install steptally[notebook]") from None
    schema: dict[str, Any] = {}
    for name in columns:
        kind = kinds.get(name)
        if kind == "float":
            schema[name] = pl.Float64  # None stays null, NaN stays NaN
        elif kind == "time":
            schema[name] = pl.Datetime("us", "UTC")
    return pl.DataFrame(columns, schema_overrides=schema, strict=False)
