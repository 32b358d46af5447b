"""A refresh: a prompt-only request that puts a context's cached blocks back at the most recently used end
of its pod's free queue, on an unmodified engine.

The request is the context's cached blocks as token ids plus the next token, ``max_tokens: 1``: the engine
finds every block cached (it always computes the last prompt token, so without the extra token it would
compute the whole last block again), computes one token, samples one, and frees the blocks, which go to the
back of its free queue (vLLM; SGLang's radix cache is LRU by last access). Checked on vLLM 0.32:
``tests/e2e/test_keep_warm.py``.

Owner: :class:`KeptPrompts` owns the prompts kept to refresh from (bounded by tokens, least recently kept
dropped first). :class:`Refresher` owns nothing: it sends one refresh through the gateway's HTTP client and
counts it (``gateway_keep_warm_requests_total``, ``gateway_keep_warm_tokens_total``,
``gateway_cache_actions_total{action="keep_warm"}``).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import msgspec

from gateway.config import AuthConfig
from gateway.http_client import HttpClient
from gateway.lru import WeightedLru
from gateway.metrics import GatewayMetrics
from gateway.pods.registry import PodRegistry
from gateway.workflow.metrics import WorkflowMetrics

TIMEOUT = aiohttp.ClientTimeout(total=30)


class RefreshFailed(Exception):
    pass


@dataclass(slots=True)
class KeptPrompt:
    """What a refresh of a context needs: the pod holding its blocks, its model, its last prompt's ids."""

    pod: str
    model: str  # as its requests name it (a LoRA adapter's name included)
    ids: Sequence[int]  # a chat prompt's packed ids may be grown in place by its next turn: ``length`` counts
    length: int

    def refresh_ids(self, blocks: int, block_size: int) -> list[int]:
        """The ids of a refresh of its first ``blocks`` blocks: those tokens and the next one."""
        full = blocks * block_size
        ids = list(self.ids[: min(full + 1, self.length)])
        if len(ids) == full:  # the prompt ends on a block boundary: any one more token, cached nowhere
            ids.append(ids[-1])
        return ids


def _length_of(kept: KeptPrompt) -> int:
    return kept.length


class KeptPrompts:
    def __init__(self, min_tokens: int, max_tokens: int) -> None:
        self._min_tokens = max(1, min_tokens)
        self._by_context: WeightedLru[str, KeptPrompt] = WeightedLru(max_tokens, _length_of)

    def keep(self, context: str, pod: str, model: str, ids: Sequence[int]) -> None:
        """The context's request went to ``pod`` with this prompt; one too short to be worth a refresh is not
        kept."""
        if len(ids) < self._min_tokens:
            self.drop(context)
            return
        packed = ids if isinstance(ids, array) else array("I", ids)
        self._by_context.put(context, KeptPrompt(pod, model, packed, len(ids)))

    @property
    def tokens(self) -> int:
        return self._by_context.total

    def drop(self, context: str) -> None:
        self._by_context.pop(context)

    def get(self, context: str) -> KeptPrompt | None:
        return self._by_context.get(context)

    def contexts(self) -> list[str]:
        return self._by_context.keys()

    def __len__(self) -> int:
        return len(self._by_context)


class Refresher:
    def __init__(self, pods: PodRegistry, auth: AuthConfig, http: HttpClient, metrics: GatewayMetrics) -> None:
        self._pods = pods
        self._auth = auth
        self._http = http
        self._metrics = metrics.owned(WorkflowMetrics)
        self._ids = itertools.count()

    async def refresh(self, pod_name: str, model: str, ids: list[int]) -> int:
        """Send one refresh to ``pod_name``; the prompt tokens it found cached. Raises :class:`RefreshFailed`
        (counted) when the pod is gone, unreachable, or does not answer 200 with a usage."""
        try:
            cached = await self._post(pod_name, model, ids)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            self._metrics.keep_warm_requests.labels(pod_name, "failed").inc()
            raise RefreshFailed(f"{type(exc).__name__}: {exc}") from None
        self._metrics.cache_actions.labels("keep_warm", "refresh", pod_name).inc()
        return cached

    def cancelled(self, pod_name: str, prompt_tokens: int, cached_tokens: int) -> None:
        """A refresh gave way to a client request: counted as the engine, which had scheduled it, counted it
        (its prompt looked up, its blocks hit), so that what the pods' own counters include is known."""
        self._metrics.keep_warm_requests.labels(pod_name, "cancelled").inc()
        self._metrics.keep_warm_tokens.labels(pod_name, "prompt").inc(prompt_tokens)
        self._metrics.keep_warm_tokens.labels(pod_name, "cached").inc(cached_tokens)

    async def _post(self, pod_name: str, model: str, ids: list[int]) -> int:
        pod = self._pods.get(pod_name)
        if pod is None:
            raise ValueError("the pod left the fleet")
        headers = {"x-request-id": f"keep-warm-{next(self._ids):x}"}
        if self._auth.upstream == "replace":
            headers["authorization"] = f"Bearer {self._auth.upstream_api_key}"
        headers["content-type"] = "application/json"
        body = msgspec.json.encode({"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0})
        async with self._http.session.post(f"{pod.url}/v1/completions", data=body, headers=headers,
                                           timeout=TIMEOUT) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            usage = (await resp.json())["usage"]
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        self._metrics.keep_warm_requests.labels(pod_name, "ok").inc()
        self._metrics.keep_warm_tokens.labels(pod_name, "prompt").inc(int(usage.get("prompt_tokens", len(ids))))
        self._metrics.keep_warm_tokens.labels(pod_name, "cached").inc(cached)
        return cached
