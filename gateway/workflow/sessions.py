"""Session affinity: a session key maps to the pod that served it last.

Owner: the :class:`SessionAffinity` owns the map. Bounded: past ``max_sessions`` the least recently used
session with nothing in flight (by the in-flight ledger) is forgotten; one with a request running never is.
With several workers or replicas each keeps its own map, and they tell each other every pin (the state
bus): a session's next request sticks to the same pod whichever process it reaches.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.cluster.facts import Fact, SessionPinned
from gateway.load.ledger import InFlightLedger
from gateway.lru import LruCache


class SessionAffinity:
    def __init__(self, ledger: InFlightLedger, max_sessions: int = 100_000) -> None:
        self._ledger = ledger
        self._pods: LruCache[str, str] = LruCache(max_sessions, keep=lambda key, pod: ledger.of_session(key) > 0)
        self.publish: Callable[[Fact], None] | None = None  # the state bus, when there is anyone to tell

    def pod_of(self, key: str) -> str | None:
        return self._pods.get(key)

    def started(self, key: str, pod: str) -> None:
        if self.publish is not None and self._pods.get(key) != pod:
            self.publish(SessionPinned(key, pod))
        self._pods.put(key, pod)

    def apply_pinned(self, origin: str, fact: SessionPinned) -> None:
        self._pods.put(fact.key, fact.pod)

    def forget_pod(self, pod: str) -> None:
        for key, held_by in list(self._pods.items()):
            if held_by == pod and not self._ledger.of_session(key):
                self._pods.pop(key)

    def __len__(self) -> int:
        return len(self._pods)
