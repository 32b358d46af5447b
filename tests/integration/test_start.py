"""A fast start: the gateway listens before its tokenizers load, its workers start beside the simulated pods, and
a pod that was not up at start is healthy at its first answer. Ordered by events (a gate the test opens), not by
seconds."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import yaml
from aiohttp import web

from gateway.config import HealthConfig, PodConfig
from gateway.http_client import HttpClient
from gateway.pods import registry as registry_module
from gateway.pods.health import HealthChecker
from gateway.pods.registry import PodRegistry
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR
from simulator.config import MockPodsConfig
from simulator.launcher import MockPodFleet
from simulator.pod import free_port
from tests.conftest import answers_ok, chat_body, eventually
from tests.integration.test_server_process import stop_cleanly

# Installed in the gateway's processes (PYTHONPATH): the slow part of loading a tokenizer, importing transformers,
# waits until the test opens the gate (a FIFO: opening it to read blocks until a writer comes). It waits in the
# module's execution, which holds that module's import lock only (a finder holds every import's).
GATE = """
import importlib.abc, importlib.machinery, os, sys

class Gate(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name != "transformers" or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        with open(os.environ["TOKENIZER_GATE"], "rb") as gate:
            gate.read()
        self.loader.exec_module(module)

sys.meta_path.insert(0, Gate())
"""


def open_gate(fifo: Path) -> bool:
    """Let every process waiting at the gate through (they read end-of-file); False if none waits yet."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no reader has opened it yet
            return False
        raise
    os.close(fd)
    return True


@contextlib.asynccontextmanager
async def gated_gateway(env: dict[str, str], *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "serve", *args,
                                                env={**os.environ, **env}, stderr=asyncio.subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def post_in_two_steps(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, body: bytes,
                            routed: asyncio.Event) -> tuple[int, bytes]:
    """POST with ``Expect: 100-continue``: the headers, then (once the gateway asks for it, the request routed to
    its handler) the body; the status and the rest of the answer."""
    writer.write(f"POST {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100")
    routed.set()
    writer.write(body)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return int(answer.split(b" ", 2)[1]), answer


def tokenization_counts(metrics: str) -> dict[str, float]:
    """``gateway_tokenization_total`` by mode and outcome, summed over the workers."""
    counts: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("gateway_tokenization_total{"):
            labels, value = line.rsplit(" ", 1)
            mode = labels.split('mode="')[1].split('"')[0]
            outcome = labels.split('outcome="')[1].split('"')[0]
            counts[f"{mode}/{outcome}"] = counts.get(f"{mode}/{outcome}", 0) + float(value)
    return counts


async def test_workers_listen_before_their_tokenizers_load_and_a_request_meanwhile_waits_for_them(
        start_mock_pod, tmp_path, http):
    """With the tokenizers' load held at a gate: the workers answer /healthz, /readyz says they are loading, and
    a chat request taken in then is answered once the gate opens, tokenized by the local tokenizer (not by a pod,
    not by text): as it would have been after the start. Fails where a worker loads its tokenizer before it
    listens (/healthz never answers while the gate is shut), or where a request does not wait for it (the pod
    tokenizes it: ``remote/ok``)."""
    pod = await start_mock_pod()
    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    (tmp_path / "sitecustomize.py").write_text(GATE)
    config = tmp_path / "gateway.yaml"
    tokenizer = {"mock-llama": {"path": str(BUNDLED_TOKENIZER_DIR)}}
    config.write_text(yaml.safe_dump({"tokenization": {"models": tokenizer}}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "TOKENIZER_GATE": str(fifo)}
    async with gated_gateway(env, "--config", str(config), "--pod", pod.url, "--policy", "kv_aware",
                             "--workers", "2", "--port", str(port)) as proc:
        assert await answers_ok(http, f"{url}/healthz", lambda: proc.returncode is None, tries=900), \
            "the gateway did not listen while its tokenizers were held"
        async with http.get(f"{url}/readyz") as resp:
            assert resp.status == 503 and (await resp.json())["status"] == "loading tokenizers"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        routed = asyncio.Event()
        answer = asyncio.create_task(post_in_two_steps(reader, writer, "/v1/chat/completions",
                                                       json.dumps(chat_body("What is a prefix?")).encode(), routed))
        await routed.wait()  # in the gateway's handler before the gate opens (a tokenizer loads in a second or more)
        while not await answers_ok(http, f"{url}/readyz", lambda: proc.returncode is None, tries=1):
            await asyncio.to_thread(open_gate, fifo)
        status, body = await answer
        assert status == 200 and b'"content"' in body, body
        async with http.get(f"{url}/metrics") as resp:
            counts = tokenization_counts(await resp.text())
        assert counts == {"local/ok": 1.0}, counts
        await stop_cleanly(proc)


async def test_the_simulated_pods_ports_are_known_before_they_listen():
    """`serve --mock-pods N` starts its workers beside the pods: where each pod will listen is chosen before
    its process starts, and is where it listens."""
    fleet = MockPodFleet(MockPodsConfig(count=2, speed=0.0), quiet=True)
    try:
        planned = fleet.spawn()
        assert planned is not None and len({p.url for p in planned}) == 2
        assert await asyncio.to_thread(fleet.wait) == planned
    finally:
        fleet.stop()


async def test_a_pod_that_was_not_up_at_start_is_healthy_at_its_first_answer():
    """A pod still starting when the gateway checks it first is asked again soon, and its first answer makes it
    healthy (as at start): with a health interval of a minute and two passing checks needed, only that puts it
    in service within the test's bound."""
    port = free_port()
    pods = PodRegistry([PodConfig(url=f"http://127.0.0.1:{port}", name="late", models=["m"])],
                       HealthConfig(interval_s=60.0))
    http = HttpClient()
    await http.start()
    checker = HealthChecker(pods, http, HealthConfig(interval_s=60.0, timeout_s=1.0, success_threshold=2))
    app = web.Application()
    app.router.add_get("/health", _ok)
    runner = web.AppRunner(app)
    try:
        await checker.start()
        assert not pods.get("late").healthy  # nothing listens yet
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await eventually(lambda: pods.get("late").healthy, within_s=30.0)
    finally:
        await checker.stop()
        await runner.cleanup()
        await http.stop()


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def test_a_request_before_a_pods_first_answer_waits_for_it_and_after_the_window_is_told_to_retry(
        start_gateway, start_mock_pod, http, monkeypatch):
    """A worker listens before its first health checks answer (on a loaded host one may time out): a request,
    or a model list, that comes meanwhile waits for the pods' first answers and is served, rather than hear
    that no pod serves its model. Past the start window a pod still silent holds nobody: a 503 to retry (a
    404 would tell the client never to). A model no pod serves is a 404 once every pod has answered."""
    port = free_port()
    gw = await start_gateway([f"http://127.0.0.1:{port}"])

    async def status_of(method: str, path: str, **kwargs) -> tuple[int, dict]:
        async with http.request(method, f"{gw.url}{path}", **kwargs) as resp:
            return resp.status, await resp.json()

    chat = asyncio.create_task(status_of("POST", "/v1/chat/completions", json=chat_body()))
    models = asyncio.create_task(status_of("GET", "/v1/models"))
    await asyncio.sleep(0.5)
    assert not chat.done() and not models.done()  # waiting, not refused
    await start_mock_pod(port=port)
    assert (await chat)[0] == 200
    status, listed = await models
    assert status == 200 and [m["id"] for m in listed["data"]] == ["mock-llama"]
    async with http.post(f"{gw.url}/v1/chat/completions", json=chat_body(model="no-such-model")) as resp:
        assert resp.status == 404 and resp.headers["x-should-retry"] == "false", await resp.text()

    monkeypatch.setattr(registry_module, "FIRST_ANSWERS_WINDOW_S", 0.5)
    silent = await start_gateway([f"http://127.0.0.1:{free_port()}"])
    async with http.post(f"{silent.url}/v1/chat/completions", json=chat_body()) as resp:
        assert resp.status == 503 and resp.headers["x-should-retry"] == "true", await resp.text()
        assert int(resp.headers["Retry-After"]) >= 1
