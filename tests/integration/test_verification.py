"""Routing that checks itself, end to end: a gateway whose chat template matches the engines' never
drifts; one whose template differs is caught, moves that model to the pods' /tokenize, and returns to
its own tokenizer once the engines agree with it again."""

from __future__ import annotations

import shutil

import msgspec

from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from simulator.pod import MockPod, MockPodConfig
from tests.integration.test_kv_routing import MODEL, ask, fleet, synced

CHECKS = {"window": 10, "min_samples": 6, "probe_every": 2, "recover_after": 2}


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_an_exact_setup_checks_out_and_never_drifts(start_mock_pod, start_gateway, http):
    pods, gw = await fleet(start_mock_pod, start_gateway, n=2, verification=CHECKS)
    for i in range(24):
        await ask(http, gw, i % 3, f"Question {i}?")
        await synced(gw, pods)
    text = await (await http.get(f"{gw.url}/metrics")).text()
    checked = {o: sum(metric(text, "gateway_kv_prediction_exact_total", model=MODEL, pod=f"pod{k}", outcome=o)
                      for k in range(2)) for o in ("exact", "near", "over", "under", "prompt_tokens_mismatch")}
    assert checked["exact"] >= 20 and checked["prompt_tokens_mismatch"] == 0 and checked["over"] == 0
    assert metric(text, "gateway_kv_drift", model=MODEL) == 0
    debug = await (await http.get(f"{gw.url}/debug/index")).json()
    assert debug["predictions"][MODEL]["drifting"] is False


async def test_a_template_drift_is_caught_and_routing_degrades_then_recovers(start_gateway, http, tmp_path,
                                                                              tokenizer):
    # The engines run a new revision of the model's chat template; the gateway still has the old one.
    revised = tmp_path / "revised"
    shutil.copytree(BUNDLED_TOKENIZER_DIR, revised)
    template = revised / "chat_template.jinja"
    template.write_text(template.read_text().replace("{{ bos_token }}", "{{ bos_token }}Revision 2.\n", 1))
    pod = MockPod(MockPodConfig(speed=0.0), tokenizer=HfTokenizer(revised))
    await pod.start()
    try:
        gw = await start_gateway([msgspec.to_builtins(pod.pod_config()) | {"name": "pod0"}],
                                 tokenization={"models": {MODEL: {"path": str(BUNDLED_TOKENIZER_DIR)}}},
                                 routing={"policy": "kv_aware"}, verification=CHECKS)
        for i in range(6):
            await ask(http, gw, 0, f"Question {i}?")
        text = await (await http.get(f"{gw.url}/metrics")).text()
        assert metric(text, "gateway_kv_prediction_exact_total", outcome="prompt_tokens_mismatch") == 6
        assert metric(text, "gateway_kv_drift", model=MODEL) == 1
        assert (await (await http.get(f"{gw.url}/debug/index")).json())["predictions"][MODEL]["drifting"]
        # Drifting: the prompt is tokenized by the pod (exactly as the engine will), so predictions hold.
        for i in range(6, 10):
            _, predicted, usage = await ask(http, gw, 0, f"Question {i}?")
            await synced(gw, [pod])
        assert predicted == usage["prompt_tokens_details"]["cached_tokens"] > 0
        text = await (await http.get(f"{gw.url}/metrics")).text()
        assert metric(text, "gateway_tokenization_total", model=MODEL, mode="remote", outcome="ok") >= 4
        # The engines go back to the gateway's template: two agreeing probes end the drift.
        pod.tokenizer = tokenizer
        for i in range(10, 16):
            await ask(http, gw, 0, f"Question {i}?")
        text = await (await http.get(f"{gw.url}/metrics")).text()
        assert metric(text, "gateway_kv_drift", model=MODEL) == 0
    finally:
        await pod.stop()
