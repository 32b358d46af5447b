"""The Responses API's routes on stored responses: ``GET``/``DELETE /v1/responses/{id}``, ``POST
/v1/responses/{id}/cancel``, ``GET /v1/responses/{id}/input_items``.

With ``responses.store: gateway`` the gateway answers them from its store
(:class:`~gateway.request.responses_state.ResponsesState`): the response as the pod answered it; its deletion;
a cancel refused as vLLM refuses one of a finished response; the input the model saw, as a page of items.
With ``responses.store: pods`` a GET (a background response's ``?stream=true`` relayed event by event as
the pod sends it) or a cancel goes to the pod that answered, and what vLLM does not serve (deleting,
listing input items) is a 501 that says so. Each is behind the same API keys as the generating routes,
and a key reads only the responses it created.

``/internal/responses/{id}`` (``GET``, ``DELETE``) is how the workers of one gateway without Redis reach
each other's stored responses (:mod:`gateway.cluster.sibling_responses`): answered only on a worker's
private Unix socket.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from gateway.api.routes import Route
from gateway.auth import ApiKeyAuth
from gateway.cluster.sibling_responses import INTERNAL_PATH
from gateway.core.errors import bad_request, not_implemented, upstream_failed
from gateway.http_client import HttpClient
from gateway.http_errors import error_event
from gateway.pods.registry import PodRegistry
from gateway.proxy.forward import Proxy
from gateway.proxy.pod_errors import translated
from gateway.request.responses_state import ResponsesState, response_not_found
from gateway.responses.store import MemoryResponses, StoredResponse, encode

PATH = "/v1/responses/{response_id}"
MAX_PAGE = 100
_WHOLE = aiohttp.ClientTimeout(total=30)
# A streamed retrieval lasts as long as the background response runs: only a silent pod ends it.
_STREAMED = aiohttp.ClientTimeout(sock_connect=30, sock_read=30)


class StoredResponseRoutes:
    """The stored responses' routes, bound to what they use: the keys, the store (``state``), the pods and the
    proxy's upstream headers (``responses.store: pods``), and ``own``: this worker's store, which its siblings
    may ask (no Redis)."""

    def __init__(self, auth: ApiKeyAuth, state: ResponsesState, pods: PodRegistry, proxy: Proxy, http: HttpClient,
                 own: MemoryResponses | None) -> None:
        self._auth = auth
        self._state = state
        self._pods = pods
        self._proxy = proxy
        self._http = http
        self._own = own

    def routes(self) -> list[Route]:
        return [Route("GET", PATH, self._retrieve), Route("DELETE", PATH, self._delete),
                Route("POST", PATH + "/cancel", self._cancel), Route("GET", PATH + "/input_items", self._input_items),
                Route("GET", INTERNAL_PATH, self._internal), Route("DELETE", INTERNAL_PATH, self._internal)]

    async def _stored(self, request: web.Request) -> StoredResponse:
        key = self._auth.check(request.headers)
        return await self._state.find(request.match_info["response_id"], key)

    async def _retrieve(self, request: web.Request) -> web.StreamResponse:
        stored = await self._stored(request)
        if self._state.pods_keep:
            return await self._on_pod(stored, request)
        if request.query.get("stream", "false").lower() == "true":
            raise not_implemented("stream: a stored response is retrieved whole here (background responses, "
                                  "which stream, need a pod's own store).", param="stream")
        return web.Response(body=stored.response, content_type="application/json")

    async def _cancel(self, request: web.Request) -> web.StreamResponse:
        stored = await self._stored(request)
        if self._state.pods_keep:
            return await self._on_pod(stored, request)
        raise bad_request("Cannot cancel a synchronous response.", param="response_id")

    async def _delete(self, request: web.Request) -> web.Response:
        stored = await self._stored(request)
        if self._state.pods_keep:
            raise not_implemented("The pods keep the responses (responses.store: pods) and do not delete them.")
        if not await self._state.delete(stored):
            raise response_not_found(stored.id, "response_id")
        return web.json_response({"id": stored.id, "object": "response", "deleted": True})

    async def _input_items(self, request: web.Request) -> web.Response:
        stored = await self._stored(request)
        if self._state.pods_keep:
            raise not_implemented("The pods keep the responses (responses.store: pods) and do not list their "
                                  "input.")
        return _input_page(stored, request.query)

    async def _on_pod(self, stored: StoredResponse, request: web.Request) -> web.StreamResponse:
        """The request sent on to the pod that keeps the response, and its answer (errors in OpenAI's shape)."""
        pod = self._pods.get(stored.pod)
        if pod is None:
            raise response_not_found(stored.id, "response_id")
        headers = self._proxy.upstream_headers(request.headers, request.headers.get("x-request-id") or stored.id)
        streamed = request.query.get("stream", "false").lower() == "true"
        try:
            async with self._http.session.request(request.method, pod.url + request.path_qs, headers=headers,
                                                  timeout=_STREAMED if streamed else _WHOLE) as upstream:
                if upstream.status < 400 and upstream.content_type == "text/event-stream":
                    return await _relayed(upstream, request, pod.name)
                data = await upstream.read()
                status = upstream.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise upstream_failed(f"Pod {pod.name}, which keeps response {stored.id}, did not answer: {exc}"
                                  ) from None
        if status >= 400:
            return translated(status, data, request.path).to_response()
        return web.Response(status=status, body=data, content_type="application/json",
                            headers={"x-gateway-pod": pod.name})

    async def _internal(self, request: web.Request) -> web.Response:
        """A sibling worker asking for (or deleting) a response this worker holds; only on the private socket."""
        own = self._own
        if own is None or request.transport is None or not isinstance(
                request.transport.get_extra_info("sockname"), str):
            raise web.HTTPNotFound()
        response_id = request.match_info["response_id"]
        if request.method == "DELETE":
            return web.Response(status=200 if own.drop(response_id) else 404)
        stored = own.find(response_id)
        if stored is None:
            return web.Response(status=404)
        return web.Response(body=encode(stored), content_type="application/msgpack")


def _input_page(stored: StoredResponse, query: Mapping[str, str]) -> web.Response:
    """A page of the input a stored response answered, as OpenAI lists it (``limit``, ``order``, ``after``)."""
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise bad_request(f"limit: must be an integer from 1 to {MAX_PAGE}.", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order: must be asc or desc.", param="order")
    items = [_listed(item, f"{stored.id}_input_{i}") for i, item in enumerate(orjson.loads(stored.input))]
    if order == "desc":
        items.reverse()
    start = 0
    if (after := query.get("after")) is not None:
        start = next((i + 1 for i, item in enumerate(items) if item["id"] == after), len(items))
    page = items[start:start + limit]
    return web.json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None,
                              "has_more": start + limit < len(items)}, dumps=_dumps)


def _listed(item: dict[str, Any], item_id: str) -> dict[str, Any]:
    """An input item as OpenAI lists it: with an id, and a message's type (the client may have left them out)."""
    if "id" in item and "type" in item:
        return item
    return {"id": item.get("id", item_id), "type": item.get("type", "message"), **item}


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


async def _relayed(upstream: aiohttp.ClientResponse, request: web.Request, pod: str) -> web.StreamResponse:
    """A background response's events (``?stream=true``), relayed as the pod sends them while it runs."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream", "x-gateway-pod": pod})
    await response.prepare(request)
    try:
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (aiohttp.ClientError, TimeoutError):
            await response.write(error_event(upstream_failed(f"Pod {pod} stopped the stream early."), False))
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left
    return response
