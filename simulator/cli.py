"""What the simulator adds to the ``gateway`` command (entry points, :mod:`gateway.extensions`):
``gateway mock`` (one simulated pod) and the pods ``gateway serve --mock-pods N`` starts beside itself.
The defaults are :class:`~simulator.config.MockPodConfig`'s."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import Any

import msgspec

from gateway.background import cancel_and_wait, freeze_start_up_heap, parent_gone, run_loop
from gateway.extensions import Command, Simulator
from gateway.kv.events import Encoding
from simulator.config import MockPodConfig, MockPodsConfig

log = logging.getLogger("simulator")
DEFAULTS = MockPodConfig()


def add_arguments(m: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    m.add_argument("--pods", type=int, help="run N pods in this process, pod i on --port + i, its events and replay "
                   "on --events-port + 2i and --replay-port + 2i (0: any free port); prints one JSON line per pod "
                   "(index, url, events, replay) once all listen")
    m.add_argument("--exit-with-parent", action="store_true",
                   help="stop once the process that started this one is gone (the launcher beside a gateway passes "
                        "it: a gateway killed outright leaves no pods behind)")
    m.add_argument("--synthetic-events", type=float, default=0.0, metavar="R",
                   help="with --pods: each pod publishes R block events a second (stored and removed) with no "
                        "requests, to measure ingest alone")
    m.add_argument("--synthetic-hold", type=int, default=64, metavar="H",
                   help="with --synthetic-events: each pod holds H batches of 16 blocks")
    m.add_argument("--host", default=d.host)
    m.add_argument("--port", type=int, default=8000)
    m.add_argument("--events-port", type=int, default=5557)
    m.add_argument("--replay-port", type=int, default=5558)
    m.add_argument("--no-events", action="store_true")
    m.add_argument("--no-replay", action="store_true")
    m.add_argument("--block-size", type=int, default=d.block_size)
    m.add_argument("--num-blocks", type=int, default=d.num_blocks)
    m.add_argument("--speed", type=float, default=d.speed, help="time factor: 1 realistic, 0 no delay")
    m.add_argument("--flavor", choices=["vllm", "sglang"], default=d.flavor)
    m.add_argument("--model", default=d.model)
    m.add_argument("--tokenizer", help="HF tokenizer directory (default: the bundled one)")
    m.add_argument("--encoding", choices=[e.value for e in Encoding], help="KV-event wire format")
    m.add_argument("--prefix-caching-hash-algo", choices=["sha256", "xxhash"], default=d.hash_algo,
                   help="vLLM's block hash in the events (current encoding)")
    m.add_argument("--int-block-hashes", action="store_true",
                   help="64-bit int hashes in the events, as vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1")
    m.add_argument("--topic", default=d.topic)
    m.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    m.add_argument("--max-batched-tokens", type=int, default=d.max_batched_tokens)
    m.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=d.scheduling_policy,
                   help="the waiting queue's order, as vLLM's: priority serves the lowest request priority first "
                        "(X-Vllm-Priority, else the body's priority)")
    m.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    m.add_argument("--ends-answers", action="store_true",
                   help="end each answer after the pod's text (finish_reason stop) instead of at max_tokens")
    m.add_argument("--responses-store", action="store_true",
                   help="keep Responses API responses in memory (vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1)")
    m.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help=f"longest prompt plus answer in tokens (default: the simulated model's, {d.max_model_len})")
    m.add_argument("--lora-adapter", action="append", help="a LoRA adapter registered at start (repeatable)")
    m.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters, registered at run time (/v1/load_lora_adapter) as vLLM does")
    m.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="LoRA adapters in one batch (vLLM's --max-loras)")
    m.add_argument("--max-cpu-loras", type=int, help="LoRA adapters kept in memory (default: --max-loras)")
    m.add_argument("--kv-transfer-config", help="vLLM's KV connector setting (JSON): ExampleConnector "
                   "(kv_connector_extra_config.shared_storage_path) or NixlConnector (kv_role, "
                   "kv_load_failure_policy), for prefill/decode disaggregation")


def pod_config(args: argparse.Namespace) -> MockPodConfig:
    return MockPodConfig(
        host=args.host, port=args.port,
        events_port=None if args.no_events else args.events_port,
        replay_port=None if args.no_replay else args.replay_port,
        block_size=args.block_size, num_blocks=args.num_blocks, speed=args.speed, flavor=args.flavor,
        model=args.model, tokenizer=args.tokenizer, encoding=Encoding(args.encoding) if args.encoding else None,
        hash_algo=args.prefix_caching_hash_algo, int_block_hashes=args.int_block_hashes,
        topic=args.topic, max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
        scheduling_policy=args.scheduling_policy, default_max_tokens=args.default_max_tokens,
        lora_adapters=args.lora_adapter or [],
        enable_lora=args.enable_lora, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
        max_model_len=args.max_model_len, kv_transfer_config=args.kv_transfer_config,
        ends_answers=args.ends_answers, responses_store=args.responses_store,
    )


async def serve_pods(config: MockPodConfig, args: argparse.Namespace) -> None:
    """One simulated pod (or ``--pods N`` in this process) until SIGTERM or SIGINT."""
    from simulator.group import MockPodGroup
    from simulator.pod import MockPod

    parent = os.getppid()  # before the pods start: the launcher waits for them, alive
    if args.pods is not None:
        group = MockPodGroup(config, args.pods, synthetic_events=args.synthetic_events,
                             synthetic_hold=args.synthetic_hold)
        endpoints = await group.start()
        # One line per pod once they all listen: what the launcher (simulator.launcher) waits for.
        sys.stdout.write("".join(msgspec.json.encode(e).decode() + "\n" for e in endpoints))
        sys.stdout.flush()
        log.info("%d mock %s pods of %s on %s..%s", len(endpoints), config.flavor, config.model, endpoints[0].url,
                 endpoints[-1].url)
        stop_pods = group.stop
    else:
        pod = MockPod(config)
        await pod.start()
        pub = pod.publisher
        log.info("mock %s pod %s on %s (events %s, replay %s)", config.flavor, config.model, pod.url,
                 pub.endpoint if pub else None, pub.replay_endpoint if pub else None)
        stop_pods = pod.stop
    # As vLLM does once started (vllm/utils/gc_utils.py, freeze_gc_heap): without it a simulated pod stalled
    # 40-150 ms in each full collection, walking its tokenizer, and every router's tail showed it.
    freeze_start_up_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    orphaned = asyncio.create_task(_stop_when_orphaned(stop, parent)) if args.exit_with_parent else None
    try:
        await stop.wait()
    finally:
        await cancel_and_wait(orphaned)
        await stop_pods()


async def _stop_when_orphaned(stop: asyncio.Event, parent: int) -> None:
    """Sets ``stop`` once the process ``parent`` has gone."""
    await parent_gone(parent)
    log.warning("the process that started these pods is gone: stopping")
    stop.set()


def run(args: argparse.Namespace) -> int:
    run_loop(serve_pods(pod_config(args), args))
    return 0


async def start_beside_gateway(config: Any) -> tuple[Any, Any]:
    from simulator.launcher import start_beside_gateway

    return await start_beside_gateway(config)


COMMAND = Command(help="run simulated vLLM/SGLang pods (one by default)", add_arguments=add_arguments, run=run)
SIMULATOR = Simulator(section=MockPodsConfig, start=start_beside_gateway)
