"""The verifier's rules: which answers miss, when a model drifts, and when it recovers."""

from __future__ import annotations

import pytest

from gateway.config import VerificationConfig
from gateway.kv.verification import PredictionVerifier, outcome_of
from gateway.metrics import GatewayMetrics


@pytest.mark.parametrize(("predicted", "reported", "gateway_tokens", "engine_tokens", "outcome"), [
    (512, 512, 600, 600, "exact"),
    (512, 384, 600, 600, "near"),  # a block of 128 apart: within the 256-token tolerance
    (1024, 0, 1100, 1100, "over"),  # the index said cached, the engine found nothing
    (0, 1024, 1100, 1100, "under"),  # the engine had more (another gateway sent it, events in flight)
    (512, 512, 600, 613, "prompt_tokens_mismatch"),  # the engine counted the prompt differently
])
def test_outcomes(predicted, reported, gateway_tokens, engine_tokens, outcome):
    assert outcome_of(predicted, reported, gateway_tokens, engine_tokens, tolerance=256) == outcome


def verifier(**config) -> tuple[PredictionVerifier, GatewayMetrics]:
    metrics = GatewayMetrics()
    return PredictionVerifier(VerificationConfig(**config), metrics), metrics


def drift_gauge(metrics: GatewayMetrics, model: str) -> float | None:
    return metrics.registry.get_sample_value("gateway_kv_drift", {"model": model})


def test_an_exact_setup_never_drifts_even_with_races():
    v, metrics = verifier(window=20, min_samples=10)
    for i in range(200):
        # every third answer raced: the engine had more, or a block less, than the index knew
        reported = 1024 if i % 3 == 0 else (384 if i % 3 == 1 else 512)
        v.observe("m", "p0", 512, reported, 600, 600)
    assert not v.drifting("m") and drift_gauge(metrics, "m") is None
    assert metrics.registry.get_sample_value("gateway_kv_prediction_exact_total",
                                             {"model": "m", "pod": "p0", "outcome": "exact"}) == pytest.approx(66)


def test_mismatches_drift_the_model_and_probes_bring_it_back():
    v, metrics = verifier(window=20, min_samples=10, max_miss_share=0.5, probe_every=2, recover_after=2)
    for _ in range(9):
        v.observe("m", "p0", 512, 512, 600, 613)
    assert not v.drifting("m")  # fewer samples than min_samples: no verdict yet
    v.observe("m", "p0", 512, 512, 600, 613)
    assert v.drifting("m") and not v.drifting("other") and drift_gauge(metrics, "m") == 1
    assert [v.probe_due("m") for _ in range(4)] == [False, True, False, True]
    v.probe("m", local_tokens=600, engine_tokens=613)  # the local tokenizer still disagrees
    v.probe("m", local_tokens=613, engine_tokens=613)
    assert v.drifting("m")
    v.probe("m", local_tokens=613, engine_tokens=613)  # two agreeing probes in a row
    assert not v.drifting("m") and drift_gauge(metrics, "m") == 0
    assert v.debug()["m"]["outcomes"]["prompt_tokens_mismatch"] == 10


def test_confident_wrong_predictions_drift_too():
    v, _ = verifier(window=10, min_samples=10, max_miss_share=0.6)
    for i in range(10):
        v.observe("m", "p0", 1024 if i < 6 else 0, 0, 1100, 1100)
    assert v.drifting("m")
