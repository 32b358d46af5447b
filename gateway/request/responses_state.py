"""The Responses API's state on the request path: a conversation continued by ``previous_response_id``.

With ``responses.store: gateway`` (the default) pods stay stateless. The resolve step
(:class:`ResponsesState`) turns a request that continues a stored response into the whole conversation
before anything else reads it: the stored response's input, its output items, then the request's own
input, sent as ``input`` without ``previous_response_id`` and with ``store`` false. Tokenization and
routing then see the conversation's full prompt, so placement finds its KV as it finds a continuing chat's,
on any worker or replica. The conversation (the id of its first response) is the request's
``conversation``: a session for placement and keep-warm. As the answer passes, its tap
(:class:`~gateway.proxy.outcome.AnswerTap`) keeps the new response (its input and the pod's response
object) before the answer's last bytes reach the client, unless the request said ``store: false``. The
pod's bytes reach the client unchanged. ``background`` is not served this way (501): it needs a pod's store.

With ``responses.store: pods`` the pod that answered keeps the response (vLLM's
``VLLM_ENABLE_RESPONSES_API_STORE``): the gateway records only which pod that was, and a follow-up goes
to that pod alone, its body untouched.

A response's id is the gateway's own (the ``request_id`` it sends the pod; a client's is replaced), unique
across workers and replicas, and a stored response is never replaced by another of the same id. An id the
store does not hold, or that another API key created, is a 404 in OpenAI's shape; so, with the
gateway's store, is one that a replica with the pods' store recorded in the shared store (it holds no
conversation).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable
from typing import Any

import msgspec
import orjson

from gateway.auth import ApiKey
from gateway.config import ResponsesConfig
from gateway.core.errors import ErrorKind, GatewayError, bad_request
from gateway.core.inference_api import RequestKind
from gateway.pods.registry import PodRegistry
from gateway.request.types import ClientRequest
from gateway.responses.store import ResponsesMetrics, ResponseStore, StoredResponse, StoreUnavailable

log = logging.getLogger("gateway.responses")

# Where the whole conversation goes in the rewritten body (a string no client sends).
_SPLICE = f"\x00{secrets.token_hex(8)}\x00"
_SPLICED = msgspec.json.encode(_SPLICE)


class _Response(msgspec.Struct):
    id: str


class _Event(msgspec.Struct):
    response: msgspec.Raw


class _Output(msgspec.Struct):
    output: list[Any] = []


_response = msgspec.json.Decoder(_Response)
_event = msgspec.json.Decoder(_Event)
_output = msgspec.json.Decoder(_Output)


def owner_of(key: ApiKey | None) -> str:
    """Who may read a stored response: the API key that created it (its digest), or anyone with keys off."""
    return key.config.hash if key is not None else ""


def response_not_found(response_id: str, param: str) -> GatewayError:
    return GatewayError(ErrorKind.NOT_FOUND, f"Response with id '{response_id}' not found.", code="response_not_found",
                        param=param)


class ResponsesState:
    """resolve: a Responses request continuing a stored response becomes its whole conversation (or, with
    the pods' store, is bound to the pod that keeps it); its answer's tap keeps the new response."""

    def __init__(self, config: ResponsesConfig, store: ResponseStore, pods: PodRegistry,
                 metrics: ResponsesMetrics) -> None:
        self.pods_keep = config.store == "pods"  # the pods keep them (vLLM's store), not the gateway
        self.store = store
        self._pods = pods
        self._metrics = metrics

    def resolve(self, request: ClientRequest) -> ClientRequest | Awaitable[ClientRequest] | None:
        if request.kind != RequestKind.RESPONSES:
            return None
        parsed = request.parsed
        if self.pods_keep:
            request = _with_gateway_id(request)
            if parsed.previous_response_id is not None:
                return self._on_keeping_pod(request)
            return dataclasses.replace(request, answer_tap=_Tap(self, owner_of(request.key), None, None))
        if parsed.background:  # a 400, as OpenAI refuses a parameter: the SDKs retry a 5xx, to no end here
            raise bad_request("background: background responses need a pod's own store; this gateway keeps "
                              "responses itself (responses.store: gateway).", param="background",
                              code="unsupported_parameter")
        if parsed.previous_response_id is not None:
            return self._continued(request)
        if parsed.store is False:
            return None
        tap = _Tap(self, owner_of(request.key), None, orjson.dumps(_items(parsed.input)))
        return dataclasses.replace(_with_gateway_id(request), answer_tap=tap)

    async def find(self, response_id: str, key: ApiKey | None, param: str = "response_id") -> StoredResponse:
        """The stored response, if ``key`` may read it; else a 404 (503 when the shared store is down)."""
        try:
            stored = await self.store.get(response_id)
        except StoreUnavailable:
            raise _store_unavailable() from None
        # A record with no response is the pods' store's (a replica with responses.store: pods wrote it to
        # the shared store): the gateway's store holds nothing of it to serve or continue.
        if stored is None or stored.owner != owner_of(key) or not (self.pods_keep or stored.response):
            self._metrics.events.labels("not_found").inc()
            raise response_not_found(response_id, param)
        self._metrics.events.labels("found").inc()
        return stored

    async def delete(self, stored: StoredResponse) -> bool:
        """Whether the store held it (and now does not); a 503 when the shared store is down."""
        try:
            deleted = await self.store.delete(stored)
        except StoreUnavailable:
            raise _store_unavailable() from None
        if deleted:
            self._metrics.events.labels("deleted").inc()
        return deleted

    async def keep(self, stored: StoredResponse) -> None:
        try:
            kept = await self.store.put(stored)
        except StoreUnavailable:
            self._metrics.events.labels("store_failed").inc()  # served, but not kept: a follow-up will 404
            return
        if kept:
            self._metrics.events.labels("stored").inc()

    async def _continued(self, request: ClientRequest) -> ClientRequest:
        parsed = request.parsed
        assert parsed.previous_response_id is not None
        previous = await self.find(parsed.previous_response_id, request.key, "previous_response_id")
        earlier = orjson.loads(previous.input)
        items = [*earlier, *_output.decode(previous.response).output, *_items(parsed.input)]
        items_json = orjson.dumps(items)
        body = _body(request)
        body.pop("previous_response_id", None)
        body["input"], body["store"], body["request_id"] = _SPLICE, False, new_response_id()
        encoded = msgspec.json.encode(body).replace(_SPLICED, items_json, 1)
        conversation = parsed.conversation or previous.conversation
        # previous_response_id stays in what was parsed (the body no longer names it): the model rules give a
        # continued response the target that answered it.
        expanded = msgspec.structs.replace(parsed, input=items, store=False, conversation=conversation)
        tap = None if parsed.store is False else _Tap(self, owner_of(request.key), previous.conversation, items_json)
        return dataclasses.replace(request, body=encoded, parsed=expanded, answer_tap=tap)

    async def _on_keeping_pod(self, request: ClientRequest) -> ClientRequest:
        parsed = request.parsed
        assert parsed.previous_response_id is not None
        previous = await self.find(parsed.previous_response_id, request.key, "previous_response_id")
        pod = self._pods.get(previous.pod)
        if pod is None:
            raise response_not_found(parsed.previous_response_id, "previous_response_id")  # its pod left the fleet
        return dataclasses.replace(
            request, only_pod=pod.name, answer_tap=_Tap(self, owner_of(request.key), previous.conversation, None),
            parsed=msgspec.structs.replace(parsed, conversation=parsed.conversation or previous.conversation))


def new_response_id() -> str:
    """A response's id, made by the gateway (never the client's ``request_id``): 122 random bits, as vLLM makes
    its own, so unique across workers and replicas without asking any of them."""
    return f"resp_{uuid.uuid4().hex}"


def _body(request: ClientRequest) -> dict[str, Any]:
    try:  # msgspec, not orjson: a big integer is kept exact; a number out of a double's range refused
        body = msgspec.json.decode(request.body)
    except msgspec.MsgspecError as exc:
        raise bad_request(f"invalid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.")
    return body


def _with_gateway_id(request: ClientRequest) -> ClientRequest:
    """The request with the gateway's own response id as its ``request_id``, which the pod names its response
    by (vLLM's ``ResponsesRequest.request_id``): a client cannot choose the id its response is kept under,
    so it cannot take another's over."""
    body = _body(request)
    body["request_id"] = new_response_id()
    return dataclasses.replace(request, body=msgspec.json.encode(body))


def _store_unavailable() -> GatewayError:
    return GatewayError(ErrorKind.UNAVAILABLE, "The Responses store is not answering; retry shortly.",
                        code="store_unavailable")


def _items(value: Any) -> list[Any]:
    """A request's input as items: a string is one user message (as OpenAI lists it; rendered the same)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    return list(value)


class _EventCapture:
    """The data of one named event of an SSE stream, found as chunks pass (an event may span chunks)."""

    __slots__ = ("_event", "_marker", "_tail", "done")

    def __init__(self, name: str) -> None:
        self._marker = f"event: {name}\n".encode()
        self._tail = b""
        self._event: bytearray | None = None
        self.done = False

    def feed(self, chunk: bytes) -> bytes | None:
        if self._event is None:
            data = self._tail + chunk
            at = data.find(self._marker)
            if at < 0:
                self._tail = data[-len(self._marker):]
                return None
            self._event = bytearray(data[at:])
        else:
            self._event += chunk
        end = self._event.find(b"\n\n")
        if end < 0:
            return None
        self.done = True
        return bytes(self._event[:end]).partition(b"\ndata: ")[2]


class _Tap:
    """The answer's tap: keeps the new response before the client has all of it. With the gateway's store
    (``items_json``: the input the model saw) the whole response is kept, from the stream's last event;
    with the pods' store only which pod answered, from its first."""

    __slots__ = ("_capture", "_conversation", "_input", "_owner", "_state")

    def __init__(self, state: ResponsesState, owner: str, conversation: str | None, items_json: bytes | None) -> None:
        self._state = state
        self._owner = owner
        self._conversation = conversation
        self._input = items_json
        self._capture = _EventCapture("response.created" if items_json is None else "response.completed")

    def whole(self, pod: str, body: bytes) -> Awaitable[None] | None:
        return self._keep(pod, body)

    def chunk(self, pod: str, chunk: bytes) -> Awaitable[None] | None:
        if self._capture.done or (data := self._capture.feed(chunk)) is None:
            return None
        try:
            response = bytes(_event.decode(data).response)
        except msgspec.MsgspecError:
            log.warning("a Responses stream's event did not parse; the response is not kept")
            return None
        return self._keep(pod, response)

    def _keep(self, pod: str, response: bytes) -> Awaitable[None] | None:
        try:
            response_id = _response.decode(response).id
        except msgspec.MsgspecError:
            return None
        conversation = self._conversation or response_id
        if self._input is None:
            return self._state.keep(StoredResponse(response_id, pod, self._owner, conversation, time.time()))
        return self._state.keep(StoredResponse(response_id, pod, self._owner, conversation, time.time(),
                                               self._input, response))
