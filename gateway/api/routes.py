"""HTTP routes: what a kit serves (:meth:`~gateway.kits.kit.Kit.routes`), each a method, a path template and a
handler bound to the parts it uses; and the handlers of the clients' own routes (the OpenAI and Anthropic
endpoints, proxied; ``/v1/models``; a workflow's state and end; liveness, readiness and the OpenAPI document)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.api.http_edge import HttpEdge
from gateway.api.openapi import openapi_document
from gateway.auth import ApiKey, ApiKeyAuth, owner_tag
from gateway.cluster.identity import WorkerIdentity
from gateway.core.errors import GatewayError
from gateway.core.inference_api import PATHS, RequestKind
from gateway.pods.health import HealthChecker
from gateway.pods.registry import PodRegistry
from gateway.proxy.forward import Proxy
from gateway.request.director import RequestDirector
from gateway.tokenization.tokenizers import TokenizationService
from gateway.workflow.planning import WorkflowService

# The deployment of the simulated pods ``gateway serve --mock-pods`` starts (simulator/launcher.py).
SIMULATED = "mock"

# The generating routes, each a request kind served by the director (count_tokens has its own).
PROXIED_ROUTES = {path: kind for kind, path in PATHS.items() if kind != RequestKind.COUNT_TOKENS}


@dataclass(frozen=True, slots=True)
class Route:
    """One route a kit serves. ``path`` is the template (``/v1/workflows/{workflow_id}``): what the answers'
    records name (:mod:`gateway.api.records`) and the OpenAPI document describes."""

    method: str
    path: str
    handler: Handler


def add_routes(app: web.Application, routes: Iterable[Route]) -> None:
    """Every route on ``app``'s router (a GET answers HEAD too, as aiohttp's ``add_get`` makes it)."""
    for route in routes:
        if route.method == "GET":
            app.router.add_get(route.path, route.handler)
        else:
            app.router.add_route(route.method, route.path, route.handler)


def name_worker(app: web.Application, identity: WorkerIdentity) -> None:
    """With several workers (``serve --workers N``), each answer names the one that answered."""

    async def named(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-gateway-worker"] = identity.name

    if identity.count > 1:
        app.on_response_prepare.append(named)


def check_admin(auth: ApiKeyAuth, request: web.Request) -> None:
    """An operators' page: a 404 when they are off (answered exactly as a route that does not exist), else
    the admin key."""
    if not auth.debug_endpoints:
        raise web.HTTPNotFound()
    auth.check_admin(request.headers)


async def directed(auth: ApiKeyAuth, proxy: Proxy, body_timeout_s: float | None, director: RequestDirector,
                   kind: RequestKind, request: web.Request) -> web.StreamResponse:
    edge = HttpEdge(request, proxy, body_timeout_s)
    try:
        key = auth.check(request.headers)  # who; the model and rate checks run once the body is parsed
    except GatewayError as err:
        director.refused(edge, kind, err)
        raise
    await director.handle(edge, kind, key)
    assert edge.response is not None  # the director returns only once an answer was relayed
    return edge.response


async def model_list(auth: ApiKeyAuth, pods: PodRegistry, cards: Callable[[ApiKey | None], list[dict[str, Any]]],
                     request: web.Request) -> web.Response:
    """The models the fleet serves that the caller's key may use (just after start, once the pods have answered)."""
    key = auth.check(request.headers)
    await pods.first_answers()
    return web.json_response({"object": "list", "data": cards(key)})


async def complete_workflow(auth: ApiKeyAuth, workflows: WorkflowService, request: web.Request) -> web.Response:
    """The caller's own workflow of that id (another key's is a 404)."""
    owner = owner_tag(auth.check(request.headers))
    return web.json_response(workflows.complete(request.match_info["workflow_id"], owner))


async def workflow_state(auth: ApiKeyAuth, workflows: WorkflowService, request: web.Request) -> web.Response:
    owner = owner_tag(auth.check(request.headers))
    return web.json_response(workflows.describe(request.match_info["workflow_id"], owner))


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


READY = "ready"


def readiness(draining: Callable[[], bool], ready_pods: Callable[[], int], tokens: TokenizationService,
              health: HealthChecker) -> tuple[str, int]:
    """Whether the process takes requests (:data:`READY`, else why not) and how many pods can: what ``/readyz``
    and the EPP's gRPC readiness both answer."""
    pods = ready_pods()
    if draining():
        return "draining", pods
    if tokens.loading:  # it listens at once; requests would wait for the tokenizers
        return "loading tokenizers", pods
    if any(p.config.deployment == SIMULATED for p in health.unanswered()):
        # serve --mock-pods starts them beside the gateway (it stops if one fails to): ready once all answer.
        return "starting simulated pods", pods
    return (READY, pods) if pods else ("no healthy pod", 0)


async def readyz(ready: Callable[[], tuple[str, int]], request: web.Request) -> web.Response:
    status, pods = ready()
    return web.json_response({"status": status, "ready_pods": pods}, status=200 if status == READY else 503)
