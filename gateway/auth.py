"""Gateway API keys: the client's key, hashed, compared in constant time with the config's; per key, the
models it may use (its request rate is a limit like the others, :mod:`gateway.limits`, held across workers
and replicas). Admin keys guard /debug and /metrics, and are accepted on the API routes too (every model, no
rate limit).

A key arrives the way the client's SDK sends it, on every route: ``Authorization: Bearer <key>`` (the
OpenAI SDK, Codex, Claude Code with ``ANTHROPIC_AUTH_TOKEN``) or ``x-api-key: <key>`` (the Anthropic SDK,
Claude Code with ``ANTHROPIC_API_KEY``). Both are looked up in the same key table.

Each key's workflows and sessions are its own: their ids are kept under its *tag* (:func:`owner_tag`), so
two keys sending the same ``x-workflow-id`` run two workflows, and one key never reads, completes or flushes
another's. A pod-wide (hard) cache flush needs the admin key while keys are on.

Owner: :class:`ApiKeyAuth` owns the table of keys.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.config import ApiKeyConfig, AuthConfig
from gateway.core.contexts import owner_in
from gateway.core.errors import ErrorKind, GatewayError, unauthenticated

ADMIN_KEY_NAME = "admin"
MAX_BAND = 2**62


@dataclass(eq=False, slots=True)
class ApiKey:
    """One configured key: who is asking, once :meth:`ApiKeyAuth.check` matched it."""

    digest: bytes
    config: ApiKeyConfig
    admin: bool = False
    # The owner of the workflows and sessions it names: the start of its digest (no two configured keys share
    # it in practice; never a ``/``, so no tag is a prefix of another's ids). Made once: every request reads it.
    tag: str = field(init=False)

    def __post_init__(self) -> None:
        self.tag = self.digest.hex()[:TAG_CHARS]


TAG_CHARS = 16


def owner_tag(key: ApiKey | None) -> str:
    """Who owns the contexts a request names: its key's tag, or no one with keys off (ids as sent)."""
    return key.tag if key is not None else ""


def _presented_key(headers: Mapping[str, str]) -> str | None:
    """The key the client sent: its bearer token, else its ``x-api-key`` (None: neither)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key", "").strip() or None


def _key_digest(headers: Mapping[str, str]) -> bytes | None:
    key = _presented_key(headers)
    return hashlib.sha256(key.encode()).digest() if key is not None else None


def _match(digest: bytes | None, keys: list[ApiKey]) -> ApiKey | None:
    # Compare against every key so the time taken does not reveal which one (if any) matched.
    found = None
    for key in keys:
        if hmac.compare_digest(digest or b"", key.digest):
            found = key
    return found


class ApiKeyAuth:
    def __init__(self, config: AuthConfig) -> None:
        keys = [ApiKeyConfig(hash=h) for h in config.api_key_hashes] + list(config.keys)
        self._keys = [ApiKey(bytes.fromhex(k.hash), k) for k in keys]
        # An admin key is also a key for the API (at least as able as any: every model, no rate), named
        # ``admin`` in usage and limits.
        # It may choose anything a header can: any band, fairness id and cache action (hard flushes too).
        self._admin = [ApiKey(bytes.fromhex(h), ApiKeyConfig(hash=h, name=ADMIN_KEY_NAME, max_priority=MAX_BAND,
                                                             may_set_fairness_id=True), admin=True)
                       for h in config.admin_key_hashes]
        self._admin_tags = frozenset(key.tag for key in self._admin)
        self.debug_endpoints = config.debug_endpoints

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, headers: Mapping[str, str]) -> ApiKey | None:
        """Who is asking (before the body is read): the matched key, or None when keys are off."""
        if not self._keys:
            return None
        digest = _key_digest(headers)
        user, admin = _match(digest, self._keys), _match(digest, self._admin)  # both compared: even timing
        key = user or admin
        if key is None:
            raise unauthenticated()
        return key

    @staticmethod
    def may_use(key: ApiKey | None, model: str) -> bool:
        """Whether the key's model list allows ``model`` (any model with keys off or no list)."""
        return key is None or not key.config.models or model in key.config.models

    def authorize(self, key: ApiKey | None, model: str) -> None:
        """Once the model is known: the key's model list (its rate is the key-limits step's)."""
        if key is not None and not self.may_use(key, model):
            raise GatewayError(ErrorKind.FORBIDDEN, f"model: this API key may not use model `{model}`.",
                               code="model_not_allowed", param="model")

    def may_flush_pod(self, workflow_id: str | None) -> bool:
        """Whether a workflow's cache action may empty a whole pod (engines flush nothing finer): with keys
        on, only the admin key's workflows; with keys off, any (as before keys)."""
        if not self._keys:
            return True
        return workflow_id is not None and owner_in(workflow_id) in self._admin_tags

    def check_admin(self, headers: Mapping[str, str]) -> None:
        """``/debug/*`` and ``/metrics`` (when debug endpoints are on: the routes hide them otherwise):
        behind an admin key, if one is configured."""
        if self._admin and _match(_key_digest(headers), self._admin) is None:
            raise unauthenticated()
