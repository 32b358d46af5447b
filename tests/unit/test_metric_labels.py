"""Label values stay bounded: a model label is a served name or ``unknown``, and no value exported passes 256
characters, in any family (issue 54, item 4)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.kv.verification import PredictionMetrics
from gateway.metrics import GatewayMetrics
from gateway.request.observers import ModelLabels


def test_a_label_value_past_256_characters_is_capped_in_every_family_and_long_names_stay_apart():
    metrics = GatewayMetrics()
    long_a, long_b = "x" * 1000 + "a", "x" * 1000 + "b"  # a config's or a pod's names, alike at first
    metrics.owned(PredictionMetrics).drift.labels(long_a).set(1)
    metrics.owned(PredictionMetrics).drift.labels(long_b).set(0)
    metrics.owned(PredictionMetrics).drift.labels("short").set(1)
    metrics.upstream_errors.labels("p" * 300, "connect").inc()
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    values = [v for f in families.values() for s in f.samples for v in s.labels.values()]
    assert max(map(len, values)) == 256
    drift = {s.labels["model"]: s.value for s in families["gateway_kv_drift"].samples}
    assert len(drift) == 3 and drift["short"] == 1
    assert sorted(drift.values()) == [0, 1, 1]
    assert all(model.startswith("x" * 200) for model in drift if model != "short")


def test_a_model_label_is_a_served_name_capped_or_unknown():
    served = {"mock-llama", "L" * 400}
    labels = ModelLabels(served.__contains__)
    assert labels.label("mock-llama") == "mock-llama"
    assert labels.label("-") == "-"  # the request named none
    assert labels.label("a client's invention") == "unknown"
    assert labels.label("m" * 1_000_000) == "unknown"
    assert len(labels.label("L" * 400)) == 256 and labels.label("L" * 400).startswith("L" * 200)
