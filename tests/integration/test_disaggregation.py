"""Prefill/decode disaggregation through a real gateway: simulated prefill and decode pods with vLLM's
ExampleConnector and NixlConnector, and recording pods that show exactly what each leg was sent."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
from aiohttp import web

from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR
from simulator.pod import MockPod
from tests.conftest import eventually, models_of

MODEL = "mock-llama"
BLOCK = 16


def kv_transfer(connector: str, role: str, storage: str = "", policy: str = "fail") -> str:
    if connector == "shared_storage":
        return json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"shared_storage_path": storage}})
    return json.dumps({"kv_connector": "NixlConnector", "kv_buffer_device": "cpu", "kv_load_failure_policy": policy,
                       "kv_role": "kv_producer" if role == "prefill" else "kv_consumer"})


async def pd_fleet(start_mock_pod, start_gateway, tmp_path, connector: str = "shared_storage", prefill: int = 1,
                   decode: int = 1, **gateway_kw: Any) -> tuple[list[MockPod], list[MockPod], Any]:
    """Prefill pods ``prefill0..``, decode pods ``decode0..``, and a kv_aware gateway in front of them."""
    def start(role: str):
        return start_mock_pod(kv_transfer_config=kv_transfer(connector, role, str(tmp_path)))
    prefills = [await start("prefill") for _ in range(prefill)]
    decodes = [await start("decode") for _ in range(decode)]
    pods = [msgspec.to_builtins(p.pod_config()) | {"name": f"{role}{i}", "role": role}
            for role, group in (("prefill", prefills), ("decode", decodes)) for i, p in enumerate(group)]
    gateway_kw.setdefault("tokenization", {"models": {MODEL: {"path": str(BUNDLED_TOKENIZER_DIR)}}})
    gateway_kw.setdefault("routing", {"policy": "kv_aware"})
    gateway_kw["disaggregation"] = {"connector": connector, **gateway_kw.get("disaggregation", {})}
    gw = await start_gateway(pods, **gateway_kw)
    return prefills, decodes, gw


def document(name: str, words: int = 300) -> str:
    return f"Document {name}. " + " ".join(f"{name}-{i % 37}" for i in range(words))


def chat(name: str, question: str = "What is in it?", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4, **extra,
            "messages": [{"role": "system", "content": document(name)}, {"role": "user", "content": question}]}


async def post(http, url: str, body: dict[str, Any]) -> tuple[Any, Any]:
    async with http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json() if resp.content_type == "application/json" else await resp.read()), resp.headers


async def pd_outcomes(http, gw) -> dict[str, float]:
    async with http.get(f"{gw.url}/metrics") as resp:
        text = await resp.text()
    return {line.split('outcome="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("gateway_pd_requests_total")}


def confirmed(gw, pod: str, ids: list[int]) -> int:
    match = gw.kits.kv.index.lookup(MODEL, None, ids, [pod])[pod]
    return match.gpu_tokens - match.speculative_tokens


@pytest.mark.parametrize("connector", ["shared_storage", "nixl"])
async def test_split_prefills_on_one_pod_and_decodes_on_the_other(start_mock_pod, start_gateway, http, tokenizer,
                                                                  tmp_path, connector):
    (prefill,), (decode,), gw = await pd_fleet(start_mock_pod, start_gateway, tmp_path, connector)
    body = chat(f"split-{connector}")
    ids = tokenizer.encode_chat(body["messages"])
    reply, headers = await post(http, f"{gw.url}/v1/chat/completions", body)
    assert headers["x-gateway-pod"] == "decode0" and headers["x-gateway-prefill-pod"] == "prefill0"
    # The prefill pod computed the prompt for one token; the decode pod loaded it and wrote the answer.
    assert prefill.engine.generation_tokens_total == 1 and prefill.engine.prompt_tokens_total == len(ids)
    assert decode.engine.generation_tokens_total == 4 and reply["usage"]["completion_tokens"] == 4
    assert decode.engine.cache.stats.hits == 0
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    if connector == "shared_storage":
        assert cached == decode.engine.external_hits == (len(ids) - 2) // BLOCK * BLOCK
    else:  # pulled whole; cached as the prefill pod found it (vLLM 0.32's D node reports its P node's)
        assert decode.engine.external_hits == len(ids) and cached == 0
        assert prefill.engine.cache.num_free == prefill.engine.cache.usable_blocks  # freed once pulled
    # The decode pod's own events credit it with the blocks it received.
    await eventually(lambda: confirmed(gw, "decode0", ids) == (len(ids) - 1) // BLOCK * BLOCK, within_s=5)

    # Streamed: the decode leg's stream, usage and all.
    streamed = chat(f"stream-{connector}", stream=True, stream_options={"include_usage": True})
    raw, headers = await post(http, f"{gw.url}/v1/chat/completions", streamed)
    assert headers["x-gateway-prefill-pod"] == "prefill0" and headers["content-type"] == "text/event-stream"
    events = [json.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 4 and raw.endswith(b"data: [DONE]\n\n")
    assert prefill.engine.generation_tokens_total == 2  # its leg was not streamed, and was one token


@pytest.mark.parametrize("connector", ["shared_storage", "nixl"])
async def test_completions_and_messages_are_split_too(start_mock_pod, start_gateway, http, tmp_path, connector):
    (prefill,), _, gw = await pd_fleet(start_mock_pod, start_gateway, tmp_path, connector)
    completion = {"model": MODEL, "prompt": document(f"completion-{connector}"), "max_tokens": 3}
    reply, headers = await post(http, f"{gw.url}/v1/completions", completion)
    assert headers["x-gateway-prefill-pod"] == "prefill0" and reply["usage"]["completion_tokens"] == 3
    message = {"model": MODEL, "max_tokens": 3, "system": document(f"messages-{connector}"),
               "messages": [{"role": "user", "content": "Summarise."}]}
    reply, headers = await post(http, f"{gw.url}/v1/messages", message)
    assert headers["x-gateway-prefill-pod"] == "prefill0" and reply["type"] == "message"
    assert reply["usage"]["output_tokens"] == 3
    assert prefill.engine.generation_tokens_total == 2
    assert await pd_outcomes(http, gw) == {"split": 2.0}


async def test_a_prompt_the_decode_pod_holds_skips_the_prefill_leg(start_mock_pod, start_gateway, http, tokenizer,
                                                                   tmp_path):
    (prefill,), _, gw = await pd_fleet(start_mock_pod, start_gateway, tmp_path)
    first = chat("repeat", "First?")
    _, headers = await post(http, f"{gw.url}/v1/chat/completions", first)
    assert headers["x-gateway-prefill-pod"] == "prefill0"
    ids = tokenizer.encode_chat(first["messages"])
    await eventually(lambda: confirmed(gw, "decode0", ids) == (len(ids) - 1) // BLOCK * BLOCK, within_s=5)
    reply, headers = await post(http, f"{gw.url}/v1/chat/completions", chat("repeat", "Second?"))
    assert "x-gateway-prefill-pod" not in headers and headers["x-gateway-pod"] == "decode0"
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == int(headers["x-gateway-prefix-tokens"]) > 0
    _, headers = await post(http, f"{gw.url}/v1/chat/completions", {**chat("x"), "messages": [
        {"role": "user", "content": "A short one."}]})
    assert "x-gateway-prefill-pod" not in headers and headers["x-gateway-pod"] == "decode0"
    assert prefill.engine.generation_tokens_total == 1
    assert await pd_outcomes(http, gw) == {"split": 1.0, "cached": 1.0, "short": 1.0}
    # Each prefill leg was checked against the prefill pod's own cache, each whole request against the decode
    # pod's: every prediction exact.
    async with http.get(f"{gw.url}/metrics") as resp:
        text = await resp.text()
    checks = [line for line in text.splitlines() if line.startswith("gateway_kv_prediction_exact_total")]
    assert checks and all('outcome="exact"' in line for line in checks), checks


async def test_the_threshold_is_the_uncached_tokens_on_the_decode_pod(start_mock_pod, start_gateway, http,
                                                                      tmp_path):
    (prefill,), _, gw = await pd_fleet(start_mock_pod, start_gateway, tmp_path,
                                       disaggregation={"uncached_token_threshold": 10_000})
    _, headers = await post(http, f"{gw.url}/v1/chat/completions", chat("under-threshold"))
    assert "x-gateway-prefill-pod" not in headers and prefill.engine.generation_tokens_total == 0


async def test_prefill_failures_try_another_prefill_pod_then_serve_whole(start_mock_pod, start_gateway, http,
                                                                         tmp_path):
    prefills, _, gw = await pd_fleet(start_mock_pod, start_gateway, tmp_path, prefill=2,
                                             health={"interval_s": 30, "eject_after_5xx": 100})
    broken = prefills[0]
    broken.faults = type(broken.faults)(error_fraction=1.0)
    for i in range(4):  # whichever prefill pod is chosen first, the working one serves the leg
        _, headers = await post(http, f"{gw.url}/v1/chat/completions", chat(f"retry-{i}"))
        assert headers["x-gateway-prefill-pod"] == "prefill1"
    assert prefills[1].engine.generation_tokens_total == 4
    prefills[1].faults = type(broken.faults)(error_fraction=1.0)
    reply, headers = await post(http, f"{gw.url}/v1/chat/completions", chat("both-broken"))
    assert "x-gateway-prefill-pod" not in headers and headers["x-gateway-pod"] == "decode0"
    assert reply["usage"]["completion_tokens"] == 4
    await prefills[1].stop()  # refuses connections now
    prefills[0].faults = type(broken.faults)()
    _, headers = await post(http, f"{gw.url}/v1/chat/completions", chat("one-gone"))
    assert headers["x-gateway-prefill-pod"] == "prefill0"
    outcomes = await pd_outcomes(http, gw)
    assert outcomes["split"] == 5 and outcomes["prefill_failed"] == 1, outcomes
    async with http.get(f"{gw.url}/metrics") as resp:
        assert 'gateway_retries_total{cause="status_5xx",pod="prefill0"}' in await resp.text()


async def test_no_prefill_pod_and_unsplit_apis_are_served_whole_by_decode_pods(start_mock_pod, start_gateway, http,
                                                                                tmp_path):
    (prefill,), _, gw = await pd_fleet(start_mock_pod, start_gateway, tmp_path, decode=2,
                                             routing={"policy": "round_robin"})
    several = {"model": MODEL, "prompt": [document("first"), document("second")], "max_tokens": 2}
    for _ in range(4):  # not split, and a prefill pod never serves a whole request
        _, headers = await post(http, f"{gw.url}/v1/completions", several)
        assert headers["x-gateway-pod"].startswith("decode") and "x-gateway-prefill-pod" not in headers
    await prefill.stop()
    pod = gw.kits.foundation.pods.get("prefill0")
    await eventually(lambda: not pod.healthy, within_s=5)
    _, headers = await post(http, f"{gw.url}/v1/chat/completions", chat("alone"))
    assert headers["x-gateway-pod"].startswith("decode") and "x-gateway-prefill-pod" not in headers
    outcomes = await pd_outcomes(http, gw)
    assert outcomes.get("unsupported") == 4 and outcomes.get("split", 0) == 0, outcomes
    assert outcomes.get("no_prefill_pod", 0) + outcomes.get("prefill_failed", 0) == 1, outcomes
    async with http.get(f"{gw.url}/debug/pods") as resp:
        roles = {p["name"]: p["role"] for p in (await resp.json())["pods"]}
    assert roles == {"prefill0": "prefill", "decode0": "decode", "decode1": "decode"}
    async with http.get(f"{gw.url}/metrics") as resp:
        assert 'gateway_pod_role{pod="prefill0",role="prefill"} 1.0' in await resp.text()


async def test_the_ledger_counts_both_legs_on_their_pods(start_mock_pod, start_gateway, http, tmp_path):
    (prefill,), _, gw = await pd_fleet(start_mock_pod, start_gateway, tmp_path)
    prefill.faults = type(prefill.faults)(stall_s=0.5)
    ledger = gw.kits.shared.ledger
    asking = asyncio.create_task(post(http, f"{gw.url}/v1/chat/completions", chat("ledger")))
    await eventually(lambda: ledger.on_pod("prefill0") == 1, within_s=2)
    assert ledger.on_pod("decode0") == 1  # chosen first, and waiting for its prefill
    await asking
    assert ledger.on_pod("prefill0") == 0 and ledger.on_pod("decode0") == 0


# What each leg is sent, seen by pods that record it.

def recording_pod(seen: list[tuple[dict[str, Any], dict[str, str], bytes]], nixl_params: dict[str, Any] | None):
    async def answer(request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw)  # exact: a 30-digit number stays one
        seen.append((body, {k.lower(): v for k, v in request.headers.items()}, raw))
        reply: dict[str, Any] = {"id": "x", "object": "chat.completion", "model": MODEL,
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                              "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": 300, "completion_tokens": 1, "total_tokens": 301}}
        if nixl_params is not None and (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            reply["kv_transfer_params"] = nixl_params
        return web.json_response(reply)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    app.router.add_get("/v1/models", models_of(MODEL))
    return app


@pytest.mark.parametrize("connector", ["shared_storage", "nixl"])
async def test_each_leg_is_sent_what_vllm_expects(start_backend, start_gateway, http, connector):
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
              "remote_engine_id": "engine-p", "remote_request_id": "r-1", "remote_host": "10.0.0.1",
              "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 300, "transfer_mode": "pull"}
    prefill_seen: list = []
    decode_seen: list = []
    prefill_url = await start_backend(recording_pod(prefill_seen, params))
    decode_url = await start_backend(recording_pod(decode_seen, None))
    gw = await start_gateway([{"url": prefill_url, "name": "p", "role": "prefill", "models": [MODEL]},
                              {"url": decode_url, "name": "d", "role": "decode", "models": [MODEL]}],
                             disaggregation={"connector": connector})
    client_body = (b'{"model": "mock-llama", "stream": true, "stream_options": {"include_usage": true}, '
                   b'"min_tokens": 2, "max_tokens": 50, "x_trace": 123456789012345678901234567890, '
                   b'"messages": [{"role": "user", "content": "'
                   + b"long text " * 200 + b'"}]}')
    async with http.post(f"{gw.url}/v1/chat/completions", data=client_body,
                         headers={"content-type": "application/json", "x-request-id": "req-42"}) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-gateway-prefill-pod"] == "p" and resp.headers["x-request-id"] == "req-42"
    (prefill_body, prefill_headers, _), = prefill_seen
    (decode_body, decode_headers, decode_raw), = decode_seen
    assert prefill_headers["x-request-id"] == decode_headers["x-request-id"] == "req-42"
    assert prefill_body["max_tokens"] == prefill_body["max_completion_tokens"] == 1
    assert prefill_body["stream"] is False and "stream_options" not in prefill_body and "min_tokens" not in prefill_body
    assert prefill_body["messages"] == decode_body["messages"]
    if connector == "shared_storage":
        assert "kv_transfer_params" not in prefill_body
        assert decode_raw == client_body  # byte for byte
    else:
        assert prefill_body["kv_transfer_params"] == {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}
        assert decode_body == {**json.loads(client_body), "kv_transfer_params": params}  # numbers exact


# The simulated pods' side of NIXL, as vLLM behaves.

async def test_a_decode_pod_refuses_parameters_of_an_unknown_engine(start_mock_pod, http, tokenizer):
    prefill = await start_mock_pod(kv_transfer_config=kv_transfer("nixl", "prefill"))
    decode = await start_mock_pod(kv_transfer_config=kv_transfer("nixl", "decode"))
    recomputing = await start_mock_pod(kv_transfer_config=kv_transfer("nixl", "decode", policy="recompute"))
    body = chat("engine-id")
    leg = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    answer, _ = await post(http, f"{prefill.url}/v1/chat/completions", leg)
    params = answer["kv_transfer_params"]
    assert params["remote_engine_id"] == prefill.nixl.engine_id and params["transfer_mode"] == "pull"
    assert params["remote_port"] == prefill.port and params["do_remote_prefill"] is True

    wrong = {**body, "kv_transfer_params": {**params, "remote_engine_id": "not-that-engine"}}
    async with http.post(f"{decode.url}/v1/chat/completions", json=wrong) as resp:
        assert resp.status == 500
        assert (await resp.json())["error"] == {"message": "Internal server error", "type": "InternalServerError",
                                                "param": None, "code": 500}
    async with http.post(f"{decode.url}/v1/chat/completions", json={**wrong, "stream": True}) as resp:
        assert resp.status == 200  # as vLLM: the error is the stream's first event
        assert b'"type":"InternalServerError"' in await resp.read()
    reply, _ = await post(http, f"{recomputing.url}/v1/chat/completions", wrong)
    assert reply["usage"]["completion_tokens"] == 4 and recomputing.engine.external_hits == 0

    prefill.restart()  # a restarted prefill pod is another engine: its old parameters are refused
    async with http.post(f"{decode.url}/v1/chat/completions", json={**body, "kv_transfer_params": params}) as resp:
        assert resp.status == 500
    answer, _ = await post(http, f"{prefill.url}/v1/chat/completions", leg)
    reply, _ = await post(http, f"{decode.url}/v1/chat/completions",
                          {**body, "kv_transfer_params": answer["kv_transfer_params"]})
    assert decode.engine.external_hits == len(tokenizer.encode_chat(body["messages"]))
    async with http.post(f"{decode.url}/v1/chat/completions",  # pulled once: the blocks are gone
                         json={**body, "kv_transfer_params": answer["kv_transfer_params"]}) as resp:
        assert resp.status == 500
