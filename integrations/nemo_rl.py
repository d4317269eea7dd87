"""NeMo-RL: its clipped policy-gradient loss, reporting exact fragments, and a logger
backend that commits each train step.

Two lines in ``examples/run_grpo.py``, after ``setup(...)`` returns ``policy``,
``loss_fn`` and ``logger``::

    from steptally.integrations.nemo_rl import SteptallyClippedPGLossFn, SteptallyLogger

    loss_fn = SteptallyClippedPGLossFn(config["loss_fn"])   # reads STEPTALLY_URL
    logger.loggers.append(SteptallyLogger(loss_fn, workers=policy.worker_group.workers))

:class:`SteptallyClippedPGLossFn` has NeMo-RL's ``ClippedPGLossFn`` call signature
(``next_token_logprobs, data, global_valid_seqs, global_valid_toks -> (loss, metrics)``,
``data`` a mapping of NeMo-RL's field names cut to the next-token positions as NeMo-RL
cuts them) and its settings (``ClippedPGLossConfig``, as a mapping or an object). It
computes the loss with Steptally's :class:`~steptally.client.loss.ClippedPGLoss`, which
implements the same semantics (the ``-inf`` keep-mask included), returns NeMo-RL's
metrics dict, each a microbatch share normalised as NeMo-RL normalises it (so NeMo-RL's
sum over microbatches still reads as before), and logs the microbatch's exact fragments
to Steptally from the worker it runs on.

:class:`SteptallyLogger` is a NeMo-RL ``LoggerInterface`` backend: the first ``train``
log of a step (the rollout metrics, logged before the policy trains) tells the loss
which step it is in; the step's final log (``step_finished=True``) commits it on every
policy worker (``__ray_call__`` on each worker actor; without ``workers``, a worker
commits a step when the next one starts and the last one at exit).

Limits: data parallel only (with tensor, context or pipeline parallelism several ranks
see the same microbatch and their fragments would count twice); the Steptally step
values are over NeMo-RL's ``mask`` like its own (the actor side narrowed by the keep
mask where logprobs are ``-inf``).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor

from steptally.client.loss import ClippedPGConfig, ClippedPGLoss, LossInputs, fragments_to_host
from steptally.client.loss.names import Fragment
from steptally.client.reporter import Reporter

__all__ = [
    "SteptallyClippedPGLossFn",
    "SteptallyLogger",
    "commit_in_process",
    "loss_config",
]

log = logging.getLogger("steptally.integrations.nemo_rl")
F = Fragment
_UNSAFE_RUN_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")

try:  # NeMo-RL's own enums where it is installed, the same values where it is not
    from nemo_rl.algorithms.loss.interfaces import (
        LossInputType,
        LossType,
        MetricNormalizer,
    )
except ImportError:

    class LossType(enum.Enum):  # type: ignore[no-redef]
        TOKEN_LEVEL = "token_level"
        SEQUENCE_LEVEL = "sequence_level"

    class MetricNormalizer(enum.Enum):  # type: ignore[no-redef]
        TOKENS = "tokens"
        SEQUENCES = "sequences"
        NONE = "none"

    class LossInputType(enum.Enum):  # type: ignore[no-redef]
        LOGIT = "logit"
        LOGPROB = "logprob"


def loss_config(cfg: Any) -> ClippedPGConfig:
    """Steptally's loss settings from NeMo-RL's ``ClippedPGLossConfig`` (a mapping or an
    object with its keys; ``use_kl_in_reward`` turns the loss's KL penalty off, as
    NeMo-RL does)."""

    def get(key: str, default: Any) -> Any:
        if isinstance(cfg, Mapping):
            return cfg.get(key, default)
        return getattr(cfg, key, default)

    values = {
        field.name: get(field.name, field.default)
        for field in dataclasses.fields(ClippedPGConfig)
        if field.default is not dataclasses.MISSING
    }
    if get("use_kl_in_reward", False):
        values["reference_policy_kl_penalty"] = 0.0
    return ClippedPGConfig(**values)


# per worker process: the loss object is pickled to the workers with every train call,
# the reporter stays where it was made
_LOCK = threading.Lock()
_REPORTERS: dict[tuple[str, str], _Open] = {}


@dataclasses.dataclass
class _Open:
    reporter: Reporter
    logged: int | None = None  # the last step logged and not yet committed


def _rank() -> tuple[int, int]:
    dist = torch.distributed
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def commit_in_process(_instance: object, step: int) -> int:
    """Commit ``step`` on every reporter of this process (run in each worker actor by
    :class:`SteptallyLogger`; ``_instance`` is the actor Ray passes)."""
    with _LOCK:
        opened = list(_REPORTERS.values())
    for entry in opened:
        _commit(entry, step)
    return len(opened)


def _commit(entry: _Open, step: int) -> None:
    try:
        entry.reporter.commit(step)
    except Exception:
        log.exception("steptally: the commit of step %s failed; training goes on", step)
    if entry.logged is not None and entry.logged <= step:
        entry.logged = None


class SteptallyClippedPGLossFn:
    """NeMo-RL's ``ClippedPGLossFn``, reporting (see the module's docs).

    ``url`` / ``run`` / ``token`` default to ``STEPTALLY_URL`` / ``STEPTALLY_RUN`` /
    ``STEPTALLY_TOKEN`` read where it is built (the driver), and travel with it; with no
    URL it is NeMo-RL's loss and reports nothing. ``steptally_step`` is the step the
    next training microbatches belong to (set by :class:`SteptallyLogger`).
    """

    input_type = LossInputType.LOGPROB

    def __init__(
        self,
        cfg: Any,
        use_fused_linear_logprobs: bool = False,
        *,
        url: str | None = None,
        run: str | None = None,
        token: str | None = None,
    ) -> None:
        self.use_fused_linear_logprobs = use_fused_linear_logprobs
        self.config = loss_config(cfg)
        self.loss = ClippedPGLoss(self.config)
        self.url = url or os.environ.get("STEPTALLY_URL") or None
        name = run or os.environ.get("STEPTALLY_RUN") or "nemo-rl-grpo"
        self.run = _UNSAFE_RUN_CHARS.sub("-", name).strip("-._")[:128] or "nemo-rl-grpo"
        self.token = token or os.environ.get("STEPTALLY_TOKEN") or None
        self.steptally_step: int | None = None
        self.loss_type = (
            LossType.TOKEN_LEVEL if self.config.token_level_loss else LossType.SEQUENCE_LEVEL
        )
        self.metric_normalizations = self._normalizations()
        self._said: set[str] = set()

    def _normalizations(self) -> dict[str, Any]:
        """Per metric, the global count it is divided by (NeMo-RL's table)."""
        grad = (
            MetricNormalizer.TOKENS if self.config.token_level_loss else MetricNormalizer.SEQUENCES
        )
        per_seq = MetricNormalizer.SEQUENCES if self.config.gspo else MetricNormalizer.TOKENS
        table: dict[str, Any] = {"loss": grad, "kl_penalty": grad}
        for name in _TOKEN_SHARES:
            table[name] = MetricNormalizer.TOKENS
        table["sampling_importance_ratio"] = per_seq
        for name in ("num_valid_samples", "positive_nll_loss", *_EXTREMA):
            table[name] = MetricNormalizer.NONE
        tis = self.config.truncated_importance_sampling_type
        if tis is not None:
            table["is_oob_ratio"] = (
                MetricNormalizer.SEQUENCES
                if tis == "seq-mask-tis" or self.config.gspo
                else MetricNormalizer.TOKENS
            )
        return table

    def inputs(
        self,
        next_token_logprobs: Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float,
    ) -> LossInputs:
        """NeMo-RL's microbatch as Steptally's loss inputs (the ``[:, 1:]`` cuts as
        NeMo-RL makes them)."""
        c = self.config
        curr = next_token_logprobs
        prev = (
            curr.detach()
            if c.force_on_policy_ratio and "prev_logprobs" not in data
            else data["prev_logprobs"][:, 1:]
        )
        token_mask = data["token_mask"][:, 1:]
        sample_mask = data["sample_mask"]
        rewards = data.get("rewards") if c.nll_enabled else None
        correct = None
        if rewards is not None:
            correct = (token_mask * sample_mask[:, None] * (rewards > 0)[:, None]).sum()
        return LossInputs(
            curr_logprobs=curr,
            prev_logprobs=prev,
            generation_logprobs=data["generation_logprobs"][:, 1:],
            advantages=data["advantages"][:, 1:],
            token_mask=token_mask,
            sample_mask=sample_mask,
            global_valid_tokens=global_valid_toks,
            global_valid_seqs=global_valid_seqs,
            reference_logprobs=data["reference_policy_logprobs"][:, 1:] if c.kl_enabled else None,
            curr_logprobs_unfiltered=data.get("curr_logprobs_unfiltered") if c.kl_enabled else None,
            rewards=rewards,
            global_correct_tokens=correct,
        )

    def __call__(
        self,
        next_token_logprobs: Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float,
    ) -> tuple[Tensor, dict[str, float]]:
        inputs = self.inputs(next_token_logprobs, data, global_valid_seqs, global_valid_toks)
        loss, fragments = self.loss(inputs)
        extra = {"loss": loss.detach(), "toks": global_valid_toks, "seqs": global_valid_seqs}
        if inputs.global_correct_tokens is not None:
            extra["correct"] = inputs.global_correct_tokens
        host = fragments_to_host({**fragments, **_tensors(extra, loss)})
        metrics = self.metrics(host)
        self._report(fragments)
        return loss, metrics

    def metrics(self, host: Mapping[str, Any]) -> dict[str, float]:
        """NeMo-RL's metrics of one microbatch from its fragments on the host: each mean
        a share of its global count, divided once and exactly from the exact numerator."""
        c = self.config
        toks, seqs = _exact(host["toks"]), _exact(host["seqs"])
        grad = toks if c.token_level_loss else seqs

        def share(name: str, count: Fraction) -> float:
            return float(_exact(host[name]) / count) if count else 0.0

        metrics = {"loss": float(_exact(host["loss"]))}
        metrics.update({name: share(num, toks) for name, num in _TOKEN_SHARES.items()})
        for name, empty in _EXTREMA.items():
            metrics[name] = float(host.get(name, empty))
        metrics["kl_penalty"] = share(F.KL_PENALTY_NUM, grad) if c.kl_enabled else 0.0
        metrics["sampling_importance_ratio"] = share(
            F.SAMPLING_IMPORTANCE_RATIO_NUM, seqs if c.gspo else toks
        )
        metrics["num_valid_samples"] = float(_exact(host[F.VALID_SEQS]))
        tis = c.truncated_importance_sampling_type
        if tis is not None:
            per_seq = tis == "seq-mask-tis" or c.gspo
            metrics["is_oob_ratio"] = share(F.IS_OOB_NUM, seqs if per_seq else toks)
        correct = _exact(host.get("correct", 0.0))
        metrics["positive_nll_loss"] = share(F.NLL_NUM, correct) if c.nll_enabled else 0.0
        return metrics

    def _report(self, fragments: Mapping[str, Tensor]) -> None:
        if self.url is None:
            return
        step = self.steptally_step
        if step is None:
            self._say_once("no-step", "no step is set (add SteptallyLogger to the logger)")
            return
        try:
            entry = self._open()
            if entry.logged is not None and entry.logged < step:
                _commit(entry, entry.logged)  # no commit came for the step before
            entry.reporter.log(step, fragments)
            entry.logged = step
        except Exception:
            log.exception("steptally: reporting stopped; training goes on")
            self.url = None

    def _open(self) -> _Open:
        assert self.url is not None
        key = (self.url, self.run)
        with _LOCK:
            entry = _REPORTERS.get(key)
            if entry is None:
                rank, world = _rank()
                reporter = Reporter(
                    self.url,
                    run=self.run,
                    spec=self.loss.metric_spec(),
                    rank=rank,
                    world_size=world,
                    token=self.token,
                )
                entry = _REPORTERS[key] = _Open(reporter)
        return entry

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning("steptally: %s; nothing is reported", message)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_said"] = set()
        return state


#: NeMo-RL's token-normalised metrics and the numerator each is
_TOKEN_SHARES: dict[str, str] = {
    "probs_ratio": F.PROBS_RATIO_NUM,
    "probs_ratio_clamped": F.PROBS_RATIO_CLAMPED_NUM,
    "token_mult_prob_error": F.TOKEN_MULT_PROB_ERROR_NUM,
    "gen_kl_error": F.GEN_KL_ERROR_NUM,
    "policy_kl_error": F.POLICY_KL_ERROR_NUM,
    "js_divergence_error": F.JS_DIVERGENCE_ERROR_NUM,
    "approx_entropy": F.APPROX_ENTROPY_NUM,
}
#: the extrema, and what NeMo-RL reports for an empty mask
_EXTREMA: dict[str, float] = {
    F.PROBS_RATIO_MIN: float("inf"),
    F.PROBS_RATIO_MAX: float("-inf"),
    F.PROBS_RATIO_CLAMPED_MIN: float("inf"),
    F.PROBS_RATIO_CLAMPED_MAX: float("-inf"),
}


def _tensors(values: Mapping[str, Tensor | float], like: Tensor) -> dict[str, Tensor]:
    return {
        name: v.detach() if isinstance(v, Tensor) else torch.tensor(float(v), device=like.device)
        for name, v in values.items()
    }


def _exact(value: float | Sequence[float]) -> Fraction:
    """A host value (a float, or an exact sum's parts) as an exact rational."""
    if isinstance(value, float | int):
        return Fraction(value)
    return sum((Fraction(part) for part in value), Fraction(0))


class SteptallyLogger:
    """A NeMo-RL ``LoggerInterface`` backend that steps and commits Steptally's steps
    (see the module's docs); it sends no metrics of its own."""

    def __init__(self, loss_fn: SteptallyClippedPGLossFn, workers: Sequence[Any] | None = None):
        self.loss_fn = loss_fn
        self.workers = list(workers) if workers is not None else None

    def log_metrics(
        self,
        metrics: Mapping[str, Any],
        step: int,
        prefix: str | None = "",
        step_metric: str | None = None,
        step_finished: bool = False,
    ) -> None:
        if step_finished:
            self.commit(step)
            self.loss_fn.steptally_step = step + 1
        elif prefix == "train":
            self.loss_fn.steptally_step = step

    def commit(self, step: int) -> None:
        """Commit ``step`` on every worker (and in this process, for a loss run here)."""
        commit_in_process(None, step)
        if self.workers:
            import ray

            ray.get([w.__ray_call__.remote(commit_in_process, step) for w in self.workers])

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        pass

    def log_histogram(self, histogram: list[Any], step: int, name: str) -> None:
        pass

    def log_plot(self, figure: Any, step: int, name: str) -> None:
        pass
