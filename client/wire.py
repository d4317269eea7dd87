"""The wire format of fragments and commits, shared by the reporter and the service.

Two JSON bodies are accepted by ``POST /v1/runs/{run}/fragments``:

* the **row form**, for people and curl::

    {"fragments": [{"step": 3, "rank": 0, "seq": 0, "values": {"loss_num": 1.5}}],
     "commits":   [{"step": 3, "rank": 0, "fragments": 1}]}

* the **compact (columnar) form**, for the reporter: the values of all fragments as
  one base64 block of little-endian float64, row-major (fragment × metric)::

    {"columnar": {"metrics": ["loss_num", "tokens"], "step": [3, 3], "rank": [0, 0],
                  "seq": [0, 1], "values": "<base64>", "present": "<base64>" | null},
     "commits": [...]}

  ``present`` holds one byte per cell (1 = the fragment carries that metric); when
  it is null every cell is present.

A sum's value may be **exact**: the terms of a float64 expansion (finite, largest
first, the first the correctly rounded sum), so that the fragments of any split of a
step's tokens add up to the same bits. The row form sends the terms as a JSON array
(``"loss_num": [1.5, 1.1e-17]``); the compact form keeps the first term in its cell and
lists the rest in an optional ragged block, ``"tails": {"cells": [cell index, ...],
"lengths": [terms after the first, ...], "values": "<base64>"}``, cells increasing. An
expansion holds at most 64 terms; a plain number is a one-term expansion.

Non-finite numbers travel in JSON as the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"`` (the proto3 JSON convention), in both directions. Every NaN is
canonicalised on decode, so a fragment's identity never depends on a NaN payload.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from steptally.client.algebra.exact import MAX_TERMS
from steptally.client.algebra.kind import NAME_PATTERN
from steptally.client.wire_numbers import (
    MAX_INT,
    NON_FINITE,
    Value,
    WireError,
    canonical_nan,
    check_terms,
    decode_b64,
    decode_int,
    decode_number,
    decode_value,
    encode_b64,
    encode_number,
    f64_from_le_bytes,
    f64_to_le_bytes,
    int_column,
)

__all__ = [
    "MAX_INT",
    "NON_FINITE",
    "Commit",
    "FragmentBatch",
    "Value",
    "WireError",
    "decode_batch",
    "decode_number",
    "decode_value",
    "encode_columnar",
    "encode_commits",
    "encode_number",
    "encode_rows",
    "f64_from_le_bytes",
    "f64_to_le_bytes",
]


@dataclass(frozen=True, slots=True)
class Commit:
    step: int
    rank: int
    fragments: int


@dataclass(slots=True)
class FragmentBatch:
    """Fragments as columns: ``values[i * len(metrics) + j]`` is fragment i's metric j."""

    metrics: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    values: array[float] = field(default_factory=lambda: array("d"))
    present: bytes | None = None
    commits: list[Commit] = field(default_factory=list)
    tails: dict[int, tuple[float, ...]] = field(default_factory=dict)  # cell → terms after
    # the first of an exact sum

    def __len__(self) -> int:
        return len(self.steps)

    def row(self, i: int) -> dict[str, Value]:
        """Fragment ``i``'s values as a dict (absent metrics left out), an exact sum as
        the tuple of its terms."""
        m = len(self.metrics)
        vals: list[Value] = list(self.values[i * m : (i + 1) * m])
        for cell, tail in self.tails.items():
            if i * m <= cell < (i + 1) * m:
                vals[cell - i * m] = (self.values[cell], *tail)
        if self.present is None:
            return dict(zip(self.metrics, vals, strict=True))
        mask = self.present[i * m : (i + 1) * m]
        return {n: v for n, v, p in zip(self.metrics, vals, mask, strict=True) if p}

    def rows(self) -> Iterator[tuple[int, int, int, dict[str, Value]]]:
        for i in range(len(self)):
            yield self.steps[i], self.ranks[i], self.seqs[i], self.row(i)


# -- decode --------------------------------------------------------------------------


def decode_batch(body: object) -> FragmentBatch:
    """Decode a parsed JSON body of either form into a :class:`FragmentBatch`."""
    if not isinstance(body, dict):
        raise WireError("", "the body must be a JSON object")
    unknown = set(body) - {"fragments", "columnar", "commits"}
    if unknown:
        raise WireError("", f"unknown field(s) {sorted(unknown)}; use fragments, columnar, commits")
    if "fragments" in body and "columnar" in body:
        raise WireError("", "send either 'fragments' (row form) or 'columnar', not both")
    if body.get("columnar") is not None:
        batch = _decode_columnar(body["columnar"])
    else:
        batch = _decode_rows(_listed(body, "fragments"))
    batch.commits = _decode_commits(_listed(body, "commits"))
    return batch


def _listed(body: dict[str, object], key: str) -> object:
    """``body[key]``, a missing or null one as an empty list (any other value as it is,
    to be refused unless it is a list: ``{}`` is not an empty list)."""
    value = body.get(key)
    return [] if value is None else value


def _decode_rows(rows: object) -> FragmentBatch:
    if not isinstance(rows, list):
        raise WireError("fragments", "must be a list")
    index: dict[str, int] = {}
    parsed: list[dict[int, float]] = []
    tails: dict[tuple[int, int], tuple[float, ...]] = {}
    batch = FragmentBatch()
    for i, row in enumerate(rows):
        where = f"fragments[{i}]"
        if not isinstance(row, dict):
            raise WireError(where, "must be an object with step, rank, seq and values")
        missing = [k for k in ("step", "rank", "seq", "values") if k not in row]
        if missing:
            raise WireError(where, f"missing field(s) {', '.join(missing)}")
        extra = set(row) - {"step", "rank", "seq", "values"}
        if extra:
            raise WireError(where, f"unknown field(s) {sorted(extra)}")
        batch.steps.append(decode_int(row["step"], f"{where}.step"))
        batch.ranks.append(decode_int(row["rank"], f"{where}.rank"))
        batch.seqs.append(decode_int(row["seq"], f"{where}.seq"))
        values = row["values"]
        if not isinstance(values, dict):
            raise WireError(f"{where}.values", "must be an object of metric name to number")
        cells: dict[int, float] = {}
        for name, v in values.items():
            if not NAME_PATTERN.fullmatch(name):
                raise WireError(f"{where}.values", f"{name!r:.40} is not a valid metric name")
            col = index.setdefault(name, len(index))
            cells[col], tail = decode_value(v, f"{where}.values.{name}")
            if tail:
                tails[i, col] = tail
        parsed.append(cells)
    batch.metrics = list(index)
    m = len(index)
    batch.values = array("d", bytes(8 * m * len(parsed)))
    present = bytearray(m * len(parsed))
    for i, cells in enumerate(parsed):
        for col, v in cells.items():
            batch.values[i * m + col] = v
            present[i * m + col] = 1
    batch.present = None if all(present) else bytes(present)
    batch.tails = {i * m + col: tail for (i, col), tail in tails.items()}
    return batch


def _decode_columnar(data: object) -> FragmentBatch:
    if not isinstance(data, dict):
        raise WireError("columnar", "must be an object")
    metrics = data.get("metrics")
    if not isinstance(metrics, list):
        raise WireError("columnar.metrics", "must be a list of metric names")
    _check_names(metrics)
    steps = int_column(data, "step", None)
    ranks = int_column(data, "rank", len(steps))
    seqs = int_column(data, "seq", len(steps))
    raw = decode_b64(data.get("values"), "columnar.values")
    cells = len(steps) * len(metrics)
    if len(raw) != 8 * cells:
        raise WireError(
            "columnar.values", f"holds {len(raw) // 8} float64 values, expected {cells}"
        )
    values = f64_from_le_bytes(raw)
    canonical_nan(values)
    present = None
    if data.get("present") is not None:
        present = decode_b64(data["present"], "columnar.present")
        if len(present) != cells or present.strip(b"\x00\x01"):
            raise WireError("columnar.present", f"must hold {cells} bytes, each 0 or 1")
        if all(present):
            present = None
    batch = FragmentBatch(list(metrics), steps, ranks, seqs, values, present)
    if data.get("tails") is not None:
        batch.tails = _decode_tails(data["tails"], batch)
    return batch


#: lists of metric names already found valid (a reporter sends the same one each time)
_VALID_NAMES: dict[tuple[str, ...], None] = {}
_VALID_NAMES_KEPT = 256


def _check_names(metrics: list[Any]) -> None:
    """Refuse a list of metric names that holds a non-string, an invalid name or one
    name twice."""
    if set(map(type, metrics)) - {str}:
        raise WireError("columnar.metrics", "must be a list of metric names")
    key = tuple(metrics)
    if key in _VALID_NAMES:
        return
    for name in metrics:
        if not NAME_PATTERN.fullmatch(name):
            raise WireError("columnar.metrics", f"{name!r:.40} is not a valid metric name")
    if len(set(metrics)) != len(metrics):
        raise WireError("columnar.metrics", "names a metric twice")
    if len(_VALID_NAMES) >= _VALID_NAMES_KEPT:
        _VALID_NAMES.clear()
    _VALID_NAMES[key] = None


def _decode_tails(data: object, batch: FragmentBatch) -> dict[int, tuple[float, ...]]:
    """The ``tails`` block of the compact form: cell index → the terms after its first."""
    if not isinstance(data, dict) or set(data) != {"cells", "lengths", "values"}:
        raise WireError("columnar.tails", "must be an object with cells, lengths and values")
    where = "columnar.tails"
    cells = int_column(data, "cells", None, where)
    lengths = int_column(data, "lengths", len(cells), where)
    total = len(batch.values)
    if any(b <= a for a, b in pairwise(cells)) or (cells and cells[-1] >= total):
        raise WireError(f"{where}.cells", f"must increase, each below {total} (the cells)")
    if any(not 1 <= n < MAX_TERMS for n in lengths):
        raise WireError(f"{where}.lengths", f"each must be 1 to {MAX_TERMS - 1}")
    values = f64_from_le_bytes(decode_b64(data["values"], f"{where}.values"))
    if len(values) != sum(lengths):
        raise WireError(f"{where}.values", f"holds {len(values)} float64, expected {sum(lengths)}")
    out: dict[int, tuple[float, ...]] = {}
    start = 0
    for k, (cell, n) in enumerate(zip(cells, lengths, strict=True)):
        if batch.present is not None and not batch.present[cell]:
            raise WireError(f"{where}.cells[{k}]", f"cell {cell} is not present")
        out[cell] = tuple(values[start : start + n])
        check_terms(batch.values[cell], out[cell], f"{where}.cells[{k}]")
        start += n
    return out


def _decode_commits(rows: object) -> list[Commit]:
    if not isinstance(rows, list):
        raise WireError("commits", "must be a list")
    out = []
    for i, row in enumerate(rows):
        where = f"commits[{i}]"
        if not isinstance(row, dict) or set(row) != {"step", "rank", "fragments"}:
            raise WireError(where, "must be an object with exactly step, rank and fragments")
        out.append(
            Commit(
                decode_int(row["step"], f"{where}.step"),
                decode_int(row["rank"], f"{where}.rank"),
                decode_int(row["fragments"], f"{where}.fragments"),
            )
        )
    return out


# -- encode --------------------------------------------------------------------------


def encode_commits(commits: Sequence[Commit]) -> list[dict[str, int]]:
    return [{"step": c.step, "rank": c.rank, "fragments": c.fragments} for c in commits]


def encode_columnar(batch: FragmentBatch) -> dict[str, Any]:
    """The compact form of ``batch`` as a JSON-ready dict (a tails block only if needed)."""
    columnar: dict[str, Any] = {
        "metrics": list(batch.metrics),
        "step": list(batch.steps),
        "rank": list(batch.ranks),
        "seq": list(batch.seqs),
        "values": encode_b64(f64_to_le_bytes(batch.values)),
        "present": None if batch.present is None else encode_b64(batch.present),
    }
    if batch.tails:
        cells = sorted(batch.tails)
        terms = array("d", (x for cell in cells for x in batch.tails[cell]))
        columnar["tails"] = {
            "cells": cells,
            "lengths": [len(batch.tails[cell]) for cell in cells],
            "values": encode_b64(f64_to_le_bytes(terms)),
        }
    return {"columnar": columnar, "commits": encode_commits(batch.commits)}


def _encode_value(v: Value) -> float | str | list[float | str]:
    return [encode_number(x) for x in v] if isinstance(v, tuple) else encode_number(v)


def encode_rows(batch: FragmentBatch) -> dict[str, Any]:
    """The row form of ``batch`` as a JSON-ready dict."""
    return {
        "fragments": [
            {"step": s, "rank": r, "seq": q, "values": {k: _encode_value(v) for k, v in d.items()}}
            for s, r, q, d in batch.rows()
        ],
        "commits": encode_commits(batch.commits),
    }
