"""An *edge*: a front door through which the director serves a request.

The director (:mod:`gateway.request.director`) runs the same steps for every request; an edge is what
differs between front doors. The HTTP proxy's edge (:mod:`gateway.api.http_edge`) reads the body from
the client's connection and relays the pod's answer itself. The endpoint picker's edge
(:mod:`gateway.epp.edge`) is handed the body by Envoy, answers Envoy with the chosen pod, and learns from
Envoy how the answer, which Envoy relays, began and ended. Neither runs a step of its own.
"""

from __future__ import annotations

from typing import Protocol

from gateway.proxy.outcome import RelayOutcome, UpstreamCall
from gateway.request.types import Headers


class Edge(Protocol):
    """One request's front door. ``headers``, ``method`` and ``path`` are the client's."""

    headers: Headers
    method: str
    path: str  # with its query string
    # How many fallback pods each call should name (the data plane tries them in order), and the pods the
    # data plane allows this request to go to (None: any of the pool).
    fallbacks: int
    allowed_pods: frozenset[str] | None

    def identified(self, request_id: str) -> None:
        """The request's id is known (echoed on errors, and to tell the request's events apart)."""

    async def read_body(self, max_bytes: int) -> bytes:
        """The body as the client meant it (decoded from its content-encoding), at most ``max_bytes``;
        raises a :class:`~gateway.core.errors.GatewayError` for one that cannot be read."""

    async def deliver(self, call: UpstreamCall) -> RelayOutcome:
        """Have ``call`` reach its pod and the answer reach the client, and say how the answer ended.
        Raises :class:`~gateway.proxy.outcome.RetryableFailure` when nothing reached the client and
        another pod may take the request (behind Envoy: one already has, named in ``served_by``)."""
