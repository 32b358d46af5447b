"""Gateway API keys: the client's bearer token, hashed, compared in constant time with the config's;
per key, the models it may use and a request rate (token bucket). Admin keys guard /debug and /metrics.

Owner: :class:`ApiKeyAuth` owns the per-key buckets.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from dataclasses import dataclass

from aiohttp import web

from gateway.api.errors import ApiError, unauthorized
from gateway.config import ApiKeyConfig, AuthConfig


@dataclass(slots=True)
class _Key:
    digest: bytes
    config: ApiKeyConfig
    tokens: float
    refreshed: float  # monotonic time of the last refill


_KEY = web.RequestKey("api_key", _Key)


def _bearer_digest(request: web.Request) -> bytes | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return hashlib.sha256(token.strip().encode()).digest()


def _match(digest: bytes | None, keys: list[_Key]) -> _Key | None:
    # Compare against every key so the time taken does not reveal which one (if any) matched.
    found = None
    for key in keys:
        if hmac.compare_digest(digest or b"", key.digest):
            found = key
    return found


class ApiKeyAuth:
    def __init__(self, config: AuthConfig) -> None:
        keys = [ApiKeyConfig(hash=h) for h in config.api_key_hashes] + list(config.keys)
        now = time.monotonic()
        self._keys = [_Key(bytes.fromhex(k.hash), k, tokens=self._burst(k), refreshed=now) for k in keys]
        self._admin = [_Key(bytes.fromhex(h), ApiKeyConfig(hash=h), math.inf, now) for h in config.admin_key_hashes]
        self.debug_endpoints = config.debug_endpoints

    @staticmethod
    def _burst(key: ApiKeyConfig) -> float:
        return key.requests_per_minute or math.inf

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, request: web.Request) -> None:
        """Authenticate the request (before its body is read); remember which key it used."""
        if not self._keys:
            return
        key = _match(_bearer_digest(request), self._keys)
        if key is None:
            raise unauthorized()
        request[_KEY] = key

    def authorize(self, request: web.Request, model: str) -> None:
        """Once the model is known: the key's model list and its rate (after :meth:`check`)."""
        key = request.get(_KEY)
        if key is None:
            return
        if key.config.models and model not in key.config.models:
            raise ApiError(403, f"This API key may not use model `{model}`.", type="permission_error",
                           code="model_not_allowed", param="model")
        self._take(key)

    def _take(self, key: _Key) -> None:
        rate = key.config.requests_per_minute
        if rate is None:
            return
        now = time.monotonic()
        key.tokens = min(rate, key.tokens + (now - key.refreshed) * rate / 60)
        key.refreshed = now
        if key.tokens < 1:
            wait = math.ceil((1 - key.tokens) * 60 / rate)
            raise ApiError(429, f"Rate limit of {rate:g} requests per minute reached for this key.",
                           type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(wait)})
        key.tokens -= 1

    def check_admin(self, request: web.Request) -> None:
        if not self.debug_endpoints:
            raise ApiError(404, f"No route for {request.method} {request.path}.", type="not_found_error",
                           code="not_found")
        if self._admin and _match(_bearer_digest(request), self._admin) is None:
            raise unauthorized()
