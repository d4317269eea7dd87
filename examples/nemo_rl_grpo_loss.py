"""NeMo-RL's GRPO loss path, reported to Steptally through the NeMo-RL adapter.

    make run                                            # terminal 1: the service
    .venv/bin/python examples/nemo_rl_grpo_loss.py      # terminal 2: report, and compare

NeMo-RL itself needs GPUs and Ray; this runs what a policy worker does with the loss
function on CPU: each step's microbatches (two ranks, uneven lengths, a few top-k/top-p
filtered tokens, in NeMo-RL's data layout: every per-token field one position longer
than the next-token log-probs) go through
:class:`~steptally.integrations.nemo_rl.SteptallyClippedPGLossFn`, and
:class:`~steptally.integrations.nemo_rl.SteptallyLogger` receives the step's logs as
``grpo_train`` sends them. It ends by printing, per step, NeMo-RL's own reading (the sum
of the microbatch shares each divided by every masked token) beside Steptally's exact
mean over the retained tokens.
"""

from __future__ import annotations

import argparse
import os
import time

import httpx
import torch

from steptally.client.loss import LossInputs
from steptally.client.loss.synthetic import synthetic_step
from steptally.integrations import nemo_rl
from steptally.integrations.nemo_rl import SteptallyClippedPGLossFn, SteptallyLogger

#: NeMo-RL loss settings (its ClippedPGLossConfig keys)
LOSS_CONFIG = {
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.28,
    "ratio_clip_c": 3.0,
    "reference_policy_kl_penalty": 0.01,
    "reference_policy_kl_type": "k3",
}
SHOWN = ("probs_ratio", "approx_entropy", "gen_kl_error")


def shifted(t: torch.Tensor) -> torch.Tensor:
    """A ``[B, T]`` tensor as NeMo-RL holds it: ``[B, T+1]``, which its loss cuts by
    ``[:, 1:]`` (the first position has no next-token log-prob)."""
    return torch.cat([torch.full_like(t[:, :1], 7.0), t.detach()], dim=1)


def nemo_data(mb: LossInputs) -> dict[str, torch.Tensor]:
    """One microbatch in NeMo-RL's field names and layout."""
    assert mb.reference_logprobs is not None and mb.rewards is not None
    return {
        "token_mask": shifted(mb.token_mask.float()),
        "sample_mask": mb.sample_mask,
        "advantages": shifted(mb.advantages),
        "prev_logprobs": shifted(mb.prev_logprobs),
        "generation_logprobs": shifted(mb.generation_logprobs),
        "reference_policy_logprobs": shifted(mb.reference_logprobs),
        "curr_logprobs_unfiltered": mb.curr_logprobs_unfiltered,  # aligned already
        "rewards": mb.rewards,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--run", default=f"nemo-rl-grpo-{time.strftime('%Y%m%d-%H%M%S')}")
    args = p.parse_args()
    url = os.environ.setdefault("STEPTALLY_URL", "http://127.0.0.1:8000")
    loss_fn = SteptallyClippedPGLossFn(LOSS_CONFIG, run=args.run)
    logger = SteptallyLogger(loss_fn)  # NeMo-RL: logger.loggers.append(...)
    print(f"watch it: {url}/runs/{loss_fn.run}", flush=True)
    readings: dict[int, dict[str, float]] = {}
    for step in range(1, args.steps + 1):
        logger.log_metrics({"reward": 0.0}, step, prefix="train")  # the rollout metrics
        summed = dict.fromkeys(SHOWN, 0.0)
        for rank in synthetic_step(step, (3, 2)):
            for mb in rank:
                data = nemo_data(mb)
                loss, metrics = loss_fn(
                    mb.curr_logprobs, data, mb.global_valid_seqs, mb.global_valid_tokens
                )
                loss.backward()
                for name in SHOWN:
                    summed[name] += metrics[name]  # as NeMo-RL sums its microbatch metrics
        readings[step] = summed
        logger.log_metrics({"t": 0.0}, step, prefix="timing/train", step_finished=True)
    for entry in nemo_rl._REPORTERS.values():
        entry.reporter.flush(30)
    compare(readings, url, loss_fn.run)


def compare(readings: dict[int, dict[str, float]], url: str, run: str) -> None:
    """NeMo-RL's reading beside Steptally's exact one."""
    pairs = [(name, len(name) + 12) for name in SHOWN]
    head = "".join(f"{f'{n}: NeMo-RL':>{w}}{'Steptally':>12}" for n, w in pairs)
    print(f"\n{'step':>4}{head}")
    for step, nemo in sorted(readings.items()):
        served = httpx.get(f"{url}/v1/runs/{run}/steps/{step}").json()["metrics"]
        cells = "".join(f"{nemo[n]:>{w}.6f}{served[n]['value']:>12.6f}" for n, w in pairs)
        print(f"{step:>4}{cells}")


if __name__ == "__main__":
    main()
