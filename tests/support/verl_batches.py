"""A verl actor-update step as verl's worker holds it, for the plugin's tests (imported
by Ray worker processes too, so it lives on the tests' path)."""

from __future__ import annotations

from functools import partial
from typing import Any

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


def step_data(seed: int, model: TinyPolicy) -> Any:
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
        **{plugin.STEP_KEY: 1},
    )
    return data


def micro_batches(data: Any) -> list[Any]:
    return list(tu.chunk_tensordict(data, B // MICRO))


class LossWorker:
    """What a verl worker does with the loss function it is sent: keep it, and call it
    on each micro-batch of an update."""

    def set_loss_fn(self, loss_fn: Any) -> None:
        self.loss_fn = loss_fn

    def train(self, seed: int) -> int:
        model = TinyPolicy()
        data = step_data(seed, model)
        for mb in micro_batches(data):
            self.loss_fn(model_output=model(mb["input_ids"]), data=mb, dp_group=None)
        return B // MICRO

    def flush(self) -> bool:
        assert self.loss_fn.reporter is not None
        return bool(self.loss_fn.reporter.flush(10.0))
