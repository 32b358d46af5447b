"""The load table the workers of one gateway share: requests and pending load per pod, one cell per worker.

Owner: each worker owns its own cell of every row and is the only one to write it (the in-flight ledger
writes it as it dispatches and finishes); readers sum a row's cells. No lock is taken on the request
path: a cell is one aligned 8-byte word, which a reader sees either before or after a write, never half
of it. A lock (``flock`` on the table's file) is taken only to give a pod its row, once per pod per
worker, and by the supervisor when it clears a dead worker's cells.

Layout of the file (``slots`` rows, ``workers`` cells per row; row-major, so summing a row reads one
contiguous run)::

    keys        slots x uint64            pod key hash; 0 = free row
    users       slots x workers x uint8   1 where that worker reads or writes the row
    in_flight   slots x workers x int64   requests the worker has in flight on the pod
    consumption slots x workers x float64 their pending load
    embedding   slots x workers x float64 the embedding requests' part of it
    prefill     slots x workers x int64   prompt tokens of its requests the pod has not begun answering
    progress    slots x workers x float64 when it last saw the pod make prefill progress (monotonic: one clock
                                          per machine): an answer of its began, or the pod's backlog began
    progressed  slots x workers x int64   the pod's backlog (every worker's) right after that
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("gateway.load.shared")

DEFAULT_SLOTS = 1024


def _align(n: int) -> int:
    return (n + 7) & ~7


def pod_key(pod: str) -> int:
    return int.from_bytes(hashlib.blake2b(pod.encode(), digest_size=8).digest(), "little") | 1


class SharedLoadTable:
    """One worker's handle on the table (``worker`` is its index; the supervisor uses -1)."""

    def __init__(self, path: str, worker: int, workers: int, slots: int = DEFAULT_SLOTS,
                 retry_full_s: float = 5.0) -> None:
        self.path, self.worker, self.workers, self.slots = path, worker, workers, slots
        self.retry_full_s = retry_full_s
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, self.size(workers, slots))
        cells = slots * workers
        users_at = 8 * slots
        counts_at = _align(users_at + cells)
        self._keys = memoryview(self._map)[:users_at].cast("Q")
        self._users = memoryview(self._map)[users_at:users_at + cells]
        self._in_flight = memoryview(self._map)[counts_at:counts_at + 8 * cells].cast("q")
        self._consumption = memoryview(self._map)[counts_at + 8 * cells:counts_at + 16 * cells].cast("d")
        self._embedding = memoryview(self._map)[counts_at + 16 * cells:counts_at + 24 * cells].cast("d")
        self._prefill = memoryview(self._map)[counts_at + 24 * cells:counts_at + 32 * cells].cast("q")
        self._progress = memoryview(self._map)[counts_at + 32 * cells:counts_at + 40 * cells].cast("d")
        self._progressed = memoryview(self._map)[counts_at + 40 * cells:counts_at + 48 * cells].cast("q")
        self._rows: dict[str, int] = {}
        self._unplaced: dict[str, float] = {}  # pods that found the table full → when to try again
        self._full_warned = False

    @staticmethod
    def size(workers: int, slots: int) -> int:
        cells = slots * workers
        return _align(8 * slots + cells) + 48 * cells

    @classmethod
    def create(cls, path: str, workers: int, slots: int = DEFAULT_SLOTS) -> SharedLoadTable:
        with open(path, "wb") as f:
            f.truncate(cls.size(workers, slots))
        return cls(path, -1, workers, slots)

    def close(self) -> None:
        for view in (self._keys, self._users, self._in_flight, self._consumption, self._embedding, self._prefill,
                     self._progress, self._progressed):
            view.release()
        self._map.close()
        os.close(self._fd)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _row(self, pod: str) -> int:
        """The pod's row, found or claimed (-1: the table is full; this worker then counts alone)."""
        row = self._rows.get(pod)
        if row is not None:
            return row
        now = time.monotonic()
        if self._unplaced.get(pod, 0.0) > now:
            return -1
        row = self._claim(pod_key(pod))
        if row >= 0:
            self._rows[pod] = row
            self._unplaced.pop(pod, None)
            return row
        self._unplaced[pod] = now + self.retry_full_s
        if not self._full_warned:
            self._full_warned = True
            log.warning("shared load table full (%d pods): new pods' load is not shared between workers",
                        self.slots)
        return -1

    def _claim(self, key: int) -> int:
        w, n = self.worker, self.workers
        with self._locked():
            keys = self._keys
            row = next((i for i in range(self.slots) if keys[i] == key), -1)
            if row < 0:
                row = next((i for i in range(self.slots) if not any(self._users[i * n:(i + 1) * n])), -1)
                if row < 0:
                    return -1
                keys[row] = key
                for cell in range(row * n, (row + 1) * n):
                    self._zero(cell)
            self._users[row * n + w] = 1
        return row

    # This worker's cells (the ledger writes them)

    def write(self, pod: str, in_flight: int, consumption: float, embedding: float, prefill: int = 0) -> None:
        row = self._row(pod)
        if row >= 0:
            cell = row * self.workers + self.worker
            self._in_flight[cell], self._consumption[cell], self._embedding[cell] = in_flight, consumption, embedding
            self._prefill[cell] = prefill

    def write_progress(self, pod: str, at: float, backlog: int) -> None:
        row = self._row(pod)
        if row >= 0:
            cell = row * self.workers + self.worker
            self._progressed[cell] = backlog
            self._progress[cell] = at

    def _zero(self, cell: int) -> None:
        self._in_flight[cell], self._consumption[cell], self._embedding[cell], self._prefill[cell] = 0, 0.0, 0.0, 0
        self._progress[cell], self._progressed[cell] = 0.0, 0

    def release(self, pod: str) -> None:
        """This worker forgets the pod: its cells go to zero and the row is free once nobody uses it."""
        self._unplaced.pop(pod, None)
        row = self._rows.pop(pod, -1)
        if row >= 0:
            cell = row * self.workers + self.worker
            with self._locked():
                self._zero(cell)
                self._users[cell] = 0

    def clear_worker(self, worker: int) -> None:
        """The supervisor, after ``worker`` died: nothing it counted is in flight any more."""
        n = self.workers
        with self._locked():
            for row in range(self.slots):
                cell = row * n + worker
                self._zero(cell)
                self._users[cell] = 0

    # Reads: every worker's cells summed

    def in_flight(self, pod: str) -> int | None:
        return self._sum(self._in_flight, pod)

    def consumption(self, pod: str) -> float | None:
        return self._sum(self._consumption, pod)

    def embedding(self, pod: str) -> float | None:
        return self._sum(self._embedding, pod)

    def prefill(self, pod: str) -> int | None:
        return self._sum(self._prefill, pod)

    def progress(self, pod: str) -> tuple[float, int] | None:
        """The pod's latest prefill progress any worker saw: (when, the backlog right after); None: no row."""
        row = self._row(pod)
        if row < 0:
            return None
        cells = range(row * self.workers, (row + 1) * self.workers)
        latest = max(cells, key=self._progress.__getitem__)
        return self._progress[latest], self._progressed[latest]

    def _sum(self, cells: memoryview, pod: str) -> Any:
        """The pod's row of ``cells`` summed (None: the pod has no row)."""
        row = self._row(pod)
        return sum(cells[row * self.workers:(row + 1) * self.workers]) if row >= 0 else None

    def debug(self, pods: list[str]) -> dict[str, Any]:
        """Per pod, each worker's cells (for ``/debug/workers``)."""
        n = self.workers
        out: dict[str, Any] = {}
        for pod in pods:
            row = self._row(pod)
            if row >= 0:
                cells = range(row * n, (row + 1) * n)
                out[pod] = {"in_flight": [self._in_flight[c] for c in cells],
                            "consumption": [round(self._consumption[c], 4) for c in cells],
                            "prefill_tokens": [self._prefill[c] for c in cells]}
        return out
