"""Where a request goes: the routing policy, token ids, the prefix index, load, prediction checks, placement and
KV-cache pressure."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta


class PartConfig(msgspec.Struct, forbid_unknown_fields=True):
    """One filter or picker of a routing profile, or one request hook: the plugin's name (entry points
    ``gateway.filters``, ``gateway.pickers``, ``gateway.pre_request``, ``gateway.response_complete``) and its
    options. In YAML a bare name stands for a part without options."""

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


class HooksConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The request hooks that run, in order (gateway/request/hooks.py; docs/routing.md, "A request hook"). Read
    at start: a changed list waits for a restart."""

    # Once an attempt's pod is chosen, before it is sent: each may add headers to what the pod receives.
    pre_request: list[str | PartConfig] = []
    # Once per request, after its answer ended, however it ended.
    response_complete: list[str | PartConfig] = []

    def __post_init__(self) -> None:
        self.pre_request = [as_part(h) for h in self.pre_request]
        self.response_complete = [as_part(h) for h in self.response_complete]


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
    # The most pods a scoring policy looks at per request: the holders of the prompt's longest cached runs and
    # a random sample of the rest (gateway/routing/candidates.py); 0: every pod.
    max_candidates: Annotated[int, Meta(ge=0)] = 16


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
    # The same for tiktoken (``fast_bpe``): at three times this (as long on the loop), a group's first prompts
    # stayed on the loop and on two real vLLM pods one seed's hit ratio fell by 0.013 (docs/benchmarks.md).
    offload_chars: int = 2_000
    # Threads tokenizing long new text; none: one per core this process may use.
    threads: int | None = None
    # Token ids of earlier chat prompts kept so that a conversation's next turn tokenizes only what it
    # adds: each conversation's latest prompt, its ids and block hashes (about 7 bytes a token).
    reuse_tokens: int = 20_000_000
    # Text no pod can hold yet is tokenized after routing, when the request's attempt ends, rather than
    # before it (docs/routing.md, "KV-aware routing"): a conversation's next turn is routed on
    # its earlier prompt, a prompt from its first message on the ids as far as its first new piece past which
    # no pod holds it (the prefix index says). Not where a count must be exact first (a key whose input tokens
    # are limited, a prompt that might pass the context, a drifting model, a prefill leg). Off by default: on real
    # pods it showed no significant gain against itself off (docs/benchmarks.md).
    defer_new_text: bool = False
    # At most this much text is left for when the attempt ends (tokenized on the loop then: 4,000 characters
    # took 0.37 ms at p50 through tiktoken, on an idle loop); more new text is tokenized before routing.
    defer_max_chars: int = 4_000
    # Text between a prompt's added tokens encoded through tiktoken, for the byte-level BPE tokenizers where it
    # gives the same ids (checked at load: gateway/tokenization/fast_bpe.py); about 3x faster than the Rust
    # tokenizer on real text, half the CPU for a long new prompt. On two real vLLM pods the hit ratio within
    # 0.01 and TTFT p90 no worse (docs/benchmarks.md, "tiktoken back, at the Rust tokenizer's threshold");
    # off: the Rust tokenizer alone.
    fast_bpe: bool = True


class KvIndexConfig(msgspec.Struct, forbid_unknown_fields=True):
    # Memory bound: past this many blocks a pod's view forgets its first stored tenth.
    max_blocks_per_view: int = 2_000_000
    # How long a routed prompt's blocks count as on the chosen pod before its events confirm them.
    speculative_ttl_s: float = 2.0
    # With several workers (serve --workers N): the processes that apply the pods' KV events once for the whole
    # host, each for a share of the pods, into shared memory every worker reads (gateway/indexer.py); 0: each
    # worker applies every event itself.
    ingest_processes: Annotated[int, Meta(ge=0)] = 1
    # Views (pods x DP ranks) one index holds at most.
    max_views: Annotated[int, Meta(ge=1)] = 16_384
    # Evicted blocks kept for the workers' free queues (keep-warm) to read, per ingest process.
    eviction_notes: Annotated[int, Meta(ge=0)] = 262_144


class LoadConfig(msgspec.Struct, forbid_unknown_fields=True):
    # Redis holding GPU profiles (AIBrix format); none: every pod holds ``default_capacity`` requests.
    redis_url: str | None = None
    profile_refresh_s: float = 10.0
    default_capacity: Annotated[int, Meta(ge=1)] = 64
    # Most of a pod that embedding requests may take, so they cannot starve chat of admission.
    embedding_share: Annotated[float, Meta(gt=0, le=1)] = 0.2
    # Engine /metrics scrape period; 0 turns scraping off.
    scrape_interval_s: float = 0.5
    # The host's scrapes per second at most (its workers share them): in a larger fleet, the pods with requests
    # in flight are scraped each period and the others in turn. 0: no limit.
    max_scrapes_per_s: Annotated[float, Meta(ge=0)] = 50.0
    predictor_window_s: float = 240.0
    predictor_slot_s: float = 10.0
    cold_start: Literal["optimistic", "input", "pessimistic"] = "input"
    max_output_tokens: int = 4096
    # Predict this percentile of recent output lengths; none: a draw weighted by their counts.
    predictor_percentile: float | None = None


class VerificationConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Routing that checks itself: the prefix the gateway predicted against the engines' reports."""

    enabled: bool = True
    # A model drifts when, among its last ``window`` answers that could be checked (at least
    # ``min_samples``), at least ``max_miss_share`` missed: the engine counted other prompt tokens than
    # the gateway, or cached more than ``tolerance_tokens`` fewer or more than predicted.
    window: Annotated[int, Meta(ge=1)] = 50
    min_samples: Annotated[int, Meta(ge=1)] = 20
    max_miss_share: Annotated[float, Meta(gt=0, le=1)] = 0.5
    tolerance_tokens: Annotated[int, Meta(ge=0)] = 256
    # While drifting, one request in ``probe_every`` is also tokenized locally and compared with the
    # engine's count; ``recover_after`` agreeing probes in a row end the drift.
    probe_every: Annotated[int, Meta(ge=1)] = 10
    recover_after: Annotated[int, Meta(ge=1)] = 3

    def __post_init__(self) -> None:
        if self.min_samples > self.window:
            raise ValueError("verification needs window >= min_samples")


class PlacementConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The resumable working set that placement weighs (``gateway/kv/working_set.py``)."""

    # A context stays resumable for margin x its predicted think time, within these bounds.
    protect_margin: Annotated[float, Meta(gt=0)] = 2.0
    min_protect_s: Annotated[float, Meta(gt=0)] = 1.0
    max_protect_s: float = 600.0
    # Think time assumed before any context has shown one.
    default_think_s: float = 3.0
    # Stages a keyed context is assumed to have in all before any has completed.
    default_stages: Annotated[int, Meta(ge=1)] = 4
    # Weight of the last observation in the running averages of think time, growth and stage count.
    smoothing: Annotated[float, Meta(gt=0, le=1)] = 0.3
    # Memory bound (each context keeps its last prompt's block hashes): past it, the idle context that
    # finished longest ago is forgotten.
    max_contexts: int = 50_000
    # A workflow or session that starts while every pod's resumable demand already fills its KV cache
    # waits up to this long for room (a context lapsing, completing or moving on), rather than pushing
    # out contexts due back; 0: it starts at once.
    hold_new_s: Annotated[float, Meta(ge=0)] = 0.0

    def __post_init__(self) -> None:
        if self.min_protect_s > self.max_protect_s:
            raise ValueError("min_protect_s must not exceed max_protect_s")


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
