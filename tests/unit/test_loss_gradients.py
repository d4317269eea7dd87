"""Gradients flow only through retained tokens: exactly 0 at filtered and masked positions."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from steptally.client.loss import ClippedPGConfig, ClippedPGLoss  # noqa: E402
from steptally.client.loss.synthetic import synthetic_microbatch  # noqa: E402

pytestmark = pytest.mark.torch

ACTOR_CONFIGS = [
    ClippedPGConfig(reference_policy_kl_penalty=0.0),
    ClippedPGConfig(reference_policy_kl_penalty=0.0, use_cispo=True),
    ClippedPGConfig(reference_policy_kl_penalty=0.0, ratio_clip_c=3.0),
    ClippedPGConfig(reference_policy_kl_penalty=0.0, disable_ppo_ratio=True),
    ClippedPGConfig(
        reference_policy_kl_penalty=0.0, force_on_policy_ratio=True, positive_example_nll_weight=0.5
    ),
    ClippedPGConfig(
        reference_policy_kl_penalty=0.0,
        sequence_level_importance_ratios=True,
        token_level_loss=False,
        use_importance_sampling_correction=True,
    ),
]


def masks_of(batch, config=None):
    """(valid, filtered); under force_on_policy_ratio the previous side is the current one."""
    weight = batch.token_mask & (batch.sample_mask[:, None] > 0)
    filtered = batch.curr_logprobs.detach() == float("-inf")
    if config is None or not config.force_on_policy_ratio:
        filtered = filtered | (batch.prev_logprobs == float("-inf"))
    return weight, filtered


@pytest.mark.parametrize("config", ACTOR_CONFIGS, ids=lambda c: str(ACTOR_CONFIGS.index(c)))
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_actor_gradient_only_at_retained_tokens(config, seed):
    batch = synthetic_microbatch(
        seed, sequences=6, max_len=40, curr_filtered=0.1, prev_filtered=0.1
    )
    loss, _ = ClippedPGLoss(config)(batch)
    loss.backward()
    grad = batch.curr_logprobs.grad
    assert grad is not None and torch.isfinite(grad).all()
    valid, filtered = masks_of(batch, config)
    retained = valid & ~filtered
    assert (grad[~retained] == 0).all()
    assert (grad[retained] != 0).any()


@pytest.mark.parametrize("seed", [0, 1])
def test_kl_gradient_reaches_filtered_tokens_through_the_unfiltered_logprobs(seed):
    batch = synthetic_microbatch(seed, sequences=6, max_len=40, curr_filtered=0.2)
    loss, _ = ClippedPGLoss(ClippedPGConfig(reference_policy_kl_penalty=0.1))(batch)
    loss.backward()
    valid, _ = masks_of(batch)
    filtered = valid & (batch.curr_logprobs.detach() == float("-inf"))
    assert filtered.any()
    kl_grad = batch.curr_logprobs_unfiltered.grad
    assert (kl_grad[filtered] != 0).all()  # the KL keeps the filtered tokens
    assert (kl_grad[~valid] == 0).all()
    assert (batch.curr_logprobs.grad[filtered] == 0).all()
