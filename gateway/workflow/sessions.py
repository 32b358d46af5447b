"""Session affinity: a session key maps to the pod that served it last.

Owner: the :class:`SessionAffinity` owns the map. Bounded: past ``max_sessions`` the least recently used
session with nothing in flight (by the in-flight ledger) is forgotten; one with a request running never is.
"""

from __future__ import annotations

from gateway.load.ledger import InFlightLedger
from gateway.lru import LruCache


class SessionAffinity:
    def __init__(self, ledger: InFlightLedger, max_sessions: int = 100_000) -> None:
        self._ledger = ledger
        self._pods: LruCache[str, str] = LruCache(max_sessions, keep=lambda key, pod: ledger.of_session(key) > 0)

    def pod_of(self, key: str) -> str | None:
        return self._pods.get(key)

    def started(self, key: str, pod: str) -> None:
        self._pods.put(key, pod)

    def forget_pod(self, pod: str) -> None:
        for key, held_by in list(self._pods.items()):
            if held_by == pod and not self._ledger.of_session(key):
                self._pods.pop(key)

    def __len__(self) -> int:
        return len(self._pods)
