"""Starts simulated pods as subprocesses (``gateway mock``) and waits until they answer.

Subprocesses keep the pods' simulated work off the gateway's event loop and core, so what a benchmark
measures is the gateway. Owner: a :class:`MockPodFleet` owns its processes and stops them (by pid,
terminate then kill) whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from gateway.config import MockPodsConfig, PodConfig
from gateway.mock.pod import free_port

log = logging.getLogger("gateway.mock")


class PodExited(RuntimeError):
    pass


@dataclass
class MockPodProcess:
    process: subprocess.Popen[bytes]
    pod: PodConfig


class MockPodFleet:
    def __init__(self, config: MockPodsConfig, host: str = "127.0.0.1", quiet: bool = False) -> None:
        self.config = config
        self.host = host
        self.quiet = quiet
        self.members: list[MockPodProcess] = []
        # Prefill/decode pods sharing their prompts through a directory (vLLM's ExampleConnector).
        self._storage = (tempfile.TemporaryDirectory(prefix="kvgw-kv-")
                         if config.prefill_pods and config.connector == "shared_storage" else None)

    def start(self, timeout_s: float = 60.0, attempts: int = 3) -> list[PodConfig]:
        for i in range(self.config.count):
            self.members.append(self._spawn(i))
        deadline = time.monotonic() + timeout_s
        for i, member in enumerate(self.members):
            for attempt in range(attempts):
                try:
                    self._wait_ready(member, deadline)
                    break
                except PodExited:
                    # Most likely a port taken between choosing it and binding it: try other ports.
                    if attempt == attempts - 1 or self.config.base_port:
                        raise
                    log.warning("mock pod %s exited at start; retrying on other ports", member.pod.name)
                    member = self.members[i] = self._spawn(i)
        return [m.pod for m in self.members]

    def _spawn(self, index: int) -> MockPodProcess:
        c = self.config
        port = c.base_port + index if c.base_port else free_port(self.host)
        events, replay = free_port(self.host), free_port(self.host)
        cmd = [
            sys.executable, "-m", "gateway", "mock", "--host", self.host, "--port", str(port),
            "--events-port", str(events), "--replay-port", str(replay), "--block-size", str(c.block_size),
            "--num-blocks", str(c.num_blocks), "--speed", str(c.speed), "--flavor", c.flavor,
            "--model", c.model, "--scheduling-policy", c.scheduling,
        ]
        if c.max_model_len is not None:
            cmd += ["--max-model-len", str(c.max_model_len)]
        if c.enable_lora or c.lora_adapters:
            cmd += ["--enable-lora", "--max-loras", str(c.max_loras)]
            cmd += [f"--lora-adapter={name}" for name in c.lora_adapters]
            if c.max_cpu_loras is not None:
                cmd += ["--max-cpu-loras", str(c.max_cpu_loras)]
        if c.ends_answers:
            cmd.append("--ends-answers")
        role = ("prefill" if index < c.prefill_pods else "decode") if c.prefill_pods else "both"
        if c.prefill_pods:
            cmd += ["--kv-transfer-config", self._kv_transfer_config(role)]
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL if self.quiet else None)
        url = f"http://{self.host}:{port}"
        pod = PodConfig(url=url, name=f"mock-{index}", flavor=c.flavor, deployment="mock",
                        kv_events=f"tcp://{self.host}:{events}", kv_replay=f"tcp://{self.host}:{replay}",
                        block_size=c.block_size, role=role, scheduling=c.scheduling)  # type: ignore[arg-type]
        return MockPodProcess(process, pod)

    def _kv_transfer_config(self, role: str) -> str:
        """The pod's ``--kv-transfer-config``, as a vLLM pod of that role would be started."""
        if self._storage is not None:
            return json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                               "kv_connector_extra_config": {"shared_storage_path": self._storage.name}})
        return json.dumps({"kv_connector": "NixlConnector", "kv_buffer_device": "cpu",
                           "kv_role": "kv_producer" if role == "prefill" else "kv_consumer"})

    def _wait_ready(self, member: MockPodProcess, deadline: float) -> None:
        while time.monotonic() < deadline:
            if member.process.poll() is not None:
                raise PodExited(f"mock pod {member.pod.name} exited with {member.process.returncode}")
            # Not HTTP yet: until the pod binds its port, another process's socket may answer there.
            with contextlib.suppress(OSError, http.client.HTTPException):
                with urllib.request.urlopen(f"{member.pod.url}/health", timeout=1) as resp:
                    if resp.status == 200:
                        return
            time.sleep(0.1)
        raise TimeoutError(f"mock pod {member.pod.name} did not become healthy in time")

    def stop(self) -> None:
        for member in self.members:
            if member.process.poll() is None:
                member.process.send_signal(signal.SIGTERM)
        for member in self.members:
            try:
                member.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(member.process.pid, signal.SIGKILL)
                member.process.wait()
        self.members.clear()
        if self._storage is not None:
            self._storage.cleanup()

    async def astart(self, timeout_s: float = 60.0) -> list[PodConfig]:
        return await asyncio.to_thread(self.start, timeout_s)
