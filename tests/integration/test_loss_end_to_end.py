"""Loss → reporter → service → REST: the exact global means, end to end.

Three ranks with uneven microbatches (one of them with an empty actor mask) compute the
clipped policy-gradient loss; each rank's reporter posts the raw device fragments (the
neutral ±inf extrema of the empty mask included) to a real ``steptally serve``. The
step's REST values must equal, bit for bit, the exact algebra over the host values, and
the diagnostics must be the single-pass global means over every token of the step.
The same batch posted whole and in a random layout of ranks and microbatches gives the
same bits for every value.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch")

from steptally.client.algebra import combine  # noqa: E402
from steptally.client.loss import ClippedPGConfig, ClippedPGLoss, fragments_to_host  # noqa: E402
from steptally.client.loss.names import Diagnostic as D  # noqa: E402
from steptally.client.loss.names import Fragment as F  # noqa: E402
from steptally.client.loss.synthetic import (  # noqa: E402
    random_layout,
    synthetic_microbatch,
    synthetic_step,
    with_global_normalisers,
)
from steptally.client.loss.terms import compute_terms  # noqa: E402
from steptally.client.reporter import Reporter  # noqa: E402
from steptally.client.wire import encode_number  # noqa: E402

pytestmark = pytest.mark.torch
CONFIG = ClippedPGConfig(positive_example_nll_weight=0.1)


def _ranks() -> list[list[Any]]:
    ranks = synthetic_step(21, (3, 1, 2), sequences=5, max_len=40)
    first = ranks[1][0]
    filtered = torch.full_like(first.curr_logprobs, -math.inf)  # every token filtered
    ranks[1].append(replace(first, curr_logprobs=filtered.requires_grad_()))
    flat = iter(with_global_normalisers([b for rank in ranks for b in rank]))
    return [[next(flat) for _ in rank] for rank in ranks]


def test_loss_fragments_through_the_service_are_the_exact_global_means(
    db_url: str, serve: Callable[..., Any], tmp_path: Path
) -> None:
    service = serve(db_url)
    loss_fn = ClippedPGLoss(CONFIG)
    ranks = _ranks()
    host_fragments = []
    for rank, batches in enumerate(ranks):
        with Reporter(
            service.url,
            run="loss-e2e",
            spec=loss_fn.metric_spec(),
            rank=rank,
            world_size=len(ranks),
            spool_dir=tmp_path / f"spool{rank}",
        ) as reporter:
            for batch in batches:
                _, fragments = loss_fn(batch)
                reporter.log(7, fragments)  # raw device values, the empty mask's ±inf too
                host_fragments.append(fragments_to_host(fragments))
            reporter.commit(7)
            assert reporter.flush(30)
            assert reporter.stats().rejected == 0
    step = httpx.get(f"{service.url}/v1/runs/loss-e2e/steps/7").json()
    assert step["status"] == "complete"
    assert step["fragments"] == {"received": 7, "expected": 7}

    reference = combine(loss_fn.metric_spec(), host_fragments)
    # value, kind, number of values and of non-finite values: the empty mask's neutral
    # ±inf extrema are skipped by the guards, exactly as the host-side omission does
    assert step["metrics"] == {
        name: {**r.to_json(), "value": None if r.value is None else encode_number(r.value)}
        for name, r in reference.items()
    }
    served = {name: m["value"] for name, m in step["metrics"].items()}

    # the single-pass global computation over every token of the step
    weighted, retained, tokens = [], [], 0.0
    for batch in (b for rank in ranks for b in rank):
        terms = compute_terms(CONFIG, batch)
        actor = terms.masks.actor
        ratio = terms.ratios.ratio.detach().double()[actor]
        weight = batch.sample_mask.double()[:, None].expand_as(actor)[actor]
        weighted += (ratio * weight).tolist()
        retained += ratio.tolist()
        tokens += float(weight.sum())
    assert served[F.ACTOR_TOKENS] == tokens
    assert served[D.PROBS_RATIO] == pytest.approx(math.fsum(weighted) / tokens, rel=1e-14)
    assert served[F.PROBS_RATIO_MAX] == max(retained)
    assert served[F.PROBS_RATIO_MIN] == min(retained)
    assert served[F.FILTERED_CURR_TOKENS] >= 40  # the fully filtered microbatch is counted


def _post(url: str, run: str, loss_fn: ClippedPGLoss, ranks: list[list[Any]], spool: Path) -> Any:
    for rank, batches in enumerate(ranks):
        with Reporter(
            url,
            run=run,
            spec=loss_fn.metric_spec(),
            rank=rank,
            world_size=len(ranks),
            spool_dir=spool / f"{run}-{rank}",
        ) as reporter:
            for batch in batches:
                reporter.log(0, loss_fn(batch)[1])
            reporter.commit(0)
            assert reporter.flush(30)
            assert reporter.stats().rejected == 0
    step = httpx.get(f"{url}/v1/runs/{run}/steps/0").json()
    assert step["status"] == "complete"
    return {name: (m["value"], m["reason"]) for name, m in step["metrics"].items()}


def test_a_random_layout_through_the_service_gives_the_whole_batch_bits(
    db_url: str, serve: Callable[..., Any], tmp_path: Path
) -> None:
    service = serve(db_url)
    config = ClippedPGConfig(positive_example_nll_weight=0.1, sequence_level_importance_ratios=True,
                             token_level_loss=False)  # fmt: skip
    loss_fn = ClippedPGLoss(config)
    batch = synthetic_microbatch(5, 12, 48, curr_filtered=0.1, prev_filtered=0.1)
    floats = {"curr_logprobs", "prev_logprobs", "generation_logprobs", "reference_logprobs"}
    batch = replace(batch, **{n: getattr(batch, n).detach().double() for n in floats})
    layout = random_layout(batch, random.Random(5))
    assert sum(map(len, layout)) > 3
    whole = _post(service.url, "whole", loss_fn, [[batch]], tmp_path)
    split = _post(service.url, "split", loss_fn, layout, tmp_path)
    assert split == whole  # JSON floats: the same shortest repr is the same float64
    assert whole[D.PROBS_RATIO][0] is not None
