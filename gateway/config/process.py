"""The gateway process: its server, health checks of the pods, timeouts, logs, traces, the endpoint picker, and
the state workers and replicas share."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8080
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 8 * 1024 * 1024
    # All request header names and values together; past it a 431 (OpenAI JSON). A single header line
    # beyond 64 KiB never reaches the gateway: the HTTP parser refuses it with a plain 400.
    max_header_bytes: int = 16 * 1024
    max_messages: int = 2048
    # Longest prompt routed, in tokens; none: the model's max_model_len as its pods list it.
    max_prompt_tokens: int | None = None
    # A streaming client that reads nothing for this long (while its buffer is full) is cut off.
    client_stall_s: float = 30.0
    # A request's headers that have not arrived whole this long after the connection opened (or, on a
    # kept-alive connection, after the request's first bytes) are answered 408 and the connection closed:
    # clients that send headers slowly do not hold connections.
    header_read_timeout_s: Annotated[float, Meta(gt=0)] = 10.0
    # A request body that has not arrived whole after this long is refused (408).
    body_timeout_s: Annotated[float, Meta(gt=0)] = 60.0
    # How long SIGTERM waits for in-flight requests before closing them.
    shutdown_grace_s: float = 30.0
    tls_cert: str | None = None
    tls_key: str | None = None
    # Worker processes sharing the port (SO_REUSEPORT), each with its own event loop; none: one per core
    # this process may use. They share their load per pod and their workflow state (``shared_state``).
    workers: Annotated[int, Meta(ge=1, le=256)] | None = None
    # How often the event loop's lag is sampled (``gateway_event_loop_lag_seconds``); 0: never.
    loop_lag_interval_s: Annotated[float, Meta(ge=0)] = 0.05
    # How often the config file is re-read for changes (a mounted ConfigMap changes in place); 0: only on
    # SIGHUP. What applies without a restart: ``flow_control`` (all but ``enabled``), ``models``, ``limits`` and
    # ``routing`` (all but ``max_retries`` and ``allow_strategy_header``).
    config_watch_interval_s: Annotated[float, Meta(ge=0)] = 5.0


class HealthConfig(msgspec.Struct, forbid_unknown_fields=True):
    interval_s: float = 2.0
    timeout_s: float = 1.0
    # The host's health checks per second at most (its workers share them): a fleet larger than this times
    # ``interval_s`` is checked in turn (gateway/pods/rotation.py); a pod that fails a request is ejected
    # meanwhile all the same. 0: no limit.
    max_checks_per_s: Annotated[float, Meta(ge=0)] = 25.0
    failure_threshold: int = 3
    success_threshold: int = 2
    # Passive ejection after a connection error: base backoff, doubled per consecutive ejection.
    ejection_base_s: float = 1.0
    ejection_max_s: float = 30.0
    # Consecutive 5xx answers that eject a pod (connection failures eject at once).
    eject_after_5xx: int = 3


class TimeoutConfig(msgspec.Struct, forbid_unknown_fields=True):
    connect_s: float = 2.0
    first_byte_s: float = 120.0
    idle_s: float = 120.0
    total_s: float = 900.0


class SharedStateConfig(msgspec.Struct, forbid_unknown_fields=True):
    """What the workers of one gateway, and (through Redis) its replicas, tell each other: workflows and
    their stages, session pins, the contexts of the placement model, just-routed blocks, which workflows
    and sessions have requests in flight, and the service flow control counts per flow (``flows``).
    Eventually consistent: each change reaches the others ``flush_ms`` plus a network hop later; nothing on
    the request path ever waits for it."""

    # Redis whose pub/sub channel the replicas share; none: only the workers of one replica share.
    redis_url: str | None = None
    channel: str = "gateway:shared-state"
    # What to share; leave one out to keep it local (each costs every other worker CPU to apply).
    share: list[Literal["workflows", "sessions", "contexts", "speculative", "flows", "adapters", "limits"]] = \
        msgspec.field(default_factory=lambda: ["workflows", "sessions", "contexts", "speculative", "flows", "adapters",
                                               "limits"])
    flush_ms: float = 2.0
    heartbeat_s: float = 1.0
    # A worker or replica not heard from for this long is gone: its requests are no longer in flight.
    peer_timeout_s: float = 5.0
    # Batches waiting for Redis; past it the oldest are dropped (and counted).
    max_pending_batches: int = 1000
    redis_timeout_s: float = 0.5


class TracingConfig(msgspec.Struct, forbid_unknown_fields=True):
    """OpenTelemetry spans per request (the ``otel`` extra). The exporter is OTLP over HTTP, configured by
    the standard ``OTEL_EXPORTER_OTLP_*`` and ``OTEL_SERVICE_NAME`` variables. Off: nothing is done."""

    enabled: bool = False


class LoggingConfig(msgspec.Struct, forbid_unknown_fields=True):
    level: Literal["debug", "info", "warning", "error"] = "info"
    json: bool = False
    # One line per request; off keeps only warnings and errors.
    access_log: bool = True


class EppConfig(msgspec.Struct, forbid_unknown_fields=True):
    """``gateway epp``: the endpoint picker Envoy calls over ext_proc (``gateway/epp/``)."""

    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 9002
    # Endpoints after the chosen one in ``x-gateway-destination-endpoint``, for the data plane to try in
    # order when one cannot be reached (0: one endpoint, as an ORIGINAL_DST cluster needs).
    fallbacks: Annotated[int, Meta(ge=0)] = 2
    # Whether Envoy sends its gRPC access log to the EPP (the end of each answer: its status, and with
    # the Lua filter of gateway/epp/envoy_config.py its usage): "auto" once Envoy has opened the stream
    # (the first answer after a start ends without one), true from the first request, false never.
    access_log: bool | Literal["auto"] = "auto"
    # How long the end of an answer waits for its entry once the ext_proc stream has closed.
    access_log_wait_s: Annotated[float, Meta(ge=0)] = 2.0
