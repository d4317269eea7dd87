"""log() and commit() on the training thread: programming errors raise at once, delivery
problems never do, host and tensor values arrive exactly, seqs are unique and contiguous."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.reporting import fake_reporter

from steptally.client.reporter import FragmentError, Reporter, ReporterClosed
from steptally.client.reporter.fake import FakeService

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch

SPEC = {
    "metrics": {"loss_num": "sum", "tokens": "count", "ratio_max": "max"},
    "derived": {"loss": "loss_num / tokens"},
}


@pytest.fixture
def service() -> FakeService:
    return FakeService()


@pytest.fixture
def reporter(service: FakeService, tmp_path: Path) -> Iterator[Reporter]:
    with fake_reporter(service, tmp_path / "spool", SPEC) as r:
        yield r


@pytest.mark.parametrize(
    ("fragments", "words"),
    [
        ({"nope": 1.0}, "'nope' is not a base metric of the run's spec"),
        ({"loss": 1.0}, "'loss' is not a base metric"),  # derived: computed, never logged
        ({"loss_num": "1.0"}, "must be a number or a one-element tensor, not str"),
        ({"loss_num": None}, "not NoneType"),
        ({"loss_num": True}, "not bool"),
        ({"loss_num": [1.0]}, "not list"),
        ({"tokens": -1}, "'tokens' is a count, so its value must be a non-negative integer"),
        ({"tokens": 2.5}, "non-negative integer, not 2.5"),
        ({"tokens": math.nan}, "non-negative integer"),
        ({"tokens": math.inf}, "non-negative integer"),
        ({"loss_num": 2**1100}, "too large for a float64"),
        ({}, "non-empty mapping"),
    ],
)
def test_programming_errors_raise_at_once(
    reporter: Reporter, fragments: dict[str, Any], words: str
) -> None:
    with pytest.raises(FragmentError, match=words):
        reporter.log(0, fragments)
    assert reporter.stats().queued == 0


@pytest.mark.parametrize("step", [-1, 1.0, "3", True, None])
def test_step_must_be_a_non_negative_integer(reporter: Reporter, step: Any) -> None:
    with pytest.raises(FragmentError, match="step must be a non-negative integer"):
        reporter.log(step, {"loss_num": 1.0})


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (torch.ones(2, dtype=torch.int64), r"exact parts, so .* real floating point"),
        (torch.ones(1, 3), r"not shape \(1, 3\)"),
        (torch.tensor(True), "torch.bool tensor is not a real number"),
        (torch.tensor(1 + 2j), "complex64 tensor is not a real number"),
    ],
)
def test_tensor_shape_and_dtype_errors_raise_at_once(
    reporter: Reporter, value: Any, words: str
) -> None:
    with pytest.raises(FragmentError, match=words):
        reporter.log(0, {"loss_num": value})


def test_a_known_count_tensor_is_checked_at_once(reporter: Reporter) -> None:
    with pytest.raises(FragmentError, match="'tokens' is a count"):
        reporter.log(0, {"tokens": torch.tensor(2.5)})


def test_host_values_and_cpu_tensors_arrive_exactly(
    reporter: Reporter, service: FakeService
) -> None:
    x = torch.tensor([0.1], dtype=torch.float64, requires_grad=True) * 3
    reporter.log(0, {"loss_num": x, "tokens": torch.tensor(7), "ratio_max": torch.tensor(0.5)})
    reporter.log(0, {"loss_num": 0.1, "tokens": 3, "ratio_max": torch.tensor([[1.25]])})
    reporter.log(0, {"loss_num": math.nan, "ratio_max": -math.inf})  # non-finite is data
    reporter.log(0, {"loss_num": torch.tensor(0.1, dtype=torch.float32)})
    reporter.commit(0)
    assert reporter.flush(5)
    got = service.fragments
    assert got[0, 0, 0] == {"loss_num": 0.1 * 3, "tokens": 7.0, "ratio_max": 0.5}
    assert got[0, 0, 1] == {"loss_num": 0.1, "tokens": 3.0, "ratio_max": 1.25}
    assert math.isnan(got[0, 0, 2]["loss_num"]) and got[0, 0, 2]["ratio_max"] == -math.inf
    assert got[0, 0, 3] == {"loss_num": float(torch.tensor(0.1, dtype=torch.float32))}
    assert service.commits == {(0, 0): 4}
    assert reporter.stats().sent == 4


def test_exact_parts_arrive_as_their_canonical_expansion(
    reporter: Reporter, service: FakeService
) -> None:
    tiny = 2.0**-80
    parts = torch.tensor([1.0, tiny, 0.0, -1.0, 3.0, 0.5], dtype=torch.float64)
    reporter.log(0, {"loss_num": parts, "tokens": 2})
    parts.zero_()  # resolved off-thread from a copy: a later change does not reach it
    reporter.log(0, {"loss_num": torch.tensor([0.25, 0.5, 0.0]), "tokens": 1})  # one term
    reporter.log(0, {"loss_num": torch.tensor([0.0, math.inf, 1.0]), "tokens": 1})
    with pytest.raises(FragmentError, match=r"must be a sum \(it is a count\)"):
        reporter.log(0, {"tokens": torch.ones(2)})
    reporter.commit(0)
    assert reporter.flush(5)
    got = service.fragments
    assert got[0, 0, 0] == {"loss_num": (3.5, tiny), "tokens": 2.0}
    assert got[0, 0, 1] == {"loss_num": 0.75, "tokens": 1.0}
    assert got[0, 0, 2] == {"loss_num": math.inf, "tokens": 1.0}  # non-finite: one number


def test_commit_counts_the_log_calls_of_its_step(reporter: Reporter, service: FakeService) -> None:
    for step, calls in [(0, 3), (1, 0), (2, 1)]:
        for _ in range(calls):
            reporter.log(step, {"loss_num": 1.0})
        reporter.commit(step)
    assert reporter.flush(5)
    assert service.commits == {(0, 0): 3, (1, 0): 0, (2, 0): 1}
    assert sorted(service.fragments) == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (2, 0, 0)]


def test_log_or_commit_after_commit_is_an_error(reporter: Reporter) -> None:
    reporter.log(4, {"loss_num": 1.0})
    reporter.commit(4)
    with pytest.raises(FragmentError, match="step 4 was already committed"):
        reporter.log(4, {"loss_num": 1.0})
    with pytest.raises(FragmentError, match="step 4 was already committed"):
        reporter.commit(4)


FLOATS = {"loss_num": 1.0, "tokens": 2}
TENSORS = {"loss_num": torch.tensor(1.0), "tokens": torch.tensor(2)}


@pytest.mark.parametrize(
    ("first", "later", "words"),
    [
        (FLOATS, {"nope": 1.0, "tokens": 1.0}, "'nope' is not a base metric of the run's spec"),
        (FLOATS, {"loss_num": 1.0, "tokens": 2.5}, "'tokens' is a count"),
        (FLOATS, {"loss_num": True, "tokens": 2}, "not bool True"),
        (TENSORS, {"loss_num": torch.ones(1, 3), "tokens": torch.tensor(1)}, r"not shape \(1, 3\)"),
        (
            TENSORS,
            {"loss_num": torch.tensor(True), "ratio_max": torch.tensor(1.0)},
            "not a real number",
        ),
        (
            TENSORS,
            {"loss_num": torch.tensor(1.0), "tokens": torch.tensor(-1)},
            "'tokens' is a count",
        ),
    ],
)
def test_a_later_fragment_of_a_checked_size_is_checked_off_thread_and_refused(
    reporter: Reporter,
    service: FakeService,
    first: dict[str, Any],
    later: dict[str, Any],
    words: str,
) -> None:
    reporter.log(0, dict(first))  # the first of two values of this kind: checked here
    reporter.log(0, later)  # does not raise: checked on the background thread
    reporter.log(0, {"loss_num": 3.0, "tokens": 4})
    reporter.commit(0)
    assert reporter.flush(5)
    stats = reporter.stats()
    assert stats.rejected == 1 and stats.sent == 2
    assert re.search(words, stats.last_error or "") and "rank 0 step 0" in (stats.last_error or "")
    assert service.fragments == {
        (0, 0, 0): {"loss_num": 1.0, "tokens": 2.0},
        (0, 0, 2): {"loss_num": 3.0, "tokens": 4.0},
    }
    assert service.commits == {(0, 0): 3}  # the refused one is counted: the step is incomplete


@pytest.mark.parametrize(
    ("first", "later"),
    [
        (FLOATS, {"loss_num": torch.ones(1, 3), "tokens": torch.tensor(1)}),
        (TENSORS, {"loss_num": 1.0, "tokens": "two"}),
        (FLOATS, {"loss_num": 1.0, "tokens": 10**400}),
        (FLOATS, {"loss_num": 1.0, "tokens": None}),
    ],
)
def test_the_first_fragment_of_a_size_and_kind_is_checked_at_once(
    reporter: Reporter, first: dict[str, Any], later: dict[str, Any]
) -> None:
    """Floats after a size was checked with tensors, or the other way round, and
    values that are not numbers at all, take the checked path: the error is raised."""
    reporter.log(0, dict(first))
    with pytest.raises(FragmentError):
        reporter.log(0, later)


def test_ints_take_the_one_frame_path_and_arrive_as_the_checked_path_makes_them() -> None:
    from steptally.client.algebra import Kind
    from steptally.client.reporter.capture import Capture
    from steptally.client.reporter.intake import Intake

    intake = Intake(0, 1 << 20, 1 << 30, Capture({"loss_num": Kind.SUM, "tokens": Kind.COUNT}))
    checked: list[object] = []
    log = intake.logger(lambda step, fragments: checked.append(fragments))
    intake.checked_size(2, False)
    log(0, {"loss_num": 2**53 + 1, "tokens": 3})  # an int past float64's integers
    log(0, {"loss_num": 0.5, "tokens": 7})
    log(0, {"loss_num": False, "tokens": 7})  # a bool is not a number here: refused
    assert not checked
    drained = intake.drain()
    assert [e.values for e in drained[:2]] == [[float(2**53 + 1), 3.0], [0.5, 7.0]]  # type: ignore[union-attr]
    assert [type(x) for e in drained[:2] for x in e.values] == [float] * 4  # type: ignore[union-attr]
    assert "not bool False" in (drained[2].refused or "")  # type: ignore[union-attr]


def test_a_dict_changed_after_log_is_sent_as_it_was_logged(
    reporter: Reporter, service: FakeService
) -> None:
    row: dict[str, Any] = {"loss_num": 1.0, "tokens": 2}
    reporter.log(0, row)
    for step in range(1, 4):
        row = {"loss_num": float(step), "tokens": float(step)}
        reporter.log(step, row)  # the one-frame path: queued as a copy of the dict
        row["loss_num"], row["tokens"] = -1.0, 99.0
        row.pop("tokens")
        reporter.commit(step)
    assert reporter.flush(5)
    assert {s: v for (s, _, _), v in service.fragments.items() if s} == {
        step: {"loss_num": float(step), "tokens": float(step)} for step in range(1, 4)
    }


def test_log_after_close_is_an_error(reporter: Reporter) -> None:
    reporter.log(0, {"loss_num": 1.0})  # a checked size: the one-frame path from now on
    reporter.close()
    with pytest.raises(ReporterClosed):
        reporter.log(0, {"loss_num": 1.0})


def test_log_never_raises_when_delivery_fails(reporter: Reporter, service: FakeService) -> None:
    service.down = True
    for step in range(20):
        for _ in range(4):
            reporter.log(step, {"loss_num": 1.0, "tokens": 2})
        reporter.commit(step)
    assert not reporter.flush(0.3)
    stats = reporter.stats()
    assert stats.retried >= 1 and stats.sent == 0
    assert "ConnectError" in (stats.last_error or "")
    service.down = False
    assert reporter.flush(5)
    assert reporter.stats().sent == 80


def test_log_from_many_threads_numbers_every_fragment_once(
    reporter: Reporter, service: FakeService
) -> None:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up
    try:
        _log_from_threads(reporter, service)
    finally:
        sys.setswitchinterval(old)


def _log_from_threads(reporter: Reporter, service: FakeService) -> None:
    threads, per_thread, steps = 8, 2000, 3
    barrier = threading.Barrier(threads)

    def work(t: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            reporter.log(i % steps, {"loss_num": float(t * per_thread + i)})

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    for step in range(steps):
        reporter.commit(step)
    assert reporter.flush(10)
    values = []
    for step in range(steps):
        seqs = sorted(q for s, _, q in service.fragments if s == step)
        assert seqs == list(range(len(seqs)))  # unique and contiguous
        assert service.commits[step, 0] == len(seqs)
        values += [v["loss_num"] for (s, _, _), v in service.fragments.items() if s == step]
    assert sorted(values) == [float(i) for i in range(threads * per_thread)]
    assert service.duplicates == 0


def test_importing_the_reporter_does_not_import_torch() -> None:
    code = "import sys, steptally.client as c; c.Reporter; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_flushed_at_interpreter_exit(tmp_path: Path) -> None:
    out = tmp_path / "received.txt"
    code = f"""
import httpx
from steptally.client.reporter import Reporter
def handler(request):
    if request.url.path.endswith("/fragments"):
        with open({str(out)!r}, "ab") as f:
            f.write(request.read() + b"\\n")
    return httpx.Response(200, json={{}})
r = Reporter("http://x", run="r", spec={{"metrics": {{"a": "sum"}}}}, rank=0, world_size=1,
             transport=httpx.MockTransport(handler), spool_dir={str(tmp_path / "s")!r})
r.log(0, {{"a": 1.0}})
r.commit(0)
"""  # no close(), no flush(): the exit hook delivers
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert b'"commits":[{"step":0,"rank":0,"fragments":1}]' in out.read_bytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_arrive_without_a_sync_on_the_calling_thread(
    reporter: Reporter, service: FakeService
) -> None:
    dev = torch.device("cuda")
    loss = torch.tensor(0.1, device=dev, dtype=torch.float64) * 3
    tokens = torch.tensor([11], device=dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        reporter.log(0, {"loss_num": loss, "tokens": tokens, "ratio_max": 2.0})
        reporter.log(0, {"tokens": torch.tensor(2.5, device=dev)})  # checked off-thread
        parts = torch.tensor([1.0, 2.0**-80, 2.0], device=dev, dtype=torch.float64)
        reporter.log(0, {"loss_num": parts, "tokens": tokens})  # exact parts: staged too
        reporter.commit(0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert reporter.flush(10)
    assert service.fragments[0, 0, 0] == {"loss_num": 0.1 * 3, "tokens": 11.0, "ratio_max": 2.0}
    assert (0, 0, 1) not in service.fragments
    assert service.fragments[0, 0, 2] == {"loss_num": (3.0, 2.0**-80), "tokens": 11.0}
    assert reporter.stats().rejected == 1
    assert "'tokens' is a count" in (reporter.stats().last_error or "")


def test_a_cpu_tensor_is_read_off_thread_and_refused_if_changed_in_place() -> None:
    from steptally.client.algebra import Kind
    from steptally.client.reporter.capture import Capture, entry_of

    capture = Capture({"a": Kind.SUM, "m": Kind.MAX, "n": Kind.COUNT})
    fresh, kept = torch.tensor(1.5), torch.tensor(2.0, dtype=torch.float32)
    entry = entry_of(capture(0, {"a": fresh, "m": kept, "n": torch.tensor(3)}))
    assert entry.values == [0.0, 0.0, 3.0]  # the count is read (and checked) at once
    assert entry.resolve() is None and entry.values == [1.5, 2.0, 3.0]
    changed = entry_of(capture(1, {"a": fresh, "m": kept}))
    kept.add_(1.0)
    reason = changed.resolve()
    assert reason is not None and "'m': the tensor was changed in place after log()" in reason
    with pytest.raises(FragmentError, match="not a real number"):
        capture(2, {"a": torch.tensor(True)})
    with pytest.raises(FragmentError, match="exactly one element"):
        capture(2, {"m": torch.tensor([[1.0, 2.0]])})


def test_a_logged_host_tensor_changed_in_place_is_never_sent_with_its_new_value(
    reporter: Reporter, service: FakeService
) -> None:
    kept = [torch.tensor(float(step)) for step in range(20)]
    for step, t in enumerate(kept):
        reporter.log(step, {"loss_num": t, "ratio_max": torch.tensor(0.5)})
        t.add_(100.0)  # before the background thread reads it, nearly always
        reporter.commit(step)
    assert reporter.flush(10)
    sent = {s: row["loss_num"] for (s, _, _), row in service.fragments.items()}
    assert all(value == float(step) for step, value in sent.items())  # never the new value
    assert reporter.stats().rejected == 20 - len(sent) and len(sent) < 20


def test_a_dict_of_host_tensors_is_checked_at_once_and_read_exactly_off_thread() -> None:
    from steptally.client.algebra import Kind
    from steptally.client.reporter.capture import Capture, entry_of

    capture = Capture({"a": Kind.SUM, "b": Kind.MIN, "c": Kind.MAX, "d": Kind.SUM})
    x = torch.tensor([0.1], dtype=torch.float64, requires_grad=True) * 3
    f32 = torch.tensor(0.1, dtype=torch.float32)
    big = torch.tensor(2**60 + 1)
    entry = entry_of(capture(0, {"a": x, "b": f32, "c": torch.tensor([[7]]), "d": big}))
    # nothing read on the calling thread: the entry holds the tensors and their versions
    assert entry.versions is not None and list(entry.versions) == [0, 0, 0, 0]
    assert all(type(v) is torch.Tensor for v in entry.values) and entry.values[1] is f32
    assert entry.resolve() is None
    assert entry.values == [0.30000000000000004, 0.10000000149011612, 7.0, 2.0**60]
    assert [v.hex() for v in entry.values] == [
        x.item().hex(),
        f32.item().hex(),
        (7.0).hex(),
        float(2**60 + 1).hex(),
    ]
    for bad, words in [
        (torch.tensor(1 + 2j), "complex64 tensor is not a real number"),
        (torch.tensor(True), "torch.bool tensor is not a real number"),
        (torch.tensor([[1.0, 2.0]]), "exactly one element"),
    ]:
        with pytest.raises(FragmentError, match=words):
            capture(1, {"a": torch.tensor(1.0), "c": bad})


def test_fragments_with_their_names_in_another_order_keep_each_value_with_its_name() -> None:
    from steptally.client.algebra import Kind
    from steptally.client.reporter.capture import Capture, entry_of

    capture = Capture({"a": Kind.SUM, "b": Kind.MIN, "c": Kind.MAX})
    first = entry_of(capture(0, {"a": 1.0, "b": 2.0, "c": 3.0}))
    same = entry_of(capture(0, {"a": 4.0, "b": 5.0, "c": 6.0}))
    other = entry_of(capture(0, {"c": 7.0, "a": 8.0, "b": 9.0}))
    fewer = entry_of(capture(0, {"b": 10.0, "a": 11.0}))
    assert same.names is first.names  # one tuple of names while the order holds
    assert dict(zip(other.names, other.values, strict=True)) == {"a": 8.0, "b": 9.0, "c": 7.0}
    assert dict(zip(fewer.names, fewer.values, strict=True)) == {"a": 11.0, "b": 10.0}
    held = entry_of(capture(0, {"c": torch.tensor(1.0), "a": torch.tensor(2.5)}))
    assert held.resolve() is None
    assert dict(zip(held.names, held.values, strict=True)) == {"a": 2.5, "c": 1.0}


@pytest.mark.parametrize("tensors", [False, True])
def test_a_fast_log_makes_few_objects_for_the_garbage_collector(tensors: bool) -> None:
    """A cyclic collection starts inside whichever call crosses the allocation
    threshold: each object a log() leaves for the collector makes that call likelier
    to be one (a dict of floats once made 3, of host tensors 6; now a tuple and the
    dict's copy, which costs less than looking at the names)."""
    import gc

    from steptally.client.algebra import Kind
    from steptally.client.reporter.capture import Capture
    from steptally.client.reporter.intake import Intake

    names = [f"m{i:02d}" for i in range(32)]
    intake = Intake(0, 1 << 20, 1 << 30, Capture(dict.fromkeys(names, Kind.SUM)))
    checked: list[object] = []
    log = intake.logger(lambda step, fragments: checked.append(fragments))
    intake.checked_size(len(names), tensors)

    def value(i: int) -> object:
        return torch.tensor(float(i), dtype=torch.float64) if tensors else float(i)

    rows = [{n: value(i) for i, n in enumerate(names)} for _ in range(64)]
    log(0, rows[0])
    gc.disable()
    try:
        before = gc.get_count()[0]
        for row in rows[1:]:
            log(1, row)
        made = gc.get_count()[0] - before
    finally:
        gc.enable()
    assert not checked and len(intake) == len(rows)  # all taken by the one-frame path
    assert made <= 2 * (len(rows) - 1)
    drained = intake.drain()
    assert all(e.refused is None and e.names == tuple(names) for e in drained)  # type: ignore[union-attr]
