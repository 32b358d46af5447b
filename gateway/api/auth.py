"""Gateway API keys: the client's bearer token, hashed, compared in constant time with the config's."""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from gateway.api.errors import unauthorized


class ApiKeyAuth:
    def __init__(self, key_hashes: list[str]) -> None:
        self._digests = [bytes.fromhex(h) for h in key_hashes]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, request: web.Request) -> None:
        if not self._digests:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise unauthorized()
        digest = hashlib.sha256(token.strip().encode()).digest()
        # Compare against every key so the time taken does not reveal which one (if any) matched.
        matched = False
        for known in self._digests:
            matched |= hmac.compare_digest(digest, known)
        if not matched:
            raise unauthorized()
