"""The :class:`RequestDirector`: runs one client request through the pipeline's extension points.

Owner: the director owns the request's context (:class:`~gateway.request.context.RequestContext`) and
the retry loop, and it alone writes the in-flight ledger (dispatch before an attempt is sent, finish
when it ends). Everything a feature does happens in a step (:mod:`gateway.request.pipeline`); the
proxy only forwards and relays.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time

from aiohttp import web

from gateway.api.errors import ApiError
from gateway.api.middleware import REQUEST_ID
from gateway.api.requests import parse_inference_request
from gateway.load.ledger import InFlightLedger
from gateway.proxy import Proxy, RetryableFailure
from gateway.request.context import RequestContext
from gateway.request.pipeline import RequestPipeline
from gateway.routing.router import Router

log = logging.getLogger("gateway.proxy")


class RequestDirector:
    def __init__(self, pipeline: RequestPipeline, router: Router, ledger: InFlightLedger, proxy: Proxy,
                 max_retries: int, default_consumption: float) -> None:
        self._pipeline = pipeline
        self._router = router
        self._ledger = ledger
        self._proxy = proxy
        self._max_retries = max_retries
        # What a request takes of a pod when nothing estimated it (no profile, no load-aware policy).
        self._default_consumption = default_consumption
        # Request ids unique across replicas without the cost of uuid4 per request.
        self._id_prefix = os.urandom(6).hex()
        self._id_counter = itertools.count()

    async def handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        ctx = RequestContext(
            http=request,
            request_id=request.headers.get("x-request-id") or f"{self._id_prefix}{next(self._id_counter):x}",
            kind=kind,
            started=time.monotonic(),
        )
        request[REQUEST_ID] = ctx.request_id
        try:
            response = await self._serve(ctx)
            ctx.status = response.status
            return response
        except ApiError as err:
            ctx.status = err.status
            raise
        except asyncio.CancelledError:
            ctx.status = 499  # the client went away first
            raise
        finally:
            for step in self._pipeline.complete:
                step.completed(ctx)

    async def _serve(self, ctx: RequestContext) -> web.StreamResponse:
        ctx.body = await ctx.http.read()
        ctx.parsed = parse_inference_request(ctx.body)
        ctx.model = ctx.parsed.model or ""
        pipeline = self._pipeline
        for prepare in pipeline.prepare:
            if (waiting := prepare.prepare(ctx)) is not None:
                await waiting
        for admit in pipeline.admit:
            if (waiting := admit.admit(ctx)) is not None:
                await waiting
        for route in pipeline.route:
            route.before_route(ctx)
        ctx.upstream_headers = self._proxy.upstream_headers(ctx.http.headers, ctx.request_id)
        assert ctx.policy is not None and ctx.routing is not None  # set by the PolicyResolution step
        exclude: set[str] = set()
        failure: RetryableFailure | None = None
        wf = ctx.workflow
        for attempt in range(self._max_retries + 1):
            try:
                decision = self._router.route(ctx.routing, ctx.policy, frozenset(exclude), wf.pin, wf.pin_reason)
            except ApiError:
                if failure:  # every pod we could try has failed: say why, not just "none left"
                    raise failure.error from None
                raise
            decision.attempt = attempt
            ctx.decision = decision
            ctx.attempts = attempt + 1
            try:
                return await self._attempt(ctx)
            except RetryableFailure as exc:
                failure = exc
                exclude.add(decision.pod.name)
                log.warning("request %s: pod %s failed before the first byte (%s: %s)",
                            ctx.request_id, decision.pod.name, exc.cause, exc.error.message)
        assert failure is not None
        raise failure.error

    async def _attempt(self, ctx: RequestContext) -> web.StreamResponse:
        assert ctx.decision is not None and ctx.routing is not None
        pod = ctx.decision.pod.name
        estimate = ctx.routing.estimates.get(pod)
        keys = ctx.workflow.ledger_keys
        ctx.dispatch = self._ledger.dispatch(
            ctx.request_id, pod, estimate.consumption if estimate else self._default_consumption, ctx.kind,
            workflow=keys[0], stage=keys[1], session=keys[2])
        for step in self._pipeline.dispatch:
            step.dispatched(ctx)
        try:
            return await self._proxy.forward(ctx)
        finally:
            self._ledger.finish(ctx.dispatch)
            for step in self._pipeline.finish:
                step.attempt_finished(ctx)
