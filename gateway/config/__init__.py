"""The gateway's settings: one msgspec ``Struct`` tree (:class:`GatewayConfig`), read and checked by
:func:`load_config` (:mod:`gateway.config.loading`), each group of sections in a module of its own."""

from gateway.config.access import ApiKeyConfig, AuthConfig, LimitsConfig, UsageLimits
from gateway.config.flow import (
    AdmissionConfig,
    FlowControlConfig,
    ObjectiveConfig,
    SaturationConfig,
    SloTargets,
    TenantConfig,
    TokenWeightsConfig,
)
from gateway.config.loading import (
    ENV_PREFIX,
    ConfigError,
    ConfigSource,
    GatewayConfig,
    deep_merge,
    env_overrides,
    file_digest,
    hash_api_key,
    load_config,
    read_config_file,
)
from gateway.config.models import AdapterConfig, LoraConfig, ModelRule, ModelsConfig, ModelTarget
from gateway.config.pods import (
    POD_ROLES,
    ConnectorConfig,
    DisaggregationConfig,
    DiscoveryConfig,
    PodConfig,
    PodRole,
)
from gateway.config.routing import (
    KvIndexConfig,
    LoadConfig,
    ModelTokenizerConfig,
    PlacementConfig,
    PressureConfig,
    RoutingConfig,
    TokenizationConfig,
    VerificationConfig,
)
from gateway.config.server import (
    EppConfig,
    HealthConfig,
    LoggingConfig,
    ServerConfig,
    SharedStateConfig,
    TimeoutConfig,
    TracingConfig,
)
from gateway.config.workflow import KeepWarmConfig, ResponsesConfig, WorkflowConfig

__all__ = [
    "ENV_PREFIX", "POD_ROLES", "AdapterConfig", "AdmissionConfig", "ApiKeyConfig", "AuthConfig", "ConfigError",
    "ConfigSource", "ConnectorConfig", "DisaggregationConfig", "DiscoveryConfig", "EppConfig",
    "FlowControlConfig", "GatewayConfig", "HealthConfig", "KeepWarmConfig", "KvIndexConfig", "LimitsConfig",
    "LoadConfig", "LoggingConfig", "LoraConfig", "ModelRule", "ModelTarget",
    "ModelTokenizerConfig", "ModelsConfig", "ObjectiveConfig", "PlacementConfig", "PodConfig", "PodRole",
    "PressureConfig", "ResponsesConfig", "RoutingConfig", "SaturationConfig", "ServerConfig",
    "SharedStateConfig", "SloTargets", "TenantConfig", "TimeoutConfig", "TokenWeightsConfig",
    "TokenizationConfig", "TracingConfig", "UsageLimits", "VerificationConfig", "WorkflowConfig", "deep_merge",
    "env_overrides", "file_digest", "hash_api_key", "load_config", "read_config_file",
]
