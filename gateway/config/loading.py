"""All gateway settings as one msgspec ``Struct`` tree, :class:`GatewayConfig`, and how it is read.

Sources, later ones winning: a YAML/JSON file, ``GATEWAY_*`` environment variables, CLI flags.
Environment variables name a field by its path with ``__`` between levels, for example
``GATEWAY_SERVER__PORT=9000`` or ``GATEWAY_ROUTING__POLICY=least_request``; values are read as YAML
scalars, so numbers, booleans and lists (``[a, b]``) work. Validation happens once, in
:func:`load_config`, and a bad value fails with a message naming the field's path.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import yaml

from gateway.config.access import AuthConfig, LimitsConfig
from gateway.config.flow import AdmissionConfig, FlowControlConfig
from gateway.config.models import ModelsConfig
from gateway.config.pods import DisaggregationConfig, DiscoveryConfig, PodConfig
from gateway.config.process import (
    EppConfig,
    HealthConfig,
    LoggingConfig,
    ServerConfig,
    SharedStateConfig,
    TimeoutConfig,
    TracingConfig,
)
from gateway.config.routing import (
    HooksConfig,
    KvIndexConfig,
    LoadConfig,
    PlacementConfig,
    PressureConfig,
    RoutingConfig,
    TokenizationConfig,
    VerificationConfig,
)
from gateway.config.workflow import ResponsesConfig, WorkflowConfig
from gateway.extensions import NotInstalled, simulator

ENV_PREFIX = "GATEWAY_"


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the offending field."""


class GatewayConfig(msgspec.Struct, forbid_unknown_fields=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    pods: list[PodConfig] = []
    routing: RoutingConfig = msgspec.field(default_factory=RoutingConfig)
    disaggregation: DisaggregationConfig = msgspec.field(default_factory=DisaggregationConfig)
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)
    timeouts: TimeoutConfig = msgspec.field(default_factory=TimeoutConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    tokenization: TokenizationConfig = msgspec.field(default_factory=TokenizationConfig)
    kv_index: KvIndexConfig = msgspec.field(default_factory=KvIndexConfig)
    load: LoadConfig = msgspec.field(default_factory=LoadConfig)
    admission: AdmissionConfig = msgspec.field(default_factory=AdmissionConfig)
    flow_control: FlowControlConfig = msgspec.field(default_factory=FlowControlConfig)
    workflow: WorkflowConfig = msgspec.field(default_factory=WorkflowConfig)
    placement: PlacementConfig = msgspec.field(default_factory=PlacementConfig)
    verification: VerificationConfig = msgspec.field(default_factory=VerificationConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    shared_state: SharedStateConfig = msgspec.field(default_factory=SharedStateConfig)
    responses: ResponsesConfig = msgspec.field(default_factory=ResponsesConfig)
    pressure: PressureConfig = msgspec.field(default_factory=PressureConfig)
    discovery: DiscoveryConfig = msgspec.field(default_factory=DiscoveryConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    # Simulated pods started beside the gateway (``gateway serve --mock-pods N``): a section the simulator
    # declares (gateway/extensions.py) and decodes into its own struct; None: none asked for.
    mock_pods: Any = None
    epp: EppConfig = msgspec.field(default_factory=EppConfig)
    # Add-on kits to run (the ``gateway.kits`` entry points, gateway/kits/addons.py): name → its options,
    # which the kit's own Struct decodes.
    kits: dict[str, dict[str, Any]] = {}
    models: ModelsConfig = msgspec.field(default_factory=ModelsConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    hooks: HooksConfig = msgspec.field(default_factory=HooksConfig)

    def __post_init__(self) -> None:
        if isinstance(self.mock_pods, Mapping):
            self.mock_pods = simulator_section(self.mock_pods)
        named = {k.name for k in self.auth.keys if k.name}
        unknown = sorted(set(self.limits.keys) - named)
        if unknown:
            raise ValueError(f"limits.keys names no key of auth.keys: {', '.join(unknown)}")


def simulator_section(raw: Mapping[str, Any]) -> msgspec.Struct:
    """``mock_pods`` decoded by the simulator's struct (``ValueError`` naming the extra that brings the
    simulator when it is not installed)."""
    try:
        return msgspec.convert(raw, simulator("this section").section, strict=False)
    except (NotInstalled, msgspec.ValidationError) as exc:
        raise ValueError(f"mock_pods: {exc}") from None


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def read_config_file(path: str | Path) -> dict[str, Any]:
    text = Path(path).read_text()
    try:
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not valid YAML/JSON: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key == ENV_PREFIX:
            continue
        path = key[len(ENV_PREFIX) :].lower().split("__")
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: conflicts with another GATEWAY_ variable")
        node[path[-1]] = yaml.safe_load(raw) if raw else raw
    return tree


def deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


# Settings that moved: a file naming the old place gets told the new one.
_MOVED = {("admission", "queue_size"): "flow_control.max_queued",
          ("admission", "max_queue_wait_s"): "flow_control.max_wait_s"}


def _check_moved(data: Mapping[str, Any]) -> None:
    for (section, key), now in _MOVED.items():
        if isinstance(data.get(section), Mapping) and key in data[section]:
            raise ConfigError(f"{section}.{key} is now {now} (flow control's queue is the one queue)")


class ConfigSource(msgspec.Struct, frozen=True):
    """Where the running config came from, so that it can be read again: the file (none: no file), the
    command line's settings over it, and the config they gave when the gateway started. ``GATEWAY_*``
    variables are re-read with the file (a process's environment does not change)."""

    path: str | None = None
    overrides: dict[str, Any] = {}
    loaded: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    # The file's SHA-256 taken just before it was read: a change made while it was read shows as a change.
    digest: str = ""

    @classmethod
    def read(cls, path: str | None, overrides: Mapping[str, Any] | None = None) -> ConfigSource:
        overrides = dict(overrides or {})
        digest = file_digest(path)
        return cls(path, overrides, load_config(path, overrides), digest)

    def reread(self) -> ConfigSource:
        """The same source read again (raises :class:`ConfigError` or ``OSError`` as at start)."""
        return ConfigSource.read(self.path, self.overrides)


def file_digest(path: str | None) -> str:
    """The SHA-256 of the file's bytes ("" when there is no file or it cannot be read)."""
    if not path:
        return ""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ""


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> GatewayConfig:
    """Build and validate the config: file, then ``GATEWAY_*`` env, then ``overrides`` (CLI flags)."""
    data: dict[str, Any] = read_config_file(path) if path else {}
    data = deep_merge(data, env_overrides(os.environ if environ is None else environ))
    data = deep_merge(data, overrides or {})
    _check_moved(data)
    try:
        return msgspec.convert(data, GatewayConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config: {exc}") from exc
