"""The operators' pages: ``/metrics`` and ``/debug/*``, behind the admin key (a 404 when
``auth.debug_endpoints`` is off). Each kit serves the page of its own state (:meth:`~gateway.kits.kit.Kit.routes`),
its handler bound to the parts it reads."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gateway.api.records import from_sibling
from gateway.api.routes import check_admin
from gateway.auth import ApiKeyAuth
from gateway.cluster.bus import StateBus
from gateway.cluster.identity import WorkerIdentity
from gateway.cluster.sibling_metrics import OWN_ONLY, merge_expositions, sibling_expositions
from gateway.flow.controller import FlowController
from gateway.kv.subscriptions import KvEventService
from gateway.kv.verification import PredictionVerifier
from gateway.kv.working_set import ResumableWorkingSet
from gateway.limits.enforcer import KeyLimits
from gateway.limits.usage import UsageTally
from gateway.load.ledger import InFlightLedger
from gateway.load.pressure_modes import PressureModes
from gateway.load.shared_table import SharedLoadTable
from gateway.metrics import GatewayMetrics
from gateway.models.adapters import AdapterLoader
from gateway.pods.registry import PodRegistry
from gateway.request.context_steps import PlacementLosses
from gateway.request.observers import StepMetrics
from gateway.routing.router import Router
from gateway.workflow.keep_warm import KeepWarm
from gateway.workflow.planning import WorkflowService


async def metrics(auth: ApiKeyAuth, gateway_metrics: GatewayMetrics, identity: WorkerIdentity,
                  request: web.Request) -> web.Response:
    """Every worker's metrics merged; ``?worker=self``: this worker's alone."""
    own_only = request.query.get("worker") == OWN_ONLY
    if not (own_only and from_sibling(request)):
        check_admin(auth, request)
    body = await _render(gateway_metrics)
    if identity.count > 1 and not own_only:
        texts, unscraped = await sibling_expositions(identity)
        body = await asyncio.to_thread(merge_expositions, [body.decode(), *texts], identity.count, unscraped)
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


async def _render(gateway_metrics: GatewayMetrics) -> bytes:
    """The exposition, written on a thread: with a thousand pods it takes ~0.1 s, which would hold every
    request on the loop that long. A collector reading a dict the loop changed meanwhile is asked again, on
    the loop."""
    try:
        return await asyncio.to_thread(gateway_metrics.render)
    except RuntimeError:  # "dictionary changed size during iteration"
        return gateway_metrics.render()


async def pods_page(auth: ApiKeyAuth, pods: PodRegistry, ledger: InFlightLedger, router: Router,
                    request: web.Request) -> web.Response:
    check_admin(auth, request)
    now = time.monotonic()
    listed = [
        {
            "name": p.name,
            "url": p.url,
            "models": sorted(p.models),
            "role": p.config.role,
            "healthy": p.healthy,
            "ejected_for_s": round(max(0.0, p.ejected_until - now), 3),
            "ejections": p.ejections,
            "in_flight": ledger.on_pod(p.name),
            "last_error": p.last_error,
            "checked_s_ago": round(now - p.last_check, 3) if p.last_check is not None else None,
        }
        for p in pods.all()
    ]
    return web.json_response({"pods": listed, "default_policy": router.default_policy,
                              "policies": router.profiles.names(), "tasks": len(asyncio.all_tasks())})


async def index_page(auth: ApiKeyAuth, events: KvEventService, verifier: PredictionVerifier,
                     request: web.Request) -> web.Response:
    check_admin(auth, request)
    return web.json_response({**events.debug(), "predictions": verifier.debug()})


async def placement_page(auth: ApiKeyAuth, pods: PodRegistry, working_set: ResumableWorkingSet,
                         capacity_of: Callable[[str], float | None], losses: PlacementLosses,
                         keep_warm: KeepWarm | None, request: web.Request) -> web.Response:
    check_admin(auth, request)
    names = [p.name for p in pods.all()]
    warm = keep_warm.debug() if keep_warm is not None else {"enabled": False}
    return web.json_response({**working_set.debug(names, capacity_of, time.monotonic()),
                              "losses": losses.debug(), "keep_warm": warm})


async def flows_page(auth: ApiKeyAuth, enabled: bool, flow: FlowController, request: web.Request) -> web.Response:
    """Flow control in this process: each flow's service and what it holds, and why each pod has no room."""
    check_admin(auth, request)
    return web.json_response({"enabled": enabled, **flow.debug()})


async def steps_page(auth: ApiKeyAuth, worker: str, steps: StepMetrics, request: web.Request) -> web.Response:
    """This worker's time per step of its recent requests (``gateway_request_step_seconds`` has them all)."""
    check_admin(auth, request)
    return web.json_response({"worker": worker, "steps": steps.debug()})


async def adapters_page(auth: ApiKeyAuth, adapters: AdapterLoader, request: web.Request) -> web.Response:
    """LoRA adapters: where each is registered and active, when each pod served it, registrations."""
    check_admin(auth, request)
    return web.json_response(adapters.debug())


async def usage_page(auth: ApiKeyAuth, worker: str, tally: UsageTally, limits: KeyLimits,
                     request: web.Request) -> web.Response:
    """Usage per key, tenant and model (this worker's), and each limited key's and tenant's use now (every
    worker's and replica's)."""
    check_admin(auth, request)
    scopes = limits.limited_scopes()
    return web.json_response({"worker": worker, "usage": tally.debug(), "share": limits.usage.share(),
                              "limited": {scope: limits.usage.debug(scope) for scope in scopes}})


async def workflows_page(auth: ApiKeyAuth, workflows: WorkflowService, modes: PressureModes,
                         request: web.Request) -> web.Response:
    check_admin(auth, request)
    return web.json_response({
        "workflows": [workflows.describe(w) for w in list(workflows.tracker.workflows)],
        "sessions": len(workflows.sessions),
        "pressure": {pod: mode.name.lower() for pod, mode in modes.items()},
        "hard_flushes": workflows.executor.hard_flushes,
    })


async def workers_page(auth: ApiKeyAuth, identity: WorkerIdentity, pods: PodRegistry,
                       shared_load: SharedLoadTable | None, ledger: InFlightLedger, bus: StateBus,
                       request: web.Request) -> web.Response:
    """Which worker answered, the load table the workers share, and who this one hears from."""
    check_admin(auth, request)
    names = [p.name for p in pods.all()]
    body: dict[str, Any] = {
        "worker": identity.name, "workers": identity.count, "replica": identity.replica, "pid": os.getpid(),
        "shared_load": shared_load.debug(names) if shared_load is not None else None,
        "in_flight_here": ledger.total(),
        "shared_state": {**bus.debug(), "remote_in_flight": ledger.remote_debug()},
    }
    return web.json_response(body)
