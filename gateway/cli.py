"""``gateway``: an OpenAI-compatible gateway that routes LLM requests by KV-cache prefix, load and SLO.

Commands: serve, mock, bench, profiles, config, hash-key.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import Any

import msgspec

from gateway.background import run_loop
from gateway.config import (
    ConfigError,
    ConfigSource,
    ConnectorConfig,
    DisaggregationConfig,
    GatewayConfig,
    LoggingConfig,
    ModelTokenizerConfig,
    TokenizationConfig,
    hash_api_key,
    load_config,
)
from gateway.kv.events import Encoding
from gateway.mock.engine import MODEL_MAX_LEN

log = logging.getLogger("gateway.cli")


def parse_pod(spec: str) -> dict[str, Any]:
    """``URL[,events=tcp://h:p][,replay=tcp://h:p][,models=a+b][,name=N][,flavor=sglang][,role=prefill]``."""
    url, *options = spec.split(",")
    pod: dict[str, Any] = {"url": url}
    keys = {"events": "kv_events", "replay": "kv_replay", "name": "name", "flavor": "flavor",
            "topic": "kv_topic", "block_size": "block_size", "dp_size": "dp_size", "role": "role"}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or (key not in keys and key != "models"):
            raise ConfigError(f"--pod {spec!r}: unknown option {option!r}")
        if key == "models":
            pod["models"] = [m for m in value.split("+") if m]
        else:
            pod[keys[key]] = value
    return pod


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    server: dict[str, Any] = {}
    if args.host:
        server["host"] = args.host
    if args.port is not None:
        server["port"] = args.port
    if args.workers is not None:
        server["workers"] = args.workers
    overrides: dict[str, Any] = {"server": server} if server else {}
    if args.policy:
        overrides["routing"] = {"policy": args.policy}
    if args.pod:
        overrides["pods"] = [parse_pod(p) for p in args.pod]
    if args.mock_pods is not None:
        mock: dict[str, Any] = {"count": args.mock_pods}
        if args.mock_speed is not None:
            mock["speed"] = args.mock_speed
        if args.mock_ends_answers:
            mock["ends_answers"] = True
        if args.mock_prefill_pods:
            mock["prefill_pods"] = args.mock_prefill_pods
            mock["connector"] = args.mock_connector
        overrides["mock_pods"] = mock
    if args.log_json:
        overrides["logging"] = {"json": True}
    if args.redis:
        overrides["load"] = {"redis_url": args.redis}
    if args.shared_state_redis:
        overrides["shared_state"] = {"redis_url": args.shared_state_redis}
    if args.admission:
        overrides["admission"] = {"enabled": True}
    if args.command == "epp":
        epp = {k: v for k, v in (("host", args.grpc_host), ("port", args.grpc_port), ("fallbacks", args.fallbacks))
               if v is not None}
        if epp:
            overrides["epp"] = epp
    return overrides


def with_mock_tokenizer(config: GatewayConfig) -> TokenizationConfig:
    """The simulated pods tokenize with the bundled tokenizer: the gateway loads the same one."""
    from gateway.tokenization.hf import MOCK_TOKENIZER_DIR

    models = dict(config.tokenization.models)
    models.setdefault(config.mock_pods.model, ModelTokenizerConfig(path=str(MOCK_TOKENIZER_DIR)))
    return msgspec.structs.replace(config.tokenization, models=models)


def with_mock_connector(config: GatewayConfig) -> DisaggregationConfig:
    """Simulated prefill and decode pods pass their KV over the connector they were started with."""
    mock, disaggregation = config.mock_pods, config.disaggregation
    if not mock.prefill_pods:
        return disaggregation
    models = {**disaggregation.models, mock.model: ConnectorConfig(mock.connector)}
    return msgspec.structs.replace(disaggregation, models=models)


async def serve(config: GatewayConfig, epp: bool = False, source: ConfigSource | None = None) -> None:
    """``gateway serve`` (the HTTP proxy, one process or a supervisor of workers), or ``gateway epp``
    (the endpoint picker: one process), with the simulated pods the config asks for. ``source``: where
    ``config`` was read from, to reload it (SIGHUP, or the file changing)."""
    from gateway.mock.launcher import MockPodFleet
    from gateway.server import run_gateway
    from gateway.supervisor import Supervisor, worker_count

    fleet = None
    if config.mock_pods.count:
        fleet = MockPodFleet(config.mock_pods)
        try:
            pods = await fleet.astart()
        except BaseException:
            fleet.stop()
            raise
        config = msgspec.structs.replace(config, pods=[*config.pods, *pods],
                                         tokenization=with_mock_tokenizer(config),
                                         disaggregation=with_mock_connector(config))
        log.info("started %d simulated pods: %s", len(pods), ", ".join(p.url for p in pods))
    workers = worker_count(config)
    try:
        if epp:
            from gateway.epp.server import run_epp

            await run_epp(config, source)
        elif workers == 1:
            await run_gateway(config, source=source)
        else:
            await Supervisor(config, workers, source).run()
    finally:
        if fleet:
            fleet.stop()


async def mock(args: argparse.Namespace) -> None:
    from gateway.mock.pod import MockPod, MockPodConfig

    config = MockPodConfig(
        host=args.host, port=args.port,
        events_port=None if args.no_events else args.events_port,
        replay_port=None if args.no_replay else args.replay_port,
        block_size=args.block_size, num_blocks=args.num_blocks, speed=args.speed, flavor=args.flavor,
        model=args.model, tokenizer=args.tokenizer, encoding=Encoding(args.encoding) if args.encoding else None,
        hash_algo=args.prefix_caching_hash_algo, int_block_hashes=args.int_block_hashes,
        topic=args.topic, max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
        default_max_tokens=args.default_max_tokens, lora_adapters=args.lora_adapter or [],
        enable_lora=args.enable_lora, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
        max_model_len=args.max_model_len, kv_transfer_config=args.kv_transfer_config,
        ends_answers=args.ends_answers, responses_store=args.responses_store,
    )
    pod = MockPod(config)
    await pod.start()
    pub = pod.publisher
    log.info("mock %s pod %s on %s (events %s, replay %s)", config.flavor, config.model, pod.url,
             pub.endpoint if pub else None, pub.replay_endpoint if pub else None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await pod.stop()


def policy_names() -> list[str]:
    from gateway.app import POLICY_GROUP
    from gateway.plugin_registry import PluginRegistry

    return sorted(PluginRegistry(POLICY_GROUP, "routing policy").names())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__.replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for s in (sub.add_parser("serve", help="run the gateway"),
              sub.add_parser("epp", help="run the gateway as an Envoy ext_proc endpoint picker (Gateway API "
                                         "Inference Extension), its HTTP port serving metrics and debug pages")):
        add_serve_arguments(s)
        if s.prog.endswith("epp"):
            s.add_argument("--grpc-host", help="address of the ext_proc gRPC server (default 127.0.0.1)")
            s.add_argument("--grpc-port", type=int, help="port of the ext_proc gRPC server (default 9002)")
            s.add_argument("--fallbacks", type=int,
                           help="endpoints after the chosen one for Envoy to try (default 2; 0 for ORIGINAL_DST)")

    m = sub.add_parser("mock", help="run one simulated vLLM/SGLang pod")
    m.add_argument("--host", default="127.0.0.1")
    m.add_argument("--port", type=int, default=8000)
    m.add_argument("--events-port", type=int, default=5557)
    m.add_argument("--replay-port", type=int, default=5558)
    m.add_argument("--no-events", action="store_true")
    m.add_argument("--no-replay", action="store_true")
    m.add_argument("--block-size", type=int, default=16)
    m.add_argument("--num-blocks", type=int, default=2048)
    m.add_argument("--speed", type=float, default=1.0, help="time factor: 1 realistic, 0 no delay")
    m.add_argument("--flavor", choices=["vllm", "sglang"], default="vllm")
    m.add_argument("--model", default="mock-llama")
    m.add_argument("--tokenizer", help="HF tokenizer directory (default: the bundled one)")
    m.add_argument("--encoding", choices=[e.value for e in Encoding], help="KV-event wire format")
    m.add_argument("--prefix-caching-hash-algo", choices=["sha256", "xxhash"], default="sha256",
                   help="vLLM's block hash in the events (current encoding)")
    m.add_argument("--int-block-hashes", action="store_true",
                   help="64-bit int hashes in the events, as vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1")
    m.add_argument("--topic", default="")
    m.add_argument("--max-num-seqs", type=int, default=128)
    m.add_argument("--max-batched-tokens", type=int, default=2048)
    m.add_argument("--default-max-tokens", type=int, default=16)
    m.add_argument("--ends-answers", action="store_true",
                   help="end each answer after the pod's text (finish_reason stop) instead of at max_tokens")
    m.add_argument("--responses-store", action="store_true",
                   help="keep Responses API responses in memory (vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1)")
    m.add_argument("--max-model-len", type=int, default=MODEL_MAX_LEN,
                   help="longest prompt plus answer in tokens (default: the simulated model's, 131072)")
    m.add_argument("--lora-adapter", action="append", help="a LoRA adapter registered at start (repeatable)")
    m.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters, registered at run time (/v1/load_lora_adapter) as vLLM does")
    m.add_argument("--max-loras", type=int, default=1, help="LoRA adapters in one batch (vLLM's --max-loras)")
    m.add_argument("--max-cpu-loras", type=int, help="LoRA adapters kept in memory (default: --max-loras)")
    m.add_argument("--kv-transfer-config", help="vLLM's KV connector setting (JSON): ExampleConnector "
                   "(kv_connector_extra_config.shared_storage_path) or NixlConnector (kv_role, "
                   "kv_load_failure_policy), for prefill/decode disaggregation")

    from gateway.load.cli import add_profiles_parser

    add_profiles_parser(sub)
    from gateway.bench.cli import add_bench_parser

    add_bench_parser(sub)

    c = sub.add_parser("config", help="check a config file")
    c_sub = c.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = c_sub.add_parser("check", help="validate FILE (with GATEWAY_* variables) and print the effective "
                                           "config, defaults filled in")
    check.add_argument("file")
    check.add_argument("--json", action="store_true", help="print JSON instead of YAML")

    k = sub.add_parser("hash-key", help="print the SHA-256 digest of an API key for auth.api_key_hashes")
    k.add_argument("key")
    return parser


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML or JSON config file")
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8080)")
    parser.add_argument("--workers", type=int,
                        help="worker processes on the port (default: one per core this process may use)")
    parser.add_argument("--policy",
                        help=f"default routing policy: {', '.join(policy_names())}, or a profile of routing.profiles "
                        "(default round_robin)")
    parser.add_argument("--pod", action="append",
                        help="pod URL[,events=tcp://..][,replay=tcp://..][,models=a+b][,role=prefill|decode|both] "
                             "(repeatable)")
    parser.add_argument("--mock-pods", type=int, help="start N simulated pods beside the gateway")
    parser.add_argument("--mock-speed", type=float, help="time factor of the simulated pods (0: no delay)")
    parser.add_argument("--mock-ends-answers", action="store_true",
                        help="the simulated pods end each answer after their text, as a model does (for agent "
                             "tools), instead of writing until max_tokens")
    parser.add_argument("--mock-prefill-pods", type=int,
                        help="of the simulated pods, this many take the prefill leg and the others decode "
                             "(prefill/decode disaggregation)")
    parser.add_argument("--mock-connector", choices=["shared_storage", "nixl"], default="shared_storage",
                        help="how the simulated prefill pods pass their KV to the decode pods")
    parser.add_argument("--log-json", action="store_true", help="one JSON object per log line")
    parser.add_argument("--redis", help="Redis URL holding GPU profiles (aibrix:profile_*)")
    parser.add_argument("--shared-state-redis", help="Redis URL through which replicas share workflow state")
    parser.add_argument("--admission", action="store_true", help="turn SLO admission on")


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kv-gateway")
    except PackageNotFoundError:
        return "unknown"


def check_config(path: str, as_json: bool) -> int:
    """Exit 0 and print the effective config, or exit 2 naming what is wrong."""
    from gateway.app import effective_plugin_options
    from gateway.plugin_registry import PluginOptionsError, UnknownPlugin

    try:
        config = load_config(path)
        plugins = effective_plugin_options(config)
    except (ConfigError, OSError, PluginOptionsError, UnknownPlugin) as exc:
        print(f"gateway: {path}: {exc}", file=sys.stderr)
        return 2
    effective = msgspec.to_builtins(config)
    effective["routing"]["options"] = plugins["routing"]
    declared = config.routing.profiles
    effective["routing"]["profiles"] = {name: p for name, p in plugins["profiles"].items() if name in declared}
    shipped = {name: p for name, p in plugins["profiles"].items() if name not in declared}
    if "pressure" in plugins:
        effective["pressure"]["options"] = plugins["pressure"][config.pressure.source]
    effective["discovery"]["options"] = plugins["discovery"][config.discovery.source]
    if as_json:
        print(msgspec.json.encode(effective).decode())
    else:
        import yaml

        print(yaml.safe_dump(effective, sort_keys=False), end="")
        for name, profile in shipped.items():  # what the shipped profiles in use are made of, to copy from
            print(f"# shipped routing profile {name}, as its routing.options make it:")
            print("".join(f"#   {line}\n" for line in yaml.safe_dump(profile, sort_keys=False).splitlines()), end="")
    return 0


def configure_logging_early() -> None:
    from gateway.logs import configure_logging

    configure_logging(LoggingConfig(access_log=False))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "hash-key":
        print(hash_api_key(args.key))
        return 0
    if args.command == "config":
        return check_config(args.file, args.json)
    if args.command == "bench":
        from gateway.bench.cli import run as run_bench

        configure_logging_early()
        return run_bench(args)
    if args.command == "profiles":
        from gateway.load.cli import run

        configure_logging_early()
        return run(args)
    if args.command == "mock":
        configure_logging_early()
        run_loop(mock(args))
        return 0
    from gateway.logs import configure_logging

    try:
        source = ConfigSource.read(args.config, serve_overrides(args))
    except (ConfigError, OSError) as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    config = source.loaded
    configure_logging(config.logging)
    if not config.pods and not config.mock_pods.count and config.discovery.source == "static":
        print("gateway: no pods configured (use --pod URL, a config file, or --mock-pods N)", file=sys.stderr)
        return 2
    try:
        run_loop(serve(config, epp=args.command == "epp", source=source))
    except Exception as exc:  # start-up failures (port in use, unknown policy, ...) are one clear line
        print(f"gateway: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
