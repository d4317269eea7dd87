"""The drop-in trainer reads its diagnostics' settings from TRL's own: the clip range,
the ratio cap, the importance-sampling level, β and its bias correction, vLLM's
importance sampling, and which losses clip at all."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("trl")

from steptally.integrations.trl import _run_name, diagnostics_config


def _trainer(**overrides: Any) -> Any:
    settings: dict[str, Any] = {
        "epsilon_low": 0.2,
        "epsilon_high": 0.28,
        "importance_sampling_level": "token",
        "loss_type": "dapo",
        "beta": 0.0,
        "use_vllm": False,
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "token_truncate",
    }
    args = {"delta": None, "use_bias_correction_kl": False}
    for name in list(overrides):
        if name in args:
            args[name] = overrides.pop(name)
    return SimpleNamespace(args=SimpleNamespace(**args), **{**settings, **overrides})


def test_the_defaults() -> None:
    config = diagnostics_config(_trainer())
    assert (config.epsilon_low, config.high, config.ratio_cap) == (0.2, 0.28, None)
    assert config.clip and config.entropy and not config.sequence_level
    assert not (config.reference or config.sampling or config.importance_ratio)


def test_each_setting_reaches_its_field() -> None:
    assert diagnostics_config(_trainer(delta=4.0)).ratio_cap == 4.0
    assert diagnostics_config(_trainer(importance_sampling_level="sequence")).sequence_level
    kl = diagnostics_config(_trainer(beta=0.04, use_bias_correction_kl=True))
    assert kl.reference and kl.kl_bias_correction
    assert not diagnostics_config(_trainer(use_bias_correction_kl=True)).kl_bias_correction
    for loss in ("cispo", "sapo", "vespo"):
        assert not diagnostics_config(_trainer(loss_type=loss)).clip
    for loss in ("grpo", "bnpo", "dr_grpo", "luspo"):
        assert diagnostics_config(_trainer(loss_type=loss)).clip


def test_vllm_importance_sampling() -> None:
    token = diagnostics_config(_trainer(use_vllm=True))
    assert token.sampling and token.importance_ratio and not token.importance_ratio_per_sequence
    seq = diagnostics_config(_trainer(use_vllm=True, vllm_importance_sampling_mode="sequence_mask"))
    assert seq.importance_ratio_per_sequence
    off = diagnostics_config(_trainer(use_vllm=True, vllm_importance_sampling_correction=False))
    assert not (off.sampling or off.importance_ratio)


def test_the_run_name() -> None:
    args = SimpleNamespace(run_name=None, output_dir="/tmp/out/my run!")
    assert _run_name(None, args) == "my-run"
    assert _run_name("explicit", args) == "explicit"
    assert _run_name(None, SimpleNamespace(run_name="Qwen/0.5B grpo", output_dir="x")) == (
        "Qwen-0.5B-grpo"
    )
