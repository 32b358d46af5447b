from __future__ import annotations

import os

import pytest
import yaml

from gateway.cli import build_parser, parse_pod, serve_overrides
from gateway.config import ConfigError, PodConfig, load_config
from plugins.discovery.kubernetes import pod_config


def test_defaults_are_valid():
    config = load_config(environ={})
    assert config.server.port == 8080 and config.routing.policy == "round_robin" and config.pods == []


def test_file_then_env_then_flags(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text("server:\n  port: 9000\n  host: 0.0.0.0\nrouting:\n  policy: random\n"
                    "pods:\n  - url: http://a:8000/\n    models: [m]\n")
    env = {"GATEWAY_SERVER__PORT": "9100", "GATEWAY_HEALTH__FAILURE_THRESHOLD": "5", "OTHER": "x"}
    config = load_config(path, {"routing": {"policy": "least_request"}}, environ=env)
    assert config.server.port == 9100  # env beats file
    assert config.server.host == "0.0.0.0"  # file kept where nothing overrides
    assert config.routing.policy == "least_request"  # flags beat everything
    assert config.health.failure_threshold == 5
    assert config.pods[0].url == "http://a:8000" and config.pods[0].name == "a:8000"


def test_json_file(tmp_path):
    path = tmp_path / "gw.json"
    path.write_text('{"pods": [{"url": "http://p:1", "kv_events": "tcp://p:5557"}]}')
    assert load_config(path, environ={}).pods[0].kv_events == "tcp://p:5557"


@pytest.mark.parametrize(
    ("overrides", "env", "fragment"),
    [
        ({"server": {"port": "eighty"}}, {}, "$.server.port"),
        ({"server": {"port": 70000}}, {}, "$.server"),
        ({"pods": [{"url": "ftp://x"}]}, {}, "$.pods[0]"),
        ({"pods": [{"url": "http://x", "colour": "red"}]}, {}, "colour"),
        ({"auth": {"upstream": "replace"}}, {}, "upstream_api_key"),
        ({"auth": {"api_key_hashes": ["abc"]}}, {}, "SHA-256"),
        ({}, {"GATEWAY_ROUTING__MAX_RETRIES": "many"}, "$.routing.max_retries"),
        ({}, {"GATEWAY_NOPE": "1"}, "nope"),
        ({"pods": [{"url": "http://x", "role": "primary"}]}, {}, "$.pods[0].role"),
        ({"disaggregation": {"connector": "p2p"}}, {}, "$.disaggregation.connector"),
        ({"disaggregation": {"prefill_attempts": 0}}, {}, "prefill_attempts"),
        ({"mock_pods": {"count": 2, "prefill_pods": 2}}, {}, "decode pod"),
        # Ranges declared on the fields: the message names the field's path and the bound.
        ({"server": {"workers": 0}}, {}, "$.server.workers"),
        ({"flow_control": {"saturation": {"kv_usage": 1.5}}}, {}, "<= 1.0 - at `$.flow_control.saturation.kv_usage`"),
        ({}, {"GATEWAY_RESPONSES__TTL_S": "0"}, "> 0.0 - at `$.responses.ttl_s`"),
        ({"models": {"lora": {"idle_unload_s": -1}}}, {}, "$.models.lora.idle_unload_s"),
        ({"mock_pods": {"per_process": -1}}, {}, "per_process"),
        ({"routing": {"max_candidates": -1}}, {}, "max_candidates"),
        ({}, {"GATEWAY_KV_INDEX__INGEST_PROCESSES": "-1"}, "ingest_processes"),
        ({"kv_index": {"max_views": 0}}, {}, "max_views"),
    ],
)
def test_invalid_config_names_the_field(overrides, env, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides, environ=env)
    assert fragment in str(info.value)


def test_bad_yaml_file(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text("server: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path, environ={})


def test_pod_flag_syntax():
    assert parse_pod("http://h:8000,events=tcp://h:5557,replay=tcp://h:5558,models=a+b,name=p1") == {
        "url": "http://h:8000", "kv_events": "tcp://h:5557", "kv_replay": "tcp://h:5558",
        "models": ["a", "b"], "name": "p1",
    }
    with pytest.raises(ConfigError, match="unknown option"):
        parse_pod("http://h:8000,colour=red")


def test_pod_roles_and_each_pools_connector():
    config = load_config(overrides={
        "pods": [parse_pod("http://p:8000,role=prefill"), parse_pod("http://d:8000,role=decode"), {"url": "http://b:1"}],
        "disaggregation": {"connector": "nixl", "models": {"other": {"connector": "shared_storage"}}}}, environ={})
    assert [p.role for p in config.pods] == ["prefill", "decode", "both"]
    assert config.disaggregation.connector_of("m") == "nixl"
    assert config.disaggregation.connector_of("other") == "shared_storage"
    assert config.disaggregation.uncached_token_threshold == 256
    with pytest.raises(ValueError, match="role"):
        PodConfig(url="http://x", role="primary")  # type: ignore[arg-type]


def test_kubernetes_annotation_says_the_role():
    def pod(role: str | None) -> dict:
        notes = {"gateway.kv/role": role} if role else {}
        ready = [{"type": "Ready", "status": "True"}]
        return {"metadata": {"name": "vllm-0", "annotations": notes},
                "status": {"phase": "Running", "podIP": "10.0.0.5", "conditions": ready}}

    assert pod_config(pod("prefill")).role == "prefill"
    assert pod_config(pod(None)).role == "both"
    assert pod_config(pod("primary")) is None  # unusable annotations: no traffic, a warning


def test_serve_flags_become_overrides():
    args = build_parser().parse_args(
        ["serve", "--port", "9999", "--policy", "random", "--pod", "http://a:1", "--mock-pods", "2"]
    )
    config = load_config(overrides=serve_overrides(args), environ={})
    assert config.server.port == 9999 and config.routing.policy == "random"
    assert [p.url for p in config.pods] == ["http://a:1"] and config.mock_pods.count == 2


def test_cli_help_version_and_config_check(tmp_path, capsys, monkeypatch):
    from gateway.cli import main

    for name in [k for k in os.environ if k.startswith("GATEWAY_")]:
        monkeypatch.delenv(name)
    help_text = build_parser().format_help()
    for command in ("serve", "mock", "bench", "profiles", "config", "hash-key"):
        assert command in help_text
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    serve_help = capsys.readouterr().out
    assert "kv_aware" in serve_help and "round_robin" in serve_help and "port to listen on" in serve_help
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("gateway ")

    good = tmp_path / "good.yaml"
    good.write_text("routing: {policy: kv_aware}\nplacement: {protect_margin: 3}\n")
    assert main(["config", "check", str(good)]) == 0
    effective = yaml.safe_load(capsys.readouterr().out)
    assert effective["routing"]["policy"] == "kv_aware" and effective["placement"]["protect_margin"] == 3
    assert effective["server"]["port"] == 8080  # defaults filled in
    bad = tmp_path / "bad.yaml"
    bad.write_text("placement: {protect_marjin: 3}\n")
    assert main(["config", "check", str(bad)]) == 2
    assert "protect_marjin" in capsys.readouterr().err


@pytest.mark.parametrize(("section", "fragment"), [
    ({"routing": {"policy": "kv_aware", "options": {"kv_aware": {"prefx_weight": 2}}}}, "prefx_weight"),
    ({"routing": {"options": {"slo": {"load_weight": "high"}}}}, "load_weight"),  # any configured policy
    ({"routing": {"options": {"round_robin": {"seed": 1}}}}, "seed"),  # a policy that takes no options
    ({"discovery": {"source": "file"}}, "path"),  # a required option missing
    ({"pressure": {"source": "nvml", "options": {"device": {"pod0": 0}}}}, "device"),
])
def test_bad_plugin_options_stop_the_start_naming_the_option(tmp_path, capsys, section, fragment):
    from gateway.app import build_gateway
    from gateway.cli import main
    from gateway.plugin_registry import PluginOptionsError

    config = load_config(None, {"pods": [{"url": "http://127.0.0.1:1", "models": ["m"]}], **section})
    with pytest.raises(PluginOptionsError, match=fragment):
        build_gateway(config)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(section))
    assert main(["config", "check", str(path)]) == 2
    assert fragment in capsys.readouterr().err


def test_config_check_prints_each_plugins_effective_options(tmp_path, capsys):
    from gateway.cli import main

    path = tmp_path / "good.yaml"
    path.write_text(yaml.safe_dump({"routing": {"policy": "kv_aware", "options": {"kv_aware": {"load_weight": 0.5}}}}))
    assert main(["config", "check", str(path)]) == 0
    options = yaml.safe_load(capsys.readouterr().out)["routing"]["options"]["kv_aware"]
    assert options["load_weight"] == 0.5 and options["idle_weight"] == 0.5 and options["overload_slack"] == 8
