"""GPU SLO profiles in AIBrix's format, their signature lookup, and the Redis-backed store.

Owner: the :class:`ProfileStore` owns the profiles; it alone writes them
(from Redis, every ``refresh_s``), and routing and admission read them. Redis being down never blocks a
request: the last profiles stay, and the failure is counted.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable

import msgspec

from gateway.background import cancel_and_wait

log = logging.getLogger("gateway.load.slo_profiles")

KEY_PREFIX = "aibrix:profile_"


class Slos(msgspec.Struct):
    percentile: float | None = None
    tput: float | None = None
    tt: float | None = None
    e2e: float | None = None
    ttft: float | None = None
    tpat: float | None = None
    tpot: float | None = None


class GpuProfile(msgspec.Struct):
    gpu: str  # the deployment name (AIBrix's historical field name)
    indexes: list[list[float]]  # [output_token_grid, input_token_grid]
    tputs: list[list[float]]  # [o][i]: max requests/s that still meet the SLOs; 0 = cannot
    e2e: list[list[float]] | None = None
    ttft: list[list[float]] | None = None
    tpot: list[list[float]] | None = None
    cost: float = 0.0
    created: float = 0.0
    slos: Slos | None = None

    def __post_init__(self) -> None:
        if len(self.indexes) != 2 or not self.indexes[0] or not self.indexes[1]:
            raise ValueError("indexes must be [output_grid, input_grid], both non-empty")
        rows, cols = len(self.indexes[0]), len(self.indexes[1])
        for name in ("tputs", "e2e", "ttft", "tpot"):
            table = getattr(self, name)
            if table is not None and (len(table) != rows or any(len(r) != cols for r in table)):
                raise ValueError(f"{name} must be {rows} x {cols} (output x input grid)")

    def signature(self, output_tokens: int, input_tokens: int) -> tuple[int, int]:
        return grid_index(self.indexes[0], output_tokens), grid_index(self.indexes[1], input_tokens)

    def capacity(self, sig: tuple[int, int]) -> float:
        """Little's law: requests of this signature in flight at capacity (L = λ·W); 0 = SLO unreachable."""
        o, i = sig
        tput = self.tputs[o][i]
        if tput <= 0 or self.e2e is None:
            return 0.0
        return tput * self.e2e[o][i]

    def ttft_s(self, sig: tuple[int, int]) -> float | None:
        return None if self.ttft is None else self.ttft[sig[0]][sig[1]]

    def e2e_s(self, sig: tuple[int, int]) -> float | None:
        return None if self.e2e is None else self.e2e[sig[0]][sig[1]]


def grid_index(grid: list[float], value: float) -> int:
    """Nearest grid point in log2 space, rounding down below the geometric midpoint."""
    x = math.log2(max(value, 1))
    points = [math.log2(max(g, 1)) for g in grid]
    if x <= points[0]:
        return 0
    for k in range(len(points) - 1):
        lo, hi = points[k], points[k + 1]
        if x < hi:
            return k if x < (lo + hi) / 2 else k + 1
    return len(points) - 1


def profile_key(model: str, deployment: str) -> str:
    return f"{KEY_PREFIX}{model}_{deployment}"


def parse_key(key: str, models: Iterable[str]) -> tuple[str, str] | None:
    """(model, deployment) of a key; model names may contain ``_``, so match the known ones first."""
    rest = key[len(KEY_PREFIX):] if key.startswith(KEY_PREFIX) else None
    if rest is None:
        return None
    for model in sorted(models, key=len, reverse=True):
        if rest.startswith(model + "_"):
            return model, rest[len(model) + 1:]
    model, sep, deployment = rest.rpartition("_")
    return (model, deployment) if sep else None


_decode = msgspec.json.Decoder(GpuProfile).decode


class ProfileStore:
    def __init__(self, redis_url: str | None, refresh_s: float = 10.0) -> None:
        self.redis_url = redis_url
        self.refresh_s = refresh_s
        self._profiles: dict[tuple[str, str], GpuProfile] = {}
        self._client = None
        self._task: asyncio.Task[None] | None = None
        self.refreshes = 0
        self.errors = 0
        self.invalid = 0
        # Model names that may contain dashes, so that a key's model and deployment split right.
        self._known_models: set[str] = set()

    def learn_models(self, models: frozenset[str]) -> None:
        self._known_models |= models

    def get(self, model: str, deployment: str) -> GpuProfile | None:
        return self._profiles.get((model, deployment))

    def all(self) -> dict[tuple[str, str], GpuProfile]:
        return dict(self._profiles)

    def put(self, model: str, deployment: str, profile: GpuProfile) -> bool:
        """Keep ``profile`` unless a newer one (by ``created``) is already known."""
        current = self._profiles.get((model, deployment))
        if current is not None and current.created > profile.created:
            return False
        self._profiles[(model, deployment)] = profile
        return True

    async def start(self) -> None:
        if not self.redis_url:
            return
        import redis.asyncio as redis

        self._client = redis.from_url(self.redis_url, socket_timeout=2, socket_connect_timeout=2)
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="profile-refresh")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        if self._client is not None:
            await self._client.aclose()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    async def refresh(self) -> bool:
        """Read every profile key once; on any Redis error keep what is known and count it."""
        assert self._client is not None
        import redis

        try:
            keys = [k async for k in self._client.scan_iter(match=f"{KEY_PREFIX}*", count=500)]
            values = await self._client.mget(keys) if keys else []
        except (redis.RedisError, OSError) as exc:
            self.errors += 1
            log.warning("profile refresh failed (keeping %d profiles): %s", len(self._profiles), exc)
            return False
        for key, value in zip(keys, values, strict=True):
            name = key.decode() if isinstance(key, bytes) else key
            parsed = parse_key(name, self._known_models)
            if parsed is None or value is None:
                continue
            try:
                profile = _decode(value)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                self.invalid += 1
                log.warning("ignoring invalid profile %s: %s", name, exc)
                continue
            self.put(*parsed, profile)
        self.refreshes += 1
        return True
