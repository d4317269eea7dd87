"""The drop-in ``GRPOTrainer`` on a real TRL training loop, against a real service.

A tiny randomly initialised causal LM (``support.tiny_grpo``: nothing downloaded) trains
GRPO on CPU with ``num_iterations=2``, ``beta > 0``, two accumulation microbatches per
optimizer step and completions of uneven lengths. Every step must be complete on the
service, and each metric the exact token-weighted mean computed independently from
TRL's own per-microbatch values and token counts, while TRL's logged mean of means
differs. Reporting must not change a bit of TRL's training.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("trl")
torch = pytest.importorskip("torch")

import trl  # noqa: E402
from support.served import free_port  # noqa: E402
from support.trl_recording import METRICS, WARNING_FILTERS, Recording  # noqa: E402
from tiny_lm import (  # noqa: E402
    grpo_config,
    tiny_model_dir,
    toy_dataset,
    toy_reward,
)
from transformers import PreTrainedTokenizerFast  # noqa: E402

from steptally.integrations.trl import GRPOTrainer  # noqa: E402

pytestmark = [pytest.mark.torch, *(pytest.mark.filterwarnings(f) for f in WARNING_FILTERS)]
STEPS = 4


def _trainer(cls: type[Any], model_dir: Path, out: Path, **kwargs: Any) -> Any:
    return cls(
        model=str(model_dir),
        reward_funcs=toy_reward,
        args=grpo_config(out, **{"max_steps": STEPS, **kwargs.pop("config", {})}),
        train_dataset=toy_dataset(16),
        processing_class=PreTrainedTokenizerFast.from_pretrained(str(model_dir)),
        **kwargs,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-lm"))


def _check_step(url: str, run: str, record: dict[str, Any], ranks: list[dict[str, Any]]) -> bool:
    """The served step against TRL's own values: each TRL value of a microbatch is
    already pooled over the ranks, so it weighs with the tokens of that microbatch on
    every rank. Whether the step's microbatches were uneven."""
    step = _step(url, run, record["step"])
    assert step["status"] == "complete"
    assert step["ranks_committed"] == list(range(len(ranks)))
    expected = len(ranks) * len(record["mb"])
    assert step["fragments"] == {"received": expected, "expected": expected}
    served = {name: m["value"] for name, m in step["metrics"].items()}
    tokens = [sum(r["mb"][i]["tokens"] for r in ranks) for i in range(len(record["mb"]))]
    assert served["completion_tokens"] == sum(tokens)
    for trl_name, name in METRICS.items():
        per_mb = record["values"][trl_name]
        assert len(per_mb) == len(tokens)
        weighted = math.fsum(v * n for v, n in zip(per_mb, tokens, strict=True)) / sum(tokens)
        assert served[name] == pytest.approx(weighted, rel=1e-6, abs=1e-7), name
    ratios = [x for r in ranks for mb in r["mb"] for x in mb["ratio"]]
    assert served["probs_ratio"] == pytest.approx(math.fsum(ratios) / len(ratios))
    assert served["probs_ratio_max"] == pytest.approx(max(ratios), rel=1e-6)
    assert served["probs_ratio_min"] == pytest.approx(min(ratios), rel=1e-6)
    return len(set(tokens)) > 1


def _step(url: str, run: str, step: int) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(f"{url}/v1/runs/{run}/steps/{step}").json()
    return found


def test_every_metric_is_the_exact_token_weighted_mean_of_the_step(
    db_url: str, serve: Callable[..., Any], model_dir: Path, tmp_path: Path
) -> None:
    service = serve(db_url)
    trainer = _trainer(
        Recording, model_dir, tmp_path / "out", steptally_url=service.url, steptally_run="trl-x"
    )
    trainer.train()
    assert trainer.steptally.flush(30) and trainer.steptally.stats().rejected == 0
    assert [s["step"] for s in trainer.steps] == list(range(1, STEPS + 1))
    uneven = sum(_check_step(service.url, "trl-x", record, [record]) for record in trainer.steps)
    assert uneven >= 2  # the microbatches of most steps hold different numbers of tokens
    # what TRL logs: the plain mean of the microbatch means, which differs where uneven
    logged = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    differs = [
        abs(
            logged[r["step"]]["kl"]
            - _step(service.url, "trl-x", r["step"])["metrics"]["kl"]["value"]
        )
        for r in trainer.steps
    ]
    assert max(differs) > 1e-5
    # the second iteration over a generation batch moved the policy: the ratio is not 1
    assert any(
        _step(service.url, "trl-x", s)["metrics"]["probs_ratio"]["value"] != 1.0 for s in (2, 4)
    )


def _losses(trainer: Any) -> list[tuple[float, float]]:
    return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


def test_reporting_changes_nothing_in_training(
    sqlite_url: str, serve: Callable[..., Any], model_dir: Path, tmp_path: Path
) -> None:
    service = serve(sqlite_url)
    plain = _trainer(trl.GRPOTrainer, model_dir, tmp_path / "plain")
    plain.train()
    reported = _trainer(GRPOTrainer, model_dir, tmp_path / "rep", steptally_url=service.url)
    reported.train()
    assert reported.steptally is not None and reported.steptally.run == "rep"
    assert _losses(reported) == _losses(plain)  # bit for bit
    params = zip(plain.model.parameters(), reported.model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in params)


def test_without_a_url_it_trains_as_trl_and_says_so_once(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    monkeypatch.delenv("STEPTALLY_URL", raising=False)
    with caplog.at_level(logging.WARNING, logger="steptally.integrations.trl"):
        trainer = _trainer(GRPOTrainer, model_dir, tmp_path / "off", config={"max_steps": 1})
        trainer.train()
    assert trainer.steptally is None
    said = [r.getMessage() for r in caplog.records if r.name == "steptally.integrations.trl"]
    assert said == ["steptally: reporting is off (set STEPTALLY_URL to turn it on)"]


def test_evaluation_batches_are_not_reported(
    sqlite_url: str,
    serve: Callable[..., Any],
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = serve(sqlite_url)
    monkeypatch.setenv("STEPTALLY_URL", service.url)
    monkeypatch.setenv("STEPTALLY_RUN", "trl-eval")
    trainer = _trainer(
        GRPOTrainer,
        model_dir,
        tmp_path / "eval",
        config={"max_steps": 2, "eval_strategy": "steps", "eval_steps": 1},
        eval_dataset=toy_dataset(8),
    )
    trainer.train()
    assert trainer.steptally.flush(30)
    assert any("eval_loss" in e for e in trainer.state.log_history)  # evaluation ran
    for step in (1, 2):
        found = _step(service.url, "trl-eval", step)
        assert found["status"] == "complete"
        assert found["fragments"] == {"received": 2, "expected": 2}


@pytest.mark.slow
def test_two_processes_under_torchrun_both_commit_every_step(
    sqlite_url: str, serve: Callable[..., Any], model_dir: Path, tmp_path: Path
) -> None:
    """Two CPU processes (gloo): each step has two ranks, both committed, and the values
    are the exact means over both ranks' tokens."""
    service = serve(sqlite_url)
    launch = Path(__file__).resolve().parents[1] / "support" / "trl_launch.py"
    env = {**os.environ, "STEPTALLY_URL": service.url, "STEPTALLY_RUN": "trl-2p"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(launch),
            str(model_dir),
            str(tmp_path),
            "3",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert all(r["stats"]["rejected"] == 0 and r["stats"]["sent"] == 6 for r in ranks)
    run = httpx.get(f"{service.url}/v1/runs/trl-2p").json()
    assert run["world_size"] == 2
    for i, record in enumerate(ranks[0]["steps"]):
        assert record["step"] == i + 1
        assert ranks[1]["steps"][i]["values"] == record["values"]  # TRL's pooled values
        _check_step(service.url, "trl-2p", record, [r["steps"][i] for r in ranks])


def test_the_short_last_accumulation_window_of_an_epoch_is_a_step(
    sqlite_url: str, serve: Callable[..., Any], model_dir: Path, tmp_path: Path
) -> None:
    """Three microbatches per generation and two per optimizer step: an epoch of 15
    microbatches ends with a window of one, which is a step of its own, complete."""
    service = serve(sqlite_url)
    trainer = _trainer(
        Recording,
        model_dir,
        tmp_path / "epoch",
        config={
            "max_steps": -1,
            "num_train_epochs": 1,
            "num_iterations": 1,
            "steps_per_generation": 3,
        },
        steptally_url=service.url,
        steptally_run="trl-epoch",
    )
    trainer.train()
    assert trainer.steptally.flush(30)
    assert trainer.state.global_step == 8
    assert [len(r["mb"]) for r in trainer.steps] == [2] * 7 + [1]
    for record in trainer.steps:
        _check_step(service.url, "trl-epoch", record, [record])


class Sampled(Recording):
    """As if generation came from vLLM with importance sampling on: each generation batch
    carries sampling logprobs (one NaN: a token the sampler could not score) and TRL's
    truncated token-level importance ratio built from them, as TRL 1.16 builds it."""

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        out = super()._generate_and_score_completions(inputs)
        old = out["old_per_token_logps"]
        g = torch.Generator().manual_seed(int(out["completion_ids"].sum()))
        sampling = old + 0.2 * torch.randn(old.shape, generator=g)
        sampling[0, 0] = math.nan
        diff = torch.nan_to_num((old - sampling) * out["completion_mask"], nan=0.0)
        out["sampling_per_token_logps"] = sampling
        out["importance_sampling_ratio"] = torch.exp(diff).clamp(max=2.0)
        return out

    def _compute_loss(self, model: Any, inputs: Any) -> Any:
        step = self.state.global_step + 1
        self.seen = [*getattr(self, "seen", []), (step, inputs)]  # after TRL's shuffle
        return super()._compute_loss(model, inputs)


def test_sampling_diagnostics_when_importance_sampling_is_on(
    sqlite_url: str,
    serve: Callable[..., Any],
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import steptally.integrations.trl as adapter

    service = serve(sqlite_url)
    plain = adapter.diagnostics_config

    def with_vllm_is(trainer: Any) -> Any:
        assert not plain(trainer).sampling  # no vLLM here: pretend its outputs
        return dataclasses.replace(plain(trainer), sampling=True, importance_ratio=True)

    monkeypatch.setattr(adapter, "diagnostics_config", with_vllm_is)
    trainer = _trainer(
        Sampled,
        model_dir,
        tmp_path / "is",
        config={"max_steps": 2, "num_iterations": 1, "steps_per_generation": 4},
        steptally_url=service.url,
        steptally_run="trl-is",
    )
    trainer.train()
    assert trainer.steptally.flush(30)
    for step in (1, 2):
        batches = [b for at, b in trainer.seen if at == step]
        assert len(batches) == 2

        def cat(name: str, batches: list[Any] = batches) -> Any:
            return torch.cat([b[name] for b in batches])

        m = cat("completion_mask").bool()
        old, sampling = cat("old_per_token_logps").double(), cat("sampling_per_token_logps")
        scored = m & ~torch.isnan(sampling)
        served = {k: v["value"] for k, v in _step(service.url, "trl-is", step)["metrics"].items()}
        diff = (old - sampling.double()).abs()[scored]
        assert served["sampling_logp_difference_mean"] == pytest.approx(
            math.fsum(diff.tolist()) / len(diff)
        )
        assert served["sampling_logp_difference_max"] == pytest.approx(diff.max().item())
        assert served["unscored_tokens"] == float((m & ~scored).sum())
        values = cat("importance_sampling_ratio").double()[m]
        assert served["importance_sampling_ratio_mean"] == pytest.approx(
            math.fsum(values.tolist()) / len(values)
        )
        assert served["importance_sampling_ratio_max"] == pytest.approx(values.max().item())
        assert served["importance_sampling_ratio_min"] == pytest.approx(values.min().item())
    unscored = [
        _step(service.url, "trl-is", s)["metrics"]["unscored_tokens"]["value"] for s in (1, 2)
    ]
    assert sorted(unscored) == [0.0, 1.0]  # the one NaN, in whichever step it fell


def test_the_example_runs_and_prints_both_logs(sqlite_url: str, serve: Callable[..., Any]) -> None:
    service = serve(sqlite_url)
    example = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo.py"
    done = subprocess.run(
        [sys.executable, str(example), "--steps", "2", "--run", "example-run"],
        env={**os.environ, "STEPTALLY_URL": service.url},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"watch it: {service.url}/runs/example-run" in done.stdout
    table = done.stdout[done.stdout.index("\nstep") :].strip().splitlines()
    assert table[0].split()[:3] == ["step", "kl:", "TRL"]
    assert [row.split()[0] for row in table[1:]] == ["1", "2"]
    step = _step(service.url, "example-run", 2)
    assert step["status"] == "complete"
    assert float(table[2].split()[2]) == pytest.approx(step["metrics"]["kl"]["value"], abs=1e-6)


def test_a_failure_in_the_reporting_stops_it_and_never_the_training(
    sqlite_url: str, serve: Callable[..., Any], model_dir: Path, tmp_path: Path, caplog: Any
) -> None:
    service = serve(sqlite_url)
    trainer = _trainer(
        GRPOTrainer,
        model_dir,
        tmp_path / "fail",
        steptally_url=service.url,
        steptally_run="trl-fail",
        config={"max_steps": 3},
    )
    real, reporter = trainer.steptally_diagnostics, trainer.steptally
    calls = []

    class Broken:
        config = real.config

        def __call__(self, **tensors: Any) -> Any:
            calls.append(1)
            if len(calls) == 3:  # the first microbatch of step 2
                raise RuntimeError("a broken diagnostic")
            return real(**tensors)

    trainer.steptally_diagnostics = Broken()
    with caplog.at_level(logging.ERROR, logger="steptally.integrations.trl"):
        trainer.train()
    assert trainer.state.global_step == 3 and trainer.steptally is None
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert said == ["steptally: reporting stopped; training goes on"]
    assert len(calls) == 3  # nothing tried after the failure
    assert reporter.flush(30)  # what was logged before it is still delivered
    assert _step(service.url, "trl-fail", 1)["status"] == "complete"
    assert _step(service.url, "trl-fail", 2).get("status") != "complete"  # missing, not wrong
    reporter.close()
