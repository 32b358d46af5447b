"""The :class:`Router`: runs the chosen policy over the healthy pods of the requested model (a shortlist of
them in a large fleet: :mod:`gateway.routing.candidates`).

Policies are built from their profiles (:mod:`gateway.routing.profiles`), declared in config or shipped;
flow control's pods with room and the workflow or session pin are filters those profiles declare
(``saturated``, ``pin``: ``plugins/routing/filters/``).

The router times each call of each part (``gateway_routing_plugin_seconds{kind, plugin}``), so that no
plugin measures itself.

Owner: the router owns the built policies (and their internal state, such as a round-robin cursor) and
the request's ``filtered_out``. It reads pods from the registry and never changes them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from time import perf_counter
from typing import Any

from gateway.config import ProfileConfig, RoutingConfig
from gateway.core.errors import bad_request, no_pod_available
from gateway.plugin_registry import PluginRegistry, UnknownPlugin
from gateway.pods.registry import Pod, PodRegistry
from gateway.routing.candidates import Shortlist
from gateway.routing.policy import Decision, Pick, Policy, PolicyContext, RoutingRequest
from gateway.routing.profiles import Profiles

log = logging.getLogger("gateway.routing")


class Router:
    def __init__(
        self,
        pods: PodRegistry,
        plugins: PluginRegistry,
        default_policy: str,
        options: Mapping[str, Mapping[str, Any]],
        context: PolicyContext,
        max_candidates: int = 0,
        profiles: Mapping[str, ProfileConfig] | None = None,
    ) -> None:
        """``max_candidates``: the most pods a policy that scores looks at per request (0: every pod)."""
        self._pods = pods
        self._shortlist = Shortlist(pods, context.index, max_candidates, clock=context.clock)
        self._context = context
        # ``plugins``: the shipped profiles (``gateway.policies``), ``options`` their settings; ``profiles``
        # those declared in ``routing.profiles``.
        self._plugins = plugins
        self.profiles = Profiles(plugins, options, profiles or {})
        self.default_policy = default_policy
        self._plugin_seconds = context.metrics.routing_plugin_seconds
        # (kind, part name) → its histogram child, looked up once: labels() costs more than the observation.
        self._timers: dict[tuple[str, str], Any] = {}
        # Fail at start on an unknown default, and on any policy's bad options (not at its first use).
        self._policies = self._built(self.profiles, default_policy)

    def _built(self, profiles: Profiles, default_policy: str) -> dict[str, Policy]:
        """Every policy the config names, built (raises on an unknown one or bad options)."""
        return {name: profiles.build(name, self._context) for name in {default_policy, *profiles.configured()}}

    def check(self, routing: RoutingConfig) -> None:
        """Raises what :meth:`reconfigure` would on ``routing``, changing nothing."""
        self._built(Profiles(self._plugins, routing.options, routing.profiles), routing.policy)

    def reconfigure(self, routing: RoutingConfig) -> None:
        """A reloaded ``routing`` section: the default policy, profiles, options and shortlist size. Its policies
        are built anew, all before any replaces the running ones (a bad one raises and changes nothing); a
        request already routed keeps the policy it had."""
        profiles = Profiles(self._plugins, routing.options, routing.profiles)
        policies = self._built(profiles, routing.policy)
        self.profiles, self._policies, self.default_policy = profiles, policies, routing.policy
        self._shortlist.limit = routing.max_candidates

    def policy(self, name: str) -> Policy:
        """The policy named ``name``, built on first use and kept (its state persists)."""
        policy = self._policies.get(name)
        if policy is None:
            policy = self.profiles.build(name, self._context)
            self._policies[name] = policy
        return policy

    def resolve(self, name: str | None) -> Policy:
        """The per-request override ``name`` (from ``x-routing-strategy``), or the default policy."""
        if not name:
            return self.policy(self.default_policy)
        try:
            return self.policy(name)
        except UnknownPlugin as exc:
            raise bad_request(str(exc), param="x-routing-strategy", code="unknown_routing_strategy") from None

    def route(
        self, request: RoutingRequest, policy: Policy, exclude: frozenset[str] = frozenset(),
        pin: str | None = None, pin_reason: str = "pinned", binding: bool = True,
    ) -> Decision:
        """Run ``policy``; a ``pin`` (a workflow's or a session's pod) wins where the policy's ``pin`` filter
        finds it among the pods its other filters kept (healthy, not excluded, ...), else the policy decides
        and the decision says so. A pin that
        is not ``binding`` only tells the filters that the request continues a context on that pod."""
        request.pin, request.pin_reason, request.pin_binding = pin, pin_reason, binding
        candidates = self._shortlist.of(request, policy, self._pods.candidates(request.model, exclude, request.leg),
                                        exclude)
        pods = self._filtered(request, policy, candidates)
        scores = self._scored(request, policy, pods)
        pick = self._picked(request, policy, pods, scores)
        unpinned = pin if pin != pick.pod.name else None
        return Decision(
            pod=pick.pod,
            policy=policy.name,
            reason=pick.reason,
            detail=pick.detail,
            scores={p.name: s for p, s in zip(pods, scores, strict=True)} if policy.scorers else {},
            prefix_tokens=request.prefix_tokens.get(pick.pod.name, 0),
            unpinned=unpinned,
            unpinned_by=self._unpinned_by(request, unpinned, pods) if unpinned is not None else "",
        )

    @staticmethod
    def _unpinned_by(request: RoutingRequest, pin: str, pods: list[Pod]) -> str:
        """Why the request went elsewhere than its pin: the filter that dropped the pin, "pod_unavailable"
        (unhealthy, ejected, or failed on an earlier attempt), or "placement" (the pin was only a hint, and
        the policy placed the request elsewhere)."""
        if any(p.name == pin for p in pods):
            return "placement"
        return next((name for name, dropped in request.filtered_out.items() if pin in dropped), "pod_unavailable")

    def _timed(self, kind: str, name: str, started: float) -> None:
        """Records a part's call that began at ``started`` (``perf_counter``)."""
        timer = self._timers.get((kind, name))
        if timer is None:
            timer = self._timers[kind, name] = self._plugin_seconds.labels(kind, name)
        timer.observe(perf_counter() - started)

    def _scored(self, request: RoutingRequest, policy: Policy, pods: list[Pod]) -> list[float]:
        """The policy's preparers run, then each pod's weighted sum of its scorers' scores."""
        for preparer in policy.preparers:
            started = perf_counter()
            preparer.prepare(request, pods)
            self._timed("preparer", preparer.name, started)
        scores = [0.0] * len(pods)
        for ws in policy.scorers:
            started = perf_counter()
            scored = ws.scorer.score(request, pods)
            self._timed("scorer", ws.scorer.name, started)
            for i, s in enumerate(scored):
                scores[i] += ws.weight * s
        return scores

    def _picked(self, request: RoutingRequest, policy: Policy, pods: list[Pod], scores: list[float]) -> Pick:
        """The first settler's pick (the workflow or session pin), else the picker's."""
        for settler in policy.settlers:
            started = perf_counter()
            settled = settler.settle(request, pods)
            self._timed("filter", settler.name, started)
            if settled is not None:
                return settled
        started = perf_counter()
        pick = policy.picker.pick(request, pods, scores)
        self._timed("picker", policy.picker.name, started)
        return pick

    def _filtered(self, request: RoutingRequest, policy: Policy, pods: list[Pod]) -> list[Pod]:
        request.filtered_out = {}
        for f in policy.filters:
            if not pods:
                break
            started = perf_counter()
            kept = f.filter(request, pods)
            self._timed("filter", f.name, started)
            if len(kept) < len(pods):
                request.filtered_out[f.name] = [p.name for p in pods if p not in kept]
            pods = kept
        if not pods:
            raise no_pod_available(request.model, self._pods.back_in_s(request.model, request.leg))
        return pods
