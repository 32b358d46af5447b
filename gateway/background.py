"""The event loop: running the gateway on it, stopping long-lived tasks, and sharing it fairly."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import os
import resource
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

# How long a cancelled task may run on before it is cancelled again.
CANCEL_AGAIN_S = 0.5
# A lag the loop-lag probe remembers as a stall, and how many of the latest it keeps (they are rare).
STALL_S = 0.1
STALLS_KEPT = 16
# A stall long enough to time out a connect or a health check (their defaults: 2 s, 1 s): logged.
LOGGED_STALL_S = 1.0

log = logging.getLogger("gateway.loop")


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (if any) and wait until it has finished unwinding. A task that runs on is cancelled
    again: a cancellation can be lost (Python 3.11's ``asyncio.wait_for`` drops one that arrives as its inner
    future completes), and a loop that lost one would keep a stop waiting for ever."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_AGAIN_S)
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def parent_gone(parent: int) -> None:
    """Returns once the process ``parent`` is no longer this one's parent: it died, and the process was handed
    to another (a child killed with it would otherwise live on). Looked at once a second."""
    while os.getppid() == parent:  # noqa: ASYNC110 (no event to wait for: the parent changes)
        await asyncio.sleep(1.0)


class LoopShare:
    """Shares the event loop between requests and long runs of work that never wait (a replay of
    thousands of buffered event batches, or a burst of queued live ones: ZeroMQ hands them over without
    suspending). Each such run holds a :meth:`turn`; together the runs take about ``budget_s`` of each
    pass of the loop, so a request is never held up by much more than that, however many pods catch up
    at once."""

    def __init__(self, budget_s: float = 0.002) -> None:
        self.budget_s = budget_s
        self.runs = 0
        self.yields = 0

    @contextlib.contextmanager
    def turn(self) -> Iterator[Turn]:
        self.runs += 1
        try:
            yield Turn(self)
        finally:
            self.runs -= 1


class Turn:
    """One run's share of the loop: call :meth:`pause` between units of work."""

    def __init__(self, share: LoopShare) -> None:
        self._share = share
        self._since = time.perf_counter()

    async def pause(self) -> None:
        share = self._share
        if time.perf_counter() - self._since >= share.budget_s / max(1, share.runs):
            await asyncio.sleep(0)
            share.yields += 1
            self._since = time.perf_counter()


def raise_open_files_limit() -> int:
    """Lift this process's soft limit on open files to its hard limit (a gateway holds sockets per pod, and so
    does a process of many simulated pods); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


def allow_sockets(context: Any, sockets: int) -> None:
    """A ZeroMQ context refuses its 1,024th socket by default: allow ``sockets`` (before making them)."""
    import zmq

    if context.get(zmq.MAX_SOCKETS) < sockets:
        context.set(zmq.MAX_SOCKETS, sockets)


def freeze_start_up_heap() -> None:
    """Keep what the process built to start (modules, its tokenizers' vocabularies and templates: about
    100,000 objects with a local tokenizer) out of every later full garbage collection. They live as long as
    the process, yet each full collection walked them all: 30-90 ms with a tokenizer loaded, during which the
    event loop served nothing. Called once started; the garbage of the start is collected first."""
    gc.collect()
    gc.freeze()


def name_process(name: str) -> None:
    """Name this process as ``ps`` and ``/proc/<pid>/comm`` show it (Linux; 15 characters at most): a host's
    workers and indexers told apart by what measures them."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on uvloop when it is installed, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


class Doorbell:
    """A wake-up call: whoever frees something rings it, and the one task waiting on it (if any) wakes. A
    ring with nobody waiting costs a test (the request path rings it on every answer). Made before the event
    loop runs (it is a collaborator given at construction); its event is made inside the loop."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None
        self._waiting = False

    def ring(self) -> None:
        if self._waiting:
            assert self._event is not None
            self._event.set()

    async def wait(self, timeout_s: float) -> None:
        """Until the bell rings or ``timeout_s`` passes."""
        if self._event is None:
            self._event = asyncio.Event()
        self._event.clear()
        self._waiting = True
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):  # not wait_for: in 3.11 it can lose a cancellation
                    await self._event.wait()
        finally:
            self._waiting = False


def own_stall(stalled_since: Callable[[float], float], started: float, timeout_s: float) -> float | None:
    """Whether a timeout of ``timeout_s`` begun at ``started`` (a ``time.perf_counter()`` reading) that ran out
    measured the gateway rather than its peer: it does when the event loop stood still for at least half of
    it (by :meth:`LoopLagProbe.stalled_since`, passed as ``stalled_since``). The stall's length when it
    does, else None. The one rule of the proxy's connects, the health checks and the Redis link."""
    stalled = stalled_since(started)
    return stalled if stalled >= timeout_s / 2 else None


class LoopLagProbe:
    """Samples how late the event loop wakes a task: every ``interval_s`` it sleeps, and reports to
    ``observe`` how much longer than ``interval_s`` the sleep took. That lateness is what any request
    waiting on the loop then waited too (a stall from event ingest, a garbage-collector pause, a burst of
    relayed chunks, the whole machine paused), so it is the loop's share of the TTFT the gateway adds.

    It also remembers its recent stalls, for :meth:`stalled_since`: a timeout that ran out while the loop
    itself stood still measured the gateway, not the peer it was waiting for."""

    def __init__(self, interval_s: float, observe: Callable[[float], None]) -> None:
        self._interval_s = interval_s
        self._observe = observe
        self._task: asyncio.Task[None] | None = None
        self._asked = 0.0  # when the sleep now under way began (perf_counter); meaningful only while running
        self._stalls: collections.deque[tuple[float, float]] = collections.deque(maxlen=STALLS_KEPT)

    async def start(self) -> None:
        if self._interval_s > 0:
            self._asked = time.perf_counter()
            self._task = asyncio.create_task(self._run(), name="loop-lag-probe")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    def stalled_since(self, since: float) -> float:
        """The longest the loop stood still since ``since`` (a ``time.perf_counter()`` reading), in seconds:
        the stalls that ended since then, and the one under way now (the probe's sleep already overdue, as
        when the loop has just woken and another task runs before the probe). 0 when the probe is off."""
        if self._task is None:
            return 0.0
        under_way = max(0.0, time.perf_counter() - self._asked - self._interval_s)
        return max([under_way, *(lag for ended, lag in self._stalls if ended >= since)])

    def stalled_within(self, seconds: float) -> float:
        """:meth:`stalled_since` the last ``seconds``."""
        return self.stalled_since(time.perf_counter() - seconds)

    async def _run(self) -> None:
        interval, observe = self._interval_s, self._observe
        while True:
            self._asked = asked = time.perf_counter()
            await asyncio.sleep(interval)
            woke = time.perf_counter()
            lag = max(0.0, woke - asked - interval)
            if lag >= STALL_S:
                self._stalls.append((woke, lag))
                if lag >= LOGGED_STALL_S:
                    log.warning("the event loop stood still for %.1f s (a burst of work, or the machine paused): "
                                "timeouts running meanwhile measured the gateway, not their peers", lag)
            observe(lag)
