"""What the verl plugin adds to verl's own ``ppo_loss``, interleaved in one run.

Per micro-batch (sequences of uneven prompts and responses in verl's no-padding layout,
the tiny policy of ``examples/verl_ppo_steps.py`` giving log-probs and entropies), it
times verl's ``ppo_loss`` alone (the anchor) and wrapped by
:class:`~steptally.integrations.verl.SteptallyPPOLoss` reporting to a live
``steptally serve`` (SQLite, a subprocess), forward and backward, alternating the order
round after round. The anchor is the loss alone, not a training step: a real step adds
the model's forward and backward, which grow with the parameters while the plugin's
work grows with the tokens only, so the share of a real step is far smaller than the
ratio printed here.

Run in verl's venv (``make verl-venv``):
    .venv-verl/bin/python bench/verl_loss.py [--rounds 7] [--sequences 16] [--response 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import verl_ppo_steps as steps  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from steptally.integrations import verl as plugin  # noqa: E402


def _serve(tmp: str, port: int) -> subprocess.Popen[bytes]:
    db = f"sqlite:///{tmp}/bench.sqlite3"
    cli = [sys.executable, "-m", "steptally.service.cli"]
    subprocess.run([*cli, "migrate", "--database-url", db], check=True, capture_output=True)
    proc = subprocess.Popen(
        [*cli, "serve", "--database-url", db, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    raise SystemExit("steptally serve did not start")


def _time(loss_fn: object, model: steps.TinyPolicy, mb: object) -> float:
    start = time.perf_counter()
    loss, _ = loss_fn(model_output=model(mb["input_ids"]), data=mb, dp_group=None)  # type: ignore[index, operator]
    loss.backward()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--response", type=int, default=1024)
    args = p.parse_args()
    torch.set_num_threads(1)
    # three micro-batches of --sequences sequences a step
    steps.B, steps.MICRO, steps.R = args.sequences * 3, args.sequences, args.response
    port = 18731
    with tempfile.TemporaryDirectory() as tmp:
        service = _serve(tmp, port)
        try:
            os.environ["STEPTALLY_URL"] = f"http://127.0.0.1:{port}"
            os.environ["STEPTALLY_RUN"] = "bench-verl"
            config = steps.verl_config()
            settings = plugin.settings_from(config)
            assert settings is not None
            actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
            plain = partial(ppo_loss, config=actor)
            wrapped = plugin.SteptallyPPOLoss(partial(ppo_loss, config=actor), settings)
            model = steps.TinyPolicy()
            times: dict[str, list[float]] = {"verl": [], "verl + steptally": []}
            tokens = 0
            for step in range(1, args.rounds + 2):
                data = steps.step_data(step, model, step=step)
                order = [("verl", plain), ("verl + steptally", wrapped)]
                for name, fn in order if step % 2 else order[::-1]:
                    for mb in steps.micro_batches(data):
                        took = _time(fn, model, mb)
                        if step > 1:  # the first round warms up
                            times[name].append(took)
                            tokens += int(mb["response_mask"].sum()) if name == "verl" else 0
                plugin.commit_in_process(None, step)
            assert wrapped.reporter is not None and wrapped.reporter.flush(30)
            complete = httpx.get(f"http://127.0.0.1:{port}/v1/runs/bench-verl/steps/2").json()
            assert complete["status"] == "complete"
        finally:
            service.terminate()
    anchor = statistics.median(times["verl"])
    with_it = statistics.median(times["verl + steptally"])
    per_mb = tokens / len(times["verl"])
    print(f"micro-batches: {len(times['verl'])} per arm, {per_mb:.0f} response tokens each")
    print(f"verl ppo_loss (forward + backward), median:     {anchor * 1e3:8.2f} ms")
    print(f"the same, wrapped and reporting, median:        {with_it * 1e3:8.2f} ms")
    print(
        f"added per micro-batch: {(with_it - anchor) * 1e3:.2f} ms = "
        f"{with_it / anchor:.2f}x verl's loss alone"
    )


if __name__ == "__main__":
    main()
