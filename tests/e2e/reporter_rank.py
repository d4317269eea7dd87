"""One training rank for the reporter's end-to-end test, run in a spawned process.

Not a test module: ``test_reporter_e2e.py`` starts it with ``runpy.run_path`` under
``multiprocessing`` spawn, and loads :func:`fragments_for` from it for the reference.
Phases are driven by the test: up (A), the service killed (B), the service back (C).
"""

from __future__ import annotations

import random
from typing import Any

SPEC = {
    "metrics": {
        "loss_num": "sum",
        "kl_num": "sum",
        "tokens": "count",
        "ratio_min": "min",
        "ratio_max": "max",
    },
    "derived": {"loss": "loss_num / tokens", "kl": "kl_num / tokens"},
}


def microbatches(rank: int, step: int) -> int:
    return 1 + (rank * 3 + step * 5) % 4  # uneven over ranks and steps


def fragments_for(rank: int, step: int) -> list[dict[str, float]]:
    """The exact values rank ``rank`` logs for ``step``, one dict per microbatch."""
    rnd = random.Random(f"{rank}/{step}")
    out = []
    for _ in range(microbatches(rank, step)):
        tokens = rnd.randrange(1, 700)
        out.append(
            {
                "loss_num": rnd.gauss(0.0, 1.0) * tokens / 3.0,
                "kl_num": rnd.expovariate(7.0) * tokens * 1e-3 + 1e-17,
                "tokens": tokens,
                "ratio_min": rnd.uniform(0.5, 1.0),
                "ratio_max": rnd.uniform(1.0, 2.0) * 10.0 ** rnd.randrange(-3, 4),
            }
        )
    return out


def run_steps(reporter: Any, rank: int, steps: range) -> None:
    import time

    for step in steps:
        for fragment in fragments_for(rank, step):
            reporter.log(step, fragment)
        reporter.commit(step)
        time.sleep(0.02)


def main(cfg: dict[str, Any], events: dict[str, Any], results: Any) -> None:
    import os

    from steptally.client.reporter import Reporter, ReporterOptions

    rank = cfg["rank"]
    options = ReporterOptions(flush_interval_s=0.05, backoff_base_s=0.05, backoff_max_s=0.5)
    reporter = Reporter(
        cfg["url"],
        run=cfg["run"],
        spec=SPEC,
        spool_dir=cfg["spool"],
        options=options,
        step_timeout_s=600,
    )  # rank and world size come from RANK and WORLD_SIZE
    try:
        for phase in cfg["phases"]:
            if phase != cfg["phases"][0]:
                events[phase].wait(120)
            run_steps(reporter, rank, range(*cfg["steps"][phase]))
            results.put(("done", rank, phase, reporter.stats().to_dict()))
        if cfg.get("leave_spool"):
            reporter.close(timeout=0.5)  # the service is down: everything stays spooled
        else:
            reporter.flush(120)
        results.put(("stats", rank, cfg["phases"][-1], reporter.stats().to_dict()))
    finally:
        reporter.close(timeout=0.5)
        results.close()
        results.join_thread()  # the queue's feeder thread must finish before _exit
        os._exit(0)


if __name__ == "__main__":
    import os

    os.environ["RANK"] = str(CFG["rank"])  # type: ignore[name-defined]  # noqa: F821
    os.environ["WORLD_SIZE"] = str(CFG["world_size"])  # type: ignore[name-defined]  # noqa: F821
    main(CFG, EVENTS, RESULTS)  # type: ignore[name-defined]  # noqa: F821
