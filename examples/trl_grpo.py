"""GRPO with TRL, reported to Steptally: one import changes.

    make run                                   # terminal 1: the service, its dashboard
    .venv/bin/python examples/trl_grpo.py      # terminal 2: train, and watch the run

It trains a tiny randomly initialised model (``tiny_lm.py`` beside this file: nothing is
downloaded) on CPU with a toy reward, two microbatches per optimizer step and
completions of uneven lengths, reports every step to ``STEPTALLY_URL`` (default
http://127.0.0.1:8000, the service ``make run`` starts) and ends by printing, per step,
what TRL's own log says beside Steptally's exact values.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import httpx
from tiny_lm import grpo_config, tiny_model_dir, toy_dataset, toy_reward
from transformers import PreTrainedTokenizerFast

from steptally.integrations.trl import GRPOTrainer  # was: from trl import GRPOTrainer

#: (TRL's logged name, Steptally's)
SHOWN = (("kl", "kl"), ("entropy", "entropy"), ("clip_ratio/region_mean", "clip_ratio_region_mean"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--run", default=f"trl-grpo-{time.strftime('%Y%m%d-%H%M%S')}")
    args = p.parse_args()
    url = os.environ.setdefault("STEPTALLY_URL", "http://127.0.0.1:8000")
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model_dir(Path(tmp) / "model")
        trainer = GRPOTrainer(
            model=str(model),
            reward_funcs=toy_reward,
            args=grpo_config(Path(tmp) / "out", max_steps=args.steps, max_completion_length=16),
            train_dataset=toy_dataset(64),
            processing_class=PreTrainedTokenizerFast.from_pretrained(str(model)),
            steptally_run=args.run,
        )
        print(f"watch it: {url}/runs/{args.run}", flush=True)
        trainer.train()
    assert trainer.steptally is not None
    trainer.steptally.flush(30)
    compare(trainer, url, args.run)


def compare(trainer: GRPOTrainer, url: str, run: str) -> None:
    """TRL's logged value (a mean of the microbatch means) beside Steptally's exact one."""
    logged = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    widths = [max(16, len(name) + 7) for _, name in SHOWN]
    head = "".join(
        f"{f'{name}: TRL':>{w}}{'Steptally':>12}"
        for (_, name), w in zip(SHOWN, widths, strict=True)
    )
    print(f"\n{'step':>4}{head}")
    for step, entry in sorted(logged.items()):
        served = httpx.get(f"{url}/v1/runs/{run}/steps/{step}").json()["metrics"]
        cells = "".join(
            f"{entry[trl_name]:>{w}.6f}{served[name]['value']:>12.6f}"
            for (trl_name, name), w in zip(SHOWN, widths, strict=True)
        )
        print(f"{step:>4}{cells}")


if __name__ == "__main__":
    main()
