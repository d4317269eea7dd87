"""verl's own actor loss on uneven micro-batches, reported through the Steptally plugin.

    make run                                          # terminal 1: the service
    make verl-venv                                    # verl in a venv of its own
    .venv-verl/bin/python examples/verl_ppo_steps.py  # terminal 2: report, and compare

A real verl run needs GPUs and a rollout engine (vLLM or SGLang); this runs what the
plugin wraps, on CPU: each step is an actor update as verl's worker holds it (uneven
prompts and responses in verl's no-padding layout, cut into micro-batches by verl's own
``chunk_tensordict``), each micro-batch goes through verl's ``ppo_loss`` wrapped by
:class:`~steptally.integrations.verl.SteptallyPPOLoss` (the loss the ``steptally``
trainer sends its workers), and the step is committed as the trainer commits it. It ends
by printing, per step, verl's own reading (its ``Metric.aggregate_dp`` of the
micro-batch values: a mean of means) beside Steptally's exact token-weighted mean.
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial
from typing import Any

import httpx
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from steptally.integrations import verl as plugin

B, P, R = 9, 5, 12  # sequences, prompt width, response width
MICRO = 3  # micro-batches of three sequences, of uneven token counts
F32 = torch.float32


class TinyPolicy(torch.nn.Module):
    """Per-token log-probs and entropies of a model's flat (no-padding) output, as a
    function of the token ids, with parameters to take gradients of."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.37))
        self.b = torch.nn.Parameter(torch.tensor(-0.4))

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        # in float64, rounded to float32: the same per token in any batch (a vector
        # kernel's tail may round a float32 transcendental differently)
        ids = input_ids.values().to(torch.float64)
        logits = torch.sin(ids * self.w.double()) * 2.0 + self.b.double()
        values = (-torch.nn.functional.softplus(-logits)).to(F32)  # log sigmoid < 0
        entropy = (torch.nn.functional.softplus(logits.detach()) * 0.5).to(F32)
        nested = partial(torch.nested.nested_tensor_from_jagged, offsets=input_ids.offsets())
        return {"log_probs": nested(values), "entropy": nested(entropy)}


def padded_step(seed: int) -> dict[str, torch.Tensor]:
    """One step's batch as verl pads it, with old, reference and rollout log-probs near
    the policy's own (a few far: log ratios past ±20 and ratios past the dual clip)."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, P + 1, (B,), generator=g)
    response_len = torch.randint(1, R + 1, (B,), generator=g)
    response_len[0] = R
    prompt_mask = torch.arange(P)[None, :] >= (P - prompt_len)[:, None]  # left padded
    response_mask = torch.arange(R)[None, :] < response_len[:, None]  # right padded
    attention = torch.cat([prompt_mask, response_mask], dim=1).long()
    ids = torch.randint(3, 500, (B, P + R), generator=g) * attention
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    shape = (B, R)
    noise = torch.randn(shape, generator=g)
    advantages = torch.randn(B, generator=g)
    advantages[3] = -advantages[3].abs() - 0.1  # the dual clip caps a loss there
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "position_ids": position_ids,
        "prompts": ids[:, :P],
        "responses": ids[:, P:],
        "response_mask": response_mask.long(),
        "noise": noise,
        "ref_noise": 0.1 * torch.randn(shape, generator=g),
        "rollout_noise": 0.05 * torch.randn(shape, generator=g),
        "advantages": advantages[:, None].expand(shape).contiguous(),
    }


def step_data(seed: int, model: TinyPolicy, step: int = 1) -> Any:
    """The step's TensorDict in verl's no-padding layout, with the log-probs verl keeps
    beside it, from the policy's current log-probs (computed through verl's padding)."""
    raw = padded_step(seed)
    noise, ref_noise, rollout_noise = (
        raw.pop("noise"),
        raw.pop("ref_noise"),
        raw.pop("rollout_noise"),
    )
    data = left_right_2_no_padding(tu.get_tensordict(raw))
    with torch.no_grad():
        current = no_padding_2_padding(model(data["input_ids"])["log_probs"], data)
    old = current + 0.3 * noise
    old[1, 0] = current[1, 0] - 25.0  # log ratio +25: verl clamps it to 20
    old[2, 0] = current[2, 0] + 30.0  # log ratio -30
    old[3, :3] = current[3, :3] - 1.5  # ratio e^1.5 > 3: dual-clip on A < 0
    data["old_log_probs"] = old
    data["ref_log_prob"] = current + ref_noise
    data["rollout_log_probs"] = old + rollout_noise
    tu.assign_non_tensor(
        data,
        dp_size=1,
        batch_num_tokens=int(raw["response_mask"].sum()),
        global_batch_size=B,
        **{plugin.STEP_KEY: step},
    )
    return data


def micro_batches(data: Any) -> list[Any]:
    return list(tu.chunk_tensordict(data, B // MICRO))


SHOWN = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")


def verl_config(*overrides: str) -> Any:
    """verl's own ``ppo_trainer`` config, as ``main_ppo`` composes it."""
    import verl
    from hydra import compose, initialize_config_dir

    where = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=where, version_base=None):
        return compose(
            config_name="ppo_trainer",
            overrides=[
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                "actor_rollout_ref.rollout.n=1",
                "actor_rollout_ref.actor.calculate_entropy=True",
                "actor_rollout_ref.actor.clip_ratio_high=0.28",
                "actor_rollout_ref.actor.use_kl_loss=True",
                "actor_rollout_ref.rollout.calculate_log_probs=True",
                *overrides,
            ],
        )


def main() -> None:
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.metric.utils import Metric
    from verl.workers.utils.losses import ppo_loss

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--run", default=f"verl-ppo-{time.strftime('%Y%m%d-%H%M%S')}")
    args = p.parse_args()
    url = os.environ.setdefault("STEPTALLY_URL", "http://127.0.0.1:8000")
    os.environ["STEPTALLY_RUN"] = args.run
    config = verl_config()
    settings = plugin.settings_from(config)
    assert settings is not None
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    loss_fn = plugin.SteptallyPPOLoss(partial(ppo_loss, config=actor), settings)
    model = TinyPolicy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    print(f"watch it: {url}/runs/{args.run}", flush=True)
    readings: dict[int, dict[str, float]] = {}
    for step in range(1, args.steps + 1):
        data = step_data(step, model, step=step)
        found: dict[str, Metric] = {}
        for mb in micro_batches(data):
            loss, metrics = loss_fn(model_output=model(mb["input_ids"]), data=mb, dp_group=None)
            loss.backward()
            for name, m in metrics.items():
                if isinstance(m, Metric):
                    found.setdefault(name, Metric(m.aggregation)).extend(m)
        optimizer.step()
        optimizer.zero_grad()
        plugin.commit_in_process(None, step)  # what the trainer runs in every worker
        readings[step] = {n: float(Metric.aggregate_dp([found[f"actor/{n}"]])) for n in SHOWN}
    assert loss_fn.reporter is not None and loss_fn.reporter.flush(30)
    compare(readings, url, args.run)


def compare(readings: dict[int, dict[str, float]], url: str, run: str) -> None:
    """verl's reading (a mean of the micro-batch means) beside Steptally's exact one."""
    widths = [len(name) + 10 for name in SHOWN]
    head = "".join(
        f"{f'{n}: verl':>{w}}{'Steptally':>12}" for n, w in zip(SHOWN, widths, strict=True)
    )
    print(f"\n{'step':>4}{head}")
    for step, verl_values in sorted(readings.items()):
        served = httpx.get(f"{url}/v1/runs/{run}/steps/{step}").json()["metrics"]
        cells = "".join(
            f"{verl_values[n]:>{w}.6f}{served[n]['value']:>12.6f}"
            for n, w in zip(SHOWN, widths, strict=True)
        )
        print(f"{step:>4}{cells}")


if __name__ == "__main__":
    main()
