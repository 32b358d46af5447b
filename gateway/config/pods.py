"""The pods: each one, how they are found, prefill/decode disaggregation, and simulated pods."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import msgspec
from msgspec import Meta

# What a pod does for a disaggregated model: prefill, decode, or whole requests.
PodRole = Literal["prefill", "decode", "both"]
POD_ROLES: tuple[str, ...] = get_args(PodRole)


class PodConfig(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    name: str | None = None
    # Empty: learned from the pod's ``/v1/models``.
    models: list[str] = []
    flavor: Literal["vllm", "sglang"] = "vllm"
    # ZeroMQ endpoints of the pod's KV-event publisher and replay socket (rank 0; rank r adds r).
    kv_events: str | None = None
    kv_replay: str | None = None
    kv_topic: str = ""
    dp_size: Annotated[int, Meta(ge=1)] = 1
    block_size: int | None = None
    # KV-cache capacity in tokens, when the engine's metrics do not say it (vLLM's cache_config_info and
    # SGLang's max_total_num_tokens do).
    kv_capacity_tokens: int | None = None
    # The deployment whose GPU profile applies (Redis key aibrix:profile_<model>_<deployment>).
    deployment: str | None = None
    # Prefill/decode disaggregation: the legs this pod serves (``disaggregation``). A model whose pods are
    # all ``both`` is served whole by one pod.
    role: PodRole = "both"
    # How the engine orders its own waiting requests: fcfs, or priority (vLLM ``--scheduling-policy
    # priority``): then each request carries its flow's priority to it (``flow_control``).
    scheduling: Literal["fcfs", "priority"] = "fcfs"

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"pod url must start with http:// or https://, got {self.url!r}")
        self.url = self.url.rstrip("/")
        if self.name is None:
            self.name = self.url.split("://", 1)[1]
        if self.role not in POD_ROLES:  # checked here too for configs built in code
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if self.scheduling == "priority" and self.flavor != "vllm":
            raise ValueError("scheduling: priority is supported for vllm pods only")


class DiscoveryConfig(msgspec.Struct, forbid_unknown_fields=True):
    # static: the pods above; file: a watched YAML/JSON file (options.path).
    source: str = "static"
    options: dict[str, Any] = {}


class ConnectorConfig(msgspec.Struct, forbid_unknown_fields=True):
    # How a prefill pod's KV reaches the decode pod, as the pods' ``--kv-transfer-config`` says:
    # shared_storage (vLLM's ExampleConnector, LMCache and the like: both legs send the client's request,
    # the prefill leg cut to one token) or nixl (NixlConnector: the prefill leg's ``kv_transfer_params``
    # go into the decode leg's body).
    connector: Literal["shared_storage", "nixl"] = "shared_storage"


class DisaggregationConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Prefill/decode disaggregation for the models whose pods have roles (``pods[].role``): the decode
    pod is chosen first, then a prefill pod, whose leg is skipped when the decode pod already holds all but
    ``uncached_token_threshold`` tokens of the prompt."""

    connector: Literal["shared_storage", "nixl"] = "shared_storage"
    # Per model (a pool of prefill and decode pods), when its connector differs from ``connector``.
    models: dict[str, ConnectorConfig] = {}
    uncached_token_threshold: Annotated[int, Meta(ge=0)] = 256
    # Prefill pods tried for one request before it is served whole by its decode pod.
    prefill_attempts: Annotated[int, Meta(ge=1)] = 2
    # A prefill leg still unanswered after this long is given up: the decode pod serves the request whole.
    prefill_timeout_s: Annotated[float, Meta(gt=0)] = 30.0

    def connector_of(self, model: str) -> Literal["shared_storage", "nixl"]:
        pool = self.models.get(model)
        return pool.connector if pool is not None else self.connector


class MockPodsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Simulated pods started beside the gateway (``gateway serve --mock-pods N``)."""

    count: int = 0
    model: str = "mock-llama"
    block_size: int = 16
    num_blocks: int = 2048
    speed: float = 1.0
    flavor: Literal["vllm", "sglang"] = "vllm"
    base_port: int = 0
    # Longest prompt plus answer in tokens; none: the simulated model's own.
    max_model_len: int | None = None
    # Each answer ends after the pods' text (finish_reason stop), as a model's does, instead of running to
    # max_tokens: for agent tools (Claude Code, Codex) tried against simulated pods.
    ends_answers: bool = False
    # Prefill/decode disaggregation: the first ``prefill_pods`` pods take the prefill leg and the others
    # decode, their KV passed over ``connector`` (a temporary directory they share, or NIXL).
    prefill_pods: int = 0
    connector: Literal["shared_storage", "nixl"] = "shared_storage"
    # Pods per process (gateway/mock/group.py); 0: one each up to 16 pods, else the pods spread over the cores.
    per_process: Annotated[int, Meta(ge=0)] = 0
    # Block events a second each pod publishes with no requests, holding ``synthetic_hold`` batches of 16 blocks
    # (gateway/mock/firehose.py: what ingest alone costs); 0: only what requests make.
    synthetic_events: float = 0.0
    synthetic_hold: int = 64
    # How each pod orders its waiting requests (vLLM's --scheduling-policy); the gateway's pods say the same.
    scheduling: Literal["fcfs", "priority"] = "fcfs"
    # LoRA: adapters every pod registers at start, whether more may be registered at run time, and how many
    # run in one batch (vLLM's --max-loras) and stay in memory (--max-cpu-loras; none: max_loras).
    lora_adapters: list[str] = []
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.prefill_pods < max(1, self.count):
            raise ValueError("mock_pods.prefill_pods must leave at least one decode pod")
