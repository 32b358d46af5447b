"""The prefix matcher: how much of the prompt each candidate holds, for the cache-aware scorers and pickers
(``prefix``, ``placement``, ``cache_aware``)."""

from __future__ import annotations

import time

from gateway.plugin_api import (
    ApproximatePrefixIndex,
    Observer,
    Pod,
    PrefixIndex,
    PrefixMatch,
    RoutingRequest,
    request_text,
)


class PrefixMatcher:
    """Finds how much of the prompt each candidate holds: precise (KV events) when the prompt has token
    ids and the policy has the index, else approximate (the gateway's own routing history of the text).
    Owner of the request's ``prefix`` and ``prefix_tokens``. What the chosen pod will hold once routed is
    recorded by the pipeline (:class:`gateway.request.context_steps.RoutedPrefix`)."""

    name = "prefix_match"

    def __init__(self, index: PrefixIndex | None, approximate: ApproximatePrefixIndex,
                 lookup_seconds: Observer | None = None) -> None:
        self._index = index
        self._approximate = approximate
        self._lookup_seconds = lookup_seconds

    def prepare(self, request: RoutingRequest, pods: list[Pod]) -> None:
        if request.token_ids and self._index is not None:
            self._precise(request, self._index, pods)
        else:
            self._by_text(request, pods)

    def _precise(self, request: RoutingRequest, index: PrefixIndex, pods: list[Pod]) -> None:
        started = time.perf_counter()
        model = request.base_model or request.model
        hashes = request.hashes or index.prompt_hashes(model, request.lora_name, request.token_ids or [])
        matches = index.lookup(model, request.lora_name, hashes, [p.name for p in pods])
        if self._lookup_seconds is not None:
            self._lookup_seconds.observe(time.perf_counter() - started)
        request.prefix = PrefixMatch(precise=True, hashes=hashes, pods=matches)
        for pod in pods:
            request.prefix_tokens[pod.name] = matches[pod.name].gpu_tokens

    def _by_text(self, request: RoutingRequest, pods: list[Pod]) -> None:
        text = request.prefix.text if request.prefix is not None else _text_of(request)
        if not text:  # nothing to match on: no prefix match at all (not an approximate one)
            request.prefix = None
            return
        request.prefix = PrefixMatch(precise=False, text=text,
                                     chars=self._approximate.lookup(text, [p.name for p in pods]))


def _text_of(request: RoutingRequest) -> str:
    return request_text(request.kind, request.body) if request.body is not None else ""
