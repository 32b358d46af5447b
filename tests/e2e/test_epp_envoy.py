"""A real Envoy with ``gateway epp`` as its endpoint picker, in front of two real vLLM pods: which pod served
each request (the engines' own counters), whole streams whose usage the EPP learns from their last chunk,
and the same precise hits as the HTTP proxy on the same trace."""

from __future__ import annotations

import json
import random
from typing import Any

import aiohttp

from gateway.config import load_config
from gateway.epp.envoy_config import bootstrap
from gateway.epp.grpc_server import EppServer
from simulator.pod import free_port
from tests.conftest import eventually
from tests.e2e.conftest import BLOCK_SIZE, MODEL, VllmFleet
from tests.integration.test_epp_envoy import Envoy, grpc_ready

WORDS = "cache prefix router token block engine agent stage latency pod gateway kernel tensor batch".split()


def document(name: str, words: int = 300) -> str:
    rng = random.Random(name)
    return f"Document {name}. " + " ".join(rng.choice(WORDS) for _ in range(words))


def trace() -> list[list[dict[str, Any]]]:
    """Conversations over three documents, each turn extending a prompt one pod already holds."""
    rng = random.Random(11)
    history: dict[str, list[dict[str, Any]]] = {}
    out = []
    for i in range(12):
        name = f"epp-{rng.randrange(3)}"
        messages = history.get(name) or [{"role": "system", "content": document(name)},
                                         {"role": "user", "content": "Start."}]
        if name in history:
            messages = [*messages, {"role": "assistant", "content": f"Answer {i}."},
                        {"role": "user", "content": f"Follow-up {i}: " + document(f"{name}-{i}", 40)}]
        history[name] = messages
        out.append(messages)
    return out


async def pod_counter(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def reset(http: aiohttp.ClientSession, fleet: VllmFleet) -> None:
    for pod in fleet.pods:
        async with http.post(f"{pod.url}/reset_prefix_cache", json={}) as resp:
            assert resp.status == 200
        async with http.post(f"{pod.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}):
            pass  # the engine steps: its AllBlocksCleared goes out before a gateway replays


async def replay(http: aiohttp.ClientSession, url: str, fleet: VllmFleet, index_of: Any) -> list[tuple[str, int]]:
    """Each request of the trace, streamed with its usage: the pod that served it (checked against the
    engines' own request counters) and the tokens it found cached (the engine's usage)."""
    out = []
    for i, messages in enumerate(trace()):
        before = [await pod_counter(http, p.url, "vllm:request_success_total") for p in fleet.pods]
        body = {"model": MODEL, "messages": messages, "max_tokens": 6, "stream": True,
                "stream_options": {"include_usage": True}}
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            pod = resp.headers["x-gateway-pod"]
            predicted = int(resp.headers["x-gateway-prefix-tokens"])
            events = [line[6:] for line in (await resp.read()).split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        usage = json.loads(events[-2])["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert predicted == cached, (i, pod, predicted, cached)
        after = [await pod_counter(http, p.url, "vllm:request_success_total") for p in fleet.pods]
        assert [a - b for a, b in zip(after, before, strict=True)] == [
            float(p.name == pod) for p in fleet.pods], (i, pod)
        out.append((pod, cached))
        await index_of(pod, messages)
    return out


async def test_envoy_and_the_epp_route_real_pods_as_the_proxy_does(vllm: VllmFleet, model_dir: str, http,
                                                                     start_gateway, tmp_path) -> None:
    overrides: dict[str, Any] = {
        "routing": {"policy": "kv_aware"}, "tokenization": {"models": {MODEL: {"path": model_dir}}},
        "health": {"interval_s": 0.3, "timeout_s": 2.0, "failure_threshold": 2}}

    def settled_in(kits: Any) -> Any:
        tokenizer = kits.tokens.tokens.local(MODEL).tokenizer

        async def wait(pod: str, messages: list[dict[str, Any]]) -> None:
            ids = tokenizer.encode_chat(messages)
            full = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE

            def held() -> bool:
                match = kits.kv.index.lookup(MODEL, None, ids, [pod])[pod]
                return match.gpu_tokens - match.speculative_tokens >= full

            await eventually(held, 20.0)
        return wait

    await reset(http, vllm)
    proxy = await start_gateway(vllm.gateway_pods(), **overrides)
    through_proxy = await replay(http, proxy.url, vllm, settled_in(proxy.kits))

    await reset(http, vllm)
    config = load_config(overrides={"pods": vllm.gateway_pods(), "server": {"port": 0},
                                    "epp": {"port": 0, "fallbacks": 0, "access_log": True}, **overrides}, environ={})
    epp = EppServer(config)
    await epp.start()
    port, admin = free_port(), free_port()
    # The bodies in full duplex, as llm-d's manifests have them (the integration suite runs both modes).
    envoy = Envoy(bootstrap(listen_port=port, admin_port=admin, epp=("127.0.0.1", epp.grpc_port),
                            cluster="original_dst", bodies="full_duplex"), tmp_path, port, admin)
    try:
        await envoy.ready()
        await eventually(lambda: all(p.healthy for p in epp.kits.foundation.pods.all()), 20.0)
        await grpc_ready(epp.grpc_port)  # its tokenizer loaded, as a Kubernetes readiness probe waits for
        through_envoy = await replay(http, envoy.url, vllm, settled_in(epp.kits))
        # The same hits, request by request, as the proxy on the same trace.
        assert [c for _, c in through_envoy] == [c for _, c in through_proxy], (through_envoy, through_proxy)
        assert sum(c > 0 for _, c in through_envoy) >= 6
        # The EPP learnt every stream's usage from its last chunk: its predictions all agreed with the engines.
        await eventually(lambda: epp.kits.shared.ledger.total() == 0, 10.0)
        checks = epp.kits.kv.verifier.debug()[MODEL]["outcomes"]
        assert checks == {"exact": len(through_envoy)}, checks
        assert epp.access_logs.received == len(through_envoy)
    finally:
        envoy.stop()
        await epp.stop()
