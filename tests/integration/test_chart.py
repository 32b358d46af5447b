"""The Helm chart, with the real helm: lint, render several value sets, validate every manifest against
the Kubernetes schemas, and check the rendered gateway config with the gateway's own loader."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.config import GatewayConfig, load_config, read_config_file

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "gateway"
HELM = ROOT / ".tools" / "helm"
INFERENCE_POOL_SCHEMA = json.loads((ROOT / "tests" / "fixtures" / "schemas" / "inferencepool-v1.json").read_text())
POD = {"url": "http://vllm-0.vllm:8000", "kv_events": "tcp://vllm-0.vllm:5557", "kv_replay": "tcp://vllm-0.vllm:5558"}

VALUE_SETS = {
    "default": [],
    "static-pods-redis-hpa-monitoring": [
        "--set", "redis.enabled=true", "--set", "autoscaling.enabled=true", "--set", "serviceMonitor.enabled=true",
        "--set", "grafanaDashboard.enabled=true", "--set-json", f"pods.list={json.dumps([POD])}"],
    "kubernetes-discovery": ["--set", "pods.discovery=kubernetes", "--set", "pods.labelSelector=app=vllm"],
    "epp-inference-pool": ["--set", "mode=epp", "--set", "rbac.create=false",
                           "--set-json", 'epp.inferencePool.selector={"app": "vllm", "model": "llama"}'],
    "file-discovery-external-redis": [
        "--set", "pods.discovery=file", "--set", "redis.externalUrl=redis://redis.shared:6379/0",
        "--set", "rbac.create=false", "--set-json", f"pods.list={json.dumps([POD])}"],
}


@pytest.fixture(scope="module")
def helm() -> Path:
    if not HELM.exists():
        pytest.fail("helm is missing: `make install` fetches it (tools/fetch-helm.sh)")
    return HELM


def render(helm: Path, args: list[str]) -> list[dict]:
    out = subprocess.run([str(helm), "template", "gw", str(CHART), "--namespace", "llm", *args],
                         capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_lint(helm):
    result = subprocess.run([str(helm), "lint", str(CHART), "--strict"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_render_and_validate(helm, name, tmp_path):
    docs = render(helm, VALUE_SETS[name])
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount"} <= kinds
    for doc in docs:
        if doc["kind"] == "InferencePool":  # a CRD: validated against the schema written from its API types
            jsonschema.validate(doc, INFERENCE_POOL_SCHEMA)
        elif doc["kind"] != "ServiceMonitor":  # a CRD: not in the core schemas
            kubernetes_validate.validate(doc, "1.30", strict=True)
    config_map = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "gw-gateway")
    path = tmp_path / "gateway.yaml"
    path.write_text(config_map["data"]["gateway.yaml"])
    config = load_config(path, environ={})  # what the container will load, validated by the gateway itself
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "gw-gateway")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    if name == "epp-inference-pool":
        check_epp(docs, config, container)
        return
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "InferencePool" not in kinds
    assert config.server.port == 8080 and config.server.shutdown_grace_s == 55 and config.server.workers == 2
    assert container["resources"]["requests"]["cpu"] == "2"  # one core per worker
    if name == "static-pods-redis-hpa-monitoring":
        assert config.pods[0].kv_events == POD["kv_events"] and config.load.redis_url == "redis://gw-gateway-redis:6379/0"
        assert config.shared_state.redis_url == config.load.redis_url
        assert {"HorizontalPodAutoscaler", "ServiceMonitor"} <= kinds and "replicas" not in deployment["spec"]
        assert any(d["metadata"]["name"] == "gw-gateway-dashboard" for d in docs)
    if name == "kubernetes-discovery":
        assert config.discovery.source == "kubernetes"
        assert config.discovery.options == {"label_selector": "app=vllm", "namespace": "llm"}
        role = next(d for d in docs if d["kind"] == "Role")
        assert role["rules"][0]["verbs"] == ["get", "list", "watch"]
    if name == "file-discovery-external-redis":
        assert config.discovery.source == "file" and config.pods == []
        pods_file = tmp_path / "pods.yaml"
        pods_file.write_text(config_map["data"]["pods.yaml"])
        assert read_config_file(pods_file)["pods"] == [POD]
        assert "Role" not in kinds and config.load.redis_url == "redis://redis.shared:6379/0"
        assert config.shared_state.redis_url == "redis://redis.shared:6379/0"
    if name == "default":
        assert config.shared_state.redis_url is None  # no Redis: each replica keeps its own state


def check_epp(docs: list[dict], config: GatewayConfig, container: dict) -> None:
    """The EPP of an InferencePool: its pods are the pool's (its selector, its port), Envoy reaches it through
    the Service the pool names, the probes are the protocol's gRPC health services, and it may read pods
    and InferencePools."""
    assert container["args"][0] == "epp"
    assert config.epp.host == "0.0.0.0" and config.epp.port == 9002 and config.epp.fallbacks == 2
    assert config.discovery.source == "kubernetes"
    assert config.discovery.options == {"label_selector": "app=vllm,model=llama", "namespace": "llm",
                                        "http_port": 8000}
    assert container["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": 9002, "service": "liveness"}
    pool = next(d for d in docs if d["kind"] == "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"] == {"app": "vllm", "model": "llama"}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    ref = pool["spec"]["endpointPickerRef"]
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == ref["name"])
    grpc_port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert grpc_port["targetPort"] == "grpc" and grpc_port["appProtocol"] == "http2"
    assert any(p["name"] == "grpc" and p["containerPort"] == 9002 for p in container["ports"])
    role = next(d for d in docs if d["kind"] == "Role")  # rbac.create=false: the EPP needs it anyway
    assert {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"]} in role["rules"]


@pytest.mark.parametrize("broken", [
    {"spec": {"targetPorts": []}},  # at least one port
    {"spec": {"endpointPickerRef": {"name": "epp", "failureMode": "Sometimes"}}},
    {"spec": {"endpointPickerRef": {"name": "epp"}}},  # a Service needs its port
    {"spec": {"selector": {"matchLabels": {"app": "vllm"}, "matchExpressions": []}}},  # v1 has matchLabels only
])
def test_the_inference_pool_schema_refuses_what_the_api_refuses(helm, broken):
    pool = next(d for d in render(helm, VALUE_SETS["epp-inference-pool"]) if d["kind"] == "InferencePool")
    jsonschema.validate(pool, INFERENCE_POOL_SCHEMA)
    pool["spec"].update(broken["spec"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, INFERENCE_POOL_SCHEMA)


def _gateway_metrics():
    """The metrics of a gateway built from the default config: each feature declares its own families on them."""
    from gateway.app import build_gateway
    from gateway.config import GatewayConfig

    return build_gateway(GatewayConfig()).foundation.metrics


def test_dashboard_queries_name_real_metrics():
    dashboard = json.loads((CHART / "dashboards" / "gateway.json").read_text())
    exported = _gateway_metrics().render().decode()
    names = {line.split(" ")[2].removesuffix("_total") for line in exported.splitlines() if line.startswith("# TYPE")}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            metric = next(tok for tok in target["expr"].replace("(", " ").replace("[", " ").replace("{", " ").split()
                          if tok.startswith("gateway_"))
            base = metric.removesuffix("_bucket").removesuffix("_total")
            assert base in names or metric.startswith("gateway_kv_"), metric


def test_dashboard_groups_by_labels_its_metrics_have_and_outcomes_the_records_give():
    from prometheus_client.metrics import MetricWrapperBase

    from gateway.loop_histogram import LoopHistogram
    from gateway.proxy.outcome import Ending
    from gateway.request.types import result_of

    dashboard = json.loads((CHART / "dashboards" / "gateway.json").read_text())
    labels_of = {m._name: {*m._labelnames, "le"} for m in list(_gateway_metrics().registry._collector_to_names)
                 if isinstance(m, MetricWrapperBase | LoopHistogram)}
    outcomes = {result_of(200, ending) for ending in Ending} | {result_of(500)}
    shown = set()
    for target in (t for panel in dashboard["panels"] for t in panel["targets"]):
        expr = target["expr"]
        metric = re.search(r"gateway_\w+", expr).group()
        base = metric.removesuffix("_bucket").removesuffix("_total")
        if metric.startswith("gateway_kv_") and base not in labels_of:
            continue  # the prefix index's own registry
        used = {name.strip() for group in re.findall(r"by \(([^)]*)\)", expr) for name in group.split(",")}
        used |= set(re.findall(r"(\w+)\s*(?:=~|!=|!~|=)\s*\"", expr))
        assert used <= labels_of[base], (expr, used - labels_of[base])
        for values in re.findall(r'outcome\s*(?:=~|!=|!~|=)\s*"([^"]*)"', expr) if base == "gateway_requests" else ():
            assert set(values.split("|")) <= outcomes, values
            shown |= set(values.split("|"))
    assert "engine_error" in shown  # an engine's error inside a 200 stream is on the dashboard


def test_dockerfile_builds_what_the_cli_runs():
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["gateway"]' in text and "COPY plugins" in text and shutil.which("python3")
