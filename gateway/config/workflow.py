"""What agents keep: workflows and sessions, keep-warm, and the Responses API's stored responses."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta


class KeepWarmConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Refreshing thinking contexts that the pod's LRU would evict before they come back
    (``gateway/workflow/keep_warm.py``): a prompt-only request over the context's cached blocks, one token
    computed, puts them at the most recently used end of the pod's free queue."""

    enabled: bool = True
    # At most this many refreshes per request routed to the pod (a budget that refills as requests come).
    max_share: Annotated[float, Meta(ge=0)] = 0.5
    # Refresh only while the pod has at most this many of the gateway's requests in flight (and none
    # waiting inside it, by its metrics). 0: only idle pods, right where a refresh's engine step delays
    # what arrives meanwhile (CPU pods, small models); a GPU batching hundreds of requests takes one more
    # token at no cost, and may take refreshes beside them.
    max_in_flight: Annotated[int, Meta(ge=0)] = 0
    # A refresh must be worth at least this many prompt tokens (a miss's re-prefill, times the chance the
    # context comes back).
    min_tokens: Annotated[int, Meta(ge=0)] = 256
    # How often each pod is looked at, and how far ahead: a context whose blocks the pod would evict within
    # ``lead_s`` (at the rate it takes new blocks), before the context is due back, is refreshed.
    interval_s: Annotated[float, Meta(gt=0)] = 0.1
    lead_s: Annotated[float, Meta(ge=0)] = 0.6
    # Of a pod's free blocks, the share that thinking contexts may be kept in; the rest takes the pod's new
    # blocks, so that refreshes never merely turn over what the pod cannot hold anyway.
    capacity_share: Annotated[float, Meta(gt=0, le=1)] = 0.8
    # Token ids kept to build refreshes (4 bytes each): past it, the prompts kept least recently go.
    max_prompt_tokens: int = 16_000_000


class WorkflowConfig(msgspec.Struct, forbid_unknown_fields=True):
    enabled: bool = True
    # A stage whose prompt grew by at most this many tokens stays on the pod holding the workflow's cache.
    preserve_threshold_tokens: int = 256
    idle_ttl_s: float = 600.0
    # Hard flushes go through the pod's cache controller (auto: by the pod's flavor; none: soft only).
    controller: str = "auto"
    # Also reset the engine's whole cache when a workflow completes, changes model or leaves a preserved
    # pod (once nothing else is resumable there). Off: it never measured a gain, and it drops the shared
    # prompts the next workflows would reuse. A stage that asks for a flush (x-stage-cache-policy: flush)
    # is flushed hard either way.
    hard_flush: bool = False
    # A hard flush the engine refuses (requests running there) is sent again this many times, the wait
    # doubling from flush_retry_base_s; the wait for other workflows to leave the pod counts no try.
    flush_retries: int = 5
    flush_retry_base_s: float = 0.5
    # Requests without a workflow but with a session key (x-session-id, prompt_cache_key, user) stick to
    # the pod that served the session last.
    session_affinity: bool = True
    max_sessions: int = 100_000
    # Headers that name a session besides the built-in ones (x-session-id, the agent tools' own: see
    # docs/workflows.md, "What a request belongs to"), read after them; the value is the session, matched exactly.
    session_headers: list[str] = []
    keep_warm: KeepWarmConfig = msgspec.field(default_factory=KeepWarmConfig)


class ResponsesConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The Responses API's state: what ``previous_response_id`` continues and ``GET /v1/responses/{id}``
    returns. ``gateway``: the gateway keeps each response (its input and output), pods stay stateless, and
    any worker or replica continues a conversation (in this process's memory; in Redis when
    ``shared_state.redis_url`` is set). ``pods``: the pod that answered keeps it (vLLM with
    ``VLLM_ENABLE_RESPONSES_API_STORE=1``) and gets the conversation's follow-ups, GETs and cancels."""

    store: Literal["gateway", "pods"] = "gateway"
    # In all: per process in memory, per Redis in Redis. Past it, the key holding the most loses its least
    # recently stored (in memory: used) response, so that one key's flood never evicts another's few.
    max_responses: Annotated[int, Meta(ge=1)] = 10_000
    # Per API key (with keys on), in memory and in Redis alike: past it, the key's own oldest goes.
    max_responses_per_key: Annotated[int, Meta(ge=1)] = 1_000
    # In memory only (Redis holds its own bound: its maxmemory).
    max_bytes: Annotated[int, Meta(ge=1)] = 256 * 1024 * 1024
    ttl_s: Annotated[float, Meta(gt=0)] = 24 * 3600.0
    redis_key_prefix: str = "gateway:response:"
