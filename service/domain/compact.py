"""The reporter's compact body, checked and packed in a few calls.

The reporter sends one shape of body thousands of times a second: the compact form
(:mod:`steptally.client.wire`) with the run's metrics in the run's column order,
every cell present, no exact sums' further terms, each fragment once, and its
commits. :func:`prepared` takes such a body from its parsed JSON straight to the
:class:`~steptally.service.domain.batch.PreparedBatch` that decoding it
(:func:`~steptally.client.wire.decode_batch`) and preparing it
(:func:`~steptally.service.domain.batch.prepare`, then
:func:`~steptally.service.domain.partial.states_of`) give — the same fragments, bytes,
commits, origins and partial states — with no Python work per value or fragment: the compiled
kernel canonicalises the NaNs and checks the count columns
(``_partial.canonical``), then checks the keys, packs the fragments and combines each
(step, rank)'s rows (``_partial.pack``).

Anything else — another shape, or anything wrong in it — gets None, and the general
path decodes, checks and names what is wrong, as before. So the fast path never
decides an error; ``tests/unit/test_compact.py`` checks that it answers exactly as the
general path does, or not at all.
"""

from __future__ import annotations

import binascii
import math
from typing import Any

import pybase64

from steptally.client.wire_numbers import MAX_INT
from steptally.service.domain.batch import PreparedBatch
from steptally.service.domain.partial import kernel
from steptally.service.domain.run import RunRecord

_COMMIT = frozenset({"step", "rank", "fragments"})


def prepared(run: RunRecord, data: Any) -> PreparedBatch | None:
    """The prepared batch of the compact body ``data`` (its parsed JSON) for ``run``, or
    None when it is not the reporter's plain shape or anything in it is wrong."""
    if kernel is None or type(data) is not dict or not data.keys() <= {"columnar", "commits"}:
        return None
    block = data["columnar"]  # the caller found it not null
    if type(block) is not dict or block.get("present") is not None:
        return None
    if block.get("tails") is not None or block.get("metrics") != list(run.columns):
        return None
    steps: Any = block.get("step")
    ranks: Any = block.get("rank")
    seqs: Any = block.get("seq")
    if type(steps) is not list or type(ranks) is not list or type(seqs) is not list:
        return None
    raw = block.get("values")
    if type(raw) is not str:
        return None
    try:
        values = pybase64.b64decode(raw, validate=True)  # SIMD; as strict as binascii's
    except (binascii.Error, ValueError):
        return None
    width = len(run.columns)
    kinds, guards = run.layout
    if len(values) != 8 * width * len(steps):
        return None
    rows = kernel.canonical(values, width, kinds, math.nan)
    if rows is None:
        return None
    out = PreparedBatch(columnar=True)
    if not _commits(data.get("commits"), run.world_size, out):
        return None
    # the lists' integers, the ranks' bound, the keys once each; the fragments, their
    # origins, each pair's state and the plain pairs: in one call, no work per value
    packed = kernel.pack(
        steps, ranks, seqs, rows, run.world_size, out.commits, kinds, guards, width
    )
    if packed is None:
        return None
    out.fragments, out.origin, out.states, plain = packed
    out.set_plain(plain)
    return out


def _commits(rows: Any, world_size: int, out: PreparedBatch) -> bool:
    """Put the commits ``rows`` in ``out``; False if any is not plain and right."""
    if rows is None:
        return True
    if type(rows) is not list:
        return False
    for i, row in enumerate(rows):
        if type(row) is not dict or row.keys() != _COMMIT:
            return False
        step, rank, fragments = row["step"], row["rank"], row["fragments"]
        if type(step) is not int or type(rank) is not int or type(fragments) is not int:
            return False
        if not (0 <= step <= MAX_INT and 0 <= rank < world_size and 0 <= fragments <= MAX_INT):
            return False
        key = (step, rank)
        if out.commits.setdefault(key, fragments) != fragments:
            return False
        out.commit_origin.setdefault(key, i)
    return True
