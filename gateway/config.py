"""All gateway settings as one msgspec ``Struct`` tree.

Sources, later ones winning: a YAML/JSON file, ``GATEWAY_*`` environment variables, CLI flags.
Environment variables name a field by its path with ``__`` between levels, for example
``GATEWAY_SERVER__PORT=9000`` or ``GATEWAY_ROUTING__POLICY=least_request``; values are read as YAML
scalars, so numbers, booleans and lists (``[a, b]``) work. Validation happens once, in
:func:`load_config`, and a bad value fails with a message naming the field's path.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

import msgspec
import yaml

ENV_PREFIX = "GATEWAY_"


# What a pod does for a disaggregated model: prefill, decode, or whole requests.
PodRole = Literal["prefill", "decode", "both"]
POD_ROLES: tuple[str, ...] = get_args(PodRole)


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the offending field."""


class PodConfig(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    name: str | None = None
    # Empty: learned from the pod's ``/v1/models``.
    models: list[str] = []
    flavor: Literal["vllm", "sglang"] = "vllm"
    # ZeroMQ endpoints of the pod's KV-event publisher and replay socket (rank 0; rank r adds r).
    kv_events: str | None = None
    kv_replay: str | None = None
    kv_topic: str = ""
    dp_size: int = 1
    block_size: int | None = None
    # KV-cache capacity in tokens, when the engine's metrics do not say it (vLLM's cache_config_info and
    # SGLang's max_total_num_tokens do).
    kv_capacity_tokens: int | None = None
    # The deployment whose GPU profile applies (Redis key aibrix:profile_<model>_<deployment>).
    deployment: str | None = None
    # Prefill/decode disaggregation: the legs this pod serves (``disaggregation``). A model whose pods are
    # all ``both`` is served whole by one pod.
    role: PodRole = "both"
    # How the engine orders its own waiting requests: fcfs, or priority (vLLM ``--scheduling-policy
    # priority``): then each request carries its flow's priority to it (``flow_control``).
    scheduling: Literal["fcfs", "priority"] = "fcfs"

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"pod url must start with http:// or https://, got {self.url!r}")
        self.url = self.url.rstrip("/")
        if self.name is None:
            self.name = self.url.split("://", 1)[1]
        if self.dp_size < 1:
            raise ValueError("dp_size must be >= 1")
        if self.role not in POD_ROLES:  # checked here too for configs built in code
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if self.scheduling == "priority" and self.flavor != "vllm":
            raise ValueError("scheduling: priority is supported for vllm pods only")


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 8 * 1024 * 1024
    # All request header names and values together; past it a 431 (OpenAI JSON). A single header line
    # beyond 64 KiB never reaches the gateway: the HTTP parser refuses it with a plain 400.
    max_header_bytes: int = 16 * 1024
    max_messages: int = 2048
    # Longest prompt routed, in tokens; none: the model's max_model_len as its pods list it.
    max_prompt_tokens: int | None = None
    # A streaming client that reads nothing for this long (while its buffer is full) is cut off.
    client_stall_s: float = 30.0
    # A request body that has not arrived whole after this long is refused (408).
    body_timeout_s: float = 60.0
    # How long SIGTERM waits for in-flight requests before closing them.
    shutdown_grace_s: float = 30.0
    tls_cert: str | None = None
    tls_key: str | None = None
    # Worker processes sharing the port (SO_REUSEPORT), each with its own event loop; none: one per core
    # this process may use. They share their load per pod and their workflow state (``shared_state``).
    workers: int | None = None
    # How often the event loop's lag is sampled (``gateway_event_loop_lag_seconds``); 0: never.
    loop_lag_interval_s: float = 0.05
    # How often the config file is re-read for changes (a mounted ConfigMap changes in place); 0: only on
    # SIGHUP. What applies without a restart: ``flow_control`` (all but ``enabled``), ``models`` and ``limits``.
    config_watch_interval_s: float = 5.0

    def __post_init__(self) -> None:
        if self.loop_lag_interval_s < 0 or self.config_watch_interval_s < 0:
            raise ValueError("loop_lag_interval_s and config_watch_interval_s must not be negative")
        if self.body_timeout_s <= 0:
            raise ValueError("body_timeout_s must be positive")
        if self.workers is not None and not 1 <= self.workers <= 256:
            raise ValueError(f"workers must be in 1..256, got {self.workers}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")


class PartConfig(msgspec.Struct, forbid_unknown_fields=True):
    """One filter or picker of a routing profile: the plugin's name (entry points ``gateway.filters``,
    ``gateway.pickers``) and its options. In YAML a bare name stands for a part without options."""

    name: str
    options: dict[str, Any] = {}


class ScorerConfig(PartConfig, forbid_unknown_fields=True):
    """One scorer of a routing profile (entry points ``gateway.scorers``): its score, in ``[0, 1]``, counts
    ``weight`` times in the pod's total."""

    weight: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.weight):
            raise ValueError(f"scorer {self.name!r}: weight must be a finite number, got {self.weight}")


def as_part(part: str | PartConfig) -> PartConfig:
    """A profile part written as a bare name, as the part it names (no options)."""
    return PartConfig(part) if isinstance(part, str) else part


class ProfileConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A routing profile, as llm-d's scheduling profiles: filters narrow the candidates in order, the
    scorers' weighted sum ranks the survivors, the picker chooses one (:mod:`gateway.routing.profiles`)."""

    filters: list[str | PartConfig] = []
    scorers: list[str | ScorerConfig] = []
    picker: str | PartConfig = "max_score"

    def __post_init__(self) -> None:
        self.filters = [as_part(f) for f in self.filters]
        self.scorers = [ScorerConfig(s) if isinstance(s, str) else s for s in self.scorers]
        self.picker = as_part(self.picker)


class RoutingConfig(msgspec.Struct, forbid_unknown_fields=True):
    # The default profile: a shipped one (``kv_aware``, ``round_robin``, ...) or one of ``profiles``.
    policy: str = "round_robin"
    # Extra tries on other pods when a pod fails before the first byte reached the client.
    max_retries: int = 2
    # Whether clients may pick a profile per request with ``x-routing-strategy``.
    allow_strategy_header: bool = True
    # Settings of the shipped profiles, e.g. ``{kv_aware: {prefix_weight: 1.0, load_weight: 0.3}}``.
    options: dict[str, dict[str, Any]] = {}
    # Profiles declared here, by name: ``{mine: {filters: [...], scorers: [{name: prefix, weight: 1}], picker: ...}}``.
    profiles: dict[str, ProfileConfig] = {}


class HealthConfig(msgspec.Struct, forbid_unknown_fields=True):
    interval_s: float = 2.0
    timeout_s: float = 1.0
    failure_threshold: int = 3
    success_threshold: int = 2
    # Passive ejection after a connection error: base backoff, doubled per consecutive ejection.
    ejection_base_s: float = 1.0
    ejection_max_s: float = 30.0
    # Consecutive 5xx answers that eject a pod (connection failures eject at once).
    eject_after_5xx: int = 3


class TimeoutConfig(msgspec.Struct, forbid_unknown_fields=True):
    connect_s: float = 2.0
    first_byte_s: float = 120.0
    idle_s: float = 120.0
    total_s: float = 900.0


def _check_digest(digest: str, field: str) -> None:
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
        raise ValueError(f"{field} entries must be SHA-256 hex digests (gateway hash-key KEY)")


class ApiKeyConfig(msgspec.Struct, forbid_unknown_fields=True):
    """One gateway API key, with what it may do."""

    hash: str
    name: str = ""
    # Models this key may use; empty: all.
    models: list[str] = []
    # Sustained request rate (bursts up to one minute's worth); none: unlimited.
    requests_per_minute: float | None = None

    def __post_init__(self) -> None:
        _check_digest(self.hash, "keys[].hash")
        if self.requests_per_minute is not None and self.requests_per_minute <= 0:
            raise ValueError("requests_per_minute must be positive")


class AuthConfig(msgspec.Struct, forbid_unknown_fields=True):
    # SHA-256 hex digests of accepted gateway API keys (no limits); with ``keys``, empty disables
    # gateway authentication.
    api_key_hashes: list[str] = []
    keys: list[ApiKeyConfig] = []
    # /debug/* and /metrics: open, behind one of these admin keys, or (debug_endpoints false) absent.
    admin_key_hashes: list[str] = []
    debug_endpoints: bool = True
    # What the pod receives as ``Authorization``: the client's header, ``upstream_api_key``, or nothing.
    upstream: Literal["pass", "replace", "strip"] = "pass"
    upstream_api_key: str | None = None

    def __post_init__(self) -> None:
        for digest in self.api_key_hashes:
            _check_digest(digest, "api_key_hashes")
        for digest in self.admin_key_hashes:
            _check_digest(digest, "admin_key_hashes")
        if self.upstream == "replace" and not self.upstream_api_key:
            raise ValueError("upstream 'replace' needs upstream_api_key")


class ModelTokenizerConfig(msgspec.Struct, forbid_unknown_fields=True):
    # A local HF tokenizer directory (tokenizer.json + tokenizer_config.json with its chat template).
    path: str | None = None
    # local: this gateway tokenizes; remote: a pod of the model does (POST /tokenize); none: no tokens.
    mode: Literal["local", "remote", "none"] = "local"

    def __post_init__(self) -> None:
        if self.mode == "local" and not self.path:
            raise ValueError("mode 'local' needs a tokenizer path")


class TokenizationConfig(msgspec.Struct, forbid_unknown_fields=True):
    models: dict[str, ModelTokenizerConfig] = {}
    # For models not listed: ask a pod (exact by construction) or route without tokens.
    default_mode: Literal["remote", "none"] = "remote"
    remote_timeout_s: float = 0.5
    segment_cache_size: int = 50_000
    # Long text between a prompt's added tokens is cached in pieces of about this many characters (where the
    # tokenizer allows exact cuts), so prompts that share a long prefix tokenize only what follows it; 0: whole.
    piece_chars: int = 512
    prompt_cache_size: int = 4_096
    # New text longer than this is tokenized in a worker thread, off the event loop. The hop to the thread
    # and back costs the request about 0.1 ms (more on a busy host); 2,000 characters take about 0.35 ms to
    # tokenize, which every other request would wait for on the loop. On the Mooncake replay, 2,000 rather
    # than 8,000 halved the loop lag's p99 (5.3 to 2.2 ms) and the added TTFT's p90, its p50 unchanged.
    offload_chars: int = 2_000
    # Threads tokenizing long new text; none: one per core this process may use.
    threads: int | None = None
    # Token ids of earlier chat prompts kept so that a conversation's next turn tokenizes only what it
    # adds: each conversation's latest prompt, its ids and block hashes (about 7 bytes a token).
    reuse_tokens: int = 20_000_000


class KvIndexConfig(msgspec.Struct, forbid_unknown_fields=True):
    # Memory bound: past this many blocks a pod's view forgets its least recently stored tenth.
    max_blocks_per_view: int = 2_000_000
    # How long a routed prompt's blocks count as on the chosen pod before its events confirm them.
    speculative_ttl_s: float = 2.0


class LoadConfig(msgspec.Struct, forbid_unknown_fields=True):
    # Redis holding GPU profiles (AIBrix format); none: every pod holds ``default_capacity`` requests.
    redis_url: str | None = None
    profile_refresh_s: float = 10.0
    default_capacity: int = 64
    # Most of a pod that embedding requests may take, so they cannot starve chat of admission.
    embedding_share: float = 0.2
    # Engine /metrics scrape period; 0 turns scraping off.
    scrape_interval_s: float = 0.5
    predictor_window_s: float = 240.0
    predictor_slot_s: float = 10.0
    cold_start: Literal["optimistic", "input", "pessimistic"] = "input"
    max_output_tokens: int = 4096
    # Predict this percentile of recent output lengths; none: a draw weighted by their counts.
    predictor_percentile: float | None = None

    def __post_init__(self) -> None:
        if self.default_capacity < 1 or not 0 < self.embedding_share <= 1:
            raise ValueError("default_capacity must be >= 1 and embedding_share in (0, 1]")


class SloTargets(msgspec.Struct, forbid_unknown_fields=True):
    ttft_ms: float | None = None
    e2e_ms: float | None = None


class AdmissionConfig(msgspec.Struct, forbid_unknown_fields=True):
    """SLO admission: with ``enabled``, the pods' predicted load (GPU profiles, Little's law) is one more
    saturation signal of flow control, and a request whose SLO no pod can meet is refused at once. Its
    requests wait in flow control's one queue (``flow_control.max_queued``, ``max_wait_s``)."""

    enabled: bool = False
    # Per model, the SLO of requests that send no x-slo-* headers.
    slo_defaults: dict[str, SloTargets] = {}
    # Request latency assumed for Retry-After when no profile gives one.
    typical_e2e_s: float = 2.0


class KeepWarmConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Refreshing thinking contexts that the pod's LRU would evict before they come back
    (``gateway/workflow/keep_warm.py``): a prompt-only request over the context's cached blocks, one token
    computed, puts them at the most recently used end of the pod's free queue."""

    enabled: bool = True
    # At most this many refreshes per request routed to the pod (a budget that refills as requests come).
    max_share: float = 0.5
    # Refresh only while the pod has at most this many of the gateway's requests in flight (and none
    # waiting inside it, by its metrics). 0: only idle pods, right where a refresh's engine step delays
    # what arrives meanwhile (CPU pods, small models); a GPU batching hundreds of requests takes one more
    # token at no cost, and may take refreshes beside them.
    max_in_flight: int = 0
    # A refresh must be worth at least this many prompt tokens (a miss's re-prefill, times the chance the
    # context comes back).
    min_tokens: int = 256
    # How often each pod is looked at, and how far ahead: a context whose blocks the pod would evict within
    # ``lead_s`` (at the rate it takes new blocks), before the context is due back, is refreshed.
    interval_s: float = 0.1
    lead_s: float = 0.6
    # Of a pod's free blocks, the share that thinking contexts may be kept in; the rest takes the pod's new
    # blocks, so that refreshes never merely turn over what the pod cannot hold anyway.
    capacity_share: float = 0.8
    # Token ids kept to build refreshes (4 bytes each): past it, the prompts kept least recently go.
    max_prompt_tokens: int = 16_000_000

    def __post_init__(self) -> None:
        if min(self.max_share, self.min_tokens, self.lead_s, self.max_in_flight) < 0 or self.interval_s <= 0:
            raise ValueError("max_share, max_in_flight, min_tokens and lead_s must not be negative, interval_s "
                             "must be positive")
        if not 0 < self.capacity_share <= 1:
            raise ValueError("capacity_share must be in (0, 1]")
class ObjectiveConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A named objective (``x-gateway-inference-objective``): its priority band, SLO and weight."""

    # Higher bands are dispatched first while the fleet is saturated.
    priority: int = 0
    # Held longer than this (less the predicted TTFT, with profiles) the request is refused (429).
    ttft_ms: float | None = None
    # Share of capacity against other flows of its band (multiplies the tenant's weight).
    weight: float = 1.0
    # How long its requests may wait at the gateway; none: ``flow_control.max_wait_s``.
    max_wait_s: float | None = None

    def __post_init__(self) -> None:
        _check_flow_limits(self.weight, self.max_wait_s)
        if self.ttft_ms is not None and self.ttft_ms <= 0:
            raise ValueError("ttft_ms must be positive")


class TenantConfig(msgspec.Struct, forbid_unknown_fields=True):
    """One fairness id's share of the fleet, and how long its requests may wait."""

    weight: float = 1.0
    max_wait_s: float | None = None

    def __post_init__(self) -> None:
        _check_flow_limits(self.weight, self.max_wait_s)


def _check_flow_limits(weight: float, max_wait_s: float | None) -> None:
    if not weight > 0 or (max_wait_s is not None and max_wait_s < 0):
        raise ValueError("weight must be positive and max_wait_s not negative")


class SaturationConfig(msgspec.Struct, forbid_unknown_fields=True):
    """When a pod has room for one more request (flow control holds requests while no candidate pod has).
    A pod is saturated while any of these holds."""

    # Prompt tokens (less those predicted cached) the pod has yet to prefill, from every worker: those it has
    # not begun answering, less what its measured rate got through since it last made progress. The prefill
    # queued in front of the next request: one long prompt may pass it; the next waits until the running one
    # drains below it. Higher keeps a chunked-prefill engine's steps fuller, at the cost of a newcomer's TTFT.
    # While several flows are served, a prompt joins a queue only where both fit in it (or the queue is empty).
    prefill_tokens: int = 2048
    # How long at most a prompt that does not fit beside a pod's queue waits for it to empty: an answer that is
    # not streamed counts as queued until it ends (its first token is not seen).
    prefill_fit_wait_s: float = 0.25
    # Requests waiting in the engine's own queue (vLLM's num_requests_waiting, SGLang's num_queue_reqs).
    engine_waiting: int = 5
    # KV-cache usage the engine reports (running requests' blocks, 0-1).
    kv_usage: float = 0.9
    # Requests in flight on the pod through the gateway (every worker); none: no limit of its own.
    in_flight: int | None = None
    # Engine metrics older than this are not read (the gateway's own counts decide alone).
    stale_after_s: float = 2.0

    def __post_init__(self) -> None:
        if self.prefill_tokens < 1 or self.engine_waiting < 1 or not 0 < self.kv_usage <= 1 \
                or (self.in_flight is not None and self.in_flight < 1) or self.stale_after_s <= 0 \
                or self.prefill_fit_wait_s < 0:
            raise ValueError("saturation needs prefill_tokens >= 1, engine_waiting >= 1, kv_usage in (0, 1], "
                             "in_flight >= 1, stale_after_s > 0 and prefill_fit_wait_s >= 0")


class TokenWeightsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """What a served token costs a flow's service counter (the Virtual Token Counter's weights)."""

    input: float = 1.0
    # Prompt tokens the engine found cached: their prefill is skipped.
    cached_input: float = 0.1
    output: float = 2.0

    def __post_init__(self) -> None:
        if min(self.input, self.cached_input, self.output) < 0:
            raise ValueError("token weights must not be negative")


class FlowControlConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Flows (a fairness id and a priority band) share the fleet: while every candidate pod is saturated,
    new requests wait at the gateway and are dispatched band by band, the flow with the least weighted
    service first. Reloaded with the config file (all but ``enabled``: :mod:`gateway.config_reload`).
    On by default: an idle fleet holds nothing, and a request that is not held costs a few per cent more
    CPU (docs/benchmarks.md#flow-control has the numbers)."""

    enabled: bool = True
    saturation: SaturationConfig = msgspec.field(default_factory=SaturationConfig)
    # Requests held at the gateway, all flows together; past it a new one is refused (429).
    max_queued: int = 4096
    # How long a request may wait at the gateway (a flow's tenant or objective may say otherwise).
    max_wait_s: float = 120.0
    tokens: TokenWeightsConfig = msgspec.field(default_factory=TokenWeightsConfig)
    objectives: dict[str, ObjectiveConfig] = {}
    # By fairness id; flows of ids not listed have weight 1.
    tenants: dict[str, TenantConfig] = {}
    # API key name (``auth.keys[].name``) → fairness id; a named key not listed is its own tenant.
    keys: dict[str, str] = {}
    # Flows kept at once (each with its service counter); a new fairness id beyond it joins ``overflow``.
    max_flows: int = 10_000

    def __post_init__(self) -> None:
        if self.max_queued < 1 or self.max_wait_s < 0 or self.max_flows < 1:
            raise ValueError("flow_control needs max_queued >= 1, max_wait_s >= 0 and max_flows >= 1")


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
    flush_retries: int = 5
    flush_retry_base_s: float = 0.5
    # Requests without a workflow but with a session key (x-session-id, prompt_cache_key, user) stick to
    # the pod that served the session last.
    session_affinity: bool = True
    max_sessions: int = 100_000
    # Headers that name a session besides the built-in ones (x-session-id, the agent tools' own: see
    # docs/architecture.md), read after them; the value is the session, matched exactly.
    session_headers: list[str] = []
    keep_warm: KeepWarmConfig = msgspec.field(default_factory=KeepWarmConfig)


class SharedStateConfig(msgspec.Struct, forbid_unknown_fields=True):
    """What the workers of one gateway, and (through Redis) its replicas, tell each other: workflows and
    their stages, session pins, the contexts of the placement model, just-routed blocks, which workflows
    and sessions have requests in flight, and the service flow control counts per flow (``flows``).
    Eventually consistent: each change reaches the others ``flush_ms`` plus a network hop later; nothing on
    the request path ever waits for it."""

    # Redis whose pub/sub channel the replicas share; none: only the workers of one replica share.
    redis_url: str | None = None
    channel: str = "gateway:shared-state"
    # What to share; leave one out to keep it local (each costs every other worker CPU to apply).
    share: list[Literal["workflows", "sessions", "contexts", "speculative", "flows", "adapters", "limits"]] = \
        msgspec.field(default_factory=lambda: ["workflows", "sessions", "contexts", "speculative", "flows", "adapters",
                                               "limits"])
    flush_ms: float = 2.0
    heartbeat_s: float = 1.0
    # A worker or replica not heard from for this long is gone: its requests are no longer in flight.
    peer_timeout_s: float = 5.0
    # Batches waiting for Redis; past it the oldest are dropped (and counted).
    max_pending_batches: int = 1000
    redis_timeout_s: float = 0.5


class ResponsesConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The Responses API's state: what ``previous_response_id`` continues and ``GET /v1/responses/{id}``
    returns. ``gateway``: the gateway keeps each response (its input and output), pods stay stateless, and
    any worker or replica continues a conversation (in this process's memory; in Redis when
    ``shared_state.redis_url`` is set). ``pods``: the pod that answered keeps it (vLLM with
    ``VLLM_ENABLE_RESPONSES_API_STORE=1``) and gets the conversation's follow-ups, GETs and cancels."""

    store: Literal["gateway", "pods"] = "gateway"
    # Per process, in memory (least recently used first out); in Redis, only ``ttl_s`` applies.
    max_responses: int = 10_000
    max_bytes: int = 256 * 1024 * 1024
    ttl_s: float = 24 * 3600.0
    redis_key_prefix: str = "gateway:response:"

    def __post_init__(self) -> None:
        if self.max_responses < 1 or self.max_bytes < 1 or self.ttl_s <= 0:
            raise ValueError("responses: max_responses, max_bytes and ttl_s must be positive")


class TracingConfig(msgspec.Struct, forbid_unknown_fields=True):
    """OpenTelemetry spans per request (the ``otel`` extra). The exporter is OTLP over HTTP, configured by
    the standard ``OTEL_EXPORTER_OTLP_*`` and ``OTEL_SERVICE_NAME`` variables. Off: nothing is done."""

    enabled: bool = False


class VerificationConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Routing that checks itself: the prefix the gateway predicted against the engines' reports."""

    enabled: bool = True
    # A model drifts when, among its last ``window`` answers that could be checked (at least
    # ``min_samples``), at least ``max_miss_share`` missed: the engine counted other prompt tokens than
    # the gateway, or cached more than ``tolerance_tokens`` fewer or more than predicted.
    window: int = 50
    min_samples: int = 20
    max_miss_share: float = 0.5
    tolerance_tokens: int = 256
    # While drifting, one request in ``probe_every`` is also tokenized locally and compared with the
    # engine's count; ``recover_after`` agreeing probes in a row end the drift.
    probe_every: int = 10
    recover_after: int = 3

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.min_samples <= self.window or not 0 < self.max_miss_share <= 1:
            raise ValueError("verification needs window >= min_samples >= 1 and max_miss_share in (0, 1]")
        if self.probe_every < 1 or self.recover_after < 1 or self.tolerance_tokens < 0:
            raise ValueError("verification needs probe_every >= 1, recover_after >= 1, tolerance_tokens >= 0")


class PlacementConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The resumable working set that placement weighs (``gateway/kv/working_set.py``)."""

    # A context stays resumable for margin x its predicted think time, within these bounds.
    protect_margin: float = 2.0
    min_protect_s: float = 1.0
    max_protect_s: float = 600.0
    # Think time assumed before any context has shown one.
    default_think_s: float = 3.0
    # Stages a keyed context is assumed to have in all before any has completed.
    default_stages: int = 4
    # Weight of the last observation in the running averages of think time, growth and stage count.
    smoothing: float = 0.3
    # Memory bound (each context keeps its last prompt's block hashes): past it, the idle context that
    # finished longest ago is forgotten.
    max_contexts: int = 50_000
    # A workflow or session that starts while every pod's resumable demand already fills its KV cache
    # waits up to this long for room (a context lapsing, completing or moving on), rather than pushing
    # out contexts due back; 0: it starts at once.
    hold_new_s: float = 0.0

    def __post_init__(self) -> None:
        if self.hold_new_s < 0:
            raise ValueError("hold_new_s must not be negative")
        if self.protect_margin <= 0 or not 0 < self.min_protect_s <= self.max_protect_s:
            raise ValueError("protect_margin must be > 0 and 0 < min_protect_s <= max_protect_s")
        if not 0 < self.smoothing <= 1 or self.default_stages < 1:
            raise ValueError("smoothing must be in (0, 1] and default_stages >= 1")


class PressureConfig(msgspec.Struct, forbid_unknown_fields=True):
    enabled: bool = True
    source: str = "engine_metrics"
    options: dict[str, Any] = {}
    interval_s: float = 2.0
    # KV usage at which each mode starts: normal, pressure, critical, emergency (below normal: relaxed).
    normal: float = 0.70
    pressure: float = 0.85
    critical: float = 0.92
    emergency: float = 0.96
    hysteresis: float = 0.03

    def __post_init__(self) -> None:
        if not 0 < self.normal < self.pressure < self.critical < self.emergency <= 1:
            raise ValueError("thresholds must rise: 0 < normal < pressure < critical < emergency <= 1")


class DiscoveryConfig(msgspec.Struct, forbid_unknown_fields=True):
    # static: the pods above; file: a watched YAML/JSON file (options.path).
    source: str = "static"
    options: dict[str, Any] = {}


class LoggingConfig(msgspec.Struct, forbid_unknown_fields=True):
    level: Literal["debug", "info", "warning", "error"] = "info"
    json: bool = False
    # One line per request; off keeps only warnings and errors.
    access_log: bool = True


class ConnectorConfig(msgspec.Struct, forbid_unknown_fields=True):
    # How a prefill pod's KV reaches the decode pod, as the pods' ``--kv-transfer-config`` says:
    # shared_storage (vLLM's ExampleConnector, LMCache and the like: both legs send the client's request,
    # the prefill leg cut to one token) or nixl (NixlConnector: the prefill leg's ``kv_transfer_params``
    # go into the decode leg's body).
    connector: Literal["shared_storage", "nixl"] = "shared_storage"


class DisaggregationConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Prefill/decode disaggregation for the models whose pods have roles (``pods[].role``): the decode
    pod is chosen first, then a prefill pod, whose leg is skipped when the decode pod already holds all but
    ``uncached_token_threshold`` tokens of the prompt."""

    connector: Literal["shared_storage", "nixl"] = "shared_storage"
    # Per model (a pool of prefill and decode pods), when its connector differs from ``connector``.
    models: dict[str, ConnectorConfig] = {}
    uncached_token_threshold: int = 256
    # Prefill pods tried for one request before it is served whole by its decode pod.
    prefill_attempts: int = 2
    # A prefill leg still unanswered after this long is given up: the decode pod serves the request whole.
    prefill_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.uncached_token_threshold < 0 or self.prefill_attempts < 1 or self.prefill_timeout_s <= 0:
            raise ValueError("disaggregation needs uncached_token_threshold >= 0, prefill_attempts >= 1 and "
                             "prefill_timeout_s > 0")

    def connector_of(self, model: str) -> Literal["shared_storage", "nixl"]:
        pool = self.models.get(model)
        return pool.connector if pool is not None else self.connector


class MockPodsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Simulated pods started beside the gateway (``gateway serve --mock-pods N``)."""

    count: int = 0
    model: str = "mock-llama"
    block_size: int = 16
    num_blocks: int = 2048
    speed: float = 1.0
    flavor: Literal["vllm", "sglang"] = "vllm"
    base_port: int = 0
    # Longest prompt plus answer in tokens; none: the simulated model's own.
    max_model_len: int | None = None
    # Each answer ends after the pods' text (finish_reason stop), as a model's does, instead of running to
    # max_tokens: for agent tools (Claude Code, Codex) tried against simulated pods.
    ends_answers: bool = False
    # Prefill/decode disaggregation: the first ``prefill_pods`` pods take the prefill leg and the others
    # decode, their KV passed over ``connector`` (a temporary directory they share, or NIXL).
    prefill_pods: int = 0
    connector: Literal["shared_storage", "nixl"] = "shared_storage"
    # LoRA: adapters every pod registers at start, whether more may be registered at run time, and how many
    # run in one batch (vLLM's --max-loras) and stay in memory (--max-cpu-loras; none: max_loras).
    lora_adapters: list[str] = []
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.prefill_pods < max(1, self.count):
            raise ValueError("mock_pods.prefill_pods must leave at least one decode pod")


class EppConfig(msgspec.Struct, forbid_unknown_fields=True):
    """``gateway epp``: the endpoint picker Envoy calls over ext_proc (``gateway/epp/``)."""

    host: str = "127.0.0.1"
    port: int = msgspec.field(default=9002)
    # Endpoints after the chosen one in ``x-gateway-destination-endpoint``, for the data plane to try in
    # order when one cannot be reached (0: one endpoint, as an ORIGINAL_DST cluster needs).
    fallbacks: int = 2
    # Whether Envoy sends its gRPC access log to the EPP (the end of each answer: its status, and with
    # the Lua filter of gateway/epp/envoy_config.py its usage): "auto" once Envoy has opened the stream
    # (the first answer after a start ends without one), true from the first request, false never.
    access_log: bool | Literal["auto"] = "auto"
    # How long the end of an answer waits for its entry once the ext_proc stream has closed.
    access_log_wait_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535 or self.fallbacks < 0 or self.access_log_wait_s < 0:
            raise ValueError("epp: port in 0..65535, fallbacks and access_log_wait_s at least 0")


class ModelTarget(msgspec.Struct, forbid_unknown_fields=True):
    """One target of a weighted split: a model or adapter the pods serve, and its share."""

    model: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.model or not self.weight > 0:
            raise ValueError("a split's target needs a model and a positive weight")


class ModelRule(msgspec.Struct, forbid_unknown_fields=True):
    """What a public model name means: one target (an alias) or weighted targets (a split, sticky per
    workflow, session or conversation), then the fallbacks tried in order when the chosen target has no
    healthy pod, its requests would wait longer than ``fallback_wait_s`` in flow control, or its pods fail
    before the first byte."""

    target: str | None = None
    targets: list[ModelTarget] = []
    fallbacks: list[str] = []
    # Whether the answer names the target that served it (true) or the public name the client asked for.
    expose_target: bool = False
    # How long a request may wait in flow control for a target that has a fallback after it (0: a
    # saturated target hands the request to its fallback at once).
    fallback_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if (self.target is None) == (not self.targets):
            raise ValueError("a model rule names either target (an alias) or targets (a split)")
        if self.fallback_wait_s < 0:
            raise ValueError("fallback_wait_s must not be negative")
        chosen = self.choices()
        if len(set(chosen)) != len(chosen) or set(chosen) & set(self.fallbacks) \
                or len(set(self.fallbacks)) != len(self.fallbacks):
            raise ValueError("a model rule names each target and fallback once")

    def choices(self) -> list[str]:
        """The targets a request may be given (before any fallback)."""
        return [self.target] if self.target is not None else [t.model for t in self.targets]


class AdapterConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A LoRA adapter the gateway registers on a pod of its base model when a request needs it."""

    path: str  # as the pod reads it: a directory on the pod, or a URI its engine resolves
    base_model: str

    def __post_init__(self) -> None:
        if not self.path or not self.base_model:
            raise ValueError("an adapter needs a path and a base_model")


class LoraConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Loading adapters where they are needed (``gateway/models/adapters.py``)."""

    # A registration still unanswered after this long is given up (the request tries another pod).
    load_timeout_s: float = 30.0
    # An adapter the gateway registered, not served on a pod for this long, is unregistered there; 0: never.
    idle_unload_s: float = 600.0
    # What placing a request where its adapter is not in the engine's batch slots costs, in prompt tokens
    # (the weights copied into a slot, and the requests of other adapters that wait meanwhile) ...
    switch_cost_tokens: int = 512
    # ... and, on a pod that has not registered it, what reading it from its path costs besides.
    load_cost_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.load_timeout_s <= 0 or self.idle_unload_s < 0 or min(self.switch_cost_tokens,
                                                                       self.load_cost_tokens) < 0:
            raise ValueError("lora needs load_timeout_s > 0, idle_unload_s >= 0 and costs >= 0")


class ModelsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Model names that platform teams manage (``gateway/models/``): public names and what they mean, and
    the adapters loaded on demand. Reloaded with the config file."""

    rules: dict[str, ModelRule] = {}
    adapters: dict[str, AdapterConfig] = {}
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        for public, rule in self.rules.items():
            chained = [t for t in (*rule.choices(), *rule.fallbacks) if t in self.rules]
            if chained:
                raise ValueError(f"models.rules.{public}: {', '.join(chained)} is a public name itself; a "
                                 "target names a served model or adapter")
            if public in self.adapters:
                raise ValueError(f"models.rules.{public}: also an adapter's name")


class UsageLimits(msgspec.Struct, forbid_unknown_fields=True):
    """What one API key, or one tenant's keys together, may use; none: unlimited. Input counts the prompt
    tokens (cached ones included), output the generated ones, as the engine's usage reports them."""

    input_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None
    input_tokens_per_day: int | None = None
    output_tokens_per_day: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        if any(v is not None and v < 1 for v in msgspec.structs.astuple(self)):
            raise ValueError("usage limits must be at least 1 (leave one out for no limit)")


class LimitsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Token and concurrency limits per API key (by ``auth.keys[].name``) and per tenant (the fairness id
    ``flow_control.keys`` gives a key; a named key not listed there is its own tenant), held across
    workers and replicas. Reloaded with the config file."""

    keys: dict[str, UsageLimits] = {}
    tenants: dict[str, UsageLimits] = {}


class GatewayConfig(msgspec.Struct, forbid_unknown_fields=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    pods: list[PodConfig] = []
    routing: RoutingConfig = msgspec.field(default_factory=RoutingConfig)
    disaggregation: DisaggregationConfig = msgspec.field(default_factory=DisaggregationConfig)
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)
    timeouts: TimeoutConfig = msgspec.field(default_factory=TimeoutConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    tokenization: TokenizationConfig = msgspec.field(default_factory=TokenizationConfig)
    kv_index: KvIndexConfig = msgspec.field(default_factory=KvIndexConfig)
    load: LoadConfig = msgspec.field(default_factory=LoadConfig)
    admission: AdmissionConfig = msgspec.field(default_factory=AdmissionConfig)
    flow_control: FlowControlConfig = msgspec.field(default_factory=FlowControlConfig)
    workflow: WorkflowConfig = msgspec.field(default_factory=WorkflowConfig)
    placement: PlacementConfig = msgspec.field(default_factory=PlacementConfig)
    verification: VerificationConfig = msgspec.field(default_factory=VerificationConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    shared_state: SharedStateConfig = msgspec.field(default_factory=SharedStateConfig)
    responses: ResponsesConfig = msgspec.field(default_factory=ResponsesConfig)
    pressure: PressureConfig = msgspec.field(default_factory=PressureConfig)
    discovery: DiscoveryConfig = msgspec.field(default_factory=DiscoveryConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    mock_pods: MockPodsConfig = msgspec.field(default_factory=MockPodsConfig)
    epp: EppConfig = msgspec.field(default_factory=EppConfig)
    models: ModelsConfig = msgspec.field(default_factory=ModelsConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)

    def __post_init__(self) -> None:
        named = {k.name for k in self.auth.keys if k.name}
        unknown = sorted(set(self.limits.keys) - named)
        if unknown:
            raise ValueError(f"limits.keys names no key of auth.keys: {', '.join(unknown)}")


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def read_config_file(path: str | Path) -> dict[str, Any]:
    text = Path(path).read_text()
    try:
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not valid YAML/JSON: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key == ENV_PREFIX:
            continue
        path = key[len(ENV_PREFIX) :].lower().split("__")
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: conflicts with another GATEWAY_ variable")
        node[path[-1]] = yaml.safe_load(raw) if raw else raw
    return tree


def deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


# Settings that moved: a file naming the old place gets told the new one.
_MOVED = {("admission", "queue_size"): "flow_control.max_queued",
          ("admission", "max_queue_wait_s"): "flow_control.max_wait_s"}


def _check_moved(data: Mapping[str, Any]) -> None:
    for (section, key), now in _MOVED.items():
        if isinstance(data.get(section), Mapping) and key in data[section]:
            raise ConfigError(f"{section}.{key} is now {now} (flow control's queue is the one queue)")


class ConfigSource(msgspec.Struct, frozen=True):
    """Where the running config came from, so that it can be read again: the file (none: no file), the
    command line's settings over it, and the config they gave when the gateway started. ``GATEWAY_*``
    variables are re-read with the file (a process's environment does not change)."""

    path: str | None = None
    overrides: dict[str, Any] = {}
    loaded: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    # The file's SHA-256 taken just before it was read: a change made while it was read shows as a change.
    digest: str = ""

    @classmethod
    def read(cls, path: str | None, overrides: Mapping[str, Any] | None = None) -> ConfigSource:
        overrides = dict(overrides or {})
        digest = file_digest(path)
        return cls(path, overrides, load_config(path, overrides), digest)

    def reread(self) -> ConfigSource:
        """The same source read again (raises :class:`ConfigError` or ``OSError`` as at start)."""
        return ConfigSource.read(self.path, self.overrides)


def file_digest(path: str | None) -> str:
    """The SHA-256 of the file's bytes ("" when there is no file or it cannot be read)."""
    if not path:
        return ""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ""


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> GatewayConfig:
    """Build and validate the config: file, then ``GATEWAY_*`` env, then ``overrides`` (CLI flags)."""
    data: dict[str, Any] = read_config_file(path) if path else {}
    data = deep_merge(data, env_overrides(os.environ if environ is None else environ))
    data = deep_merge(data, overrides or {})
    _check_moved(data)
    try:
        return msgspec.convert(data, GatewayConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config: {exc}") from exc
