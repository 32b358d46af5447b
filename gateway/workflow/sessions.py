"""Session affinity: a session key maps to the pod that served it last.

Owner: the :class:`SessionAffinity` owns the map. Bounded: past ``max_sessions`` the least recently used
session with nothing in flight is forgotten (an in-flight session never is).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Session:
    pod: str
    in_flight: int = 0


class SessionAffinity:
    def __init__(self, max_sessions: int = 100_000) -> None:
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}  # insertion order is recency

    def pod_of(self, key: str) -> str | None:
        session = self._sessions.get(key)
        return session.pod if session else None

    def started(self, key: str, pod: str) -> None:
        session = self._sessions.pop(key, None) or Session(pod)
        session.pod = pod
        session.in_flight += 1
        self._sessions[key] = session
        self._evict()

    def finished(self, key: str) -> None:
        session = self._sessions.get(key)
        if session:
            session.in_flight = max(0, session.in_flight - 1)

    def forget_pod(self, pod: str) -> None:
        for key in [k for k, s in self._sessions.items() if s.pod == pod and not s.in_flight]:
            del self._sessions[key]

    def _evict(self) -> None:
        if len(self._sessions) <= self.max_sessions:
            return
        for key in list(self._sessions):
            if len(self._sessions) <= self.max_sessions:
                return
            if not self._sessions[key].in_flight:
                del self._sessions[key]

    def __len__(self) -> int:
        return len(self._sessions)
