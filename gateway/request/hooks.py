"""Request hooks: the plugins of ``gateway.pre_request`` and ``gateway.response_complete`` (the contract:
:mod:`gateway.plugin_api`), built from the ``hooks`` section at start and run as steps of the pipeline.

A pre-request hook is a ``dispatch`` step: it sees each attempt once its pod is chosen, before it is sent,
and the headers it returns are added to the attempt's (a name already there keeps its value). A
response-complete hook is a ``complete`` step deferred to the event loop's next turn: the director has
recorded the request and the answer has ended (a non-streamed answer's bytes are handed to the connection
when the handler returns, before that turn). Each call is timed in ``gateway_routing_plugin_seconds{kind,
plugin}``; one that raises is logged and counted in ``gateway_request_hook_errors_total{kind, hook}``, and
the request goes on. No hook configured: no step added, nothing paid per request.

Owner: :class:`RequestHooks` owns the built hooks; they see frozen views built here, never the director's
own types.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from time import perf_counter
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter

from gateway.config import HooksConfig, PartConfig, as_part
from gateway.metrics import GatewayMetrics
from gateway.plugin_api import HookContext, PreRequest, PreRequestView, ResponseComplete, ResponseView
from gateway.plugin_registry import PluginRegistry
from gateway.request.pipeline import RequestPipeline
from gateway.request.types import Attempt, CompletedRequest

PRE_REQUEST_GROUP = "gateway.pre_request"
RESPONSE_COMPLETE_GROUP = "gateway.response_complete"

log = logging.getLogger("gateway.hooks")

# Runs a function later, off the request's path (the event loop's next turn).
Defer = Callable[[Callable[[ResponseView], None], ResponseView], Any]


def _next_turn(run: Callable[[ResponseView], None], view: ResponseView) -> None:
    asyncio.get_running_loop().call_soon(run, view)


class HookMetrics:
    """``gateway_request_hook_errors_total``, on the gateway's registry (:meth:`GatewayMetrics.owned`).
    Producer: :class:`_Hook`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.errors = Counter(
            "gateway_request_hook_errors", "Calls of a request hook that raised, by kind (pre_request, "
            "response_complete) and hook (a name of the hooks section); the request went on", ["kind", "hook"],
            registry=registry,
        )


@dataclass(frozen=True, slots=True)
class _Hook:
    """One configured hook: its call, timed and guarded, with its metrics' children looked up once."""

    name: str
    call: Callable[[Any], Any]
    seconds: Any  # its child of gateway_routing_plugin_seconds
    errors: Any  # its child of gateway_request_hook_errors_total

    def run(self, view: Any) -> Any:
        """What the hook returned; None when it raised (logged and counted)."""
        started = perf_counter()
        try:
            return self.call(view)
        except Exception:
            self.errors.inc()
            log.exception("request %s: hook %s raised; the request goes on", view.request_id, self.name)
            return None
        finally:
            self.seconds.observe(perf_counter() - started)


def _headers(hook: PreRequest, view: PreRequestView) -> dict[str, str]:
    """A pre-request hook's headers, checked: a hook that returns something else raised, as far as we care."""
    added = hook.pre_request(view)
    if added is None:
        return {}
    if not isinstance(added, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in
                                                 added.items()):
        raise TypeError(f"pre_request returned {added!r}, not a mapping of header names to strings")
    return dict(added)


class PreRequestHooks:
    """dispatch: each pre-request hook, in order, with the attempt's view; the headers each returns go to
    the pod (a name the attempt already carries, whatever its case, keeps the gateway's value)."""

    def __init__(self, hooks: tuple[_Hook, ...]) -> None:
        self._hooks = hooks

    def dispatched(self, attempt: Attempt) -> None:
        decision, routing = attempt.decision, attempt.routing
        view = PreRequestView(attempt.request.id, routing.model, attempt.request.kind, decision.pod.name,
                              decision.pod.url, decision.policy, decision.reason, attempt.number)
        headers = attempt.upstream_headers
        for hook in self._hooks:
            added = hook.run(view)
            if added:
                present = {name.lower() for name in headers}
                headers.update((name, value) for name, value in added.items() if name.lower() not in present)


class ResponseCompleteHooks:
    """complete: each response-complete hook, in order, with the request's view, on the loop's next turn."""

    def __init__(self, hooks: tuple[_Hook, ...], defer: Defer = _next_turn) -> None:
        self._hooks = hooks
        self._defer = defer

    def completed(self, done: CompletedRequest) -> None:
        self._defer(self._run, response_view(done))

    def _run(self, view: ResponseView) -> None:
        for hook in self._hooks:
            hook.run(view)


def response_view(done: CompletedRequest) -> ResponseView:
    """How ``done`` ended, as a response-complete hook sees it."""
    decision, outcome = done.decision, done.outcome
    usage = outcome.usage if outcome is not None else None
    return ResponseView(done.request.id, done.model, done.request.kind, decision.pod.name if decision else None,
                        done.answered, done.result, done.attempts, usage.prompt_tokens if usage else None,
                        usage.completion_tokens if usage else None, done.first_byte_s,
                        done.finished - done.request.started)


def _response_complete(hook: ResponseComplete, view: ResponseView) -> None:
    hook.response_complete(view)


class RequestHooks:
    """The hooks the config names, built at start (an unknown name or bad options raises
    :class:`~gateway.plugin_registry.UnknownPlugin` or :class:`~gateway.plugin_registry.PluginOptionsError`)."""

    def __init__(self, config: HooksConfig, metrics: GatewayMetrics) -> None:
        self._metrics = metrics
        self.pre_request = self._built(PRE_REQUEST_GROUP, "pre_request", config.pre_request, _headers)
        self.response_complete = self._built(RESPONSE_COMPLETE_GROUP, "response_complete",
                                             config.response_complete, _response_complete)

    def _built(self, group: str, kind: str, parts: Sequence[str | PartConfig],
               call: Callable[[Any, Any], Any]) -> tuple[_Hook, ...]:
        if not parts:  # no family declared: a gateway without hooks exports what it did before them
            return ()
        registry = _registry(group, kind)
        seconds, errors = self._metrics.routing_plugin_seconds, self._metrics.owned(HookMetrics).errors
        return tuple(_Hook(p.name, partial(call, registry.build(p.name, HookContext(p.name), p.options)),
                           seconds.labels(kind, p.name), errors.labels(kind, p.name)) for p in map(as_part, parts))

    def around(self, pipeline: RequestPipeline, defer: Defer = _next_turn) -> RequestPipeline:
        """``pipeline`` with the hooks' steps last at dispatch and complete (itself when none is configured)."""
        dispatch = [PreRequestHooks(self.pre_request)] if self.pre_request else []
        complete = [ResponseCompleteHooks(self.response_complete, defer)] if self.response_complete else []
        if not dispatch and not complete:
            return pipeline
        return replace(pipeline, dispatch=[*pipeline.dispatch, *dispatch], complete=[*pipeline.complete, *complete])


def _registry(group: str, kind: str) -> PluginRegistry:
    return PluginRegistry(group, f"{kind.replace('_', '-')} hook")


def hook_options(config: HooksConfig) -> dict[str, list[dict[str, Any]]]:
    """The ``hooks`` section with each hook's options decoded with their defaults (``gateway config check``;
    nothing built; raises as :class:`RequestHooks` would)."""
    kinds = ((PRE_REQUEST_GROUP, "pre_request", config.pre_request),
             (RESPONSE_COMPLETE_GROUP, "response_complete", config.response_complete))
    return {kind: [{"name": p.name, "options": msgspec.to_builtins(_registry(group, kind).options(p.name, p.options))}
                   for p in map(as_part, parts)] for group, kind, parts in kinds}
