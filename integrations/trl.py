"""A drop-in ``trl.GRPOTrainer`` that reports exact per-step diagnostics to Steptally.

Change one import::

    from steptally.integrations.trl import GRPOTrainer   # instead of trl's

and set ``STEPTALLY_URL`` (or pass ``steptally_url=``; ``steptally_run=`` /
``STEPTALLY_RUN`` and ``steptally_token=`` / ``STEPTALLY_TOKEN`` likewise). With no URL
the trainer trains exactly as TRL's does and says once that reporting is off.

One Steptally step per optimizer step, numbered as TRL logs it (``state.global_step``
after that step). Every training microbatch is a fragment, built from the tensors TRL's
own ``_compute_loss`` uses (no second forward pass, no change to the loss or its
gradient, no host sync); every process commits the step at its end, the short last
accumulation window of an epoch included. Evaluation batches are not reported. Each
metric (``entropy``, ``kl``, ``clip_ratio_low_mean``, ``probs_ratio``, …; see
:mod:`steptally.client.diagnostics`) is the exact token-weighted mean over every
completion token of the step, all microbatches and all processes — where TRL's own log
is a mean of per-microbatch means.

The private TRL methods overridden here are :data:`OVERRIDDEN`; they are checked against
the tested ``trl`` range of the ``steptally[trl]`` extra, and a mismatch is a warning at
construction (and a failing test in this project).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from typing import Any

import torch
from transformers import TrainerCallback
from trl.trainer.grpo_trainer import GRPOTrainer as TRLGRPOTrainer

from steptally.client.diagnostics import DiagnosticsConfig, PolicyDiagnostics
from steptally.client.reporter import Reporter

__all__ = ["OVERRIDDEN", "TESTED_RANGE", "GRPOTrainer", "diagnostics_config"]

log = logging.getLogger("steptally.integrations.trl")

#: the trl releases this module is tested against (the ``steptally[trl]`` extra)
TESTED_RANGE = "trl>=1.16,<1.17"
#: loss types whose loss clips the ratio two-sided (TRL logs clip_ratio/* for these)
CLIPPED_LOSSES = frozenset({"grpo", "bnpo", "dr_grpo", "dapo", "luspo"})
#: the private methods overridden, with the parameters this module relies on
OVERRIDDEN: dict[str, tuple[str, ...]] = {
    "_compute_loss": ("self", "model", "inputs"),
    "_get_per_token_logps_and_entropies": (
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
    ),
}
_UNSAFE_RUN_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")


def signature_problems() -> list[str]:
    """How the installed TRL's overridden methods differ from what this module expects."""
    problems = []
    for name, expected in OVERRIDDEN.items():
        found = tuple(inspect.signature(getattr(TRLGRPOTrainer, name)).parameters)
        if found[: len(expected)] != expected:
            problems.append(f"trl.GRPOTrainer.{name}{found} does not start with {expected}")
    return problems


def diagnostics_config(trainer: TRLGRPOTrainer) -> DiagnosticsConfig:
    """The diagnostics of ``trainer``'s loss as its settings configure it."""
    args: Any = trainer.args  # a GRPOConfig
    beta = float(trainer.beta)
    vllm_is = bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction)
    mode = str(getattr(trainer, "vllm_importance_sampling_mode", ""))
    return DiagnosticsConfig(
        epsilon_low=float(trainer.epsilon_low),
        epsilon_high=float(trainer.epsilon_high),
        ratio_cap=args.delta,
        sequence_level=trainer.importance_sampling_level == "sequence",
        clip=trainer.loss_type in CLIPPED_LOSSES,
        reference=beta != 0.0,
        kl_bias_correction=beta != 0.0 and bool(args.use_bias_correction_kl),
        sampling=vllm_is,
        importance_ratio=vllm_is,
        importance_ratio_per_sequence=vllm_is and mode.startswith("sequence"),
    )


def _run_name(explicit: str | None, args: Any) -> str:
    name = explicit or os.environ.get("STEPTALLY_RUN") or args.run_name
    name = name or os.path.basename(os.path.normpath(args.output_dir)) or "trl-grpo"
    return _UNSAFE_RUN_CHARS.sub("-", str(name)).strip("-._")[:128] or "trl-grpo"


class _Commit(TrainerCallback):
    """Commits each optimizer step on every process, and flushes at the end, for as
    long as the trainer reports."""

    def __init__(self, trainer: GRPOTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.steptally is not None:
            self.trainer.steptally.commit(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.steptally is not None:
            self.trainer.steptally.flush(10.0)


class GRPOTrainer(TRLGRPOTrainer):
    """``trl.GRPOTrainer`` with the same arguments, plus ``steptally_url``,
    ``steptally_run`` and ``steptally_token`` (else the ``STEPTALLY_*`` variables)."""

    def __init__(
        self,
        *args: Any,
        steptally_url: str | None = None,
        steptally_run: str | None = None,
        steptally_token: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.steptally: Reporter | None = None
        self._steptally_stash: tuple[torch.Tensor, torch.Tensor | None] | None = None
        for problem in signature_problems():
            log.warning("steptally: %s; the tested range is %s", problem, TESTED_RANGE)
        url = steptally_url or os.environ.get("STEPTALLY_URL")
        if not url:
            if self.accelerator.is_main_process:
                log.warning("steptally: reporting is off (set STEPTALLY_URL to turn it on)")
            return
        self.steptally_diagnostics = PolicyDiagnostics(diagnostics_config(self))
        self.steptally = Reporter(
            url,
            run=_run_name(steptally_run, self.args),
            spec=self.steptally_diagnostics.metric_spec(),
            rank=self.accelerator.process_index,
            world_size=self.accelerator.num_processes,
            token=steptally_token,
        )
        self.add_callback(_Commit(self))

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: Any,
        attention_mask: Any,
        logits_to_keep: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        found = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        if kwargs.get("compute_entropy"):  # the policy forward of _compute_loss
            self._steptally_stash = (found[0], found[1])
        return found

    def _compute_loss(self, model: Any, inputs: Any) -> Any:
        self._steptally_stash = None
        loss = super()._compute_loss(model, inputs)  # type: ignore[no-untyped-call]
        stash, self._steptally_stash = self._steptally_stash, None
        if (
            self.steptally is not None
            and getattr(self.model, "training", False)
            and stash is not None
        ):
            self._report(inputs, *stash)
        return loss

    def _report(self, inputs: Any, logps: torch.Tensor, entropies: torch.Tensor | None) -> None:
        """Log this microbatch's fragments under the step it belongs to. A failure stops
        reporting (said once, loudly) and never the training: the step then shows as
        incomplete on the service."""
        assert self.steptally is not None
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        config = self.steptally_diagnostics.config
        try:
            fragments = self.steptally_diagnostics(
                logprobs=logps,
                mask=mask,
                advantages=inputs["advantages"],
                old_logprobs=inputs.get("old_per_token_logps"),
                ref_logprobs=inputs.get("ref_per_token_logps") if config.reference else None,
                sampling_logprobs=inputs.get("sampling_per_token_logps")
                if config.sampling
                else None,
                entropies=entropies,
                importance_ratio=inputs.get("importance_sampling_ratio")
                if config.importance_ratio
                else None,
            )
            self.steptally.log(self.state.global_step + 1, fragments)
        except Exception:
            log.exception("steptally: reporting stopped; training goes on")
            # no more log() or commit(); what was logged is still delivered in the
            # background, and the reporter is closed at exit like any other
            self.steptally = None
