"""Who may ask, and how much: API keys, admin keys, token and concurrency limits."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta


def _check_digest(digest: str, field: str) -> None:
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
        raise ValueError(f"{field} entries must be SHA-256 hex digests (gateway hash-key KEY)")


class ApiKeyConfig(msgspec.Struct, forbid_unknown_fields=True):
    """One gateway API key, with what it may do."""

    hash: str
    name: str = ""
    # Models this key may use; empty: all.
    models: list[str] = []
    # Requests in any sliding minute (at least one request), over every worker and replica: this key's
    # ``limits.keys`` requests_per_minute unless that gives one; none: unlimited.
    requests_per_minute: Annotated[float, Meta(gt=0)] | None = None
    # Who its requests are, whatever they send (docs/models.md#what-a-key-may-choose): its tenant (the
    # fairness id flow control and tenant limits count it under; none: ``flow_control.keys``' entry for its
    # name, else its name), the highest priority band it may ask for (``x-priority``, an objective's band),
    # and whether it may name another fairness id (``x-gateway-inference-fairness-id``: a platform's own
    # gateway acting for its users) or set cache actions (``x-stage-cache-policy``,
    # ``x-stage-preserve-threshold``). A header asking for more than this is refused (403).
    tenant: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    max_priority: int = 0
    may_set_fairness_id: bool = False
    may_set_cache_actions: bool = True

    def __post_init__(self) -> None:
        _check_digest(self.hash, "keys[].hash")


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


class UsageLimits(msgspec.Struct, forbid_unknown_fields=True):
    """What one API key, or one tenant's keys together, may use; none: unlimited. Input counts the prompt
    tokens (cached ones included), output the generated ones, as the engine's usage reports them."""

    input_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None
    input_tokens_per_day: int | None = None
    output_tokens_per_day: int | None = None
    max_concurrent: int | None = None
    # Requests begun in any sliding minute (under one: one request a minute).
    requests_per_minute: Annotated[float, Meta(gt=0)] | None = None

    def __post_init__(self) -> None:
        if any(v is not None and v < 1 for v in msgspec.structs.astuple(self)[:5]):
            raise ValueError("usage limits must be at least 1 (leave one out for no limit)")


class LimitsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Token and concurrency limits per API key (by ``auth.keys[].name``) and per tenant (the fairness id
    ``flow_control.keys`` gives a key; a named key not listed there is its own tenant), held across
    workers and replicas. Reloaded with the config file."""

    keys: dict[str, UsageLimits] = {}
    tenants: dict[str, UsageLimits] = {}
