"""The loss-agnostic diagnostics: exact per-step means from a trainer's own tensors.

Each step value is checked against a single pass over every token of the step in exact
rational arithmetic (rounded once), for any split of the step into microbatches; the
``-inf`` keep-mask semantics against hand-made cases; and the trainer's loss and
gradient against a run without diagnostics.
"""

from __future__ import annotations

import dataclasses
import math
import random
from fractions import Fraction

import pytest

torch = pytest.importorskip("torch")

from steptally.client.algebra import combine  # noqa: E402
from steptally.client.diagnostics import (  # noqa: E402
    DiagnosticsConfig,
    Metric,
    PolicyDiagnostics,
    Signal,
)
from steptally.client.diagnostics.spec import signal_kinds  # noqa: E402
from steptally.client.loss import InputError, fragments_to_host  # noqa: E402
from steptally.client.loss.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.torch
S, M = Signal, Metric
INF = math.inf
FULL = DiagnosticsConfig(
    epsilon_low=0.1, epsilon_high=0.15, reference=True, sampling=True, importance_ratio=True
)


def _batch(seed: int, rows: int = 6, width: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    lp = -torch.rand(rows, width, generator=g) * 3
    old = lp + 0.3 * torch.randn(rows, width, generator=g)
    sampling = old + 0.05 * torch.randn(rows, width, generator=g)
    sampling[0, 0] = math.nan  # a token the sampler could not score
    lp[1, 0] = -INF  # filtered on the current side
    old[2, 1] = -INF  # filtered on the old side
    return {
        "logprobs": lp,
        "mask": mask,
        "advantages": torch.randn(rows, generator=g),
        "old_logprobs": old,
        "ref_logprobs": lp.clamp(min=-3) + 0.1 * torch.randn(rows, width, generator=g),
        "unfiltered_logprobs": lp.clamp(min=-3),
        "sampling_logprobs": sampling,
        "entropies": torch.rand(rows, width, generator=g),
        "importance_ratio": 0.5 + torch.rand(rows, width, generator=g),
    }


def _rows(batch: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    return {name: t[rows] for name, t in batch.items()}


def _step(diag: PolicyDiagnostics, parts: list[dict[str, torch.Tensor]]) -> dict[str, float | None]:
    spec = diag.metric_spec()
    host = [fragments_to_host(diag(**p), companions=spec.guards) for p in parts]
    return {name: r.value for name, r in combine(spec, host).items()}


def _mean(values: list[float]) -> float:
    return float(sum(map(Fraction, values)) / len(values))


def _reference(batch: dict[str, torch.Tensor], config: DiagnosticsConfig) -> dict[str, float]:
    """One pass over every token, in exact rationals, from the definitions (each per-token
    value as the trainer's float32 computes it)."""
    t = {k: v.double() for k, v in batch.items()}
    full = batch["mask"] != 0
    keep_old = batch["old_logprobs"] != -INF
    actor = full & (batch["logprobs"] != -INF) & keep_old
    ratio = torch.exp(batch["logprobs"] - batch["old_logprobs"]).double()
    adv = t["advantages"][:, None].expand_as(ratio)
    low = (ratio < 1 - config.epsilon_low) & (adv < 0)
    high = (ratio > 1 + config.high) & (adv > 0)
    mismatch = full & keep_old
    scored = mismatch & ~torch.isnan(t["sampling_logprobs"])
    diff = batch["ref_logprobs"] - batch["unfiltered_logprobs"]
    kl = (torch.exp(diff) - diff - 1).double()  # per token in the trainer's dtype
    return {
        M.PROBS_RATIO: _mean(ratio[actor].tolist()),
        S.PROBS_RATIO_MAX: ratio[actor].max().item(),
        S.PROBS_RATIO_MIN: ratio[actor].min().item(),
        M.ENTROPY: _mean(t["entropies"][actor].tolist()),
        M.KL: _mean(kl[full].tolist()),
        M.CLIP_RATIO_LOW_MEAN: _mean(low[actor].double().tolist()),
        M.CLIP_RATIO_HIGH_MEAN: _mean(high[actor].double().tolist()),
        M.CLIP_RATIO_REGION_MEAN: _mean((low | high)[actor].double().tolist()),
        S.COMPLETION_TOKENS: float(full.sum()),
        S.ACTOR_TOKENS: float(actor.sum()),
        M.SAMPLING_LOGP_DIFFERENCE_MEAN: _mean(
            (t["old_logprobs"] - t["sampling_logprobs"]).abs()[scored].tolist()
        ),
        M.UNSCORED_TOKENS: float((mismatch & ~scored).sum()),
        M.IMPORTANCE_SAMPLING_RATIO_MEAN: _mean(t["importance_ratio"][mismatch].tolist()),
        S.FILTERED_CURR_TOKENS: float((full & (batch["logprobs"] == -INF)).sum()),
        S.FILTERED_OLD_TOKENS: float((full & ~keep_old).sum()),
    }


@pytest.mark.parametrize("seed", range(4))
def test_step_values_are_the_single_pass_means_for_any_split(seed: int) -> None:
    diag = PolicyDiagnostics(FULL)
    batch = _batch(seed)
    rng = random.Random(seed)
    rows = list(range(6))
    rng.shuffle(rows)
    cuts = sorted(rng.sample(range(1, 6), 2))
    split = [rows[: cuts[0]], rows[cuts[0] : cuts[1]], rows[cuts[1] :]]
    whole = _step(diag, [batch])
    parts = _step(diag, [_rows(batch, r) for r in split])
    ones = _step(diag, [_rows(batch, [r]) for r in rows])
    assert whole == parts == ones  # bit-identical (NaN-free here)
    reference = _reference(batch, FULL)
    assert {name: whole[name] for name in reference} == reference


def test_mean_of_microbatch_means_differs() -> None:
    """The error the exact division removes is real on this data."""
    diag = PolicyDiagnostics(FULL)
    batch = _batch(3)
    single = [_step(diag, [_rows(batch, [r])]) for r in range(6)]
    naive = sum(v[M.ENTROPY] for v in single) / 6  # type: ignore[operator, misc]
    assert abs(naive - _step(diag, [batch])[M.ENTROPY]) > 1e-3  # type: ignore[operator]


def test_the_keep_mask_narrows_the_actor_side_only() -> None:
    diag = PolicyDiagnostics(DiagnosticsConfig(reference=True))
    lp = torch.tensor([[-INF, -1.0, -2.0, -0.5]])
    unfiltered = torch.tensor([[-4.0, -1.0, -2.0, -0.5]])
    ref = torch.tensor([[-3.0, -1.2, -2.0, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    step = _step(
        diag,
        [
            {
                "logprobs": lp,
                "mask": mask,
                "advantages": torch.ones(1),
                "old_logprobs": torch.tensor([[-3.0, -1.1, -2.0, -0.5]]),
                "ref_logprobs": ref,
                "unfiltered_logprobs": unfiltered,
                "entropies": torch.tensor([[100.0, 1.0, 2.0, 50.0]]),
            }
        ],
    )
    assert step[S.ACTOR_TOKENS] == 2.0 and step[S.COMPLETION_TOKENS] == 3.0
    assert step[S.FILTERED_CURR_TOKENS] == 1.0 and step[S.FILTERED_OLD_TOKENS] == 0.0
    assert step[M.ENTROPY] == 1.5  # the filtered and the padded tokens are out
    assert step[S.PROBS_RATIO_MAX] == pytest.approx(math.exp(0.1), rel=1e-6)  # not exp(3)
    kl = [math.exp(r - c) - (r - c) - 1 for r, c in ((-3, -4), (-1.2, -1.0), (-2, -2))]
    assert step[M.KL] == pytest.approx(sum(kl) / 3, rel=1e-6)  # the full mask, unfiltered
    assert step[M.FILTERED_TOKEN_SHARE] == 1 / 3


def test_an_empty_microbatch_contributes_nothing() -> None:
    diag = PolicyDiagnostics(FULL)
    batch = _batch(1)
    empty = {**_rows(batch, [0]), "mask": torch.zeros_like(batch["mask"][:1])}
    assert _step(diag, [batch, empty]) == _step(diag, [batch])
    alone = _step(diag, [empty])
    assert alone[M.PROBS_RATIO] is None and alone[S.PROBS_RATIO_MAX] is None


def test_sequence_level_ratio_is_one_per_sequence() -> None:
    config = DiagnosticsConfig(sequence_level=True, epsilon_low=0.01, entropy=False)
    diag = PolicyDiagnostics(config)
    batch = _batch(2)
    batch["logprobs"][1, 0] = -1.0
    parts = {k: batch[k] for k in ("logprobs", "mask", "advantages", "old_logprobs")}
    step = _step(diag, [parts])
    full = batch["mask"] != 0
    actor = full & (batch["old_logprobs"] != -INF)
    log_ratio = torch.where(actor, batch["logprobs"] - batch["old_logprobs"], 0.0)
    seq = torch.exp(log_ratio.sum(-1) / actor.sum(-1)).double()
    assert step[M.PROBS_RATIO] == _mean(seq.tolist())
    low = (seq < 0.99) & (batch["advantages"].double() < 0)
    assert step[M.CLIP_RATIO_LOW_MEAN] == _mean(low.double().tolist())
    assert step[S.ACTOR_SEQS] == 6.0


def test_the_loss_and_its_gradient_are_untouched() -> None:
    batch = _batch(5)
    lp = batch["logprobs"].clamp(min=-3).requires_grad_()
    loss = (torch.exp(lp - batch["old_logprobs"].clamp(min=-3)) * batch["mask"]).sum()
    (plain,) = torch.autograd.grad(loss, lp, retain_graph=True)
    PolicyDiagnostics(FULL)(**{**batch, "logprobs": lp})
    (after,) = torch.autograd.grad(loss, lp)
    assert torch.equal(plain, after) and lp.grad is None


def test_the_key_set_follows_the_config_and_bad_input_is_refused() -> None:
    diag = PolicyDiagnostics(DiagnosticsConfig())
    batch = _batch(0)
    plain = {k: batch[k] for k in ("logprobs", "mask", "advantages", "entropies")}
    assert set(diag(**plain)) == set(diag.metric_spec().metrics)
    assert M.KL not in diag.metric_spec().derived
    with pytest.raises(InputError, match="ref_logprobs"):
        diag(**plain, ref_logprobs=batch["ref_logprobs"])
    with pytest.raises(InputError, match="entropies"):
        diag(**{**plain, "entropies": None})
    with pytest.raises(InputError, match="advantages"):
        diag(**{**plain, "advantages": torch.zeros(2)})
    with pytest.raises(ConfigError, match="reference"):
        DiagnosticsConfig(kl_bias_correction=True)


def test_aliases_name_the_same_values() -> None:
    diag = PolicyDiagnostics(FULL, aliases={"pg_clipfrac": "clip_ratio_region_mean"})
    step = _step(diag, [_batch(0)])
    assert step["pg_clipfrac"] == step[M.CLIP_RATIO_REGION_MEAN]


def _verl_batch(seed: int) -> dict[str, torch.Tensor]:
    """A batch with log ratios past ±20 and ratios past the dual-clip bound."""
    batch = _batch(seed)
    old = batch["old_logprobs"].clone()
    old[3, 0] = batch["logprobs"][3, 0] - 25.0  # log ratio +25: clamped to 20
    old[4, 0] = batch["logprobs"][4, 0] + 30.0  # log ratio -30: clamped to -20
    old[:, 1] = batch["logprobs"][:, 1] - 1.5  # ratio e^1.5 > 3 in every row
    return {**batch, "old_logprobs": old}


def _verl_kl(estimator: str, d: torch.Tensor) -> torch.Tensor:
    """The estimators as written out per token from ``d = ref - logp``."""
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "abs":
        return d.abs()
    e = torch.exp(d.clamp(-20, 20)) - d.clamp(-20, 20) - 1
    return e.clamp(-10, 10) if estimator == "low_var_kl" else torch.exp(d) - d - 1


@pytest.mark.parametrize("estimator", ["k3", "low_var_kl", "k1", "k2", "abs"])
def test_the_clamped_log_ratio_dual_clip_and_kl_estimators(estimator: str) -> None:
    config = DiagnosticsConfig(
        epsilon_low=0.2,
        reference=True,
        kl_estimator=estimator,
        log_ratio_clamp=20.0,
        dual_clip=3.0,
        approx_kl=True,
    )
    diag = PolicyDiagnostics(config, aliases={"ppo_kl": "approx_kl"})
    batch = {k: v for k, v in _verl_batch(1).items() if k not in ("sampling_logprobs",)}
    del batch["importance_ratio"]
    whole = _step(diag, [batch])
    assert whole == _step(diag, [_rows(batch, [r]) for r in range(6)])  # any split
    full = batch["mask"] != 0
    actor = full & (batch["logprobs"] != -INF) & (batch["old_logprobs"] != -INF)
    log_ratio = (batch["logprobs"] - batch["old_logprobs"]).clamp(-20, 20)
    ratio = torch.exp(log_ratio)
    adv = batch["advantages"][:, None].expand_as(ratio)
    dual = (torch.maximum(ratio, ratio.clamp(0.8, 1.2)) > 3.0) & (adv < 0)
    kl = _verl_kl(estimator, batch["ref_logprobs"] - batch["unfiltered_logprobs"])
    assert whole[S.PROBS_RATIO_MAX] == torch.exp(torch.tensor(20.0)).item() == ratio[actor].max()
    assert whole[S.PROBS_RATIO_MIN] == ratio[actor].min().item()
    assert whole[M.PROBS_RATIO] == _mean(ratio[actor].double().tolist())
    assert whole[M.CLIP_RATIO_DUAL_MEAN] == _mean(dual[actor].double().tolist()) > 0
    assert whole["ppo_kl"] == whole[M.APPROX_KL] == _mean((-log_ratio)[actor].double().tolist())
    assert whole[M.KL] == _mean(kl[full].double().tolist())
    unclamped = dataclasses.replace(config, log_ratio_clamp=None)
    assert _step(PolicyDiagnostics(unclamped), [batch])[S.PROBS_RATIO_MAX] > math.exp(24)


def test_the_new_options_are_declared_by_the_config_alone() -> None:
    plain = signal_kinds(DiagnosticsConfig())
    assert S.CLIPPED_DUAL not in plain and S.APPROX_KL_NUM not in plain
    kinds = signal_kinds(DiagnosticsConfig(dual_clip=3.0, approx_kl=True))
    assert kinds[S.CLIPPED_DUAL] == "count" and kinds[S.APPROX_KL_NUM] == "sum"
    assert S.CLIPPED_DUAL not in signal_kinds(DiagnosticsConfig(clip=False, dual_clip=3.0))
    for bad, match in (
        ({"kl_estimator": "k4"}, "kl_estimator must be one of"),
        ({"log_ratio_clamp": 0.0}, "log_ratio_clamp must be > 0"),
        ({"dual_clip": 1.0}, "dual_clip must be > 1"),
    ):
        with pytest.raises(ConfigError, match=match):
            DiagnosticsConfig(**bad)  # type: ignore[arg-type]


def test_the_sampling_mismatch_in_probability() -> None:
    config = DiagnosticsConfig(sampling=True, sampling_probs=True)
    diag = PolicyDiagnostics(config)
    batch = {k: _batch(2)[k] for k in ("logprobs", "mask", "advantages", "old_logprobs")}
    batch |= {
        "sampling_logprobs": _batch(2)["sampling_logprobs"],
        "entropies": _batch(2)["entropies"],
    }
    whole = _step(diag, [batch])
    assert whole == _step(diag, [_rows(batch, [r]) for r in range(6)])
    full, old = batch["mask"] != 0, batch["old_logprobs"]
    scored = full & (old != -INF) & ~torch.isnan(batch["sampling_logprobs"])
    probs = (torch.exp(old) - torch.exp(batch["sampling_logprobs"])).abs()
    assert whole[M.SAMPLING_PROB_DIFFERENCE_MEAN] == _mean(probs[scored].double().tolist())
    assert whole[S.SAMPLING_PROB_DIFFERENCE_MAX] == probs[scored].max().item()
    with pytest.raises(ConfigError, match="sampling_probs needs sampling"):
        DiagnosticsConfig(sampling_probs=True)
