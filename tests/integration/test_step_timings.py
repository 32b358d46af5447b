"""The time of each step of a request, on real sockets and a simulated pod: every step a request took is in
``gateway_request_step_seconds`` and ``/debug/steps``, and the steps add up as they should around the
pod's own time to first token."""

from __future__ import annotations

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR

MODEL = "mock-llama"
TAKEN = ("parse", "tokenize", "prepare", "admit", "route", "dispatch", "connect", "first_byte")


def histogram_sums(text: str, family_name: str) -> dict[str, tuple[float, float]]:
    """Per ``step`` label (or "" without one): the histogram's count and sum."""
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != family_name:
            continue
        for sample in family.samples:
            label = sample.labels.get("step", "")
            if sample.name.endswith("_count"):
                out.setdefault(label, [0.0, 0.0])[0] += sample.value
            elif sample.name.endswith("_sum"):
                out.setdefault(label, [0.0, 0.0])[1] += sample.value
    return {k: (v[0], v[1]) for k, v in out.items()}


async def test_each_request_step_is_measured_and_they_add_up_around_the_pods_own_time(
        start_mock_pod, start_gateway, http):
    pod = await start_mock_pod(speed=1.0)  # the pod takes real time to prefill: its TTFT is not nothing
    gw = await start_gateway([msgspec.to_builtins(pod.pod_config()) | {"name": "pod0"}],
                             routing={"policy": "kv_aware"},
                             tokenization={"models": {MODEL: {"path": str(BUNDLED_TOKENIZER_DIR)}}})
    ids = [f"steps-{i}" for i in range(3)]
    for i, request_id in enumerate(ids):
        body = {"model": MODEL, "max_tokens": 4, "stream": True,
                "messages": [{"role": "user", "content": f"Question {i}: " + "why is the sky blue? " * 40}]}
        async with http.post(f"{gw.url}/v1/chat/completions", json=body, headers={"x-request-id": request_id}) as resp:
            assert resp.status == 200
            await resp.read()
    async with http.get(f"{gw.url}/metrics") as resp:
        text = await resp.text()
    steps = histogram_sums(text, "gateway_request_step_seconds")
    assert {name: count for name, (count, _) in steps.items() if count} == dict.fromkeys(TAKEN, 3)
    assert steps.get("prefill", (0.0, 0.0))[0] == 0  # not a disaggregated model
    # The steps follow each other from the director's start to the first byte: no more than the TTFT it saw.
    (ttft_count, ttft_sum), = histogram_sums(text, "gateway_time_to_first_byte_seconds").values()
    assert ttft_count == 3 and sum(s for _, s in steps.values()) <= ttft_sum
    # The pod's own time to first token lies within the connect and first-byte steps of each request.
    async with http.get(f"{pod.url}/debug/ttft") as resp:
        pod_ttft = (await resp.json())["ttft_s"]
    pod_total = sum(pod_ttft[i] for i in ids)
    assert pod_total > 0 and steps["connect"][1] + steps["first_byte"][1] >= pod_total
    async with http.get(f"{gw.url}/debug/steps") as resp:
        assert resp.status == 200
        view = (await resp.json())["steps"]
    assert {name: row["seen"] for name, row in view.items()} == {**dict.fromkeys(TAKEN, 3), "prefill": 0}
    for name in TAKEN:
        row = view[name]
        assert row["window"] == 3 and 0 <= row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"]
    assert "p50_ms" not in view["prefill"]

