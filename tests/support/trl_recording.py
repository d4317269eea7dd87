"""A drop-in GRPOTrainer that also records what TRL itself computed, per optimizer step:
its own per-microbatch metric values (before its ``log()`` averages them), and each
training microbatch's completion-token count and probability ratios, so a test can
compute the exact token-weighted means independently of Steptally."""

from __future__ import annotations

from typing import Any

import torch

from steptally.integrations.trl import GRPOTrainer

#: `filterwarnings` specs for what a tiny CPU run warns of that no setting removes
WARNING_FILTERS: list[str] = [
    # TRL 1.16 reads the deprecated alias in `unwrap_model_for_generation` on every generation
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning:transformers.modeling_utils",
]
#: TRL's per-microbatch metric name → Steptally's
METRICS = {
    "entropy": "entropy",
    "kl": "kl",
    "clip_ratio/low_mean": "clip_ratio_low_mean",
    "clip_ratio/high_mean": "clip_ratio_high_mean",
    "clip_ratio/region_mean": "clip_ratio_region_mean",
}


class Recording(GRPOTrainer):
    """``steps``: one dict per optimizer step: ``step``, TRL's per-microbatch ``values``
    by TRL name, and per microbatch its ``tokens`` and ``ratio`` (a float64 list)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.window: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        super().__init__(*args, **kwargs)

    def _compute_loss(self, model: Any, inputs: Any) -> Any:
        loss = super()._compute_loss(model, inputs)
        if self.model.training:
            logps = self._get_per_token_logps_and_entropies(
                model,
                torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
                inputs["completion_ids"].size(1),
            )[0].detach()
            old = inputs.get("old_per_token_logps")
            mask = inputs["completion_mask"].bool()
            ratio = torch.exp(logps - (logps if old is None else old))[mask].double()
            self.window.append({"tokens": int(mask.sum()), "ratio": ratio.tolist()})
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and "loss" in logs:
            values = {k: list(self._metrics["train"][k]) for k in METRICS}
            self.steps.append({"step": self.state.global_step, "values": values, "mb": self.window})
            self.window = []
        super().log(logs, start_time)
