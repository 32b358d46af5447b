"""Session affinity: a session key maps to the pod that served it last.

Owner: the :class:`SessionAffinity` owns the map. Bounded: past ``max_sessions`` the least recently used
session with nothing in flight (by the in-flight ledger) is forgotten; one with a request running never is.
With several workers or replicas each keeps its own map, and they tell each other every pin (the sink it
is built with; it applies theirs in :meth:`SessionAffinity.apply_remote`): a session's next request sticks to the
same pod whichever process it reaches.
"""

from __future__ import annotations

from gateway.core.facts import Publish, SessionPinned, unshared
from gateway.load.ledger import InFlightLedger
from gateway.lru import LruCache


class SessionAffinity:
    def __init__(self, ledger: InFlightLedger, max_sessions: int = 100_000, publish: Publish = unshared) -> None:
        self._ledger = ledger
        self._pods: LruCache[str, str] = LruCache(max_sessions, keep=lambda key, pod: ledger.of_session(key) > 0)
        self._publish = publish

    def pod_of(self, key: str) -> str | None:
        return self._pods.get(key)

    def started(self, key: str, pod: str) -> None:
        if self._pods.get(key) != pod:
            self._publish(SessionPinned(key, pod))
        self._pods.put(key, pod)

    def apply_remote(self, origin: str, fact: SessionPinned) -> None:
        """Another worker or replica pinned the session."""
        self._pods.put(fact.key, fact.pod)

    def forget_pod(self, pod: str) -> None:
        for key, held_by in list(self._pods.items()):
            if held_by == pod and not self._ledger.of_session(key):
                self._pods.pop(key)

    def __len__(self) -> int:
        return len(self._pods)
