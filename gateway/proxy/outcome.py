"""What one upstream call is and how it ended: the proxy's input and its typed result.

The proxy returns a :class:`RelayOutcome` for every answer it relayed, and raises
:class:`RetryableFailure` (nothing reached the client: another pod may take it) or a
:class:`~gateway.core.errors.GatewayError` (an answer to give the client, not retried). The director
records the outcome once; nobody else decides a request's status.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.core.errors import GatewayError
from gateway.core.usage import Usage
from gateway.pods.registry import Pod
from gateway.proxy.rewrite import AnswerRewrite


class AnswerTap(Protocol):
    """Reads a pod's successful answer as it passes, before the client has its end (the Responses API's
    store keeps the response this way). Each method returns an awaitable only when it has work to wait for;
    the relay waits for it before writing what it was shown."""

    def whole(self, pod: str, body: bytes) -> Awaitable[None] | None:
        """A whole (not streamed) answer of ``pod``."""

    def chunk(self, pod: str, chunk: bytes) -> Awaitable[None] | None:
        """The next chunk of ``pod``'s streamed answer."""


@dataclass(frozen=True, slots=True)
class UpstreamCall:
    """One attempt, as an edge needs it: where to, and what to send (the edge knows whom to answer)."""

    pod: Pod
    path: str  # with its query string
    body: bytes  # the client's, or a decode leg's rewrite of it
    headers: dict[str, str]  # sent to the pod
    answer_headers: dict[str, str]  # the gateway's own, added to the answer (x-gateway-pod, ...)
    request_id: str
    anthropic: bool  # Anthropic's API: a broken stream ends with its named error event
    # Called once, when the pod's answer begins (its first byte relayed): the prompt is prefilled.
    answering: Callable[[], None] | None = None
    # Called when the client left mid-stream and the server cancelled its request (so no outcome can be
    # returned), with how far the answer had come: what the pod generated until then was used.
    left: Callable[[RelayOutcome], None] | None = None
    # The pods to try next, best first, for an edge whose data plane retries by itself (Envoy).
    fallbacks: tuple[Pod, ...] = ()
    # What the answer needs on its way to the client (the public model name restored), if anything.
    rewrite: AnswerRewrite | None = None
    # Reads the answer as it passes (the HTTP proxy's edge; Envoy relays answers itself).
    tap: AnswerTap | None = None


class Ending(enum.Enum):
    COMPLETE = "complete"  # the pod's whole answer reached the client
    UPSTREAM_BROKE = "upstream_broke"  # the pod failed or stalled mid-stream; the client got an error event
    CLIENT_GONE = "client_gone"  # the client disconnected
    CLIENT_STALLED = "client_stalled"  # the client stopped reading for ``server.client_stall_s``: cut
    FAILED = "failed"  # nothing was relayed: the attempt failed before the first byte
    ENGINE_ERROR = "engine_error"  # the whole stream reached the client, an engine's error event inside it
    MALFORMED = "malformed"  # the pod wrote an event that is not JSON: held back, the client got an error event


@dataclass(frozen=True, slots=True)
class RelayOutcome:
    """How an attempt ended. ``status`` is the request's truth for learning: a stream whose 200 headers went
    out but that broke is a 502 (or a 499 when the client left); ``sent`` is the status line the client got
    (None: none yet), which metrics and logs count, with the ending beside it."""

    status: int
    ending: Ending
    first_byte_at: float | None = None
    usage: Usage | None = None
    streamed_events: int = 0
    # Monotonic, when the pod's answer's headers reached the gateway (the step timings' connect ends there).
    headers_at: float | None = None
    # A Responses answer's id, where the call asked for it (``UpstreamCall.rewrite``).
    response_id: str | None = None
    sent: int | None = None

    @property
    def complete(self) -> bool:
        return self.ending is Ending.COMPLETE

    @classmethod
    def failed(cls, status: int) -> RelayOutcome:
        return cls(status, Ending.FAILED)


class RetryableFailure(Exception):
    """The pod failed before anything reached the client: another pod may take the request. Behind Envoy
    the data plane has already taken it to one of the EPP's fallback endpoints: ``served_by`` says which."""

    def __init__(self, error: GatewayError, cause: str, status: int = 502, served_by: Pod | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.cause = cause
        self.status = status  # the pod's own 5xx, or 502 (unreachable, or it broke off)
        self.served_by = served_by
