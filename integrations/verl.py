"""verl: exact per-step diagnostics from verl's own PPO loss tensors.

Install ``steptally[verl]`` beside verl, set ``STEPTALLY_URL`` and pick the trainer::

    STEPTALLY_URL=http://steptally:8000 python -m verl.trainer.main_ppo \\
        trainer.use_v1=True trainer.v1.trainer_mode=steptally ...

This module is a verl plugin (entry point ``verl.plugins``), so every process that imports
verl — the task runner and each Ray worker — registers the ``steptally`` trainer: verl's
synchronous v1 trainer (``PPOTrainerSync``, which it runs as ``sync``) whose actor loss
is wrapped by :class:`SteptallyPPOLoss`. The wrapper calls verl's own ``ppo_loss`` and
returns what it returns; besides, on every training micro-batch, it logs the fragments of
the tensors that loss read (its log-probs, entropies, old and reference log-probs,
advantages, response mask, and the rollout's log-probs when the rollout computes them).
No second forward pass, no change to the loss or its gradient.

One Steptally step per verl global step (every mini-batch and PPO epoch of the actor
update), numbered as verl logs it. After the update the driver commits the step on every
worker (``__ray_call__`` on each worker actor). verl's ``actor/pg_clipfrac``,
``actor/ppo_kl`` and ``actor/pg_clipfrac_lower`` are means of per-micro-batch means;
the same names here (:data:`ALIASES`) are exact token-weighted means over the step.

Limits: only the plain actor loss (``ppo_loss``; not the distillation loss); data
parallel only (with tensor, pipeline or sequence parallelism the data-parallel size is
below the world size, and reporting says so once and stays off); clip counts for the
``vanilla`` policy loss only (other loss modes report ratios, entropy and KL).
"""

from __future__ import annotations

import logging
import os
import re
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from steptally.client.diagnostics import DiagnosticsConfig, PolicyDiagnostics
from steptally.client.reporter import Reporter

__all__ = [
    "ALIASES",
    "ROLLOUT_ALIASES",
    "STEP_KEY",
    "TESTED_RANGE",
    "Settings",
    "SteptallyPPOLoss",
    "aliases",
    "commit_in_process",
    "commit_workers",
    "diagnostics_config",
    "settings_from",
]

log = logging.getLogger("steptally.integrations.verl")

#: the verl releases this module is tested against (the ``steptally[verl]`` extra)
TESTED_RANGE = "verl>=0.9.1,<0.10"
#: verl's metric names, as exact expressions over the diagnostics
ALIASES: dict[str, str] = {
    "pg_clipfrac": "clip_ratio_region_mean",
    "ppo_kl": "approx_kl",
    "pg_clipfrac_lower": "clip_ratio_dual_mean",
}
#: verl's rollout mismatch (its ``training/rollout_probs_diff_*``, in probability), when
#: the rollout computes its log-probs
ROLLOUT_ALIASES: dict[str, str] = {
    "rollout_probs_diff_mean": "sampling_prob_difference_mean",
    "rollout_probs_diff_max": "sampling_prob_difference_max",
}
#: the non-tensor key of the worker data that carries the step under way
STEP_KEY = "steptally_step"
#: verl's ``kl_loss_type`` names (a trailing ``+`` is the straight-through variant,
#: whose forward value is the same) and the estimator each computes
KL_TYPES: dict[str, str] = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "low_var_kl",
    "k3": "low_var_kl",
}
_UNSAFE_RUN_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")
_LIVE: weakref.WeakSet[SteptallyPPOLoss] = weakref.WeakSet()


def _get(config: Any, key: str, default: Any = None) -> Any:
    """A setting of an OmegaConf node, a dataclass or a mapping."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def diagnostics_config(actor: Any, *, rollout_log_probs: bool = False) -> DiagnosticsConfig:
    """The diagnostics of verl's actor loss as ``actor`` (``actor_rollout_ref.actor``,
    an ``ActorConfig`` or its OmegaConf node) configures it; ``rollout_log_probs``: the
    rollout computes its own log-probs (``rollout.calculate_log_probs``)."""
    clip_ratio = float(_get(actor, "clip_ratio", 0.2))
    low, high = _get(actor, "clip_ratio_low"), _get(actor, "clip_ratio_high")
    mode = _get(_get(actor, "policy_loss") or {}, "loss_mode", "vanilla")
    vanilla = mode == "vanilla"
    use_kl = bool(_get(actor, "use_kl_loss", False))
    kl_type = str(_get(actor, "kl_loss_type", "low_var_kl")).removesuffix("+")
    if use_kl and kl_type not in KL_TYPES:
        raise ValueError(f"kl_loss_type {kl_type!r} has no per-token estimate to report")
    entropy = bool(_get(actor, "calculate_entropy", False)) or _get(actor, "entropy_coeff", 0) != 0
    return DiagnosticsConfig(
        epsilon_low=clip_ratio if low is None else float(low),
        epsilon_high=clip_ratio if high is None else float(high),
        clip=vanilla,
        dual_clip=float(_get(actor, "clip_ratio_c", 3.0)) if vanilla else None,
        log_ratio_clamp=20.0,
        approx_kl=True,
        entropy=entropy,
        reference=use_kl,
        kl_estimator=KL_TYPES.get(kl_type, "low_var_kl"),
        sampling=rollout_log_probs,
        sampling_probs=rollout_log_probs,
    )


def aliases(config: DiagnosticsConfig) -> dict[str, str]:
    """verl's names for the diagnostics ``config`` emits."""
    return {**ALIASES, **(ROLLOUT_ALIASES if config.sampling_probs else {})}


@dataclass(frozen=True)
class Settings:
    """Where and as what a run reports: pickled to every worker with the loss."""

    url: str
    run: str
    config: DiagnosticsConfig
    token: str | None = None


def _run_name(config: Any) -> str:
    trainer = _get(config, "trainer") or {}
    name = os.environ.get("STEPTALLY_RUN") or _get(trainer, "experiment_name") or "verl-ppo"
    return _UNSAFE_RUN_CHARS.sub("-", str(name)).strip("-._")[:128] or "verl-ppo"


def settings_from(config: Any) -> Settings | None:
    """The reporting settings of a verl run config (its ``STEPTALLY_*`` variables), or
    None when ``STEPTALLY_URL`` is unset."""
    url = os.environ.get("STEPTALLY_URL")
    if not url:
        return None
    arr = _get(config, "actor_rollout_ref")
    rollout = _get(arr, "rollout") or {}
    return Settings(
        url=url,
        run=_run_name(config),
        config=diagnostics_config(
            _get(arr, "actor"), rollout_log_probs=bool(_get(rollout, "calculate_log_probs", False))
        ),
        token=os.environ.get("STEPTALLY_TOKEN"),
    )


def _nondata(data: Any, key: str) -> Any:
    """A non-tensor entry of a TensorDict, or None."""
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=None)


class SteptallyPPOLoss:
    """verl's actor loss function with reporting beside it: ``__call__`` has the loss
    function's signature and returns what ``loss_fn`` returns, untouched.

    Built on the driver and sent to the workers (verl's ``set_loss_fn``); the reporter is
    made in each worker process on first use and never pickled. Micro-batches without
    the step key (every forward that is not the actor update) are not reported. A
    failure stops reporting, said once, and never the training: the step then shows as
    incomplete on the service.
    """

    def __init__(self, loss_fn: Callable[..., Any], settings: Settings) -> None:
        self.loss_fn = loss_fn
        self.settings = settings
        self.diagnostics = PolicyDiagnostics(settings.config, aliases=aliases(settings.config))
        self.reporter: Reporter | None = None
        self.off = False
        _LIVE.add(self)

    def __getstate__(self) -> dict[str, Any]:
        return {"loss_fn": self.loss_fn, "settings": self.settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["loss_fn"], state["settings"])  # type: ignore[misc]

    def __call__(self, model_output: Any, data: Any, dp_group: Any = None) -> Any:
        result = self.loss_fn(model_output=model_output, data=data, dp_group=dp_group)
        step = _nondata(data, STEP_KEY)
        if step is not None and not self.off:
            try:
                fragments = self._fragments(model_output, data)
                reporter = self._reporter(data)
                if reporter is not None:
                    reporter.log(int(step), fragments)
            except Exception:
                log.exception("steptally: reporting stopped; training goes on")
                self._stop()
        return result

    def _fragments(self, model_output: Any, data: Any) -> dict[str, torch.Tensor]:
        """The micro-batch's fragments, from the tensors ``ppo_loss`` reads, brought to
        the padded layout the same way it does."""
        from verl.workers.utils.padding import no_padding_2_padding

        config = self.settings.config
        log_prob = no_padding_2_padding(model_output["log_probs"], data)
        entropy = model_output.get("entropy") if config.entropy else None
        if config.entropy and entropy is None:
            raise ValueError("the config says the loss computes entropy, but the model gave none")
        fields = ["response_mask", "old_log_probs", "advantages"]
        fields += ["ref_log_prob"] if config.reference else []
        fields += ["rollout_log_probs"] if config.sampling else []
        padded = data.select(*fields).to_padded_tensor()
        return self.diagnostics(
            logprobs=log_prob,
            mask=padded["response_mask"],
            advantages=padded["advantages"],
            old_logprobs=padded["old_log_probs"],
            ref_logprobs=padded["ref_log_prob"] if config.reference else None,
            sampling_logprobs=padded["rollout_log_probs"] if config.sampling else None,
            entropies=None if entropy is None else no_padding_2_padding(entropy, data),
        )

    def _reporter(self, data: Any = None) -> Reporter | None:
        """This process's reporter, made on first use; None (and reporting off, said
        once) when the data-parallel size is not the world size."""
        if self.reporter is not None or self.off:
            return self.reporter
        dist = torch.distributed
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        dp_size = None if data is None else _nondata(data, "dp_size")
        if dp_size is not None and int(dp_size) != world:
            log.warning(
                "steptally: data-parallel size %s is not the world size %s (model parallel);"
                " reporting is off for this run",
                dp_size,
                world,
            )
            self._stop()
            return None
        self.reporter = Reporter(
            self.settings.url,
            run=self.settings.run,
            spec=self.diagnostics.metric_spec(),
            rank=rank,
            world_size=world,
            token=self.settings.token,
        )
        return self.reporter

    def _stop(self) -> None:
        # no more log() or commit(); what was logged is still delivered in the
        # background, and the reporter is closed at exit like any other
        self.off = True
        self.reporter = None

    def commit(self, step: int) -> None:
        """End ``step`` for this process (made here when this rank logged nothing)."""
        if self.off:
            return
        try:
            reporter = self._reporter()
            if reporter is not None:
                reporter.commit(step)
        except Exception:
            log.exception("steptally: reporting stopped; training goes on")
            self._stop()


def commit_in_process(_instance: object, step: int) -> int:
    """Commit ``step`` for every Steptally loss of this process; run in each worker
    actor by :func:`commit_workers` (``_instance`` is the actor Ray passes)."""
    live = list(_LIVE)
    for loss in live:
        loss.commit(step)
    return len(live)


def commit_workers(worker_group: Any, step: int) -> list[int]:
    """Commit ``step`` on every worker of a verl ``RayWorkerGroup``; how many losses
    each committed."""
    import ray

    calls = [w.__ray_call__.remote(commit_in_process, step) for w in worker_group.workers]
    return list(ray.get(calls))


def _register() -> None:
    """Register the ``steptally`` trainer with verl's v1 trainers (at plugin load)."""
    from omegaconf import open_dict
    from verl.trainer.ppo.v1 import register_trainer
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    @register_trainer("steptally")
    class SteptallyTrainer(PPOTrainerSync):  # type: ignore[misc]
        """verl's synchronous v1 trainer, reporting to Steptally."""

        def __init__(self, config: Any) -> None:
            with open_dict(config):
                config.trainer.v1.trainer_mode = "sync"  # what verl runs: its sync trainer
            super().__init__(config)
            self.steptally = settings_from(config)
            if self.steptally is None:
                log.warning("steptally: reporting is off (set STEPTALLY_URL to turn it on)")
            elif config.get("distillation") and config.distillation.get("enabled", False):
                log.warning("steptally: the distillation loss is not reported; reporting is off")
                self.steptally = None

        def on_init_end(self) -> None:
            super().on_init_end()
            if self.steptally is not None:
                actor = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
                loss = SteptallyPPOLoss(partial(ppo_loss, config=actor), self.steptally)
                self.actor_rollout_wg.set_loss_fn(loss)

        def _update_actor(self, batch: Any, metrics: dict[str, Any]) -> Any:
            if self.steptally is None:
                return super()._update_actor(batch, metrics)
            batch.extra_info[STEP_KEY] = self.global_steps
            try:
                updated = super()._update_actor(batch, metrics)
            finally:
                batch.extra_info.pop(STEP_KEY, None)
            try:
                commit_workers(self.actor_rollout_wg, self.global_steps)
            except Exception:
                log.exception("steptally: the commit of step %s failed", self.global_steps)
            return updated


try:  # verl imports this module as a plugin; without verl it is a plain library
    _register()
except ImportError as error:  # pragma: no cover - exercised where verl is absent
    log.debug("steptally: the verl trainer is not registered (%s)", error)
