"""What Steptally reporting costs a TRL GRPO training step, interleaved in one run.

Four trainers train the same tiny model on the same data, round after round, in a
rotating order: TRL's own ``trl.GRPOTrainer`` (the anchor, and once more as a second
trainer: the comparison's noise floor), the drop-in
``steptally.integrations.trl.GRPOTrainer`` reporting to a live ``steptally serve``
(SQLite, a subprocess on this machine), and the drop-in reporting to a service that is
down (a closed port: the reporter retries and spools in the background). Per optimizer
step it records the wall time (``on_step_begin`` to ``on_step_end``: generation, the
forward and backward passes of every microbatch, the optimizer step), and per
microbatch the time the reporting adds on the training thread (the diagnostics'
kernels and ``log()``), each call of ``log()`` on its own.

The reporting's work is a fixed number of elementwise passes over the microbatch's
``[B, T]`` completion tokens plus one exact sum per signal: it grows with the tokens,
not with the model, while a step's work grows with tokens times parameters (and the
vocabulary's logits). The smaller the model, the larger the share, so a tiny model is
the hard case for the ratio.

Usage:
    python bench/trl_step.py [--rounds 5] [--steps 6] [--hidden 256] [--layers 4]
                             [--completion 64] [--batch 8] [--record LABEL]
"""

from __future__ import annotations

import argparse
import csv
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REPORTING = ("steptally", "down")  # the drop-in, its service up or down
sys.path.insert(0, str(ROOT / "examples"))
RESULTS = ROOT / "bench" / "results"

import trl  # noqa: E402
from tiny_lm import grpo_config, tiny_model_dir, toy_dataset, toy_reward  # noqa: E402
from transformers import PreTrainedTokenizerFast, TrainerCallback  # noqa: E402

from steptally.integrations import trl as adapter  # noqa: E402


class StepClock(TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


class Timed(adapter.GRPOTrainer):
    """The drop-in, timing what it adds to the training thread."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.report_s: list[float] = []
        self.log_s: list[float] = []
        super().__init__(*args, **kwargs)
        reporter = self.steptally
        assert reporter is not None
        logged = reporter.log

        def timed_log(step: int, fragments: Any) -> None:
            t = time.perf_counter()
            logged(step, fragments)
            self.log_s.append(time.perf_counter() - t)

        reporter.log = timed_log  # type: ignore[method-assign]

    def _report(self, *args: Any) -> None:
        t = time.perf_counter()
        super()._report(*args)
        self.report_s.append(time.perf_counter() - t)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_service(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    db = f"sqlite:///{folder / 'bench.sqlite3'}"
    cli = [sys.executable, "-m", "steptally.service.cli"]
    subprocess.run([*cli, "migrate", "--database-url", db], check=True, capture_output=True)
    port = free_port()
    proc = subprocess.Popen(
        [*cli, "serve", "--database-url", db, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import httpx

    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/readyz").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("steptally serve did not become ready")


def train(kind: str, model: Path, out: Path, args: argparse.Namespace, url: str) -> dict[str, Any]:
    config = grpo_config(
        out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        num_generations=args.batch,
        max_completion_length=args.completion,
        logging_steps=args.steps,
    )
    common: dict[str, Any] = {
        "model": str(model),
        "reward_funcs": toy_reward,
        "args": config,
        "train_dataset": toy_dataset(64),
        "processing_class": PreTrainedTokenizerFast.from_pretrained(str(model)),
    }
    clock = StepClock()
    if kind in ("trl", "trl-again"):
        trainer: Any = trl.GRPOTrainer(**common, callbacks=[clock])
    else:
        run = f"bench-{kind}-{time.monotonic_ns()}"
        trainer = Timed(**common, callbacks=[clock], steptally_url=url, steptally_run=run)
    trainer.train()
    found = {"kind": kind, "step_s": clock.times[1:]}  # the first step warms caches
    if kind in REPORTING:
        found["report_s"] = trainer.report_s
        found["log_s"] = trainer.log_s
        found["stats"] = trainer.steptally.stats()
        trainer.steptally.close(0.0)
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--completion", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch's intra-op threads (0: its default, one per core)",
    )
    p.add_argument("--record", metavar="LABEL", help="append the rows to bench/results/")
    args = p.parse_args()
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ["XDG_CACHE_HOME"] = str(folder / "cache")  # the down run's spools
        model = tiny_model_dir(folder / "model", hidden=args.hidden, layers=args.layers)
        proc, url = start_service(folder)
        down = f"http://127.0.0.1:{free_port()}"
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("trl", "trl-again", *REPORTING)}
        try:
            kinds = list(runs)
            for r in range(args.rounds):
                for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                    target = down if kind == "down" else url
                    found = train(kind, model, folder / f"{kind}-{r}", args, target)
                    runs[kind].append(found)
                    med = statistics.median(found["step_s"]) * 1e3
                    print(
                        f"round {r + 1}/{args.rounds} {kind:9s} step median {med:7.1f} ms",
                        flush=True,
                    )
        finally:
            proc.terminate()
            proc.wait(10)
    return report(runs, args)


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> int:
    steps = {k: [s for f in v for s in f["step_s"]] for k, v in runs.items()}
    base = statistics.median(steps["trl"])
    print(
        f"\ntorch threads: {args.torch_threads or 'default'}; model: hidden {args.hidden}, "
        f"{args.layers} layers; {args.batch} completions of "
        f"up to {args.completion} tokens per microbatch, 2 microbatches per step"
    )
    rows = []
    for kind, times in steps.items():
        med = statistics.median(times)
        row = {
            "kind": kind,
            "steps": len(times),
            "step_median_ms": med * 1e3,
            "ratio_to_trl": med / base,
        }
        if kind in REPORTING:
            report_s = [s for f in runs[kind] for s in f["report_s"]]
            log_s = [s for f in runs[kind] for s in f["log_s"]]
            per_step = 2 * statistics.median(report_s)
            row |= {
                "report_median_us": statistics.median(report_s) * 1e6,
                "report_share_of_step": per_step / base,
                "log_median_us": statistics.median(log_s) * 1e6,
                "log_max_us": max(log_s) * 1e6,
            }
        if kind != "trl":  # trl-again: the noise floor of the same comparison
            paired = [
                a / b
                for f, g in zip(runs[kind], runs["trl"], strict=True)
                for a, b in zip(f["step_s"], g["step_s"], strict=True)
            ]
            row["paired_ratio_median"] = statistics.median(paired)
        rows.append(row)
        print(
            "  ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
            )
        )
    if args.record:
        plot(runs, args)
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / "trl_step.csv"
        new = not path.exists()
        with path.open("a", newline="") as f:
            head = ["label", "hidden", "layers", "completion", "batch", "torch_threads"]
            w = csv.DictWriter(f, [*head, *rows[-1]])
            if new:
                w.writeheader()
            for row in rows:
                w.writerow(
                    {
                        "label": args.record,
                        "hidden": args.hidden,
                        "layers": args.layers,
                        "completion": args.completion,
                        "batch": args.batch,
                        "torch_threads": args.torch_threads or "default",
                        **row,
                    }
                )
    return 0


def plot(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    """Step times per trainer, and what the reporting adds per microbatch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    labels = {
        "steptally": "drop-in, service up",
        "down": "drop-in, service down",
        "trl-again": "trl.GRPOTrainer again (noise floor)",
    }
    colours = {"steptally": "tab:blue", "down": "tab:orange", "trl-again": "tab:grey"}
    for n, (kind, colour) in enumerate(colours.items()):
        for f, g in zip(runs[kind], runs["trl"], strict=True):
            ratios = [a / b for a, b in zip(f["step_s"], g["step_s"], strict=True)]
            xs = [i + 2 + 0.15 * (n - 1) for i in range(len(ratios))]
            left.scatter(xs, ratios, s=12, color=colour, alpha=0.7)
        left.scatter([], [], color=colour, label=labels[kind])
    left.axhline(1.0, color="black", lw=0.8)
    left.axhline(1.02, color="grey", ls="--", lw=0.8, label="+2 %")
    left.set_xlabel("optimizer step (each round: the same step of every trainer)")
    left.set_ylabel("step time ÷ trl.GRPOTrainer's")
    left.set_title(f"GRPO step, hidden {args.hidden} × {args.layers} layers, {args.rounds} rounds")
    left.legend(fontsize=7)
    for kind, colour in (("steptally", "tab:blue"), ("down", "tab:orange")):
        report_s = sorted(s * 1e3 for f in runs[kind] for s in f["report_s"])
        log_s = sorted(s * 1e3 for f in runs[kind] for s in f["log_s"])
        right.plot(
            report_s,
            [i / len(report_s) for i in range(len(report_s))],
            color=colour,
            label=f"reporting per microbatch, {labels[kind]}",
        )
        right.plot(
            log_s,
            [i / len(log_s) for i in range(len(log_s))],
            color=colour,
            ls=":",
            label=f"log() alone, {labels[kind]}",
        )
    base = statistics.median(s for f in runs["trl"] for s in f["step_s"]) * 1e3
    right.axvline(base * 0.01, color="grey", ls="--", label="1 % of the median step")
    right.set_xscale("log")
    right.set_xlabel("time on the training thread (ms)")
    right.set_ylabel("fraction of calls")
    right.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(RESULTS / f"trl_step-{args.record}.png", dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
