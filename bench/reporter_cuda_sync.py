"""Does Reporter.log() synchronise with the GPU? Run on a machine with CUDA:

    python bench/reporter_cuda_sync.py [--steps 20] [--metrics 32] [--microbatches 8]

It logs CUDA tensors (float64, float32 and an int64 count, 0-d and 1-element) under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising call,
while the GPU is kept busy by ``torch.cuda._sleep`` so that a hidden sync would also
show in the time log() takes. Then it flushes to an in-memory fake service and checks
that every value arrived exactly. Exit status 0: no sync and exact values; 1: a sync or
a wrong value; 0 with a message when CUDA is absent (nothing to check).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--metrics", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=8)
    args = p.parse_args()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch
    except ImportError:
        print("torch is not installed: nothing to check")
        return 0
    if not torch.cuda.is_available():
        print("CUDA is not available: nothing to check; run this on a machine with a GPU")
        return 0

    from steptally.client.reporter import Reporter
    from steptally.client.reporter.fake import FakeService

    names = [f"m{i:02d}" for i in range(args.metrics - 1)] + ["tokens"]
    spec = {"metrics": {**{n: "sum" for n in names[:-1]}, "tokens": "count"}}
    service = FakeService()
    dev = torch.device("cuda")
    expected: dict[tuple[int, int], dict[str, float]] = {}
    times: list[float] = []
    busy = hasattr(torch.cuda, "_sleep")
    with (
        tempfile.TemporaryDirectory() as spool,
        Reporter(
            "http://steptally.test",
            run="cuda-sync",
            spec=spec,
            rank=0,
            world_size=1,
            transport=service.transport(),
            spool_dir=spool,
        ) as reporter,
    ):
        batches = [_fragments(torch, dev, names, s, args.microbatches) for s in range(args.steps)]
        torch.cuda.synchronize()
        synced = None
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step, fragments in enumerate(batches):
                if busy:
                    torch.cuda._sleep(50_000_000)  # keep the GPU busy for a while
                for fragment in fragments:
                    t0 = time.perf_counter()
                    reporter.log(step, fragment)
                    times.append(time.perf_counter() - t0)
                reporter.commit(step)
        except RuntimeError as exc:
            synced = str(exc)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for step, fragments in enumerate(batches):
            for seq, fragment in enumerate(fragments):
                expected[step, seq] = {n: float(v.item()) for n, v in fragment.items()}
        flushed = reporter.flush(120)
        stats = reporter.stats()
    got = {(s, q): v for (s, _, q), v in service.fragments.items()}
    exact = got == expected
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(
        f"log() calls: {len(times)}, p50 {statistics.median(times) * 1e6:.1f} µs, "
        f"max {max(times) * 1e6:.1f} µs (GPU kept busy: {busy})"
    )
    print(f"synchronised: {'YES: ' + synced if synced else 'no'}")
    print(f"flushed: {flushed}; values exact: {exact}; {stats.line()}")
    return 0 if synced is None and flushed and exact else 1


def _fragments(torch: Any, dev: Any, names: list[str], step: int, n: int) -> list[dict[str, Any]]:
    """Microbatch values as CUDA tensors of mixed dtypes and shapes, and an int64 count."""
    out = []
    for mb in range(n):
        fragment: dict[str, Any] = {}
        for i, name in enumerate(names[:-1]):
            dtype = torch.float32 if i % 5 == 0 else torch.float64
            value = torch.tensor((step * 31 + mb * 7 + i) / 3.0, dtype=dtype, device=dev)
            fragment[name] = value.reshape(1) if i % 3 == 0 else value
        fragment["tokens"] = torch.tensor(17 + mb, dtype=torch.int64, device=dev)
        out.append(fragment)
    return out


if __name__ == "__main__":
    sys.exit(main())
