"""LoRA adapters on demand, on two real vLLM pods (``--enable-lora --max-loras 1``, runtime registration on)
that register none at start: the gateway registers each of two tiny random adapters where it is first
needed, keeps each adapter's requests on its pod, and a repeated prompt for an adapter finds its prefix
cached there (the engine's own ``cached_tokens``; and the gateway's index, from the pod's LoRA-namespaced
events, predicted it)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from gateway.core.inference_api import parse_inference_request
from tests.conftest import eventually
from tests.e2e.conftest import MODEL, VllmFleet, running_pods
from tests.e2e.test_real_vllm import WAIT_S, conversation, document, full_blocks, post

ADAPTERS = ("sql-lora", "poem-lora")
LORA_ARGS = ("--enable-lora", "--max-loras", "1", "--max-lora-rank", "8")
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two tiny random adapters, built by the vLLM environment's Python (it has torch and safetensors)."""
    python = os.environ.get("E2E_VLLM_PYTHON")
    if not python:
        pytest.fail("E2E_VLLM_PYTHON is not set: run the suite through tests/e2e/run.sh", pytrace=False)
    out = tmp_path_factory.mktemp("adapters")
    subprocess.run([python, "tiny_lora.py", str(out), *ADAPTERS], cwd=Path(__file__).parent, check=True,
                   capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def lora_pods(model_dir: str) -> Iterator[VllmFleet]:
    yield from running_pods(model_dir, [(f"lora{i}", LORA_ARGS, LORA_ENV) for i in range(2)])


def confirmed(gw, pod: str, adapter: str | None, ids: list[int]) -> int:
    """Prompt tokens the gateway's index holds on ``pod`` under ``adapter`` from the pod's events alone."""
    match = gw.kits.kv.index.lookup(MODEL, adapter, ids, [pod])[pod]
    return match.gpu_tokens - match.speculative_tokens


async def listed(http: aiohttp.ClientSession, url: str) -> set[str]:
    async with http.get(f"{url}/v1/models") as resp:
        return {card["id"] for card in (await resp.json())["data"] if card.get("parent")}


async def test_adapters_are_registered_on_demand_and_keep_their_pod_and_prefix(
        lora_pods: VllmFleet, adapter_dir: Path, model_dir: str, start_gateway, http: aiohttp.ClientSession):
    assert [await listed(http, pod.url) for pod in lora_pods.pods] == [set(), set()]  # none at start
    adapters = {name: {"path": str(adapter_dir / name), "base_model": MODEL} for name in ADAPTERS}
    gw = await start_gateway(lora_pods.gateway_pods(), routing={"policy": "kv_aware"},
                             tokenization={"models": {MODEL: {"path": model_dir}}},
                             health={"interval_s": 0.3, "timeout_s": 2.0, "failure_threshold": 2},
                             models={"adapters": adapters})
    served: dict[str, set[str]] = {name: set() for name in ADAPTERS}
    answers: dict[str, list[tuple[dict, dict]]] = {name: [] for name in ADAPTERS}
    for _ in range(3):
        for name in ADAPTERS:
            body = {"model": name, "max_tokens": 4, "messages": conversation(document(name), "Summarise it.")}
            answer, headers = await post(http, f"{gw.url}/v1/chat/completions", body)
            assert answer["model"] == name
            served[name].add(headers["x-gateway-pod"])
            answers[name].append((answer, dict(headers)))
    pods = {name: next(iter(s)) for name, s in served.items()}
    assert all(len(s) == 1 for s in served.values()) and pods[ADAPTERS[0]] != pods[ADAPTERS[1]]
    by_name = {p.name: p for p in lora_pods.pods}
    for name, pod in pods.items():  # registered where it was needed, and only there
        assert await listed(http, by_name[pod].url) == {name}
    for name, replies in answers.items():
        prompt = replies[0][0]["usage"]["prompt_tokens"]
        cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a, _ in replies]
        assert cached[0] == 0 and cached[1:] == [full_blocks(prompt)] * 2, (name, cached)
        assert int(replies[2][1]["x-gateway-prefix-tokens"]) == full_blocks(prompt)
        # The gateway's index holds the adapter's blocks from the pod's own events (vLLM marks them per adapter),
        # in the adapter's namespace only.
        body = {"model": name, "messages": conversation(document(name), "Summarise it.")}
        tokens = await gw.kits.tokens.tokens.tokenize(name, "chat", parse_inference_request(json.dumps(body).encode()))
        assert tokens is not None and len(tokens.ids) == prompt
        expected = full_blocks(prompt)
        await eventually(lambda ids=tokens.ids, name=name, expected=expected:
                         confirmed(gw, pods[name], name, ids) == expected, WAIT_S)
        assert confirmed(gw, pods[name], None, tokens.ids) == 0
    debug = await (await http.get(f"{gw.url}/debug/adapters")).json()
    assert sorted(n for p in debug["pods"].values() for n in p["listed"]) == sorted(ADAPTERS)
    await eventually(lambda: all(gw.kits.load.load.engine[p.name].max_loras == 1 for p in lora_pods.pods), 10)
