"""An Envoy bootstrap that puts Envoy in front of a pool with ``gateway epp`` as its endpoint picker.

What the tests, the benchmark and a reader setting up Envoy by hand use: one listener whose HTTP filters
are ext_proc (to the EPP) and a Lua filter that keeps the answer's last bytes, then the router, and one
cluster of the pods, either

- ``original_dst``: an ORIGINAL_DST cluster that connects to the ``ip:port`` in the request header
  ``x-gateway-destination-endpoint`` (one endpoint: run the EPP with ``--fallbacks 0``), or
- ``override_host``: the pods as static endpoints, with Envoy's override-host load balancing policy,
  which takes the endpoints from the header (or the ``envoy.lb`` metadata) in order, the next one on a
  retry, and round robin when there is none (the EPP down with ``failure_mode_allow``).

The bodies go to the EPP ``buffered`` (the request's whole body once its headers are answered; the
answer's body not at all), or ``full_duplex`` as llm-d's and the Gateway API Inference Extension's own
manifests have it (``FULL_DUPLEX_STREAMED`` both ways: Envoy forwards only the bytes the EPP sends back).

Envoy's gRPC access log sends the EPP one entry per request at its end (status, how it ended, and the
Lua filter's ``kvgw`` / ``tail``), so the EPP sees the end of an answer without a message per chunk.
"""

from __future__ import annotations

from typing import Any, Literal

import yaml

ClusterKind = Literal["original_dst", "override_host"]
BodyModes = Literal["buffered", "full_duplex"]

_PROCESSING_MODES: dict[BodyModes, dict[str, str]] = {
    "buffered": {"request_header_mode": "SEND", "request_body_mode": "BUFFERED",
                 "response_header_mode": "SEND", "response_body_mode": "NONE",
                 "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
    # Envoy refuses a full-duplex body without its trailers.
    "full_duplex": {"request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED",
                    "response_header_mode": "SEND", "response_body_mode": "FULL_DUPLEX_STREAMED",
                    "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
}

# The answer's last bytes, kept by Envoy as they pass: the usage of a stream rides in its last events,
# of a JSON answer near its end. Four chunks of at most 4 KiB, as the HTTP proxy keeps.
TAIL_LUA = """
function envoy_on_response(handle)
  local tail = {}
  for chunk in handle:bodyChunks() do
    local size = chunk:length()
    if size > 0 then
      local from = size > 4096 and size - 4096 or 0
      tail[#tail + 1] = chunk:getBytes(from, size - from)
      if #tail > 4 then table.remove(tail, 1) end
    end
  end
  if #tail > 0 then
    local text = table.concat(tail)
    local start = 1  -- a cut may split a character: start at the next one (metadata is UTF-8)
    while start <= #text and text:byte(start) >= 128 and text:byte(start) < 192 do start = start + 1 end
    handle:streamInfo():dynamicMetadata():set("kvgw", "tail", text:sub(start))
  end
end
"""


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def bootstrap(*, listen_port: int, epp: tuple[str, int], pods: list[tuple[str, int]] | None = None,
              cluster: ClusterKind = "original_dst", failure_mode_allow: bool = False, access_log: bool = True,
              admin_port: int | None = None, retries: int = 2, message_timeout_s: float = 60.0,
              listen_host: str = "127.0.0.1", bodies: BodyModes = "buffered") -> dict[str, Any]:
    """The bootstrap as a dict (``yaml.safe_dump`` it for ``envoy -c``). ``pods`` (``(ip, port)``) are the
    override-host cluster's endpoints; an ORIGINAL_DST cluster needs none."""
    manager = _connection_manager(cluster=cluster, failure_mode_allow=failure_mode_allow, access_log=access_log,
                                  retries=retries, message_timeout_s=message_timeout_s, bodies=bodies)
    pods_cluster = _original_dst_cluster() if cluster == "original_dst" else _override_host_cluster(pods or [])
    config: dict[str, Any] = {
        "static_resources": {
            "listeners": [{"name": "inference", "address": _address(listen_host, listen_port),
                           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                           "typed_config": manager}]}]}],
            "clusters": [_epp_cluster(epp), pods_cluster],
        },
        # No limit on downstream connections is Envoy's default; say so, rather than be warned at start.
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.resource_monitors."
                                      "downstream_connections.v3.DownstreamConnectionsConfig",
                             "max_active_downstream_connections": 10000}}]},
    }
    if admin_port is not None:
        config["admin"] = {"address": _address("127.0.0.1", admin_port)}
    return config


def _ext_proc_filter(*, failure_mode_allow: bool, message_timeout_s: float, bodies: BodyModes) -> dict[str, Any]:
    """The ext_proc filter that asks the EPP where each request goes."""
    return {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}},
        "failure_mode_allow": failure_mode_allow,
        # The EPP may hold a request (admission) and tokenizes long prompts: not Envoy's 200 ms default.
        "message_timeout": f"{message_timeout_s:g}s",
        "processing_mode": _PROCESSING_MODES[bodies],
        "response_attributes": ["upstream.address"],
        "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]}},
        "mutation_rules": {"allow_all_routing": True},
    }


def _connection_manager(*, cluster: ClusterKind, failure_mode_allow: bool, access_log: bool, retries: int,
                        message_timeout_s: float, bodies: BodyModes) -> dict[str, Any]:
    """The listener's HTTP connection manager: its filters (ext_proc, the access log's Lua tail, the router),
    its one route to the pods and, when ``access_log``, the gRPC access log the EPP reads."""
    ext_proc = _ext_proc_filter(failure_mode_allow=failure_mode_allow, message_timeout_s=message_timeout_s,
                                bodies=bodies)
    filters = [
        {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
        {"name": "envoy.filters.http.lua", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": TAIL_LUA}}},
        {"name": "envoy.filters.http.router",
         "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
    ]
    route: dict[str, Any] = {"cluster": "pods", "timeout": "0s"}
    if cluster == "override_host" and retries:
        route["retry_policy"] = {"retry_on": "connect-failure,refused-stream,reset-before-request",
                                 "num_retries": retries}
    manager: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                 ".HttpConnectionManager",
        "stat_prefix": "inference",
        "route_config": {"virtual_hosts": [{"name": "pool", "domains": ["*"],
                                            "routes": [{"match": {"prefix": "/"}, "route": route}]}]},
        "http_filters": filters if access_log else [f for f in filters if f["name"] != "envoy.filters.http.lua"],
    }
    if access_log:
        manager["access_log"] = [{"name": "envoy.access_loggers.http_grpc", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {"log_name": "kv-gateway", "transport_api_version": "V3",
                              "buffer_size_bytes": 0,  # each entry at once: the EPP waits for it
                              "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}}}}}]
    return manager


def _epp_cluster(epp: tuple[str, int]) -> dict[str, Any]:
    """The EPP's cluster: one static endpoint spoken to over HTTP/2 (ext_proc and the access log are gRPC)."""
    return {
        "name": "epp", "type": "STATIC", "connect_timeout": "1s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}},
        "load_assignment": {"cluster_name": "epp", "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": _address(*epp)}}]}]},
    }


def _original_dst_cluster() -> dict[str, Any]:
    """The pods' cluster that connects wherever the EPP's destination header says (no endpoints listed)."""
    return {
        "name": "pods", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "2s",
        "original_dst_lb_config": {"use_http_header": True,
                                   "http_header_name": "x-gateway-destination-endpoint"}}


def _override_host_cluster(pods: list[tuple[str, int]]) -> dict[str, Any]:
    """The pods' cluster of listed endpoints, the EPP's pick overriding round robin (by header or metadata)."""
    return {
        "name": "pods", "type": "STATIC", "connect_timeout": "2s",
        "load_assignment": {"cluster_name": "pods", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _address(host, port)}} for host, port in pods]}]},
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3"
                         ".OverrideHost",
                "override_host_sources": [{"header": "x-gateway-destination-endpoint"},
                                          {"metadata": {"key": "envoy.lb",
                                                        "path": [{"key": "x-gateway-destination-endpoint"}]}}],
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3"
                                 ".RoundRobin"}}}]},
            }}}]},
    }


def bootstrap_yaml(**kwargs: Any) -> str:
    return yaml.safe_dump(bootstrap(**kwargs), sort_keys=False)
