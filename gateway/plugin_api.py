"""The plugin contract: every extension point of the gateway, the views a plugin receives, and what a plugin
is built from. A plugin (``plugins/`` or a package of its own) imports this module and nothing else of
``gateway`` (``tests/unit/test_layers.py`` holds the shipped ones to it), so the runtime may move its
internals without breaking a plugin.

A plugin is a :class:`PluginSpec`, named by an entry point of its group in ``pyproject.toml``: the msgspec
Struct its options decode into (with their defaults) and the function that builds it from its group's
context and those options (docs/routing.md, "A new scorer").

Routing parts, run by the router in this order for each attempt (the Gateway API Inference Extension's
names in brackets):

- ``gateway.filters``: a :class:`Filter` [Filter] narrows the candidates; a filter with a ``settle``
  method is a :class:`Settler` (the workflow or session pin), run after the scorers;
- a :class:`Preparer` computes what scorers and pickers share (the prefix match, the placement costs),
  once per attempt; it is not found by name: a part names the ones it needs in its :class:`Needs`;
- ``gateway.scorers``: a :class:`Scorer` [Scorer] scores each candidate in ``[0, 1]``, higher is better;
  the policy weighs and sums the scores;
- ``gateway.pickers``: a :class:`Picker` [Picker] chooses one pod from the candidates and their totals;
- ``gateway.policies``: a shipped policy turns its ``routing.options`` into a :class:`ProfileConfig` (its
  filters, weighted scorers and picker, by name).

Routing parts are built with a :class:`PolicyContext` and read a :class:`RoutingRequest`; the router
times each call (``gateway_routing_plugin_seconds{kind, plugin}``), so a part measures nothing itself.

Request hooks, run by the director for every request whichever edge received it (the HTTP proxy, or Envoy
through the endpoint picker), in the order ``hooks`` lists them; the Extension's ``requestcontrol`` points:

- ``gateway.pre_request``: a :class:`PreRequest` [PreRequest] sees each attempt once its pod is chosen,
  before it is sent (a :class:`PreRequestView`), and may return headers to add to what the pod receives;
- ``gateway.response_complete``: a :class:`ResponseComplete` [ResponseComplete] sees each request once,
  after its answer ended however it ended (a :class:`ResponseView`), on the event loop's next turn.

Both are built with a :class:`HookContext`; the director times each call (the same histogram, kinds
``pre_request`` and ``response_complete``) and counts a call that raises
(``gateway_request_hook_errors_total{kind, hook}``): the request goes on as if the hook were not there. A
hook runs on the event loop: one with slow work (a network call) hands it to a task or a thread of its own.

The other kinds: ``gateway.cache_controllers`` (a :class:`CacheController` flushes a pod's prefix cache),
``gateway.pressure_sources`` (a :class:`PressureSource` reads a pod's cache usage; built with a
:class:`PressureContext`), ``gateway.discovery_sources`` (a :class:`DiscoverySource` watches the fleet's
pods; built with a :class:`DiscoveryContext`).

Where a part reads the gateway's shared state, it is given a narrow read-only view (:class:`InFlightCounts`,
:class:`PendingLoadView`, :class:`Observer`); the few components re-exported whole say why beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import msgspec

from gateway.config import ConfigError, PartConfig, PodConfig, ProfileConfig, ScorerConfig, read_config_file
from gateway.core.inference_api import RequestKind

# The prefix indexes and the working set are re-exported whole: a matcher and the placement planner use most
# of what they offer (lookups keyed by prompt hashes, the working set's contexts and their forecast), so a
# narrower view would restate their signatures and the types they return.
from gateway.kv.approx import ApproximatePrefixIndex
from gateway.kv.index import PrefixIndex
from gateway.kv.working_set import ResumableWorkingSet
from gateway.load.pending import EngineStats, Estimate
from gateway.plugin_registry import NoOptions, PluginSpec
from gateway.pods.discovery import DiscoveryContext, DiscoverySource
from gateway.pods.registry import Pod
from gateway.pressure.monitor import DeviceOptions, PressureContext, PressureSource, PressureSourceUnavailable
from gateway.routing.policy import (
    NO_NEEDS,
    Filter,
    Needs,
    Pick,
    Picker,
    PlacementCost,
    PolicyContext,
    PrefixMatch,
    Preparer,
    RoutingRequest,
    Scorer,
    Settler,
)

# The text the approximate prefix index is keyed by: a plugin must derive it as the gateway records it.
from gateway.tokenization.conversation import request_text
from gateway.workflow.actions import CacheController, FlushOutcome

# A pod's KV capacity in tokens, when known (``PolicyContext.capacity_of``, ``PressureContext.capacity_of``).
CapacityOf = Callable[[str], float | None]


class InFlightCounts(Protocol):
    """Requests in flight per pod through the gateway (``PolicyContext.ledger``), counted before they are sent."""

    def on_pod(self, pod: str) -> int: ...


class PendingLoadView(Protocol):
    """Each pod's Little's-law load and a request's predicted cost there (``PolicyContext.load``,
    ``PressureContext.load``)."""

    @property
    def engine(self) -> Mapping[str, EngineStats]:
        """What each pod's ``/metrics`` said last."""
        ...

    def estimate(self, pod: str, model: str, input_tokens: int, output_tokens: int) -> Estimate: ...

    def load(self, pod: str) -> float: ...

    def fits(self, pod: str, estimate: Estimate, kind: RequestKind) -> bool: ...


class Observer(Protocol):
    """A histogram a part records into (``PolicyContext.metrics.lookup_seconds``)."""

    def observe(self, amount: float) -> None: ...


class PreRequestView(msgspec.Struct, frozen=True):
    """One attempt, its pod chosen, before it is sent: what a :class:`PreRequest` hook sees."""

    request_id: str
    model: str  # the model it is served as (the target of the client's name, when a model rule maps it)
    kind: RequestKind
    pod: str  # the chosen pod's name
    pod_url: str
    policy: str  # the routing profile that chose it
    reason: str  # why it chose it (the ``reason`` label of gateway_routing_decisions_total)
    # 0 for the first try; a retry on another pod is seen again. Behind Envoy, a fallback endpoint the data
    # plane took by itself (reason ``fallback``) is seen once it was sent: its headers reach no pod.
    attempt: int


class ResponseView(msgspec.Struct, frozen=True):
    """A request whose answer ended, as the gateway recorded it: what a :class:`ResponseComplete` hook sees."""

    request_id: str
    model: str  # as the client asked for it ("-": a body not understood)
    kind: RequestKind
    pod: str | None  # the pod of its last attempt (None: it never reached one)
    status: int  # the status line the client got (a stream's 200 even when it broke: ``outcome`` says)
    outcome: str  # ok, error, engine_error, malformed, upstream_broke, client_gone, client_stalled
    attempts: int
    prompt_tokens: int | None  # the pod's usage, when its answer reported one
    completion_tokens: int | None
    first_byte_s: float | None  # from the request's arrival to the answer's first byte (its TTFT)
    total_s: float  # from the request's arrival to its end


@dataclass(frozen=True, slots=True)
class HookContext:
    """What a request hook is built with: the name the config gives it (its entry point's)."""

    name: str


class PreRequest(Protocol):
    """``gateway.pre_request``: headers to add to the attempt the pod receives (a name it already carries
    keeps the gateway's value), or None."""

    def pre_request(self, request: PreRequestView) -> Mapping[str, str] | None: ...


class ResponseComplete(Protocol):
    """``gateway.response_complete``: sees how a request ended; what it returns is not read."""

    def response_complete(self, response: ResponseView) -> None: ...


__all__ = [
    "NO_NEEDS",
    "ApproximatePrefixIndex",
    "CacheController",
    "CapacityOf",
    "ConfigError",
    "DeviceOptions",
    "DiscoveryContext",
    "DiscoverySource",
    "EngineStats",
    "Estimate",
    "Filter",
    "FlushOutcome",
    "HookContext",
    "InFlightCounts",
    "Needs",
    "NoOptions",
    "Observer",
    "PartConfig",
    "PendingLoadView",
    "Pick",
    "Picker",
    "PlacementCost",
    "PluginSpec",
    "Pod",
    "PodConfig",
    "PolicyContext",
    "PreRequest",
    "PreRequestView",
    "PrefixIndex",
    "PrefixMatch",
    "Preparer",
    "PressureContext",
    "PressureSource",
    "PressureSourceUnavailable",
    "ProfileConfig",
    "RequestKind",
    "ResponseComplete",
    "ResponseView",
    "ResumableWorkingSet",
    "RoutingRequest",
    "Scorer",
    "ScorerConfig",
    "Settler",
    "read_config_file",
    "request_text",
]
