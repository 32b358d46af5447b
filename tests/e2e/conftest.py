"""Real vLLM pods (CPU build, tiny random-weight Llama) for the end-to-end suite; run by ``make e2e``.

``tests/e2e/run.sh`` prepares the vLLM environment and the model and passes them in the environment.
Each pod runs in its own process group, written to ``E2E_PIDFILE`` so that the script can kill what a
killed pytest left behind; here the pods are stopped by the session's teardown, and a SIGTERM (the
script's timeout) is turned into an exception so that the teardown runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from simulator.pod import free_ports
from tests.e2e.cpu_quota import PodCpuQuota, requested_share

MODEL = "tiny"
BLOCK_SIZE = 128  # vLLM's CPU backend
READY_TIMEOUT_S = 420.0
ENGINE_FAILED = "EngineCore failed to start"


# Ports handed out to pods in this session (a pod may not have bound its own yet).
_handed_out: set[int] = set()


def ports_to_bind_later(n: int) -> list[int]:
    """``n`` free ports outside the ephemeral range (see ``free_ports``), distinct from any handed out
    before: a vLLM pod binds its ports tens of seconds after they are chosen (after loading its model)."""
    chosen: list[int] = []
    while len(chosen) < n:
        chosen += [p for p in free_ports(n - len(chosen), "0.0.0.0") if p not in _handed_out]  # vLLM binds *
        _handed_out.update(chosen)
    return chosen


def _required_env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set: the end-to-end suite runs through `make e2e` (tests/e2e/run.sh), "
                    "which installs real vLLM and builds the model", pytrace=False)
    return value


class VllmPod:
    """One ``vllm.entrypoints.openai.api_server`` process with KV events, replay and dev mode on."""

    def __init__(self, name: str, python: str, model_dir: str, run_dir: Path, pidfile: Path,
                 extra_args: tuple[str, ...] = (), cores: str = "auto", extra_env: dict[str, str] | None = None
                 ) -> None:
        self.name = name
        self.extra_args = extra_args
        self.extra_env = extra_env or {}
        self.cores = cores
        self.python = python
        self.model_dir = model_dir
        self.log_path = run_dir / f"{name}.log"
        self.pidfile = pidfile
        self.port, self.events_port, self.replay_port = ports_to_bind_later(3)
        self.process: subprocess.Popen[bytes] | None = None
        self.cpu_quota: PodCpuQuota | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def gateway_config(self) -> dict[str, Any]:
        return {"url": self.url, "name": self.name, "kv_events": f"tcp://127.0.0.1:{self.events_port}",
                "kv_replay": f"tcp://127.0.0.1:{self.replay_port}"}

    def start(self) -> None:
        kv_events = (f'{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{self.events_port}",'
                     f'"replay_endpoint":"tcp://*:{self.replay_port}"}}')
        command = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                   "--served-model-name", MODEL, "--port", str(self.port), "--host", "127.0.0.1",
                   "--max-model-len", "2048", "--enable-prefix-caching", "--enable-prompt-tokens-details",
                   "--kv-events-config", kv_events, *self.extra_args]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_CPU_OMP_THREADS_BIND": self.cores,
               **self.extra_env}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        with open(self.pidfile, "a") as pids:
            pids.write(f"{self.process.pid}\n")
        if (share := requested_share()) is not None:  # before the engine's processes start (they inherit it)
            self.cpu_quota = self.cpu_quota or PodCpuQuota(self.name, share)
            self.cpu_quota.join(self.process.pid)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                pytest.fail(f"vLLM pod {self.name} exited with {self.process.returncode}:\n{self.log_tail()}",
                            pytrace=False)
            if ENGINE_FAILED in self.log_text():  # the API server may live on without its engine
                pytest.fail(f"vLLM pod {self.name}'s engine failed to start:\n{self.log_tail()}", pytrace=False)
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        pytest.fail(f"vLLM pod {self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}", pytrace=False)

    def kill(self) -> None:
        """SIGKILL the whole process group (the API server and its engine core), as a crash would."""
        self._signal_group(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)  # the engine core may outlive its parent
        if self.process is not None:
            self.process.wait(timeout=10)
        if self.cpu_quota is not None:
            self.cpu_quota.remove()
            self.cpu_quota = None

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.process is not None:
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                pass

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


class VllmFleet:
    def __init__(self, pods: list[VllmPod]) -> None:
        self.pods = pods

    def __getitem__(self, i: int) -> VllmPod:
        return self.pods[i]

    def gateway_pods(self) -> list[dict[str, Any]]:
        return [p.gateway_config() for p in self.pods]


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # pytest tears its fixtures down on KeyboardInterrupt


@pytest.fixture(scope="session")
def model_dir() -> str:
    return _required_env("E2E_MODEL_DIR")


@pytest.fixture(scope="session")
def vllm(model_dir: str) -> Iterator[VllmFleet]:
    yield from running_fleet("vllm", model_dir)


def running_fleet(prefix: str, model_dir: str, extra_args: tuple[str, ...] = ()) -> Iterator[VllmFleet]:
    """Two pods started together, stopped at teardown (and on SIGTERM)."""
    yield from running_pods(model_dir, [(f"{prefix}{i}", extra_args, {}) for i in range(2)])


def running_pods(model_dir: str, specs: list[tuple[str, tuple[str, ...], dict[str, str]]]) -> Iterator[VllmFleet]:
    """Pods (name, extra arguments, extra environment) started together, stopped at teardown (and on
    SIGTERM)."""
    python = _required_env("E2E_VLLM_PYTHON")
    run_dir = Path(_required_env("E2E_RUN_DIR"))
    pidfile = Path(_required_env("E2E_PIDFILE"))
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    # Each pod's OpenMP threads on a core of its own: two engines spinning on the same cores slow each
    # other down tenfold, which would make spreading work look slower than piling it onto one pod.
    cpus = os.cpu_count() or 1
    fleet = VllmFleet([VllmPod(name, python, model_dir, run_dir, pidfile, args, str(i % cpus), env)
                       for i, (name, args, env) in enumerate(specs)])
    try:
        for pod in fleet.pods:
            pod.start()
        for pod in fleet.pods:
            pod.wait_ready()
        yield fleet
    finally:
        for pod in fleet.pods:
            pod.stop()
        signal.signal(signal.SIGTERM, previous)
