"""Every setting is exercised; invalid combinations raise at construction, naming them."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from steptally.client.loss import (  # noqa: E402
    ClippedPGConfig,
    ClippedPGLoss,
    ConfigError,
    InputError,
    fragments_to_host,
)
from steptally.client.loss.names import Diagnostic as D  # noqa: E402
from steptally.client.loss.names import Fragment as F  # noqa: E402
from steptally.client.loss.spec import fragment_kinds  # noqa: E402
from steptally.client.loss.synthetic import synthetic_microbatch  # noqa: E402

pytestmark = pytest.mark.torch

TIS = {"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 1.05}
SETTINGS = {
    "clip": {"ratio_clip_min": 0.1, "ratio_clip_max": 0.3},
    "dual_clip": {"ratio_clip_c": 3.0},
    "kl_k1": {"reference_policy_kl_type": "k1"},
    "kl_k2_no_clamps": {
        "reference_policy_kl_type": "k2",
        "kl_input_clamp_value": None,
        "kl_output_clamp_value": None,
    },
    "kl_on_policy": {"use_on_policy_kl_approximation": True},
    "no_kl": {"reference_policy_kl_penalty": 0.0},
    "sequence_level": {"token_level_loss": False},
    "reinforce": {"disable_ppo_ratio": True},
    "cispo": {"use_cispo": True},
    "gspo": {"sequence_level_importance_ratios": True, "token_level_loss": False},
    "is_plain": {"use_importance_sampling_correction": True},
    "tis": {**TIS, "truncated_importance_sampling_type": "tis"},
    "icepop": {
        **TIS,
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio_min": 0.95,
    },
    "seq_mask_tis": {
        **TIS,
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio_min": 0.95,
    },
    "force_on_policy": {"force_on_policy_ratio": True},
    "nll": {"positive_example_nll_weight": 0.2},
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_setting_runs_and_matches_its_spec(name):
    config = ClippedPGConfig(**SETTINGS[name])
    loss_fn = ClippedPGLoss(config)
    batch = synthetic_microbatch(11, sequences=5, max_len=32)
    loss, frags = loss_fn(batch)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert set(frags) == set(loss_fn.metric_spec().metrics) == set(fragment_kinds(config))
    host = fragments_to_host(frags, rounded=True)
    assert all(math.isfinite(v) for v in host.values())
    if config.truncated_importance_sampling_type is not None:
        assert F.IS_OOB_NUM in host


def test_settings_change_the_values():
    batch = synthetic_microbatch(12, sequences=5, max_len=32)
    seen = {}
    for name, settings in SETTINGS.items():
        _, frags = ClippedPGLoss(ClippedPGConfig(**settings))(batch)
        seen[name] = fragments_to_host(frags, rounded=True)[F.ACTOR_LOSS_NUM]
    base = fragments_to_host(ClippedPGLoss()(batch)[1], rounded=True)[F.ACTOR_LOSS_NUM]
    changed = {n for n, v in seen.items() if v != base}
    assert changed >= {
        "clip",
        "sequence_level",
        "reinforce",
        "cispo",
        "gspo",
        "is_plain",
        "tis",
        "icepop",
        "seq_mask_tis",
        "force_on_policy",
    }


def test_tis_bounds_hold():
    batch = synthetic_microbatch(13, sequences=6, max_len=48)
    config = ClippedPGConfig(**SETTINGS["tis"])
    from steptally.client.loss.terms import compute_terms

    w = compute_terms(config, batch).importance.value
    assert float(w.max()) <= 1.05 and float(w.min()) >= 0.0


INVALID = [
    (
        {"use_cispo": True, "disable_ppo_ratio": True},
        "use_cispo cannot be combined with disable_ppo_ratio",
    ),
    ({"use_cispo": True, "force_on_policy_ratio": True}, "force_on_policy_ratio"),
    ({"use_cispo": True, "ratio_clip_c": 3.0}, "ratio_clip_c"),
    ({"use_cispo": True, "token_level_loss": False}, "use_cispo needs a token-level loss"),
    (
        {"use_cispo": True, "sequence_level_importance_ratios": True, "token_level_loss": False},
        "sequence_level_importance_ratios",
    ),
    ({"sequence_level_importance_ratios": True}, "needs a sequence-level loss"),
    (
        {"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0},
        "needs use_importance_sampling_correction=True",
    ),
    (
        {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "tis"},
        "truncated_importance_sampling_ratio (the upper bound)",
    ),
    ({**TIS, "truncated_importance_sampling_type": "icepop"}, "ratio_min (the lower bound)"),
    ({**TIS, "truncated_importance_sampling_type": "seq-mask-tis"}, "ratio_min"),
    (
        {
            **TIS,
            "truncated_importance_sampling_type": "seq-mask-tis",
            "truncated_importance_sampling_ratio_min": 0.9,
            "sequence_level_importance_ratios": True,
            "token_level_loss": False,
        },
        "'seq-mask-tis' cannot be combined",
    ),
    ({**TIS, "truncated_importance_sampling_type": "bogus"}, "must be one of"),
    ({"reference_policy_kl_type": "k4"}, "reference_policy_kl_type"),
    ({"ratio_clip_c": 1.0}, "ratio_clip_c (dual clip) must be"),
    ({"reference_policy_kl_penalty": -1.0}, "reference_policy_kl_penalty must be"),
]


@pytest.mark.parametrize(("settings", "message"), INVALID)
def test_invalid_combinations_raise(settings, message):
    with pytest.raises(ConfigError) as info:
        ClippedPGConfig(**settings)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_missing_inputs_raise():
    from dataclasses import replace

    batch = synthetic_microbatch(1)
    with pytest.raises(InputError, match="curr_logprobs_unfiltered"):
        ClippedPGLoss()(replace(batch, curr_logprobs_unfiltered=None))
    with pytest.raises(InputError, match="rewards"):
        ClippedPGLoss(ClippedPGConfig(positive_example_nll_weight=1.0))(
            replace(batch, rewards=None)
        )
    with pytest.raises(InputError, match="advantages has shape"):
        ClippedPGLoss()(replace(batch, advantages=batch.advantages[:, :3]))


def test_spec_loss_expression_uses_the_weights():
    spec = ClippedPGLoss(ClippedPGConfig(positive_example_nll_weight=0.25)).metric_spec()
    assert spec.derived[D.LOSS] == "actor_loss + 0.01 * kl_penalty + 0.25 * positive_nll_loss"
    assert spec.derived[D.PROBS_RATIO] == "probs_ratio_num / actor_tokens"
    gspo = ClippedPGLoss(ClippedPGConfig(**SETTINGS["gspo"])).metric_spec()
    assert gspo.derived[D.SAMPLING_IMPORTANCE_RATIO].endswith("/ valid_seqs")
    assert gspo.derived[D.ACTOR_LOSS] == "actor_loss_num / valid_seqs"
