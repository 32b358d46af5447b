"""``gateway epp``: one process serving the endpoint picker over gRPC beside the gateway's HTTP port.

The HTTP port (``server.port``) has everything ``gateway serve`` has (metrics, health, debug pages, and
the proxy's own routes); the gRPC port (``epp.port``) has ext_proc, Envoy's access log and gRPC health.
Both serve the same components, started once and stopped in reverse (SIGTERM: not ready, then the
requests in flight finish, streams included, for up to ``server.shutdown_grace_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2_grpc

from gateway.app import Assembly, build_app, build_gateway
from gateway.background import cancel_and_wait, freeze_start_up_heap
from gateway.config import ConfigSource, GatewayConfig
from gateway.epp.access_log import AccessLogs, AccessLogService
from gateway.epp.ext_proc import ExtProcService, Readiness
from gateway.serve import SERVER_OPTIONS, on_signals, start_runner
from gateway.tokenization.tokenizers import TokenizationService

log = logging.getLogger("gateway.epp")


class EppServer:
    """The gateway's kits behind two listeners: HTTP (``server.port``) and gRPC (``epp.port``). The gRPC
    services get the front door (``kits.requests.front``)."""

    def __init__(self, config: GatewayConfig, source: ConfigSource | None = None) -> None:
        self.config = config
        self.kits: Assembly = build_gateway(config, source=source)
        self._app = build_app(self.kits)
        front = self.kits.requests.front
        self.access_logs = AccessLogs(config.epp.access_log)
        self._runner = web.AppRunner(self._app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=config.server.shutdown_grace_s, **SERVER_OPTIONS)
        self._health = health.aio.HealthServicer()
        self._readiness = Readiness(self.kits.serving.ready, self._health)
        self._grpc = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
            ExtProcService(front, self.access_logs, config.epp), self._grpc)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogService(self.access_logs), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        self.grpc_port = 0
        self.http_port = 0

    async def start(self) -> None:
        """Components first (in order), then the listeners; what started is stopped if a later part fails."""
        await start_runner(self._runner)
        try:
            server = self.config.server
            site = web.TCPSite(self._runner, server.host, server.port, backlog=2048)
            await site.start()
            self.http_port = self._runner.addresses[0][1]
            address = f"{self.config.epp.host}:{self.config.epp.port}"
            self.grpc_port = self._grpc.add_insecure_port(address)
            if not self.grpc_port:
                raise OSError(f"cannot listen on {address}")
            await self._grpc.start()
            await self._readiness.start()
        except BaseException:
            await self._runner.cleanup()
            raise
        log.info("endpoint picker on %s:%d (gRPC), HTTP on port %d (policy %s, %d pods)", self.config.epp.host,
                 self.grpc_port, self.http_port, self.config.routing.policy, len(self.config.pods))

    async def stop(self) -> None:
        """Not ready, nothing new admitted, the streams in flight finish (up to the grace), then the rest."""
        self.kits.serving.drain()
        try:
            await self._readiness.stop()
            await self._grpc.stop(self.config.server.shutdown_grace_s)
        finally:
            await self._runner.cleanup()


async def run_epp(config: GatewayConfig, source: ConfigSource | None = None) -> None:
    server = EppServer(config, source)
    await server.start()
    frozen = asyncio.ensure_future(_freeze_when_loaded(server.kits.tokens.tokens))
    stop = asyncio.Event()
    reloader = server.kits.reload.reloader
    on_signals(stop, reloader.request if reloader is not None else None)
    try:
        await stop.wait()
    finally:
        await cancel_and_wait(frozen)
        log.info("shutting down: draining in-flight requests for up to %.0f s", config.server.shutdown_grace_s)
        await server.stop()
        log.info("endpoint picker stopped")


async def _freeze_when_loaded(tokens: TokenizationService) -> None:
    """As ``gateway serve`` does once its tokenizers have loaded (the endpoint picker answers meanwhile)."""
    with contextlib.suppress(Exception):  # they failed to load: readiness says so, and nothing is frozen
        await tokens.loaded()
        freeze_start_up_heap()
