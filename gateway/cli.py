"""``gateway``: an OpenAI-compatible gateway that routes LLM requests by KV-cache prefix, load and SLO.

Commands: serve, epp, profiles, config, hash-key; and those of the packages installed beside it (mock from
the simulator, bench from the benchmark).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Coroutine
from typing import Any

import msgspec

from gateway.background import run_loop
from gateway.config import ConfigError, ConfigSource, GatewayConfig, LoggingConfig, hash_api_key, load_config
from gateway.extensions import Command, NotInstalled, SimulatedPods, commands, simulator

log = logging.getLogger("gateway.cli")


def parse_pod(spec: str) -> dict[str, Any]:
    """``URL[,events=tcp://h:p][,replay=tcp://h:p][,models=a+b][,name=N][,flavor=sglang][,role=prefill]
    [,scheduling=priority]``."""
    url, *options = spec.split(",")
    pod: dict[str, Any] = {"url": url}
    keys = {"events": "kv_events", "replay": "kv_replay", "name": "name", "flavor": "flavor",
            "topic": "kv_topic", "block_size": "block_size", "dp_size": "dp_size", "role": "role",
            "scheduling": "scheduling"}
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
        if args.mock_ends_answers is not None:
            mock["ends_answers"] = args.mock_ends_answers
        if args.mock_prefill_pods:
            mock["prefill_pods"] = args.mock_prefill_pods
        if args.mock_connector:
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


async def serve(config: GatewayConfig, epp: bool = False, source: ConfigSource | None = None) -> None:
    """``gateway serve`` (the HTTP proxy, one process or a supervisor of workers), or ``gateway epp``
    (the endpoint picker: one process), with the simulated pods the config asks for. ``source``: where
    ``config`` was read from, to reload it (SIGHUP, or the file changing)."""
    fleet = None
    pods = None
    if wants_simulated_pods(config):
        pods = asyncio.ensure_future(simulator("gateway serve --mock-pods").start(config))
        await asyncio.sleep(0)  # their processes are spawned: this one's imports below overlap their start
    from gateway.supervisor import Supervisor, worker_count

    if pods is not None:
        config, fleet = await pods
    workers = worker_count(config)
    try:
        if epp:
            from gateway.epp.grpc_server import run_epp

            serving = run_epp(config, source)
        elif workers == 1:
            from gateway.serve import run_gateway  # the whole gateway (a supervisor leaves it to its workers)

            serving = run_gateway(config, source=source)
        else:
            serving = Supervisor(config, workers, source).run()
        await (serve_beside(serving, fleet) if fleet else serving)
    finally:
        if fleet:
            fleet.stop()


async def serve_beside(serving: Coroutine[Any, Any, None], pods: SimulatedPods) -> None:
    """Serve while the simulated pods start (the gateway's start needs where they listen, not them): one
    that fails to start stops the gateway, with its error."""
    server = asyncio.ensure_future(serving)
    starting = asyncio.ensure_future(pods.started())
    try:
        await asyncio.wait((server, starting), return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # the pods' error, if one failed
        await server
    finally:
        for task in (server, starting):
            task.cancel()
        await asyncio.gather(server, starting, return_exceptions=True)


def policy_names() -> list[str]:
    from gateway.app import POLICY_GROUP
    from gateway.plugin_registry import PluginRegistry

    return sorted(PluginRegistry(POLICY_GROUP, "routing policy").names())


class _PolicyNames:
    """The policies' names, listed only when help is printed: finding them imports the whole gateway (1-2 s
    of a start on a loaded machine), which every ``gateway`` process, a simulated pod's included, would pay."""

    def __str__(self) -> str:
        return ", ".join(policy_names())


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

    from gateway.load.cli import add_profiles_parser

    add_profiles_parser(sub)
    for name, command in sorted(plugged_in_commands().items()):
        command.add_arguments(sub.add_parser(name, help=command.help))
        sub.choices[name].set_defaults(plugged_in=command)

    c = sub.add_parser("config", help="check a config file")
    c_sub = c.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = c_sub.add_parser("check", help="validate FILE (with GATEWAY_* variables) and print the effective "
                                           "config, defaults filled in")
    check.add_argument("file")
    check.add_argument("--json", action="store_true", help="print JSON instead of YAML")

    k = sub.add_parser("hash-key", help="print the SHA-256 digest of an API key for auth.api_key_hashes")
    k.add_argument("key")
    return parser


def plugged_in_commands() -> dict[str, Command]:
    """The commands of the packages beside the runtime; one that is not installed answers how to install it."""
    installed, missing = commands()
    return {**installed, **{name: not_installed(name, package) for name, package in missing.items()}}


def not_installed(name: str, package: str) -> Command:
    hint = NotInstalled(f"gateway {name}", package)

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.set_defaults(any_arguments=True)  # whatever was asked, the answer is the hint

    def run(args: argparse.Namespace) -> int:
        print(f"gateway: {hint}", file=sys.stderr)
        return 2

    return Command(help=f"(not installed: pip install 'kv-gateway[{package}]')", add_arguments=add_arguments, run=run)


def wants_simulated_pods(config: GatewayConfig) -> bool:
    return config.mock_pods is not None and config.mock_pods.count > 0


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML or JSON config file")
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8080)")
    parser.add_argument("--workers", type=int,
                        help="worker processes on the port (default: one per core this process may use)")
    policy = parser.add_argument("--policy", help="default routing policy: %(names)s, or a profile of "
                                                  "routing.profiles (default round_robin)")
    policy.names = _PolicyNames()  # type: ignore[attr-defined]  # argparse fills %(names)s from the action
    parser.add_argument("--pod", action="append",
                        help="pod URL[,events=tcp://..][,replay=tcp://..][,models=a+b][,role=prefill|decode|both]"
                             "[,scheduling=priority] "
                             "(repeatable)")
    parser.add_argument("--mock-pods", type=int, help="start N simulated pods beside the gateway (the simulator: "
                                                      "pip install 'kv-gateway[simulator]')")
    parser.add_argument("--mock-speed", type=float, help="time factor of the simulated pods (0: no delay)")
    parser.add_argument("--mock-ends-answers", action=argparse.BooleanOptionalAction,
                        help="the simulated pods end each answer after their text, as a model does (the default: "
                             "what agent tools want); --no-mock-ends-answers: they write until max_tokens, as "
                             "benchmarks want")
    parser.add_argument("--mock-prefill-pods", type=int,
                        help="of the simulated pods, this many take the prefill leg and the others decode "
                             "(prefill/decode disaggregation)")
    parser.add_argument("--mock-connector", choices=["shared_storage", "nixl"],
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
    effective["hooks"] = plugins["hooks"]
    effective["kits"] = plugins["kits"]
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
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "hash-key":
        print(hash_api_key(args.key))
        return 0
    if args.command == "config":
        return check_config(args.file, args.json)
    if hasattr(args, "plugged_in"):
        configure_logging_early()
        return args.plugged_in.run(args)
    if args.command == "profiles":
        from gateway.load.cli import run

        configure_logging_early()
        return run(args)
    from gateway.logs import configure_logging

    try:
        source = ConfigSource.read(args.config, serve_overrides(args))
    except (ConfigError, OSError) as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    config = source.loaded
    configure_logging(config.logging)
    if not config.pods and not wants_simulated_pods(config) and config.discovery.source == "static":
        print("gateway: no pods configured (use --pod URL, a config file, or --mock-pods N)", file=sys.stderr)
        return 2
    try:
        run_loop(serve(config, epp=args.command == "epp", source=source))
    except Exception as exc:  # start-up failures (port in use, unknown policy, ...) are one clear line
        print(f"gateway: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
