"""The verl plugin against verl itself: its entry point, its own ``ppo_loss`` on uneven
micro-batches, its config, and a real service.

A step's batch is built as verl's actor update holds it (left-padded prompts,
right-padded responses, brought to verl's no-padding layout by verl's own
``left_right_2_no_padding``, cut into micro-batches by verl's ``chunk_tensordict``), and
each micro-batch goes through verl's ``ppo_loss`` with and without the plugin. The loss
and gradient must be bit-identical; the served step values the exact token-weighted
means over the whole step, computed here from verl's own per-token definitions in
rational arithmetic; verl's own reading (``Metric.aggregate_dp`` of its per-micro-batch
values) the mean of means, which differs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from fractions import Fraction
from functools import partial
from importlib.metadata import entry_points
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch")
verl = pytest.importorskip("verl")

from support.verl_batches import (  # noqa: E402
    LossWorker,
    TinyPolicy,
    micro_batches,
    step_data,
)
from verl import DataProto  # noqa: E402
from verl.trainer.ppo.core_algos import kl_penalty  # noqa: E402
from verl.trainer.ppo.v1 import get_trainer_cls  # noqa: E402
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.utils.debug.metrics import calculate_debug_metrics  # noqa: E402
from verl.utils.metric.utils import Metric  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402
from verl_ppo_steps import verl_config as _config  # noqa: E402

from steptally.integrations import verl as plugin  # noqa: E402

F32 = torch.float32


def _exact_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    kept = values[mask.bool()].to(torch.float64).tolist()
    return float(sum(map(Fraction, kept)) / len(kept))


def _reference(data: Any, model: TinyPolicy, actor: Any) -> dict[str, float]:
    """verl's per-token definitions (``compute_policy_loss_vanilla``, ``kl_penalty``)
    over the whole step at once, each mean exact."""
    with torch.no_grad():
        out = model(data["input_ids"])
        logp = no_padding_2_padding(out["log_probs"], data)
        entropy = no_padding_2_padding(out["entropy"], data)
    padded = data.select(
        "response_mask", "old_log_probs", "advantages", "ref_log_prob", "rollout_log_probs"
    ).to_padded_tensor()
    mask, adv = padded["response_mask"], padded["advantages"]
    log_ratio = torch.clamp(logp - padded["old_log_probs"], min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - actor.clip_ratio_low, 1 + actor.clip_ratio_high)
    loss3 = -adv * actor.clip_ratio_c
    kl = kl_penalty(logprob=logp, ref_logprob=padded["ref_log_prob"], kl_penalty=actor.kl_loss_type)
    return {
        "pg_clipfrac": _exact_mean(torch.gt(loss2, loss1).to(F32), mask),
        "ppo_kl": _exact_mean(-log_ratio, mask),
        "pg_clipfrac_lower": _exact_mean(
            (torch.gt(torch.maximum(loss1, loss2), loss3) & (adv < 0)).to(F32), mask
        ),
        "entropy": _exact_mean(entropy, mask),
        "kl": _exact_mean(kl, mask),
        "probs_ratio": _exact_mean(ratio, mask),
        "sampling_logp_difference_mean": _exact_mean(
            (padded["old_log_probs"] - padded["rollout_log_probs"]).abs(), mask
        ),
        "rollout_probs_diff_mean": _exact_mean(
            torch.abs(torch.exp(padded["old_log_probs"]) - torch.exp(padded["rollout_log_probs"])),
            mask,
        ),
        "completion_tokens": float(mask.sum()),
    }


def _wrapped(monkeypatch: pytest.MonkeyPatch, url: str) -> plugin.SteptallyPPOLoss:
    """verl's ppo_loss under the default test config, wrapped as the trainer wraps it."""
    monkeypatch.setenv("STEPTALLY_URL", url)
    config = _config()
    settings = plugin.settings_from(config)
    assert settings is not None
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    return plugin.SteptallyPPOLoss(partial(ppo_loss, config=actor), settings)


def test_the_entry_point_registers_the_steptally_trainer() -> None:
    (found,) = [e for e in entry_points(group="verl.plugins") if e.name == "steptally"]
    assert found.value == "steptally.integrations.verl"
    trainer = get_trainer_cls("steptally")
    assert issubclass(trainer, PPOTrainerSync) and trainer is not PPOTrainerSync


def test_importing_verl_alone_loads_the_plugin() -> None:
    """As in verl's task runner and its Ray workers: a fresh process that imports verl,
    and never this module, has the ``steptally`` trainer."""
    import subprocess
    import sys

    probe = (
        "import sys, verl\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls\n"
        "get_trainer_cls('steptally')\n"
        "print('steptally.integrations.verl' in sys.modules)\n"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "auto"}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True"]


def test_settings_follow_verl_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPTALLY_URL", raising=False)
    assert plugin.settings_from(_config()) is None
    monkeypatch.setenv("STEPTALLY_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("STEPTALLY_RUN", "ppo/a b")
    settings = plugin.settings_from(_config("actor_rollout_ref.actor.kl_loss_type=k2"))
    assert settings is not None and settings.run == "ppo-a-b"
    c = settings.config
    assert (c.epsilon_low, c.epsilon_high, c.dual_clip, c.log_ratio_clamp) == (0.2, 0.28, 3.0, 20.0)
    assert c.reference and c.kl_estimator == "k2" and c.sampling and c.entropy and c.clip
    gspo = plugin.settings_from(_config("actor_rollout_ref.actor.policy_loss.loss_mode=gspo"))
    assert gspo is not None and not gspo.config.clip and gspo.config.dual_clip is None
    with pytest.raises(ValueError, match="kl_loss_type 'full'"):
        plugin.settings_from(_config("actor_rollout_ref.actor.kl_loss_type=full"))


@pytest.fixture
def service(serve: Callable[..., Any], tmp_path: Any) -> Any:
    return serve(f"sqlite:///{tmp_path}/steptally.db")


@pytest.fixture
def losses() -> Iterator[list[plugin.SteptallyPPOLoss]]:
    made: list[plugin.SteptallyPPOLoss] = []
    yield made
    for loss in made:
        if loss.reporter is not None:
            loss.reporter.close(10.0)


def test_verl_ppo_loss_reports_the_exact_step_while_verl_reads_a_mean_of_means(
    service: Any, monkeypatch: pytest.MonkeyPatch, losses: list[plugin.SteptallyPPOLoss]
) -> None:
    config = _config()
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    monkeypatch.setenv("STEPTALLY_URL", service.url)
    monkeypatch.setenv("STEPTALLY_RUN", "verl-x")
    settings = plugin.settings_from(config)
    assert settings is not None
    wrapped = plugin.SteptallyPPOLoss(partial(ppo_loss, config=actor), settings)
    losses.append(wrapped)
    plain = partial(ppo_loss, config=omega_conf_to_dataclass(config.actor_rollout_ref.actor))

    model = TinyPolicy()
    data = step_data(11, model)
    verl_metrics: dict[str, Metric] = {}
    tokens = []
    for mb in micro_batches(data):
        tokens.append(int(mb["response_mask"].sum()))
        grads = []
        for loss_fn in (plain, wrapped):
            model.zero_grad()
            loss, metrics = loss_fn(model_output=model(mb["input_ids"]), data=mb, dp_group=None)
            loss.backward()
            grads.append((loss.detach(), model.w.grad.clone(), model.b.grad.clone()))
            if loss_fn is plain:
                for name, m in metrics.items():
                    if isinstance(m, Metric):
                        verl_metrics.setdefault(name, Metric(m.aggregation)).extend(m)
        assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))  # untouched
    assert len(set(tokens)) > 1  # uneven micro-batches
    assert plugin.commit_in_process(None, 1) >= 1
    assert wrapped.reporter is not None and wrapped.reporter.flush(10.0)

    step = httpx.get(f"{service.url}/v1/runs/verl-x/steps/1").json()
    assert step["status"] == "complete"
    served = {name: m["value"] for name, m in step["metrics"].items()}
    reference = _reference(data, model, actor)
    assert {name: served[name] for name in reference} == reference  # bit-exact
    assert reference["pg_clipfrac"] > 0 and reference["pg_clipfrac_lower"] > 0
    assert served["probs_ratio_max"] == torch.exp(torch.tensor(20.0)).item()
    # verl's own rollout mismatch, one float32 pass over the whole batch on the driver
    padded = data.select("response_mask", "old_log_probs", "rollout_log_probs", "responses")
    debug = calculate_debug_metrics(DataProto(batch=padded.to_padded_tensor()))
    for name in ("rollout_probs_diff_mean", "rollout_probs_diff_max"):
        assert served[name] == pytest.approx(float(debug[f"training/{name}"]), rel=1e-5)
    # verl's own reading is the unweighted mean of the micro-batch means, which is not
    # the step's token-weighted mean
    per_micro_batch = [_reference(mb, model, actor) for mb in micro_batches(data)]
    for name in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        verl_reading = Metric.aggregate_dp([verl_metrics[f"actor/{name}"]])
        mean_of_means = sum(r[name] for r in per_micro_batch) / len(per_micro_batch)
        assert verl_reading == pytest.approx(mean_of_means, rel=1e-5, abs=1e-7), name
        assert verl_reading != served[name], name
    assert abs(Metric.aggregate_dp([verl_metrics["actor/ppo_kl"]]) - served["ppo_kl"]) > 1e-4


def test_forwards_outside_the_actor_update_are_not_reported(
    service: Any, monkeypatch: pytest.MonkeyPatch, losses: list[plugin.SteptallyPPOLoss]
) -> None:
    wrapped = _wrapped(monkeypatch, service.url)
    losses.append(wrapped)
    model = TinyPolicy()
    data = step_data(3, model)
    tu.pop(data, key=plugin.STEP_KEY)  # as verl's other forwards carry no step
    mb = micro_batches(data)[0]
    wrapped(model_output=model(mb["input_ids"]), data=mb)
    assert wrapped.reporter is None and not wrapped.off


def test_a_reporting_failure_never_reaches_training(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrapped = _wrapped(monkeypatch, "http://127.0.0.1:9")
    model = TinyPolicy()
    data = step_data(5, model)
    mb = micro_batches(data)[0]
    broken = mb.clone()
    del broken["rollout_log_probs"]  # the config says the rollout computes them
    with caplog.at_level("ERROR", logger="steptally.integrations.verl"):
        loss, _ = wrapped(model_output=model(broken["input_ids"]), data=broken)
    assert torch.isfinite(loss) and wrapped.off
    assert "reporting stopped; training goes on" in caplog.text


def test_model_parallel_runs_say_so_and_report_nothing(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrapped = _wrapped(monkeypatch, "http://127.0.0.1:9")
    model = TinyPolicy()
    data = step_data(5, model)
    tu.assign_non_tensor(data, dp_size=2)  # two data-parallel ranks, but one process
    mb = micro_batches(data)[0]
    with caplog.at_level("WARNING", logger="steptally.integrations.verl"):
        wrapped(model_output=model(mb["input_ids"]), data=mb)
    assert wrapped.off and wrapped.reporter is None
    assert "is not the world size" in caplog.text


def test_the_loss_travels_to_workers_without_its_reporter() -> None:
    import pickle

    settings = plugin.Settings(
        url="http://127.0.0.1:9", run="r", config=plugin.diagnostics_config({})
    )
    wrapped = plugin.SteptallyPPOLoss(partial(ppo_loss, config=None), settings)
    copy = pickle.loads(pickle.dumps(wrapped))
    assert copy.settings == settings and copy.reporter is None and copy in plugin._LIVE


def test_the_driver_commits_the_step_in_each_ray_worker(
    service: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the trainer does after the actor update: the loss sent to a Ray worker actor
    (verl's ``set_loss_fn`` pickles it there), micro-batches reported in that worker,
    and ``commit_workers`` running the commit in it through ``__ray_call__``."""
    ray = pytest.importorskip("ray")
    config = _config()
    monkeypatch.setenv("STEPTALLY_URL", service.url)
    monkeypatch.setenv("STEPTALLY_RUN", "verl-ray")
    settings = plugin.settings_from(config)
    assert settings is not None
    actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    loss = plugin.SteptallyPPOLoss(partial(ppo_loss, config=actor_config), settings)

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    examples = os.path.join(os.path.dirname(tests), "examples")
    path = os.pathsep.join([tests, examples, os.environ.get("PYTHONPATH", "")])
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    try:
        worker = ray.remote(num_cpus=0)(LossWorker).remote()
        ray.get(worker.set_loss_fn.remote(loss))
        assert ray.get(worker.train.remote(7)) == 3
        group = type("WorkerGroup", (), {"workers": [worker]})()
        assert plugin.commit_workers(group, 1) == [1]
        assert ray.get(worker.flush.remote())
    finally:
        ray.shutdown()
    step = httpx.get(f"{service.url}/v1/runs/verl-ray/steps/1").json()
    assert step["status"] == "complete"
    assert step["fragments"]["received"] == 3


def test_the_example_reports_every_step_and_prints_both_readings(service: Any) -> None:
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "STEPTALLY_URL": service.url}
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "examples", "verl_ppo_steps.py"),
            "--steps",
            "3",
            "--run",
            "verl-example",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line[:4].strip().isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    for step in (1, 2, 3):
        served = httpx.get(f"{service.url}/v1/runs/verl-example/steps/{step}").json()
        assert served["status"] == "complete"
        assert float(rows[step - 1][2]) == round(served["metrics"]["pg_clipfrac"]["value"], 6)


class _FakeActorGroup:
    """The actor worker group as the trainer drives it: ``set_loss_fn`` and
    ``update_actor`` (whose batch carries the step), with no worker to commit in."""

    def __init__(self) -> None:
        self.loss_fn: Any = None
        self.steps_seen: list[Any] = []
        self.workers: list[Any] = []

    def set_loss_fn(self, loss_fn: Any) -> None:
        self.loss_fn = loss_fn

    def update_actor(self, batch: Any) -> dict[str, Any]:
        self.steps_seen.append(batch.extra_info.get(plugin.STEP_KEY))
        return {"metrics": {"mfu": [0.5], "pg_loss": [1.0, 3.0]}}


def test_the_trainer_runs_as_sync_sends_the_loss_and_marks_each_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STEPTALLY_URL", "http://127.0.0.1:9")
    config = _config("trainer.use_v1=True", "trainer.v1.trainer_mode=steptally")
    trainer = get_trainer_cls(config.trainer.v1.trainer_mode)(config)
    assert trainer.trainer_mode == "sync" and type(trainer.replay_buffer).__name__ == "ReplayBuffer"
    group = _FakeActorGroup()
    trainer.actor_rollout_wg = group
    trainer.checkpoint_manager = type("Checkpoints", (), {"update_weights": lambda self, s: None})()
    trainer.global_steps = 0  # as after loading a checkpoint
    trainer.on_init_end()
    assert isinstance(group.loss_fn, plugin.SteptallyPPOLoss)
    assert group.loss_fn.loss_fn.func is ppo_loss
    assert group.loss_fn.loss_fn.keywords["config"].clip_ratio_high == 0.28
    batch = type("Batch", (), {"extra_info": {}})()
    metrics: dict[str, Any] = {}
    trainer.global_steps = 4
    trainer._update_actor(batch, metrics)
    assert group.steps_seen == [4] and plugin.STEP_KEY not in batch.extra_info
    assert metrics["actor/pg_loss"] == 2.0  # verl's own reduction, untouched

    monkeypatch.delenv("STEPTALLY_URL")
    plain = get_trainer_cls("steptally")(_config("trainer.use_v1=True"))
    group = _FakeActorGroup()
    plain.actor_rollout_wg = group
    plain.checkpoint_manager = trainer.checkpoint_manager
    plain.global_steps = 1
    plain.on_init_end()
    plain._update_actor(batch, {})
    assert group.loss_fn is None and group.steps_seen == [None]
