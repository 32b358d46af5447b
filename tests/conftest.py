"""Shared fixtures: real mock pods, real backends and a real gateway, all on loopback TCP sockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import aiohttp
import pytest
from aiohttp import web

from bench.runner import start_redis_server, wait_http
from gateway.api.records import RECORDS_KEY, runner_options
from gateway.app import Assembly, build_app, build_gateway
from gateway.cluster.identity import WorkerIdentity
from gateway.config import GatewayConfig, load_config
from gateway.serve import SERVER_OPTIONS
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from simulator.pod import MockPod, MockPodConfig, free_port


@pytest.fixture(scope="session")
def tokenizer() -> HfTokenizer:
    return HfTokenizer(BUNDLED_TOKENIZER_DIR)


class RunningGateway:
    def __init__(self, runner: web.AppRunner, app: web.Application, kits: Assembly) -> None:
        self.runner = runner
        self.app = app
        self.kits = kits  # each feature's state, through the kit that built it
        self.port = runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"

    async def serving(self, model: str) -> None:
        """Until a healthy pod serves ``model``: on a loaded machine the first health check (before the gateway
        serves) can time out, and the pod is back a few checks later."""
        await eventually(lambda: any(p.healthy and p.serves(model) for p in self.kits.foundation.pods.all()))


async def serve_app(app: web.Application) -> web.AppRunner:
    recording = runner_options(app) if RECORDS_KEY in app else {"access_log": None}
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1, **SERVER_OPTIONS, **recording)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


@pytest.fixture
async def start_gateway() -> AsyncIterator[Callable[..., Awaitable[RunningGateway]]]:
    runners: list[web.AppRunner] = []

    async def start(pods: list[Any], identity: WorkerIdentity | None = None, **overrides: Any) -> RunningGateway:
        """``identity``: one worker of several (their run directory and load table made by the caller)."""
        pod_dicts = [p if isinstance(p, dict) else {"url": p} for p in pods]
        overrides.setdefault("health", {"interval_s": 0.2, "timeout_s": 0.5})
        config: GatewayConfig = load_config(overrides={"pods": pod_dicts, **overrides}, environ={})
        kits = build_gateway(config, identity=identity)
        app = build_app(kits)
        runner = await serve_app(app)
        runners.append(runner)
        await kits.tokens.tokens.loaded()  # it listens at once; the tests begin as a ready gateway would
        return RunningGateway(runner, app, kits)

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def start_mock_pod(tokenizer: HfTokenizer) -> AsyncIterator[Callable[..., Awaitable[MockPod]]]:
    pods: list[MockPod] = []

    async def start(**overrides: Any) -> MockPod:
        overrides.setdefault("speed", 0.0)
        pod = MockPod(MockPodConfig(**overrides), tokenizer=tokenizer)
        await pod.start()
        pods.append(pod)
        return pod

    yield start
    for pod in pods:
        await pod.stop()


@pytest.fixture
async def start_backend() -> AsyncIterator[Callable[[web.Application], Awaitable[str]]]:
    """A plain aiohttp app as a pod; returns its base URL."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        if not any(r.resource and r.resource.canonical == "/health" for r in app.router.routes()):
            app.router.add_get("/health", _ok)
        runner = await serve_app(app)
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


class RedisServer:
    """A real ``redis-server`` on a free loopback port (installed by ``make install``)."""

    def __init__(self) -> None:
        import shutil

        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: run `make install` (it apt-installs redis-server)")
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = start_redis_server(self.binary, self.port)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def answers_ok(http: aiohttp.ClientSession, url: str, running: Callable[[], bool], tries: int = 300,
                     every_s: float = 0.1) -> bool:
    """GET ``url`` until it answers 200 (True), or until ``running`` says the process behind it has exited or
    the ``tries``, ``every_s`` apart, run out (False)."""
    for _ in range(tries):
        if not running():
            return False
        try:
            async with http.get(url) as resp:
                if resp.status == 200:
                    return True
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(every_s)
    return False


async def eventually(condition: Callable[[], bool], within_s: float = 15.0,
                     nudge: Callable[[], Awaitable[Any]] | None = None) -> None:
    """Wait for ``condition``; ``nudge`` (if given) runs every 2 s to move things along. The wait is no
    measurement (a test that times something says so with its own bound): 15 s holds on a machine 5x slower
    than ours beside CPU hogs, where 5 s did not (a hard flush after its workflow's end took longer)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    next_nudge = loop.time() + 2
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        if nudge is not None and loop.time() >= next_nudge:
            await nudge()
            next_nudge = loop.time() + 2
        await asyncio.sleep(0.01)


def chat_body(content: str = "Hello there", model: str = "mock-llama", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def models_of(*models: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A ``/v1/models`` handler listing ``models``."""

    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in models]})

    return handler


@dataclass
class GatewayProcess:
    url: str
    proc: subprocess.Popen[bytes]
    stderr: bytes = b""


@contextlib.contextmanager
def gateway_process(*args: str, env: dict[str, str] | None = None,
                    capture_stderr: bool = False, ready_path: str = "/readyz") -> Iterator[GatewayProcess]:
    """``gateway serve ARGS`` as a real process on a free port, ready when yielded (``ready_path`` answers
    200: ``/healthz`` for a gateway with no healthy pod), SIGTERMed after; its exit code and (if captured)
    stderr are on the yielded object afterwards. ``KVGW_TEST_GATEWAY_LOG=FILE`` appends the output of every
    gateway not captured to FILE, access log on: each request's pod, hold and first byte, to tell where a slow
    answer waited."""
    port = free_port()
    kept = os.environ.get("KVGW_TEST_GATEWAY_LOG")
    with contextlib.ExitStack() as files:
        stderr: int | IO[bytes] = subprocess.DEVNULL
        if capture_stderr:
            stderr = subprocess.PIPE
        elif kept:
            stderr = files.enter_context(open(kept, "ab"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--port", str(port), *args],
            env={**os.environ, "GATEWAY_LOGGING__ACCESS_LOG": "true" if kept else "false", **(env or {})},
            stderr=stderr,
        )
    run = GatewayProcess(f"http://127.0.0.1:{port}", proc)
    try:
        wait_http(f"{run.url}{ready_path}", 90, proc)
        yield run
    finally:
        proc.send_signal(signal.SIGTERM)
        run.stderr = proc.communicate(timeout=60)[1] or b""
