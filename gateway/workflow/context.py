"""What a request says about its workflow, stage and session (headers first, body fields as fallback)."""

from __future__ import annotations

from typing import Literal

import msgspec
from multidict import CIMultiDictProxy

from gateway.core.contexts import context_key
from gateway.core.errors import bad_request
from gateway.core.requests import InferenceRequest

CachePolicy = Literal["auto", "preserve", "flush"]


class WorkflowContext(msgspec.Struct):
    workflow_id: str | None = None
    stage_id: str | None = None
    cache_policy: CachePolicy = "auto"
    preserve_threshold: int | None = None
    complete: bool = False
    session_id: str | None = None


def _first(headers: CIMultiDictProxy[str], *names: str) -> str | None:
    for name in names:
        value = headers.get(name)
        if value:
            return value.strip()
    return None


def _workflow_id(headers: CIMultiDictProxy[str], body: InferenceRequest) -> str | None:
    meta = body.metadata
    return _first(headers, "x-workflow-id", "x-orla-workflow-run") or (meta.workflow_id if meta else None)


def _session_id(headers: CIMultiDictProxy[str], body: InferenceRequest) -> str | None:
    meta = body.metadata
    return (_first(headers, "x-session-id") or body.prompt_cache_key or body.user
            or (meta.user_id if meta else None))


def context_key_of(headers: CIMultiDictProxy[str], body: InferenceRequest) -> str | None:
    """The workflow or session a request continues, for placement (read even with workflow actions off;
    never an error: a bad cache-policy header is the workflow service's to refuse)."""
    return context_key(_workflow_id(headers, body), _session_id(headers, body))


def parse_workflow_context(headers: CIMultiDictProxy[str], body: InferenceRequest) -> WorkflowContext:
    meta = body.metadata
    workflow = _workflow_id(headers, body)
    stage = _first(headers, "x-stage-id", "x-orla-stage") or (meta.stage_id if meta else None)
    policy = (headers.get("x-stage-cache-policy") or "auto").strip().lower()
    if policy not in ("auto", "preserve", "flush"):
        raise bad_request("x-stage-cache-policy must be auto, preserve or flush.", param="x-stage-cache-policy")
    threshold = headers.get("x-stage-preserve-threshold")
    try:
        preserve_threshold = int(threshold) if threshold else None
    except ValueError:
        raise bad_request("x-stage-preserve-threshold must be a number of tokens.",
                          param="x-stage-preserve-threshold") from None
    if preserve_threshold is not None and preserve_threshold < 0:
        raise bad_request("x-stage-preserve-threshold must not be negative.", param="x-stage-preserve-threshold")
    session = _session_id(headers, body)
    return WorkflowContext(
        workflow_id=workflow, stage_id=stage, cache_policy=policy,  # type: ignore[arg-type]
        preserve_threshold=preserve_threshold,
        complete=(headers.get("x-workflow-complete") or "").strip().lower() == "true",
        session_id=session,
    )
