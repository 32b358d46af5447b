"""Prefill/decode disaggregation on real vLLM: one prefill pod and one decode pod, with ExampleConnector
(a directory the two share) and, when ``nixl`` is installed in the vLLM environment, with NixlConnector.

The two pods are shared by the module's tests (one connector after the other, never more than two engines
at once); each test starts its own gateway in front of them and uses prompts of its own. What is checked
is what the engines themselves report: their answers, their usage and their prefix-cache counters.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import eventually
from tests.e2e.conftest import BLOCK_SIZE, MODEL, VllmFleet, _required_env, ports_to_bind_later, running_pods
from tests.e2e.test_real_vllm import (
    WAIT_S,
    confirmed_tokens,
    conversation,
    document,
    full_blocks,
    pod_metric,
    post,
    step_engine,
)

GREEDY = {"temperature": 0, "ignore_eos": True}


def nixl_installed() -> bool:
    python = _required_env("E2E_VLLM_PYTHON")
    return subprocess.run([python, "-c", "import nixl"], capture_output=True).returncode == 0


def pod_specs(connector: str, storage: Path) -> list[tuple[str, tuple[str, ...], dict[str, str]]]:
    """The prefill pod and the decode pod, started as the pd-on-cpu spec says."""
    if connector == "shared_storage":
        config = json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                             "kv_connector_extra_config": {"shared_storage_path": str(storage)}})
        # ExampleConnector saves a prompt's KV as its first step computed it: a prefill chunked over several
        # steps is saved cut short, and a pod loading it dies (vLLM 0.32). Whole prefills only.
        return [(name, ("--kv-transfer-config", config, "--no-enable-chunked-prefill"), {})
                for name in ("prefill", "decode")]
    specs = []
    for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        # The decode pod recomputes what it cannot pull (a prefill pod that died after answering).
        config = json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
                             "kv_load_failure_policy": "recompute"})
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
               "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports_to_bind_later(1)[0]), "UCX_TLS": "tcp,self,sm"}
        specs.append((name, ("--kv-transfer-config", config), env))
    return specs


@pytest.fixture(scope="module", params=["shared_storage", "nixl"])
def pd(request: pytest.FixtureRequest, model_dir: str, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[tuple[str, VllmFleet]]:
    connector = request.param
    if connector == "nixl" and not nixl_installed():
        pytest.skip("nixl is not installed in the vLLM environment (KVGW_E2E_NIXL=1 make e2e installs it)")
    storage = tmp_path_factory.mktemp(f"kv-{connector}")
    for fleet in running_pods(model_dir, pod_specs(connector, storage)):
        yield connector, fleet


@pytest.fixture
def start_pd_gateway(start_gateway, pd: tuple[str, VllmFleet], model_dir: str):
    connector, fleet = pd

    async def start(**overrides: Any):
        pods = [{**p.gateway_config(), "role": p.name} for p in fleet.pods]
        return await start_gateway(pods, routing={"policy": "kv_aware"}, disaggregation={"connector": connector},
                                   health={"interval_s": 0.3, "timeout_s": 2.0, "failure_threshold": 2},
                                   tokenization={"models": {MODEL: {"path": model_dir}}}, **overrides)
    return start


def chat_body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 8, **GREEDY, **extra}


async def streamed_text(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[str, Any, Any]:
    """The content of a streamed chat answer, its usage and its headers."""
    async with http.post(url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status == 200, await resp.text()
        parts, usage = [], None
        async for line in resp.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                usage = event.get("usage") or usage
                parts += [c["delta"].get("content") or "" for c in event.get("choices") or []]
        return "".join(parts), usage, resp.headers


async def test_split_answers_equal_one_pods_and_the_transfer_shows(start_pd_gateway, pd, http) -> None:
    connector, fleet = pd
    prefill, decode = fleet[0], fleet[1]
    gw = await start_pd_gateway()
    tokens = gw.kits.tokens.tokens.local(MODEL).tokenizer
    messages = conversation(document(f"split-{connector}"), "What is in it?")
    n = len(tokens.encode_chat(messages))
    external_before = await pod_metric(http, decode.url, "vllm:external_prefix_cache_hits_total")
    local_before = await pod_metric(http, decode.url, "vllm:prefix_cache_hits_total")

    reply, headers = await post(http, f"{gw.url}/v1/chat/completions", chat_body(messages))
    assert headers["x-gateway-pod"] == "decode" and headers["x-gateway-prefill-pod"] == "prefill"
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    external = await pod_metric(http, decode.url, "vllm:external_prefix_cache_hits_total") - external_before
    assert await pod_metric(http, decode.url, "vllm:prefix_cache_hits_total") == local_before
    if connector == "shared_storage":  # the decode pod loaded the prompt's whole blocks (less the last token)
        assert cached == external == (n - 2) // BLOCK_SIZE * BLOCK_SIZE > 0, (cached, external, n)
    else:  # it pulled the whole prompt; vLLM reports the prefill pod's own cache hits as cached
        assert external >= full_blocks(n) > 0 and cached == 0, (cached, external, n)
    # The decode pod's own events credit it with the blocks it received.
    ids = tokens.encode_chat(messages)
    await eventually(lambda: confirmed_tokens(gw, "decode", ids) == full_blocks(n), WAIT_S,
                     nudge=lambda: step_engine(http, decode.url))

    # Greedy output through the split is one pod's alone, streamed or not, on all three APIs.
    alone, _ = await post(http, f"{prefill.url}/v1/chat/completions", chat_body(messages))
    assert reply["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    streamed = conversation(document(f"stream-{connector}"), "And this one?")
    text, usage, headers = await streamed_text(http, f"{gw.url}/v1/chat/completions", chat_body(streamed))
    assert headers["x-gateway-prefill-pod"] == "prefill" and usage["completion_tokens"] == 8
    alone, _ = await post(http, f"{prefill.url}/v1/chat/completions", chat_body(streamed))
    assert text == alone["choices"][0]["message"]["content"]

    prompt = {"model": MODEL, "prompt": document(f"completion-{connector}"), "max_tokens": 8, **GREEDY}
    reply, headers = await post(http, f"{gw.url}/v1/completions", prompt)
    assert headers.get("x-gateway-prefill-pod") == "prefill"
    alone, _ = await post(http, f"{prefill.url}/v1/completions", prompt)
    assert reply["choices"][0]["text"] == alone["choices"][0]["text"]

    message = {"model": MODEL, "max_tokens": 8, **GREEDY, "system": document(f"messages-{connector}"),
               "messages": [{"role": "user", "content": "Summarise."}]}
    reply, headers = await post(http, f"{gw.url}/v1/messages", message)
    assert headers.get("x-gateway-prefill-pod") == "prefill"
    alone, _ = await post(http, f"{prefill.url}/v1/messages", message)
    assert reply["content"] == alone["content"]


async def test_a_prompt_the_decode_pod_holds_skips_the_prefill_leg(start_pd_gateway, pd, http) -> None:
    connector, fleet = pd
    gw = await start_pd_gateway()
    tokens = gw.kits.tokens.tokens.local(MODEL).tokenizer
    doc = document(f"repeat-{connector}")
    first = conversation(doc, "First question?")
    _, headers = await post(http, f"{gw.url}/v1/chat/completions", chat_body(first))
    assert headers.get("x-gateway-prefill-pod") == "prefill", dict(headers)
    ids = tokens.encode_chat(first)
    await eventually(lambda: confirmed_tokens(gw, "decode", ids) == full_blocks(len(ids)), WAIT_S,
                     nudge=lambda: step_engine(http, fleet[1].url))
    # The same document, another short question: all but the last block or so is on the decode pod.
    again = conversation(doc, "Second one?")
    reply, headers = await post(http, f"{gw.url}/v1/chat/completions", chat_body(again))
    assert "x-gateway-prefill-pod" not in headers and headers["x-gateway-pod"] == "decode", dict(headers)
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == int(headers["x-gateway-prefix-tokens"]) > 0, (reply["usage"], dict(headers))
    async with http.get(f"{gw.url}/metrics") as resp:
        text = await resp.text()
    outcomes = [line for line in text.splitlines() if line.startswith("gateway_pd_requests_total")]
    assert f'gateway_pd_requests_total{{model="{MODEL}",outcome="split"}} 1.0' in outcomes, outcomes
    assert f'gateway_pd_requests_total{{model="{MODEL}",outcome="cached"}} 1.0' in outcomes, outcomes


async def test_no_request_fails_when_the_prefill_pod_is_killed(start_pd_gateway, pd, http) -> None:
    """Last in the module: the prefill pod does not come back."""
    connector, fleet = pd
    # Flow control off: it releases held requests one at a time as each prefill leg is answered, so the
    # prefill pod is seldom idle while decode legs run, the moment the ExampleConnector case waits for.
    gw = await start_pd_gateway(flow_control={"enabled": False})
    statuses: list[int] = []
    served: list[str | None] = []

    async def one(i: int) -> None:
        body = chat_body(conversation(document(f"kill-{connector}-{i}"), f"Question {i}?"))
        async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            await resp.read()
            statuses.append(resp.status)
            served.append(resp.headers.get("x-gateway-prefill-pod"))

    async def run(first: int, count: int) -> None:
        await asyncio.gather(*(one(i) for i in range(first, first + count)))

    await run(0, 3)
    running = asyncio.create_task(run(3, 6))
    if connector == "nixl":  # mid-run: prefill legs on their way, in flight, or answered and not yet pulled
        await asyncio.sleep(0.3)
    else:
        # ExampleConnector saves a prompt's KV as a folder, then a file per layer, and a pod finding the folder
        # loads every file: a prefill pod killed while saving leaves an entry that kills the decode pod loading
        # it (vLLM 0.32; docs/disaggregation.md). So here it dies while the decode legs run, none of its own in flight.
        ledger = gw.kits.shared.ledger
        await eventually(lambda: ledger.on_pod("prefill") == 0 and ledger.on_pod("decode") > 0, WAIT_S)
    await asyncio.to_thread(fleet[0].kill)
    await running
    await run(9, 3)
    assert statuses == [200] * 12, statuses
    assert served[:3] == ["prefill"] * 3 and served[-3:] == [None] * 3, served
    async with http.get(f"{gw.url}/metrics") as resp:
        text = await resp.text()
    aggregated = sum(f'outcome="{o}"' in line and float(line.rsplit(" ", 1)[1]) > 0 for line in text.splitlines()
                     for o in ("prefill_failed", "no_prefill_pod") if line.startswith("gateway_pd_requests_total"))
    assert aggregated, text
