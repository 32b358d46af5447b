"""Request hooks (gateway/request/hooks.py): found by name from the config, their options checked at start,
each call timed, and a hook that raises or answers nonsense counted while the request goes on."""

from __future__ import annotations

import json
import logging
import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from gateway.app import build_gateway, effective_plugin_options
from gateway.cli import check_config
from gateway.config import ConfigError, HooksConfig, PartConfig, load_config
from gateway.core.inference_api import RequestKind
from gateway.metrics import GatewayMetrics
from gateway.plugin_api import ResponseView
from gateway.plugin_registry import PluginOptionsError, UnknownPlugin
from gateway.request.hooks import PreRequestHooks, RequestHooks
from gateway.request.pipeline import RequestPipeline
from plugins.hooks.routing_headers import RoutingHeaders
from plugins.hooks.usage_log import UsageLog

ROOT = Path(__file__).resolve().parents[2]


def hooks_config(**hooks: object) -> HooksConfig:
    return load_config(overrides={"hooks": hooks}, environ={}).hooks


def attempt(headers: dict[str, str] | None = None) -> SimpleNamespace:
    """What a pre-request step reads of an attempt (the director's :class:`~gateway.request.types.Attempt`)."""
    pod = SimpleNamespace(name="p1", url="http://p1:8000")
    return SimpleNamespace(
        request=SimpleNamespace(id="r1", kind=RequestKind.CHAT), routing=SimpleNamespace(model="m"), number=0,
        decision=SimpleNamespace(pod=pod, policy="kv_aware", reason="prefix"), upstream_headers=headers or {})


def exported(metrics: GatewayMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_a_hook_is_named_bare_or_with_its_options_and_config_check_shows_their_defaults():
    config = load_config(overrides={"hooks": {"pre_request": ["routing_headers"], "response_complete": [
        {"name": "usage_log", "options": {"logger": "billing"}}]}}, environ={})
    assert config.hooks.pre_request == [PartConfig("routing_headers")]
    assert effective_plugin_options(config)["hooks"] == {
        "pre_request": [{"name": "routing_headers", "options": {"policy_header": "x-gateway-routing-policy",
                                                                "reason_header": "x-gateway-routing-reason"}}],
        "response_complete": [{"name": "usage_log", "options": {"logger": "billing"}}]}


def test_config_check_prints_each_hook_with_its_options_and_their_defaults(tmp_path, capsys):
    path = tmp_path / "gateway.yaml"
    path.write_text("hooks: {response_complete: [usage_log, {name: usage_log, options: {logger: billing}}]}\n")
    assert check_config(str(path), as_json=True) == 0
    assert json.loads(capsys.readouterr().out)["hooks"] == {"pre_request": [], "response_complete": [
        {"name": "usage_log", "options": {"logger": "gateway.usage"}},
        {"name": "usage_log", "options": {"logger": "billing"}}]}


@pytest.mark.parametrize(("hooks", "error", "message"), [
    ({"pre_request": ["routing_header"]}, UnknownPlugin, "unknown pre-request hook 'routing_header'; known: "
     "routing_headers"),
    ({"response_complete": ["routing_headers"]}, UnknownPlugin, "unknown response-complete hook"),
    ({"response_complete": [{"name": "usage_log", "options": {"loger": "x"}}]}, PluginOptionsError,
     "response-complete hook 'usage_log': bad options: Object contains unknown field `loger`"),
])
def test_an_unknown_hook_or_bad_options_stop_the_start_naming_them(hooks, error, message):
    config = load_config(overrides={"hooks": hooks}, environ={})
    with pytest.raises(error, match=message):
        effective_plugin_options(config)  # gateway config check
    with pytest.raises(error, match=message):
        build_gateway(config)  # gateway serve


def test_a_hooks_section_with_a_field_of_its_own_is_refused():
    with pytest.raises(ConfigError, match="pre_requests"):
        load_config(overrides={"hooks": {"pre_requests": []}}, environ={})


def test_without_hooks_the_pipeline_and_the_metrics_are_as_before():
    metrics = GatewayMetrics()
    pipeline = RequestPipeline()
    assert RequestHooks(HooksConfig(), metrics).around(pipeline) is pipeline
    assert "gateway_request_hook_errors" not in exported(metrics)


def test_a_pre_request_hook_adds_headers_without_replacing_any_and_is_timed():
    metrics = GatewayMetrics()
    hooks = RequestHooks(hooks_config(pre_request=["routing_headers"]), metrics)
    pipeline = hooks.around(RequestPipeline(dispatch=[]))
    (step,) = pipeline.dispatch
    sent = attempt({"X-Gateway-Routing-Policy": "the client's", "x-request-id": "r1"})
    step.dispatched(sent)
    assert sent.upstream_headers == {"X-Gateway-Routing-Policy": "the client's", "x-request-id": "r1",
                                     "x-gateway-routing-reason": "prefix"}
    assert 'gateway_routing_plugin_seconds_count{kind="pre_request",plugin="routing_headers"} 1.0' \
        in exported(metrics)


@pytest.mark.parametrize("answer", [RuntimeError("boom"), ["x-a"], {"x-a": 1}])
def test_a_pre_request_hook_that_raises_or_answers_nonsense_is_counted_and_the_attempt_goes_on(
        answer, monkeypatch, caplog):
    def hook(self, request):
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(RoutingHeaders, "pre_request", hook)
    metrics = GatewayMetrics()
    hooks = RequestHooks(hooks_config(pre_request=["routing_headers"]), metrics)
    sent = attempt()
    with caplog.at_level(logging.ERROR, logger="gateway.hooks"):
        PreRequestHooks(hooks.pre_request).dispatched(sent)
    assert sent.upstream_headers == {}
    assert "request r1: hook routing_headers raised" in caplog.text
    text = exported(metrics)
    assert 'gateway_request_hook_errors_total{hook="routing_headers",kind="pre_request"} 1.0' in text
    assert 'gateway_routing_plugin_seconds_count{kind="pre_request",plugin="routing_headers"} 1.0' in text


def completed_view(**fields: object) -> ResponseView:
    base = {"request_id": "r1", "model": "m", "kind": RequestKind.CHAT, "pod": "p1", "status": 200, "outcome": "ok",
            "attempts": 1, "prompt_tokens": 3, "completion_tokens": 2, "first_byte_s": 0.01, "total_s": 0.02}
    return ResponseView(**{**base, **fields})


def test_a_response_complete_hook_runs_later_than_the_request_and_a_raising_one_spares_the_next(
        monkeypatch, caplog):
    deferred = []
    metrics = GatewayMetrics()
    hooks = RequestHooks(hooks_config(response_complete=["usage_log", {"name": "usage_log", "options": {
        "logger": "second"}}]), metrics)
    (step,) = hooks.around(RequestPipeline(), defer=lambda run, view: deferred.append((run, view))).complete
    calls = []

    def hook(self, response):
        calls.append(response)
        if len(calls) == 1:
            raise RuntimeError("boom")

    monkeypatch.setattr(UsageLog, "response_complete", hook)
    step._run(completed_view())  # what the loop runs on its next turn
    assert len(calls) == 2
    text = exported(metrics)
    assert 'gateway_request_hook_errors_total{hook="usage_log",kind="response_complete"} 1.0' in text
    assert 'gateway_routing_plugin_seconds_count{kind="response_complete",plugin="usage_log"} 2.0' in text
    assert deferred == []


def test_the_usage_log_writes_one_structured_line_to_its_logger(caplog):
    with caplog.at_level(logging.INFO, logger="billing"):
        UsageLog("billing").response_complete(completed_view(status=502, outcome="upstream_broke"))
    (record,) = caplog.records
    assert (record.name, record.pod, record.status, record.outcome, record.prompt_tokens,
            record.completion_tokens, record.ttfb_ms, record.duration_ms) == (
        "billing", "p1", 502, "upstream_broke", 3, 2, 10.0, 20.0)


def test_the_worked_example_of_the_docs_is_the_shipped_hook_and_its_entry_point():
    """docs/routing.md, "A request hook": its code is plugins/hooks/routing_headers.py's, its entry point
    pyproject.toml's (the config block runs in tests/integration/test_request_hooks.py)."""
    text = (ROOT / "docs/routing.md").read_text()
    code = next(b for b in re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M) if "pre_request" in b)
    assert code in (ROOT / "plugins/hooks/routing_headers.py").read_text()
    entry = next(b for b in re.findall(r"^```toml\n(.*?)^```", text, flags=re.S | re.M) if "pre_request" in b)
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert tomllib.loads(entry)["project"]["entry-points"]["gateway.pre_request"].items() <= \
        declared["gateway.pre_request"].items()
