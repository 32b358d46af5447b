"""The gRPC services of ``gateway epp``: ext_proc (one stream per request, over the same directors as the
HTTP routes), Envoy's access log (how each answer ended), and gRPC health (liveness, readiness and the
ext_proc service, as the endpoint-picker protocol asks)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
import msgspec
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2

from gateway.api.routes import PROXIED_ROUTES
from gateway.auth import ApiKey
from gateway.config import EppConfig
from gateway.core.errors import ErrorKind, GatewayError, internal_error
from gateway.core.inference_api import ANTHROPIC_PATHS, PATHS, RequestKind
from gateway.epp.access_log import AccessLogs
from gateway.epp.edge import EnvoyEdge
from gateway.kits.requests import FrontDoor

log = logging.getLogger("gateway.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)


class ExtProcService(external_processor_pb2_grpc.ExternalProcessorServicer):
    """Each ext_proc stream is one client request: its path picks the director, as the HTTP routes do."""

    def __init__(self, front: FrontDoor, access_logs: AccessLogs, config: EppConfig) -> None:
        self._front = front
        self._access_logs = access_logs
        self._config = config
        self._serving: set[asyncio.Task[None]] = set()  # requests whose stream Envoy may close before they end

    async def Process(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF or first.WhichOneof("request") != "request_headers":
            return
        edge = EnvoyEdge(first, context, self._front.pods, self._access_logs, fallbacks=self._config.fallbacks,
                         access_log_wait_s=self._config.access_log_wait_s)
        serving = asyncio.create_task(self._serve(edge))
        self._serving.add(serving)
        serving.add_done_callback(self._serving.discard)
        try:
            await asyncio.shield(serving)
        except asyncio.CancelledError:
            # Envoy closed the stream. Once the HTTP stream had ended (the end of the answer was seen), the
            # request finishes by itself (it may wait for its access-log entry); before, the client left.
            if not edge.answer_started:
                serving.cancel()
            raise

    def _key(self, edge: EnvoyEdge, kind: RequestKind | None) -> ApiKey | None:
        """Who is asking; a generating request refused for its key is recorded as any other."""
        try:
            return self._front.auth.check(edge.headers)
        except GatewayError as err:
            if kind is not None:
                self._front.director.refused(edge, kind, err)
            raise

    async def _serve(self, edge: EnvoyEdge) -> None:
        front = self._front
        path = edge.path.partition("?")[0]
        anthropic = path in ANTHROPIC_PATHS
        kind = PROXIED_ROUTES.get(path)
        try:
            key = self._key(edge, kind)
            if kind is not None:
                await front.director.handle(edge, kind, key)
            elif path == PATHS[RequestKind.COUNT_TOKENS]:
                await front.counting.handle(edge, RequestKind.COUNT_TOKENS, key)
            elif path == "/v1/models" and edge.method == "GET":
                await edge.answer(200, msgspec.json.encode({"object": "list", "data": front.model_cards(key)}))
            else:
                raise GatewayError(ErrorKind.NOT_FOUND, f"No route for {edge.method} {path}.", code="not_found")
        except GatewayError as err:
            await edge.refuse(err, anthropic)
        except Exception:
            log.exception("EPP: unhandled error on %s %s", edge.method, path)
            await edge.refuse(internal_error(), anthropic)
        finally:
            edge.close()


class Readiness:
    """Keeps the gRPC health statuses true: live while the process serves; ready (and the ext_proc service
    serving) while ``ready`` says so: what the HTTP port's ``/readyz`` says (pods, tokenizers, draining)."""

    def __init__(self, ready: Callable[[], bool], servicer: health.aio.HealthServicer, interval_s: float = 1.0
                 ) -> None:
        self._ready = ready
        self._servicer = servicer
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self.update()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for service in HEALTH_SERVICES:
            await self._servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def update(self) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if self._ready() else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", "readiness", EXT_PROC_SERVICE):
            await self._servicer.set(service, status)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.update()
