"""``gateway serve --workers N``: N gateway processes on one port, kept running by a supervisor.

The supervisor (the process ``serve`` started) makes a private directory for the workers' sockets and
their shared tables (the load table, flow control's release order), and one in shared memory for the
prefix index; it spawns the host's indexers (``kv_index.ingest_processes``, :mod:`gateway.indexer`: they
apply the pods' KV events once for the host), then the workers. Each worker is a whole gateway with its own
event loop, bound to the same port with ``SO_REUSEPORT`` (the kernel spreads connections between them),
reading the indexers' prefix index in place, and sharing with its siblings what the docs call shared
state (the tables directly; workflows, sessions, contexts and just-routed blocks over the state bus).

Owner: the supervisor owns the worker and indexer processes and their directories. A worker that exits
unexpectedly has its cells of the shared tables cleared and is started again; so is an indexer (the workers
read its last tables meanwhile, then the new one's as it rebuilds them from the pods' replays). A process
failing to start stops them all: the same error would follow every restart. SIGTERM or SIGINT go to every
worker, each drains its own requests for up to ``server.shutdown_grace_s`` (what is left after that is
killed), then to the indexers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

import msgspec

from gateway.background import name_process, parent_gone, run_loop
from gateway.cluster.identity import WorkerIdentity, new_replica_id
from gateway.config import ConfigSource, GatewayConfig
from gateway.flow.release_order import SharedReleaseOrder
from gateway.load.shared_table import SharedLoadTable

log = logging.getLogger("gateway.workers")

# A worker that dies sooner than this after starting, this many times in a row, is not restarted again.
QUICK_EXIT_S = 10.0
MAX_QUICK_EXITS = 3


def worker_count(config: GatewayConfig, cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """``server.workers``, or the cores this process may use: its CPU affinity, bounded by its cgroup's CPU
    quota (a container sees every core of its node but may be given two)."""
    if config.server.workers is not None:
        return config.server.workers
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path(cpu_max).read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    return cores


class WorkerStartError(RuntimeError):
    pass


@dataclass(eq=False)
class Worker:
    identity: WorkerIdentity
    process: BaseProcess
    started: float
    quick_exits: int = 0
    shard: int | None = None  # an indexer: its share of the pods (none: a gateway worker)

    @property
    def name(self) -> str:
        return f"indexer {self.shard}" if self.shard is not None else f"worker {self.identity.name}"


class Supervisor:
    def __init__(self, config: GatewayConfig, count: int, source: ConfigSource | None = None) -> None:
        if config.server.port == 0:  # every worker must bind the same port: choose it now
            config = msgspec.structs.replace(config, server=msgspec.structs.replace(
                config.server, port=_free_port(config.server.host)))
        self.config = config
        self.count = count
        self.run_dir = tempfile.mkdtemp(prefix="gateway-workers-")
        self.index_dir = _shared_memory_dir() if config.kv_index.ingest_processes and count > 1 else None
        self.replica = new_replica_id()
        self.table = SharedLoadTable.create(self._identity(0).load_table, count)
        self.release_order = SharedReleaseOrder.create(self._identity(0).release_order, count)
        self._context = multiprocessing.get_context("spawn")
        # Set once the indexers' files exist: the workers start beside the indexers (their imports, a second
        # of each start, overlap) and open the index only then.
        self._index_made = self._context.Event()
        self._config_bytes = msgspec.json.encode(config)
        self._source_bytes = msgspec.json.encode(source) if source is not None else b""
        self.workers: list[Worker] = []
        self.indexers: list[Worker] = []
        self._stopping = False

    async def run(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # before any worker listens: a client may signal at once
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, self._signal_workers, signal.SIGHUP)  # each reloads its config
        try:
            started = time.monotonic()
            log.info("starting %d gateway workers on %s:%d (each listens, then loads its tokenizers; %d pods to "
                     "check)...", self.count, self.config.server.host, self.config.server.port, len(self.config.pods))
            await self._start_all()
            log.info("gateway started in %.1f s: %d workers on %s:%d, their tokenizers loaded (replica %s)",
                     time.monotonic() - started, self.count, self.config.server.host, self.config.server.port,
                     self.replica)
            while not stop.is_set():
                self._restart_dead()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await stop.wait()
        finally:
            await self._stop_all()
            self.table.close()
            self.release_order.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            if self.index_dir is not None:
                shutil.rmtree(self.index_dir, ignore_errors=True)

    def _identity(self, index: int) -> WorkerIdentity:
        return WorkerIdentity(self.replica, index, self.count, self.run_dir, self.index_dir)

    def _spawn(self, index: int, shard: int | None = None) -> tuple[BaseProcess, multiprocessing.connection.Connection]:
        parent, child = self._context.Pipe(duplex=False)
        if shard is None:
            target, name = worker_main, f"gateway-w{index}"
            args: tuple[object, ...] = (self._config_bytes, self._source_bytes, self._identity(index), child,
                                        self._index_made)
        else:
            target, name = indexer_main, f"gateway-indexer{shard}"
            args = (self._config_bytes, self._identity(0), shard, child)
        process = self._context.Process(target=target, name=name, args=args, daemon=False)
        process.start()
        child.close()
        return process, parent

    async def _start_all(self) -> None:
        indexers = self._start([(0, shard) for shard in range(self.config.kv_index.ingest_processes)]) \
            if self.index_dir is not None else None
        if indexers is None:
            self._index_made.set()
        workers = self._start([(i, None) for i in range(self.count)])
        # Theirs to stop whatever happens next.
        self.indexers, self.workers = [w for w, _ in indexers or []], [w for w, _ in workers]
        if indexers is not None:  # the index the workers read exists before they open it
            await self._started(indexers)
            self._index_made.set()
        await self._started(workers)

    def _start(self, which: list[tuple[int, int | None]]
               ) -> list[tuple[Worker, multiprocessing.connection.Connection]]:
        spawned = [self._spawn(index, shard) for index, shard in which]
        return [(Worker(self._identity(index), p, time.monotonic(), shard=shard), conn)
                for (index, shard), (p, conn) in zip(which, spawned, strict=True)]

    @staticmethod
    async def _started(spawned: list[tuple[Worker, multiprocessing.connection.Connection]]) -> None:
        failures = await asyncio.gather(*(asyncio.to_thread(_wait_ready, conn) for _, conn in spawned))
        errors = [e for e in failures if e]
        if errors:
            raise WorkerStartError(errors[0])

    def _restart_dead(self) -> None:
        for worker in [*self.indexers, *self.workers]:
            if worker.process.is_alive() or self._stopping:
                continue
            index = worker.identity.index
            lived = time.monotonic() - worker.started
            worker.quick_exits = worker.quick_exits + 1 if lived < QUICK_EXIT_S else 0
            if worker.shard is None:
                self.table.clear_worker(index)
                self.release_order.clear_worker(index)
            if worker.quick_exits >= MAX_QUICK_EXITS:
                raise WorkerStartError(f"{worker.name} keeps exiting (code {worker.process.exitcode})")
            log.error("%s exited (code %s) after %.0f s: starting it again", worker.name, worker.process.exitcode,
                      lived)
            worker.process, conn = self._spawn(index, worker.shard)
            worker.started = time.monotonic()
            conn.close()  # its readiness is not awaited: the others serve meanwhile

    def _signal_workers(self, sig: signal.Signals, workers: list[Worker] | None = None) -> None:
        for worker in self.workers if workers is None else workers:
            if worker.process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.process.pid, sig)  # type: ignore[arg-type]

    async def _stop_all(self) -> None:
        self._stopping = True
        # The workers drain first (they read the index meanwhile), then the indexers stop.
        await self._stop(self.workers, self.config.server.shutdown_grace_s + 10)
        await self._stop(self.indexers, 10)

    async def _stop(self, workers: list[Worker], grace_s: float) -> None:
        alive = [w.process for w in workers if w.process.is_alive()]
        self._signal_workers(signal.SIGTERM, workers)
        deadline = time.monotonic() + grace_s
        for process in alive:
            await asyncio.to_thread(process.join, max(0.0, deadline - time.monotonic()))
        for process in alive:
            if process.is_alive():
                log.warning("%s did not stop in time: killed", process.name)
                process.kill()
            process.join(timeout=5)


def _shared_memory_dir() -> str:
    """A private directory in shared memory (``/dev/shm``) where there is one, else in the temporary directory:
    the prefix index's files are written all the time, and a disk need not see them."""
    with contextlib.suppress(OSError):
        return tempfile.mkdtemp(prefix="kvgw-index-", dir="/dev/shm")
    return tempfile.mkdtemp(prefix="kvgw-index-")


def _wait_ready(conn: multiprocessing.connection.Connection) -> str | None:
    """None once the worker listens and its tokenizers are loaded; the reason when it failed to start."""
    try:
        message = conn.recv()
    except EOFError:
        return "a worker exited during start-up"
    finally:
        conn.close()
    return None if message == "ready" else str(message)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def worker_main(config_bytes: bytes, source_bytes: bytes, identity: WorkerIdentity,
                ready: multiprocessing.connection.Connection, index_made: EventType) -> None:
    """A worker process: one gateway on the shared port, until SIGTERM; it reloads its config on SIGHUP."""
    from gateway.logs import configure_logging
    from gateway.serve import run_gateway  # the whole gateway: imported by the workers, not the supervisor

    config = msgspec.json.decode(config_bytes, type=GatewayConfig)
    source = msgspec.json.decode(source_bytes, type=ConfigSource) if source_bytes else None
    configure_logging(config.logging)
    name_process(f"gw-{identity.name}")
    supervisor = os.getppid()
    while not index_made.wait(1.0):  # the supervisor stops it if an indexer fails to start
        if os.getppid() != supervisor:
            raise SystemExit(1)

    _run_child(ready, f"worker {identity.name}", lambda started: run_gateway(config, started, identity, source))


def _run_child(ready: multiprocessing.connection.Connection, label: str,
               run: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """A child process's event loop around ``run``: the supervisor is told "ready" once ``run`` sets its event
    (or why it failed to start), and the child drains itself if the supervisor goes."""
    async def main() -> None:
        started = asyncio.Event()
        waiter = asyncio.create_task(started.wait())
        waiter.add_done_callback(lambda task: None if task.cancelled() else _tell(ready, "ready"))
        orphan_watch = asyncio.create_task(_drain_if_orphaned(os.getppid()))
        try:
            await run(started)
        finally:
            orphan_watch.cancel()

    try:
        run_loop(main())
    except Exception as exc:
        _tell(ready, f"{type(exc).__name__}: {exc}")
        log.error("%s failed: %s: %s", label, type(exc).__name__, exc)
        raise SystemExit(1) from None


async def _drain_if_orphaned(supervisor: int) -> None:
    """A supervisor killed outright cannot stop its workers: each notices and drains itself."""
    await parent_gone(supervisor)
    log.warning("the supervisor is gone: this worker drains and stops")
    os.kill(os.getpid(), signal.SIGTERM)


def indexer_main(config_bytes: bytes, identity: WorkerIdentity, shard: int,
                 ready: multiprocessing.connection.Connection) -> None:
    """An indexer process (:mod:`gateway.indexer`): its share of the pods' KV events, until SIGTERM."""
    from gateway.indexer import run_indexer
    from gateway.logs import configure_logging

    config = msgspec.json.decode(config_bytes, type=GatewayConfig)
    configure_logging(config.logging)
    name_process(f"gw-indexer{shard}")  # the bench measures the indexers' CPU by this name

    _run_child(ready, f"indexer {shard}", lambda started: run_indexer(config, identity, shard, started))


def _tell(conn: multiprocessing.connection.Connection, message: str) -> None:
    """Tell the supervisor, if it still listens (it does not wait for a restarted worker)."""
    with contextlib.suppress(OSError):
        conn.send(message)
