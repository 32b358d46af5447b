"""HTTP routes: the OpenAI endpoints (proxied) and the operational ones (models, health, metrics)."""

from __future__ import annotations

import asyncio
import os
import time
from functools import partial

from aiohttp import web

from gateway.api.http_edge import HttpEdge
from gateway.api.openapi import openapi_document
from gateway.api.records import from_sibling
from gateway.api.responses import add_response_routes
from gateway.auth import owner_tag
from gateway.cluster.sibling_metrics import OWN_ONLY, merge_expositions, sibling_expositions
from gateway.components import GATEWAY_KEY, Gateway
from gateway.core.errors import GatewayError
from gateway.core.requests import PATHS, RequestKind
from gateway.kits.requests import FrontDoor
from gateway.request.director import RequestDirector

# The deployment of the simulated pods ``gateway serve --mock-pods`` starts (simulator/launcher.py).
SIMULATED = "mock"

# The generating routes, each a request kind served by the director (count_tokens has its own).
PROXIED_ROUTES = {path: kind for kind, path in PATHS.items() if kind != RequestKind.COUNT_TOKENS}


def add_routes(app: web.Application) -> None:
    """The routes of the gateway stored on ``app`` (under ``GATEWAY_KEY``), each handler bound to what it
    uses: the clients' routes to the front door, the operators' pages to the whole gateway."""
    gateway = app[GATEWAY_KEY]
    front = gateway.front
    for path, kind in PROXIED_ROUTES.items():
        app.router.add_post(path, partial(_directed, front, front.director, kind))
    app.router.add_post(PATHS[RequestKind.COUNT_TOKENS],
                        partial(_directed, front, front.counting, RequestKind.COUNT_TOKENS))
    add_response_routes(app, front, gateway.http, gateway.own_responses)
    app.router.add_get("/v1/models", partial(_models, front))
    app.router.add_post("/v1/workflows/{workflow_id}/complete", partial(_complete_workflow, front))
    app.router.add_get("/v1/workflows/{workflow_id}", partial(_workflow_state, front))
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_get("/readyz", partial(_readyz, gateway))
    app.router.add_get("/metrics", partial(_metrics, gateway))
    app.router.add_get("/debug/pods", partial(_debug_pods, gateway))
    app.router.add_get("/debug/index", partial(_debug_index, gateway))
    app.router.add_get("/debug/placement", partial(_debug_placement, gateway))
    app.router.add_get("/debug/flows", partial(_debug_flows, gateway))
    app.router.add_get("/debug/steps", partial(_debug_steps, gateway))
    app.router.add_get("/debug/adapters", partial(_debug_adapters, gateway))
    app.router.add_get("/debug/usage", partial(_debug_usage, gateway))
    app.router.add_get("/debug/workflows", partial(_debug_workflows, gateway))
    app.router.add_get("/debug/workers", partial(_debug_workers, gateway))
    if gateway.identity.count > 1:
        app.on_response_prepare.append(partial(_name_worker, gateway.identity.name))


async def _name_worker(name: str, request: web.Request, response: web.StreamResponse) -> None:
    """Which worker answered (``serve --workers N``)."""
    response.headers["x-gateway-worker"] = name


def _check_admin(gateway: Gateway, request: web.Request) -> None:
    auth = gateway.front.auth
    if not auth.debug_endpoints:
        raise web.HTTPNotFound()  # answered exactly as a route that does not exist
    auth.check_admin(request.headers)


async def _directed(front: FrontDoor, director: RequestDirector, kind: RequestKind, request: web.Request
                    ) -> web.StreamResponse:
    edge = HttpEdge(request, front.proxy, front.config.body_timeout_s)
    try:
        key = front.auth.check(request.headers)  # who; the model and rate checks run once the body is parsed
    except GatewayError as err:
        director.refused(edge, kind, err)
        raise
    await director.handle(edge, kind, key)
    assert edge.response is not None  # the director returns only once an answer was relayed
    return edge.response


async def _models(front: FrontDoor, request: web.Request) -> web.Response:
    """The models the fleet serves that the caller's key may use (just after start, once the pods have answered)."""
    key = front.auth.check(request.headers)
    await front.pods.first_answers()
    return web.json_response({"object": "list", "data": front.model_cards(key)})


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(gateway: Gateway, request: web.Request) -> web.Response:
    front = gateway.front
    ready_pods = front.ready_pods()
    if front.draining:
        return web.json_response({"status": "draining", "ready_pods": ready_pods}, status=503)
    if gateway.tokens.loading:  # it listens at once; requests would wait for the tokenizers
        return web.json_response({"status": "loading tokenizers", "ready_pods": ready_pods}, status=503)
    if any(p.config.deployment == SIMULATED for p in gateway.health.unanswered()):
        # serve --mock-pods starts them beside the gateway (it stops if one fails to): ready once all answer.
        return web.json_response({"status": "starting simulated pods", "ready_pods": ready_pods}, status=503)
    if not ready_pods:
        return web.json_response({"status": "no healthy pod", "ready_pods": 0}, status=503)
    return web.json_response({"status": "ready", "ready_pods": ready_pods})


async def _complete_workflow(front: FrontDoor, request: web.Request) -> web.Response:
    """The caller's own workflow of that id (another key's is a 404)."""
    owner = owner_tag(front.auth.check(request.headers))
    return web.json_response(front.workflows.complete(request.match_info["workflow_id"], owner))


async def _workflow_state(front: FrontDoor, request: web.Request) -> web.Response:
    owner = owner_tag(front.auth.check(request.headers))
    return web.json_response(front.workflows.describe(request.match_info["workflow_id"], owner))


async def _metrics(gateway: Gateway, request: web.Request) -> web.Response:
    """Every worker's metrics merged; ``?worker=self``: this worker's alone."""
    own_only = request.query.get("worker") == OWN_ONLY
    if not (own_only and from_sibling(request)):
        _check_admin(gateway, request)
    body = await _render(gateway)
    identity = gateway.identity
    if identity.count > 1 and not own_only:
        texts, unscraped = await sibling_expositions(identity)
        body = await asyncio.to_thread(merge_expositions, [body.decode(), *texts], identity.count, unscraped)
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


async def _render(gateway: Gateway) -> bytes:
    """The exposition, written on a thread: with a thousand pods it takes ~0.1 s, which would hold every
    request on the loop that long. A collector reading a dict the loop changed meanwhile is asked again, on
    the loop."""
    try:
        return await asyncio.to_thread(gateway.metrics.render)
    except RuntimeError:  # "dictionary changed size during iteration"
        return gateway.metrics.render()


async def _debug_pods(gateway: Gateway, request: web.Request) -> web.Response:
    _check_admin(gateway, request)
    now = time.monotonic()
    pods = [
        {
            "name": p.name,
            "url": p.url,
            "models": sorted(p.models),
            "role": p.config.role,
            "healthy": p.healthy,
            "ejected_for_s": round(max(0.0, p.ejected_until - now), 3),
            "ejections": p.ejections,
            "in_flight": gateway.ledger.on_pod(p.name),
            "last_error": p.last_error,
            "checked_s_ago": round(now - p.last_check, 3) if p.last_check is not None else None,
        }
        for p in gateway.pods.all()
    ]
    return web.json_response({"pods": pods, "default_policy": gateway.router.default_policy,
                              "policies": gateway.router.profiles.names(), "tasks": len(asyncio.all_tasks())})


async def _debug_index(gateway: Gateway, request: web.Request) -> web.Response:
    _check_admin(gateway, request)
    return web.json_response({**gateway.kv.debug(), "predictions": gateway.verifier.debug()})


async def _debug_placement(gateway: Gateway, request: web.Request) -> web.Response:
    _check_admin(gateway, request)
    pods = [p.name for p in gateway.pods.all()]
    keep_warm = gateway.keep_warm.debug() if gateway.keep_warm is not None else {"enabled": False}
    return web.json_response({**gateway.working_set.debug(pods, gateway.capacity_of, time.monotonic()),
                              "losses": gateway.losses.debug(), "keep_warm": keep_warm})


async def _debug_flows(gateway: Gateway, request: web.Request) -> web.Response:
    """Flow control in this process: each flow's service and what it holds, and why each pod has no room."""
    _check_admin(gateway, request)
    return web.json_response({"enabled": gateway.config.flow_control.enabled, **gateway.flow.debug()})


async def _debug_steps(gateway: Gateway, request: web.Request) -> web.Response:
    """This worker's time per step of its recent requests (``gateway_request_step_seconds`` has them all)."""
    _check_admin(gateway, request)
    return web.json_response({"worker": gateway.identity.name, "steps": gateway.steps.debug()})


async def _debug_adapters(gateway: Gateway, request: web.Request) -> web.Response:
    """LoRA adapters: where each is registered and active, when each pod served it, registrations."""
    _check_admin(gateway, request)
    return web.json_response(gateway.adapters.debug())


async def _debug_usage(gateway: Gateway, request: web.Request) -> web.Response:
    """Usage per key, tenant and model (this worker's), and each limited key's and tenant's use now (every
    worker's and replica's)."""
    _check_admin(gateway, request)
    limits = gateway.limits
    scopes = limits.limited_scopes()
    return web.json_response({"worker": gateway.identity.name, "usage": gateway.usage.debug(),
                              "share": limits.usage.share(),
                              "limited": {scope: limits.usage.debug(scope) for scope in scopes}})


async def _debug_workflows(gateway: Gateway, request: web.Request) -> web.Response:
    _check_admin(gateway, request)
    workflows = gateway.front.workflows
    return web.json_response({
        "workflows": [workflows.describe(w) for w in list(workflows.tracker.workflows)],
        "sessions": len(workflows.sessions),
        "pressure": {pod: mode.name.lower() for pod, mode in gateway.modes.items()},
        "hard_flushes": workflows.executor.hard_flushes,
    })


async def _debug_workers(gateway: Gateway, request: web.Request) -> web.Response:
    """Which worker answered, the load table the workers share, and who this one hears from."""
    _check_admin(gateway, request)
    identity = gateway.identity
    pods = [p.name for p in gateway.pods.all()]
    return web.json_response({
        "worker": identity.name, "workers": identity.count, "replica": identity.replica, "pid": os.getpid(),
        "shared_load": gateway.shared_load.debug(pods) if gateway.shared_load is not None else None,
        "in_flight_here": gateway.ledger.total(),
        "shared_state": {**gateway.bus.debug(), "remote_in_flight": gateway.ledger.remote_debug()},
    })


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())
