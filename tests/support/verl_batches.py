"""A verl actor-update step as verl's worker holds it, for the plugin's tests (imported
by Ray worker processes too, so it lives on the tests' path); the step itself is built
by ``examples/verl_ppo_steps.py``."""

from __future__ import annotations

from typing import Any

from verl_ppo_steps import MICRO, B, TinyPolicy, micro_batches, padded_step, step_data

__all__ = ["MICRO", "B", "LossWorker", "TinyPolicy", "micro_batches", "padded_step", "step_data"]


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
