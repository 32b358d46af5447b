"""The simulator's settings, each default written once: what every simulated pod is
(:class:`SimulatedPodSettings`), one pod (:class:`MockPodConfig`, ``gateway mock``) and the pods started
beside the gateway (:class:`MockPodsConfig`, the config's ``mock_pods`` section and its
``GATEWAY_MOCK_PODS__*`` variables, ``gateway serve --mock-pods N``)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from gateway.kv.events import Encoding
from simulator.block_hashes import HashAlgo
from simulator.engine import MODEL_MAX_LEN, SchedulingPolicy, TimingModel

Connector = Literal["shared_storage", "nixl"]


class SimulatedPodSettings(msgspec.Struct, forbid_unknown_fields=True):
    model: str = "mock-llama"
    flavor: Literal["vllm", "sglang"] = "vllm"
    block_size: int = 16
    num_blocks: int = 2048
    # Time factor: 1 realistic, 0 no delay.
    speed: float = 1.0
    # Longest prompt plus answer, in tokens; by default the simulated model's own (Llama 3.1's 128k context),
    # as vLLM defaults to the model's.
    max_model_len: int = MODEL_MAX_LEN
    # End each answer after the pod's text, as a model emits end-of-sequence (finish_reason stop), instead of
    # writing until max_tokens (what benchmarks want: outputs as long as their traces say; agent tools such
    # as Claude Code and Codex want answers that end).
    ends_answers: bool = False
    # LoRA: adapters registered at start (each read from ``/adapters/<name>``), whether adapters may be
    # registered at run time, and how many run in one batch (vLLM's --max-loras) and stay in memory
    # (--max-cpu-loras; none: max_loras).
    lora_adapters: list[str] = []
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None


class MockPodConfig(SimulatedPodSettings, forbid_unknown_fields=True):
    port: int = 0
    host: str = "127.0.0.1"
    # None: no KV events (or no replay); 0: any free port.
    events_port: int | None = 0
    replay_port: int | None = 0
    tokenizer: str | None = None
    encoding: Encoding | None = None
    # vLLM >= 0.26 (current encoding): its own block hashes, by this --prefix-caching-hash-algo, as bytes
    # or (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) 64-bit ints. Older vLLM and SGLang: seeded per process.
    hash_algo: HashAlgo = "sha256"
    int_block_hashes: bool = False
    topic: str = ""
    default_max_tokens: int = 16
    max_num_seqs: int = 128
    max_batched_tokens: int = 2048
    # vLLM's --scheduling-policy: the waiting queue's order (priority: the lowest request priority first).
    scheduling_policy: SchedulingPolicy = "fcfs"
    timing: TimingModel | None = None
    # vLLM's --kv-transfer-config (JSON): ExampleConnector or NixlConnector (:mod:`simulator.kv_transfer`).
    kv_transfer_config: str | None = None
    # vLLM's VLLM_ENABLE_RESPONSES_API_STORE: keep the Responses API's responses in the pod's memory.
    responses_store: bool = False


class MockPodsConfig(SimulatedPodSettings, forbid_unknown_fields=True):
    """Simulated pods started beside the gateway (``gateway serve --mock-pods N``), each a ``gateway mock``
    process. They are the quick start's, what a client is first tried against, so they behave as a model
    behind vLLM does for an agent tool: answers that end, and a cache that holds a request of the model's
    whole context. The benchmark (bench/runner.py) says what it wants instead: answers as long as its
    trace's ``max_tokens``, and a cache sized to its working set."""

    # Room for one request of the simulated model's whole context, as vLLM checks at start, plus vLLM's null
    # block: Claude Code's first request alone (~4,400 prompt tokens plus 32,000 of answer) needs 2,276 blocks
    # of 16. Blocks are made when first used (simulator/kvcache.py), so an idle pod's cache costs nothing.
    num_blocks: int = MODEL_MAX_LEN // 16 + 1
    ends_answers: bool = True
    count: int = 0
    base_port: int = 0
    # Prefill/decode disaggregation: the first ``prefill_pods`` pods take the prefill leg and the others
    # decode, their KV passed over ``connector`` (a temporary directory they share, or NIXL).
    prefill_pods: int = 0
    connector: Connector = "shared_storage"
    # How each pod orders its waiting requests (vLLM's --scheduling-policy); the gateway's pods say the same.
    scheduling: SchedulingPolicy = "fcfs"
    # Pods per process (simulator/group.py); 0: one each up to 16 pods, else the pods spread over the cores.
    per_process: Annotated[int, Meta(ge=0)] = 0
    # Block events a second each pod publishes with no requests, holding ``synthetic_hold`` batches of 16 blocks
    # (simulator/firehose.py: what ingest alone costs); 0: only what requests make.
    synthetic_events: float = 0.0
    synthetic_hold: int = 64

    def __post_init__(self) -> None:
        if not 0 <= self.prefill_pods < max(1, self.count):
            raise ValueError("prefill_pods must leave at least one decode pod")
