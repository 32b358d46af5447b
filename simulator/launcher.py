"""Starts simulated pods as subprocesses (``gateway mock --pods K``) and waits until they answer.

A pod with a process of its own is given its ports (free now, outside the ephemeral range), so that where
it will listen is known before it does: ``gateway serve --mock-pods N`` starts its workers beside the pods
rather than after them (the workers check the pods' health anyway; one not up yet is not healthy yet).

Subprocesses keep the pods' simulated work off the gateway's event loop and core, so what a benchmark
measures is the gateway. A few pods get a process each, as real pods would; a fleet of many shares a few
processes (``mock_pods.per_process``: :mod:`simulator.group`), so that a thousand fit a small machine.
Owner: a :class:`MockPodFleet` owns its processes and stops them (by pid, terminate then kill) whatever
happens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO

import msgspec

from gateway.config import (
    ConnectorConfig,
    DisaggregationConfig,
    GatewayConfig,
    ModelTokenizerConfig,
    PodConfig,
    TokenizationConfig,
)
from gateway.tokenization.hf import BUNDLED_TOKENIZER_DIR
from simulator.config import MockPodsConfig
from simulator.ports import PodEndpoints, free_ports

log = logging.getLogger("simulator")

# Up to this many pods, each gets a process of its own (the default).
OWN_PROCESS_UP_TO = 16


class PodExited(RuntimeError):
    pass


@dataclass
class MockPodProcess:
    """One process of simulated pods: the first pod's index in the fleet, how many, and their role."""

    process: subprocess.Popen[bytes]
    first: int
    count: int
    role: str
    planned: PodEndpoints | None = None  # where its one pod was told to listen (None: it chooses)
    # Where a quiet fleet's process writes its errors, to say why it exited (None: the fleet's own stderr).
    stderr: IO[bytes] | None = None

    def last_error(self) -> str:
        """The last line the process wrote to its captured stderr ("" when none or not captured)."""
        if self.stderr is None:
            return ""
        self.stderr.seek(0)
        lines = self.stderr.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else ""


def pods_per_process(config: MockPodsConfig, cores: int | None = None) -> int:
    """``mock_pods.per_process``, or: one each for a few pods; a fleet spread over the cores (two at least)."""
    if config.per_process:
        return config.per_process
    if config.count <= OWN_PROCESS_UP_TO or config.prefill_pods:
        return 1
    return math.ceil(config.count / max(2, cores or os.cpu_count() or 1))


def port_of(endpoint: str | None) -> int:
    """The port of ``http://host:port`` or ``tcp://host:port``."""
    assert endpoint is not None
    return int(endpoint.rsplit(":", 1)[1])


class MockPodFleet:
    def __init__(self, config: MockPodsConfig, host: str = "127.0.0.1", quiet: bool = False,
                 avoid_ports: frozenset[int] = frozenset()) -> None:
        """``avoid_ports``: ports another process is about to bind (a gateway starting beside its pods), which
        a pod given its ports here must not be given (seen in CI: a pod bound the gateway's port first)."""
        self.config = config
        self.host = host
        self.quiet = quiet
        self.avoid_ports = avoid_ports
        self.members: list[MockPodProcess] = []
        # Prefill/decode pods sharing their prompts through a directory (vLLM's ExampleConnector).
        self._storage = (tempfile.TemporaryDirectory(prefix="kvgw-kv-")
                         if config.prefill_pods and config.connector == "shared_storage" else None)

    def start(self, timeout_s: float = 120.0) -> list[PodConfig]:
        """Spawn the pods and wait until they listen. A fleet whose process exits while starting is stopped
        and started once more: a port chosen free can be taken before the pod binds it (another test's
        listener), and a loaded machine widens that gap."""
        try:
            self.spawn()
            return self.wait(timeout_s)
        except PodExited as exc:
            log.warning("simulated pods exited while starting (%s); starting them again", exc)
        return self.respawn(timeout_s)

    def respawn(self, timeout_s: float = 120.0) -> list[PodConfig]:
        """Stop the pods' processes and start them once more, on ports chosen anew."""
        self._stop_processes()
        self.spawn()
        return self.wait(timeout_s)

    def spawn(self) -> list[PodConfig] | None:
        """Start the processes; the pods' configs when their ports were chosen here (each pod a process of
        its own), else None (a process of several pods chooses its own: :meth:`wait` says them)."""
        per = pods_per_process(self.config)
        for first in range(0, self.config.count, per):
            planned = self._planned(first) if per == 1 else None
            self.members.append(self._spawn(first, min(per, self.config.count - first), planned))
        if per != 1:
            return None
        return [self._pod_config(m, m.planned) for m in self.members if m.planned is not None]

    def wait(self, timeout_s: float = 120.0) -> list[PodConfig]:
        """The pods' configs once every pod listens (where it was told to, if it was)."""
        deadline = time.monotonic() + timeout_s
        pods: list[PodConfig] = []
        for member in self.members:
            endpoints = self._wait_ready(member, deadline)
            if member.planned is not None and endpoints != [member.planned]:
                raise PodExited(f"mock pod {member.first} listens on {endpoints}, not on {member.planned}")
            pods += [self._pod_config(member, e) for e in endpoints]
        return pods

    def _planned(self, index: int) -> PodEndpoints:
        """Where pod ``index`` (a process of its own) is to listen: ``base_port + index``, or a free port."""
        c, host = self.config, self.host
        http, events, replay = free_ports(3, host, avoid=self.avoid_ports)
        http = c.base_port + index if c.base_port else http
        return PodEndpoints(0, f"http://{host}:{http}", f"tcp://{host}:{events}", f"tcp://{host}:{replay}")

    def _role(self, index: int) -> str:
        c = self.config
        return ("prefill" if index < c.prefill_pods else "decode") if c.prefill_pods else "both"

    def _spawn(self, first: int, count: int, planned: PodEndpoints | None = None) -> MockPodProcess:
        c = self.config
        role = self._role(first)
        ports = [port_of(e) for e in (planned.url, planned.events, planned.replay)] if planned else \
            [c.base_port + first if c.base_port else 0, 0, 0]
        cmd = [
            sys.executable, "-m", "gateway", "mock", "--pods", str(count), "--host", self.host,
            "--port", str(ports[0]), "--events-port", str(ports[1]), "--replay-port", str(ports[2]),
            "--block-size", str(c.block_size), "--num-blocks", str(c.num_blocks), "--speed", str(c.speed),
            "--flavor", c.flavor, "--model", c.model, "--max-model-len", str(c.max_model_len),
            "--scheduling-policy", c.scheduling, "--exit-with-parent",
        ]
        if c.enable_lora or c.lora_adapters:
            cmd += ["--enable-lora", "--max-loras", str(c.max_loras)]
            cmd += [f"--lora-adapter={name}" for name in c.lora_adapters]
            if c.max_cpu_loras is not None:
                cmd += ["--max-cpu-loras", str(c.max_cpu_loras)]
        if c.ends_answers:
            cmd.append("--ends-answers")
        if c.synthetic_events:
            cmd += ["--synthetic-events", str(c.synthetic_events), "--synthetic-hold", str(c.synthetic_hold)]
        if c.prefill_pods:
            cmd += ["--kv-transfer-config", self._kv_transfer_config(role)]
        stderr = tempfile.NamedTemporaryFile(prefix="kvgw-mock-", suffix=".err") if self.quiet else None
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr)
        return MockPodProcess(process, first, count, role, planned, stderr)

    def _pod_config(self, member: MockPodProcess, endpoints: PodEndpoints) -> PodConfig:
        c = self.config
        return PodConfig(url=endpoints.url, name=f"mock-{member.first + endpoints.index}", flavor=c.flavor,
                         deployment="mock",  # the gateway's /readyz waits for these to answer (api/routes.py)
                         kv_events=endpoints.events, kv_replay=endpoints.replay,
                         block_size=c.block_size, role=member.role,  # type: ignore[arg-type]
                         scheduling=c.scheduling)

    def _kv_transfer_config(self, role: str) -> str:
        """The pod's ``--kv-transfer-config``, as a vLLM pod of that role would be started."""
        if self._storage is not None:
            return json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                               "kv_connector_extra_config": {"shared_storage_path": self._storage.name}})
        return json.dumps({"kv_connector": "NixlConnector", "kv_buffer_device": "cpu",
                           "kv_role": "kv_producer" if role == "prefill" else "kv_consumer"})

    @staticmethod
    def _wait_ready(member: MockPodProcess, deadline: float) -> list[PodEndpoints]:
        """The pods' endpoints, one line each, which the process writes once they all listen."""
        process, received = member.process, b""
        assert process.stdout is not None
        fd = process.stdout.fileno()
        while received.count(b"\n") < member.count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"mock pods {member.first}.. did not start in time")
            ready, _, _ = select.select([fd], [], [], min(remaining, 0.5))
            chunk = os.read(fd, 1 << 16) if ready else b""
            received += chunk
            if not chunk and process.poll() is not None:
                said = member.last_error()
                raise PodExited(f"mock pods {member.first}.. exited with {process.returncode}"
                                + (f": {said}" if said else ""))
        return [msgspec.json.decode(line, type=PodEndpoints) for line in received.splitlines()[:member.count]]

    def stop(self) -> None:
        self._stop_processes()
        if self._storage is not None:
            self._storage.cleanup()

    def _stop_processes(self) -> None:
        for member in self.members:
            if member.process.poll() is None:
                member.process.send_signal(signal.SIGTERM)
        for member in self.members:
            try:
                member.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(member.process.pid, signal.SIGKILL)
                member.process.wait()
            if member.process.stdout is not None:
                member.process.stdout.close()
            if member.stderr is not None:
                member.stderr.close()
        self.members.clear()

    async def astart(self, timeout_s: float = 120.0) -> list[PodConfig]:
        return await asyncio.to_thread(self.start, timeout_s)


class PodsBesideGateway:
    """The simulated pods of ``gateway serve --mock-pods``, being started: :meth:`started` returns once they
    all listen, or raises when one exits or does not start in time."""

    def __init__(self, fleet: MockPodFleet, pods: list[PodConfig] | None) -> None:
        self.fleet = fleet
        self.pods = pods  # their configs, known at once when each was given its ports
        self._began = time.monotonic()
        self._started = False

    async def started(self, timeout_s: float = 120.0) -> None:
        if self._started:
            return
        planned = self.pods is not None
        try:
            self.pods = await asyncio.to_thread(self.fleet.wait, timeout_s)
        except PodExited as exc:
            if planned:  # their ports are in the gateway's config already
                raise
            # A process of several pods chose its own ports, and one was taken before it bound it.
            log.warning("simulated pods exited while starting (%s); starting them again", exc)
            self.pods = await asyncio.to_thread(self.fleet.respawn, timeout_s)
        self._started = True
        log.info("started %d simulated pods in %.1f s: %s", len(self.pods), time.monotonic() - self._began,
                 ", ".join(p.url for p in self.pods))

    def stop(self) -> None:
        self.fleet.stop()


async def start_beside_gateway(config: GatewayConfig) -> tuple[GatewayConfig, PodsBesideGateway]:
    """The pods ``config.mock_pods`` asks for, being started (waited for only when they choose their own
    ports); and the config with them among its pods, loading the tokenizer they use and passing KV over the
    connector they were started with."""
    fleet = MockPodFleet(config.mock_pods, avoid_ports=frozenset({config.server.port, config.epp.port}))
    log.info("starting %d simulated pods (gateway mock, %d at a time in each process)...", config.mock_pods.count,
             pods_per_process(config.mock_pods))
    pods = PodsBesideGateway(fleet, None)
    try:
        pods.pods = fleet.spawn()
        if pods.pods is None:
            await pods.started()
    except BaseException:
        fleet.stop()
        raise
    assert pods.pods is not None
    return msgspec.structs.replace(config, pods=[*config.pods, *pods.pods], tokenization=_with_tokenizer(config),
                                   disaggregation=_with_connector(config)), pods


def _with_tokenizer(config: GatewayConfig) -> TokenizationConfig:
    """The simulated pods tokenize with the bundled tokenizer: the gateway loads the same one."""
    models = dict(config.tokenization.models)
    models.setdefault(config.mock_pods.model, ModelTokenizerConfig(path=str(BUNDLED_TOKENIZER_DIR)))
    return msgspec.structs.replace(config.tokenization, models=models)


def _with_connector(config: GatewayConfig) -> DisaggregationConfig:
    """Simulated prefill and decode pods pass their KV over the connector they were started with."""
    mock, disaggregation = config.mock_pods, config.disaggregation
    if not mock.prefill_pods:
        return disaggregation
    models = {**disaggregation.models, mock.model: ConnectorConfig(mock.connector)}
    return msgspec.structs.replace(disaggregation, models=models)
