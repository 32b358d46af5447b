"""The order in which the workers of one gateway release held requests: they agree on one.

Each worker holds its own clients' requests (:mod:`gateway.flow.controller`). Left alone, the worker whose
request freed room would see it first and give it to its own next request, whatever the flows' service
counters say, and a flow whose requests happen to wait in another worker would starve. So each worker
publishes its *contender*: the request it would release next (its band, its flow's service, its deadline, and
the pods it may go to), whether or not there is room for it yet. A worker releases only while no other
worker's contender for the same pods ranks before its own and no other worker's release is still on its way
to a pod; and room freed in one worker wakes the others that hold requests (one datagram each, over the state
bus's sibling link), so that the first in rank takes it, not the first to hear of it.

Ranks: the higher band first, then the lesser service, then the earlier deadline, then the lower worker
index. A contender unrefreshed for ``STALE_S`` (a worker stalled) and a transit older than the controller's
transit limit are passed over. Contenders for other pods (another model) do not hold each other back.
Replicas do not take part: they share the service counters only.

Layout of the table file, one row of float64 words per worker::

    published_at    when the row was last written (time.monotonic: CLOCK_MONOTONIC, one clock per machine)
    held            requests the worker holds
    priority        its contender's band (-inf: no contender)
    service         its contender's flow's service
    deadline        its contender's give-up time
    pool            its contender's candidate pods (:func:`pool_key`)
    transit_since   when its last released request left its queue (0: none on its way)

Owner: each worker writes its own row only, through :class:`SharedReleaseOrder`, with the file's lock held
while it decides, so that two workers never both take the same room; the supervisor creates the table
and clears a dead worker's row. :class:`SoleRelease` stands for it where one worker holds everything.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import math
import mmap
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from gateway.background import Doorbell
from gateway.pods.registry import Pod

STALE_S = 0.5  # a worker holding requests refreshes its row every tick (50 ms)
_WORDS = 7
_PUBLISHED, _HELD, _PRIORITY, _SERVICE, _DEADLINE, _POOL, _TRANSIT = range(_WORDS)


class Contender(NamedTuple):
    """The request a worker would release next."""

    priority: int
    service: float  # its flow's weighted service so far
    deadline: float  # when it gives up (monotonic)
    pool: int  # the pods it may go to (:func:`pool_key`)


def pool_key(pods: Sequence[Pod]) -> int:
    """The same number in every worker for the same candidate pods (48 bits: exact as a float64)."""
    return _names_key(tuple(sorted(p.name for p in pods)))


@functools.lru_cache(maxsize=1024)
def _names_key(names: tuple[str, ...]) -> int:
    return int.from_bytes(hashlib.blake2b("\0".join(names).encode(), digest_size=6).digest(), "little")


class ReleaseOrder(Protocol):
    def claim(self, contender: Contender | None, room: bool, held: int, now: float, transit_limit_s: float
              ) -> bool:
        """Publish this worker's ``contender`` (None: none) and the requests it holds; True when there is
        ``room`` for the contender and it goes first, now marked in transit."""
        ...

    def landed(self, held: int, now: float) -> None:
        """The released request was dispatched (or ended without): the others may release."""
        ...

    def holding(self, held: int, now: float) -> None:
        """The requests held changed without a release (one left or expired); 0 withdraws the contender."""
        ...

    def others_hold(self, now: float) -> bool:
        """Whether another worker holds requests (a new one must then queue behind them, not go on at once)."""
        ...

    def floor(self, priority: int, now: float) -> float | None:
        """The least service among the other workers' contenders in the band (None: none)."""
        ...

    def freed(self) -> None:
        """Room freed up on a pod: wake whoever waits for it."""
        ...


class SoleRelease:
    """One worker: its own order is the only one. Room freed rings its own doorbell."""

    def __init__(self, doorbell: Doorbell) -> None:
        self._doorbell = doorbell

    def claim(self, contender: Contender | None, room: bool, held: int, now: float, transit_limit_s: float
              ) -> bool:
        return room

    def landed(self, held: int, now: float) -> None:
        pass

    def holding(self, held: int, now: float) -> None:
        pass

    def others_hold(self, now: float) -> bool:
        return False

    def floor(self, priority: int, now: float) -> float | None:
        return None

    def freed(self) -> None:
        self._doorbell.ring()


class SharedReleaseOrder:
    """This worker's handle on the table of ``workers`` rows (``worker``: its index; -1: the supervisor's)."""

    def __init__(self, path: str, worker: int, workers: int, doorbell: Doorbell | None = None,
                 wake_others: Callable[[], None] = lambda: None) -> None:
        self.worker, self.workers = worker, workers
        self._doorbell = doorbell
        self._wake_others = wake_others  # one datagram to each sibling, which rings its doorbell
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, self.size(workers))
        self._rows = memoryview(self._map).cast("d")
        self._other_rows = [i * _WORDS for i in range(workers) if i != worker]  # where each other row begins

    @staticmethod
    def size(workers: int) -> int:
        return 8 * _WORDS * workers

    @classmethod
    def create(cls, path: str, workers: int) -> SharedReleaseOrder:
        with open(path, "wb") as f:
            f.truncate(cls.size(workers))
        return cls(path, -1, workers)

    def close(self) -> None:
        self._rows.release()
        self._map.close()
        os.close(self._fd)

    def clear_worker(self, worker: int) -> None:
        """A dead worker holds nothing and releases nothing."""
        base = worker * _WORDS
        self._rows[base:base + _WORDS] = memoryview(bytes(8 * _WORDS)).cast("d")

    # A worker's side

    def claim(self, contender: Contender | None, room: bool, held: int, now: float, transit_limit_s: float
              ) -> bool:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            first = room and contender is not None and self._goes_first(contender, now, transit_limit_s)
            self._write(contender, held, now, transit_since=now if first else 0.0)
            return first
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def landed(self, held: int, now: float) -> None:
        self._rows[self.worker * _WORDS + _TRANSIT] = 0.0
        self.holding(held, now)
        if self.others_hold(now):
            self._wake_others()  # one of theirs may rank first now

    def holding(self, held: int, now: float) -> None:
        rows, base = self._rows, self.worker * _WORDS
        if not held:
            rows[base + _PRIORITY] = -math.inf
        rows[base + _HELD] = float(held)
        rows[base + _PUBLISHED] = now

    def others_hold(self, now: float) -> bool:
        rows = self._rows
        return any(rows[base + _HELD] > 0 and self._fresh(base, now) for base in self._other_rows)

    def floor(self, priority: int, now: float) -> float | None:
        services = [self._rows[base + _SERVICE] for base in self._other_rows
                    if self._fresh(base, now) and self._rows[base + _PRIORITY] == priority]
        return min(services, default=None)

    def freed(self) -> None:
        if self._doorbell is not None:
            self._doorbell.ring()
        rows = self._rows
        if any(rows[base + _HELD] > 0 for base in self._other_rows):  # no clock read: this is the request path
            self._wake_others()

    # Reading the others

    def _goes_first(self, mine: Contender, now: float, transit_limit_s: float) -> bool:
        rows = self._rows
        for base in self._other_rows:
            transit = rows[base + _TRANSIT]
            if transit and now - transit < transit_limit_s:
                return False  # a release on its way: the room it takes is not counted yet
            if not self._fresh(base, now) or rows[base + _PRIORITY] == -math.inf or rows[base + _POOL] != mine.pool:
                continue
            theirs = (-rows[base + _PRIORITY], rows[base + _SERVICE], rows[base + _DEADLINE], base)
            if theirs < (-mine.priority, mine.service, mine.deadline, self.worker * _WORDS):
                return False
        return True

    def _fresh(self, base: int, now: float) -> bool:
        published = self._rows[base + _PUBLISHED]
        return published > 0 and now - published < STALE_S  # 0: never written, or cleared

    def _write(self, contender: Contender | None, held: int, now: float, transit_since: float) -> None:
        rows, base = self._rows, self.worker * _WORDS
        if contender is None:
            rows[base + _PRIORITY] = -math.inf
        else:
            rows[base + _PRIORITY] = float(contender.priority)
            rows[base + _SERVICE] = contender.service
            rows[base + _DEADLINE] = contender.deadline
            rows[base + _POOL] = float(contender.pool)
        rows[base + _HELD] = float(held)
        rows[base + _TRANSIT] = transit_since
        rows[base + _PUBLISHED] = now
