"""The NeMo-RL adapter: its loss function against Steptally's ``ClippedPGLoss`` on the same
data, and its reported fragments against a real service.

NeMo-RL does not install here (its registry entry is a placeholder), so its data layout
is built from the field names and the ``[:, 1:]`` cuts of its ``ClippedPGLossFn``: every
per-token field one position longer than the next-token log-probs. The loss and its
gradient must be bit-identical to ``ClippedPGLoss``, each metric the microbatch's share
normalised as NeMo-RL normalises it (divided once, exactly), and the served step values
the exact ones, which NeMo-RL's sum of shares is not where tokens are filtered.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch")

from nemo_rl_grpo_loss import nemo_data  # noqa: E402

from steptally.client.algebra import combine  # noqa: E402
from steptally.client.loss import (  # noqa: E402
    ClippedPGConfig,
    ClippedPGLoss,
    LossInputs,
    fragments_to_host,
)
from steptally.client.loss.names import Fragment  # noqa: E402
from steptally.client.loss.synthetic import synthetic_step  # noqa: E402
from steptally.integrations import nemo_rl  # noqa: E402
from steptally.integrations.nemo_rl import (  # noqa: E402
    SteptallyClippedPGLossFn,
    SteptallyLogger,
)

pytestmark = pytest.mark.torch
F = Fragment
#: the keys NeMo-RL's ClippedPGLossFn returns (``is_oob_ratio`` only with TIS)
NEMO_KEYS = {
    "loss",
    "probs_ratio",
    "probs_ratio_clamped",
    "probs_ratio_min",
    "probs_ratio_max",
    "probs_ratio_clamped_min",
    "probs_ratio_clamped_max",
    "kl_penalty",
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    "js_divergence_error",
    "sampling_importance_ratio",
    "num_valid_samples",
    "approx_entropy",
    "positive_nll_loss",
}
#: NeMo-RL's loss settings (its ClippedPGLossConfig keys), one per family of the loss
CONFIGS: dict[str, dict[str, Any]] = {
    "grpo": {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28, "ratio_clip_c": 3.0},
    "kl-nll": {
        "reference_policy_kl_penalty": 0.05,
        "reference_policy_kl_type": "k3",
        "positive_example_nll_weight": 0.1,
        "use_on_policy_kl_approximation": True,
    },
    "gspo": {
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
        "reference_policy_kl_penalty": 0.01,
    },
    "tis": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.02,
        "reference_policy_kl_penalty": 0.0,
    },
    "kl-in-reward": {"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.05},
}


def _microbatches(seed: int) -> list[LossInputs]:
    """One step's microbatches over two ranks, uneven, with the step's normalisers."""
    return [mb for rank in synthetic_step(seed, (3, 2)) for mb in rank]


def _exact(value: Any) -> Fraction:
    parts = value if isinstance(value, (tuple, list)) else (value,)
    return sum((Fraction(p) for p in parts), Fraction(0))


def _local_correct(mb: LossInputs) -> torch.Tensor:
    assert mb.rewards is not None
    return (mb.token_mask * mb.sample_mask[:, None] * (mb.rewards > 0)[:, None]).sum()


#: NeMo-RL's token-normalised metrics and the numerator of each
TOKEN_SHARES = {
    "probs_ratio": F.PROBS_RATIO_NUM,
    "probs_ratio_clamped": F.PROBS_RATIO_CLAMPED_NUM,
    "token_mult_prob_error": F.TOKEN_MULT_PROB_ERROR_NUM,
    "gen_kl_error": F.GEN_KL_ERROR_NUM,
    "policy_kl_error": F.POLICY_KL_ERROR_NUM,
    "js_divergence_error": F.JS_DIVERGENCE_ERROR_NUM,
    "approx_entropy": F.APPROX_ENTROPY_NUM,
}
EXTREMA = (
    "probs_ratio_min",
    "probs_ratio_max",
    "probs_ratio_clamped_min",
    "probs_ratio_clamped_max",
)


def _nemo_metrics(
    config: ClippedPGConfig, mb: LossInputs, loss: torch.Tensor, host: dict[str, Any]
) -> dict[str, float]:
    """Every metric NeMo-RL's ``ClippedPGLossFn`` returns for ``mb``, from what
    ``ClippedPGLoss`` computes on it: each mean its exact numerator over the global count
    NeMo-RL divides it by, the extrema as they are, the NLL over the microbatch's own
    correct tokens (0 where there are none)."""
    tokens = Fraction(float(mb.global_valid_tokens))
    sequences = Fraction(float(mb.global_valid_seqs))

    def share(fragment: str, count: Fraction) -> float:
        return float(_exact(host[fragment]) / count)

    metrics = {"loss": loss.item(), **{k: share(f, tokens) for k, f in TOKEN_SHARES.items()}}
    metrics.update({key: host[key] for key in EXTREMA})
    grad_count = tokens if config.token_level_loss else sequences
    metrics["kl_penalty"] = share(F.KL_PENALTY_NUM, grad_count) if config.kl_enabled else 0.0
    importance = sequences if config.gspo else tokens
    metrics["sampling_importance_ratio"] = share(F.SAMPLING_IMPORTANCE_RATIO_NUM, importance)
    metrics["num_valid_samples"] = float(mb.sample_mask.sum())
    correct = Fraction(float(_local_correct(mb))) if config.nll_enabled else Fraction(0)
    metrics["positive_nll_loss"] = share(F.NLL_NUM, correct) if correct else 0.0
    tis = config.truncated_importance_sampling_type
    if tis is not None:
        per_sequence = config.gspo or tis == "seq-mask-tis"
        metrics["is_oob_ratio"] = share(F.IS_OOB_NUM, sequences if per_sequence else tokens)
    return metrics


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loss_gradient_and_metrics_equal_clipped_pg_loss_on_the_same_data(name: str) -> None:
    cfg = CONFIGS[name]
    adapter = SteptallyClippedPGLossFn(cfg)
    config = adapter.config
    assert config.kl_enabled == (name not in ("tis", "kl-in-reward"))  # defaults: 0.01
    reference = ClippedPGLoss(config)
    for mb in _microbatches(3):
        toks, seqs = mb.global_valid_tokens, mb.global_valid_seqs
        loss, metrics = adapter(mb.curr_logprobs, nemo_data(mb), seqs, toks)
        own = dataclasses.replace(mb, global_correct_tokens=_local_correct(mb))
        expected, fragments = reference(own)
        assert torch.equal(loss, expected)
        (grad,) = torch.autograd.grad(loss, mb.curr_logprobs)
        (expected_grad,) = torch.autograd.grad(expected, mb.curr_logprobs)
        assert torch.equal(grad, expected_grad)

        tis = config.truncated_importance_sampling_type is not None
        assert set(metrics) == NEMO_KEYS | ({"is_oob_ratio"} if tis else set())
        assert metrics == _nemo_metrics(config, mb, expected, fragments_to_host(fragments))


def test_the_loss_function_speaks_nemo_rl() -> None:
    adapter = SteptallyClippedPGLossFn({"token_level_loss": False})
    assert adapter.loss_type.value == "sequence_level"
    assert adapter.input_type.value == "logprob"
    assert adapter.metric_normalizations["loss"].value == "sequences"
    assert adapter.metric_normalizations["probs_ratio"].value == "tokens"
    assert adapter.metric_normalizations["probs_ratio_max"].value == "none"
    # NeMo-RL's pydantic config is read by attribute, like a mapping by key
    as_object = SteptallyClippedPGLossFn(type("Cfg", (), {"ratio_clip_min": 0.1})())
    assert as_object.config.ratio_clip_min == 0.1 and as_object.config.ratio_clip_max == 0.2
    with pytest.raises(Exception, match="ratio_clip_c"):
        SteptallyClippedPGLossFn({"ratio_clip_c": 0.5})


@pytest.fixture
def fresh_reporters() -> Iterator[None]:
    yield
    for entry in nemo_rl._REPORTERS.values():
        entry.reporter.close(10.0)
    nemo_rl._REPORTERS.clear()


def _served(url: str, run: str, step: int) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(f"{url}/v1/runs/{run}/steps/{step}").json()
    return found


def _flush() -> None:
    for entry in nemo_rl._REPORTERS.values():
        assert entry.reporter.flush(10.0)


def test_each_train_step_is_committed_with_its_exact_values(
    serve: Callable[..., Any], sqlite_url: str, fresh_reporters: None
) -> None:
    """Two train steps as ``grpo_train`` logs them: the rollout metrics (``train``) before
    the policy trains, the timings with ``step_finished`` after. Step 1 is committed by
    the logger; step 2 by the logger too, after a step with no logs in between."""
    service = serve(sqlite_url)
    cfg = {"reference_policy_kl_penalty": 0.02, "ratio_clip_c": 3.0}
    loss_fn = SteptallyClippedPGLossFn(cfg, url=service.url, run="nemo-x")
    logger = SteptallyLogger(loss_fn)
    shares: dict[int, list[float]] = {}
    expected: dict[int, dict[str, Any]] = {}
    for step, seed in ((1, 5), (2, 6)):
        logger.log_metrics({"reward": 0.5}, step, prefix="train")
        microbatches = _microbatches(seed)
        for mb in microbatches:
            data = nemo_data(mb)
            _, metrics = loss_fn(
                mb.curr_logprobs, data, mb.global_valid_seqs, mb.global_valid_tokens
            )
            shares.setdefault(step, []).append(metrics["probs_ratio"])
        spec = loss_fn.loss.metric_spec()
        host = [fragments_to_host(loss_fn.loss(mb)[1]) for mb in microbatches]
        expected[step] = {k: r.value for k, r in combine(spec, host).items()}
        logger.log_metrics({"t": 1.0}, step, prefix="timing/train", step_finished=True)
        assert loss_fn.steptally_step == step + 1
    _flush()
    for step in (1, 2):
        served = _served(service.url, "nemo-x", step)
        assert served["status"] == "complete"
        values = {name: m["value"] for name, m in served["metrics"].items()}
        assert values == {k: v for k, v in expected[step].items() if k in values}
        assert values["probs_ratio"] == expected[step]["probs_ratio"]
        # NeMo-RL's own reading, the sum of the shares, divides by every masked token,
        # the filtered ones included: not the mean over the retained ones
        assert values["actor_tokens"] < values["valid_tokens"]
        assert abs(sum(shares[step]) - values["probs_ratio"]) > 1e-6


def test_without_the_logger_commit_a_step_is_committed_when_the_next_begins(
    serve: Callable[..., Any], sqlite_url: str, fresh_reporters: None
) -> None:
    service = serve(sqlite_url)
    loss_fn = SteptallyClippedPGLossFn({}, url=service.url, run="nemo-deferred")
    for step in (1, 2):
        loss_fn.steptally_step = step
        for mb in _microbatches(step):
            loss_fn(mb.curr_logprobs, nemo_data(mb), mb.global_valid_seqs, mb.global_valid_tokens)
    _flush()
    assert _served(service.url, "nemo-deferred", 1)["status"] == "complete"
    assert _served(service.url, "nemo-deferred", 2)["status"] != "complete"
    nemo_rl.commit_in_process(None, 2)  # what SteptallyLogger runs in each worker
    _flush()
    assert _served(service.url, "nemo-deferred", 2)["status"] == "complete"


def test_no_url_reports_nothing_and_no_step_says_so_once(
    caplog: pytest.LogCaptureFixture, fresh_reporters: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STEPTALLY_URL", raising=False)
    mb = _microbatches(1)[0]
    args = (mb.curr_logprobs, nemo_data(mb), mb.global_valid_seqs, mb.global_valid_tokens)
    SteptallyClippedPGLossFn({})(*args)
    assert nemo_rl._REPORTERS == {}
    unstepped = SteptallyClippedPGLossFn({}, url="http://127.0.0.1:9")
    with caplog.at_level("WARNING", logger="steptally.integrations.nemo_rl"):
        unstepped(*args)
        unstepped(*args)
    assert [r.message for r in caplog.records].count(
        "steptally: no step is set (add SteptallyLogger to the logger); nothing is reported"
    ) == 1
    assert nemo_rl._REPORTERS == {}


def test_the_loss_function_pickles_without_its_reporter(
    serve: Callable[..., Any], sqlite_url: str, fresh_reporters: None
) -> None:
    """NeMo-RL sends the loss function to its workers with every train call."""
    import pickle

    service = serve(sqlite_url)
    loss_fn = SteptallyClippedPGLossFn({}, url=service.url, run="nemo-pickle")
    loss_fn.steptally_step = 4
    mb = _microbatches(2)[0]
    loss_fn(mb.curr_logprobs, nemo_data(mb), mb.global_valid_seqs, mb.global_valid_tokens)
    copy = pickle.loads(pickle.dumps(loss_fn))
    assert copy.steptally_step == 4 and copy.url == service.url
    assert isinstance(copy.config, ClippedPGConfig)


def test_the_example_reports_every_step_and_prints_both_readings(
    serve: Callable[..., Any], sqlite_url: str
) -> None:
    import subprocess
    import sys
    from pathlib import Path

    service = serve(sqlite_url)
    example = Path(__file__).parents[2] / "examples" / "nemo_rl_grpo_loss.py"
    done = subprocess.run(
        [sys.executable, str(example), "--steps", "3", "--run", "nemo-example"],
        env={**os.environ, "STEPTALLY_URL": service.url},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line[:4].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    for step, row in zip((1, 2, 3), rows, strict=True):
        served = _served(service.url, "nemo-example", step)
        assert served["status"] == "complete"
        exact = served["metrics"]["probs_ratio"]["value"]
        assert float(row[2]) == round(exact, 6)
        assert float(row[1]) != float(row[2])  # NeMo-RL's reading is not the exact one
