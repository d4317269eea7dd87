"""``POST /v1/runs/{run}/fragments``: the ingest route.

The body is read here (size limit, gzip); decoding, validation and the store's
transaction run on a worker thread (``app.state.handoff``), and the answer is sent
only after the commit.
``?partial=true`` stores what is right and lists the wrong items in ``rejected``.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from steptally.service.api.body import decode_content, inflated_size, read_limited
from steptally.service.api.deps import RunName, ServiceDep, SettingsDep
from steptally.service.api.handoff import Handoff
from steptally.service.api.limits import BodyBudget
from steptally.service.api.schemas import IngestAnswer, JsonResponse, errors

router = APIRouter(prefix="/v1/runs", tags=["fragments"])


@router.post(
    "/{run}/fragments",
    response_model=IngestAnswer,
    responses=errors(400, 404, 409, 413, 415, 422, 503),
)
async def post_fragments(
    run: RunName,
    request: Request,
    service: ServiceDep,
    settings: SettingsDep,
    partial: bool = False,
) -> JsonResponse:
    arrived = time.perf_counter()
    limit = settings.max_body_bytes
    budget: BodyBudget = request.app.state.body_budget
    handoff: Handoff = request.app.state.handoff
    declared = request.headers.get("content-length", "")
    held = min(limit, int(declared)) if declared.isdigit() else limit
    await budget.acquire(held)  # the raw bytes before they are read
    try:
        raw = await read_limited(request, limit)
        encoding = request.headers.get("content-encoding")
        inflated = inflated_size(raw, encoding, limit)
        if inflated:  # let go and take raw plus inflated at once: no two wait on each other
            budget.release(held)
            held = 0
            await budget.acquire(len(raw) + inflated)
            held = len(raw) + inflated

        def handle() -> JsonResponse:
            body = decode_content(raw, encoding, limit, inflated)
            return JsonResponse(service.ingest(run, body, arrived, partial))

        return await handoff.run(handle)
    finally:
        budget.release(held)
