"""Runs a gateway process: listener, optional simulated pods, signals and graceful shutdown.

On SIGTERM/SIGINT the gateway reports not-ready, stops accepting connections, lets in-flight requests
(streams included) finish for up to ``server.shutdown_grace_s``, then closes what is left. On SIGHUP it
reads its config file again (:mod:`gateway.config_reload`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import time
from collections.abc import Callable

from aiohttp import web

from gateway.api.connections import GatewayRunner
from gateway.api.records import RECORDS_KEY, runner_options
from gateway.app import build_app, build_gateway
from gateway.background import freeze_start_up_heap, raise_open_files_limit
from gateway.cluster.identity import WorkerIdentity
from gateway.config import ConfigSource, GatewayConfig, ServerConfig
from gateway.tokenization.tokenizers import TokenizationService

log = logging.getLogger("gateway.server")

# The HTTP server's own handling of requests: per-line limits well above server.max_header_bytes, and no
# decoding of compressed bodies, so that oversized headers and undecodable bodies are answered by the
# gateway (431 / 400, in the API's error JSON) rather than by the parser (plain text).
SERVER_OPTIONS = {"max_line_size": 64 * 1024, "max_field_size": 64 * 1024, "auto_decompress": False}


def tls_context(server: ServerConfig) -> ssl.SSLContext | None:
    if not server.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(server.tls_cert, server.tls_key)
    return context


async def start_runner(runner: web.AppRunner) -> None:
    """Start the app's components; if one fails, stop (in reverse) those that had started, then raise."""
    try:
        await runner.setup()
    except BaseException:
        await runner.cleanup()
        raise


def on_signals(stop: asyncio.Event, reload: Callable[[], None] | None) -> None:
    """SIGTERM and SIGINT set ``stop``; SIGHUP calls ``reload`` (none: SIGHUP is left as it was)."""
    loop = asyncio.get_running_loop()
    handlers: list[tuple[signal.Signals, Callable[[], None]]] = [(signal.SIGTERM, stop.set), (signal.SIGINT, stop.set)]
    if reload is not None:
        handlers.append((signal.SIGHUP, reload))
    for sig, handler in handlers:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, handler)


async def run_gateway(config: GatewayConfig, ready: asyncio.Event | None = None,
                      identity: WorkerIdentity | None = None, source: ConfigSource | None = None) -> None:
    """One gateway process: the only one, or worker ``identity.index`` of ``serve --workers N`` (then the
    port is shared with its siblings, and it also answers on a private Unix socket for them). ``source``:
    where ``config`` was read from, to reload it."""
    raise_open_files_limit()  # sockets per pod: a subscriber, connections for requests, health and metrics
    began = time.monotonic()
    if identity is None:  # one process (the workers' supervisor says it for them)
        log.info("starting the gateway (it listens, then loads its tokenizers; %d pods to check)...",
                 len(config.pods))
    gateway = build_gateway(config, identity=identity, source=source)
    app = build_app(gateway)
    identity, tokens, reloader = gateway.foundation.identity, gateway.tokens.tokens, gateway.reload.reloader
    runner = GatewayRunner(
        app, header_timeout_s=config.server.header_read_timeout_s, on_header_timeout=app[RECORDS_KEY].unparsed,
        handler_cancellation=True, shutdown_timeout=config.server.shutdown_grace_s, **SERVER_OPTIONS,
        **runner_options(app),
    )
    await start_runner(runner)
    many = identity.count > 1
    site = web.TCPSite(runner, config.server.host, config.server.port, ssl_context=tls_context(config.server),
                       backlog=2048, shutdown_timeout=config.server.shutdown_grace_s, reuse_port=many or None)
    await site.start()
    if many:
        await web.UnixSite(runner, identity.http_socket(identity.index)).start()
    stop = asyncio.Event()
    try:
        name = f"worker {identity.name} " if many else ""
        log.info("gateway %slistening on %s (policy %s, %d pods)%s", name, site.name, config.routing.policy,
                 len(config.pods), "; loading its tokenizers..." if tokens.loading else "")
        on_signals(stop, reloader.request if reloader is not None else None)
        if await _loaded(tokens, stop):
            freeze_start_up_heap()
            log.info("gateway %sstarted (%.1f s after its imports): tokenizers loaded, %d of %d pods healthy", name,
                     time.monotonic() - began, gateway.requests.front.ready_pods(), len(config.pods))
            if ready:
                ready.set()
        await stop.wait()
    finally:
        log.info("shutting down: draining in-flight requests for up to %.0f s",
                 config.server.shutdown_grace_s)
        await runner.cleanup()
        log.info("gateway stopped")


async def _loaded(tokens: TokenizationService, stop: asyncio.Event) -> bool:
    """Whether the tokenizers loaded before ``stop`` was set; raises what stopped them loading."""
    stopped = asyncio.ensure_future(stop.wait())
    loaded = asyncio.ensure_future(tokens.loaded())
    try:
        await asyncio.wait((stopped, loaded), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        loaded.cancel()
    if not loaded.done() or loaded.cancelled():
        return False
    loaded.result()
    return True
