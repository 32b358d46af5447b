"""What every key and tenant (a *scope*: ``key:<name>``, ``tenant:<id>``) used, summed over every worker
and replica: tokens and requests per wall-clock minute and day, and requests in flight.

Each process counts its own and tells the others (:class:`~gateway.core.facts.UsageCharged` and
:class:`~gateway.core.facts.ScopeRequests` as they happen, a snapshot of its own counts every heartbeat,
which repairs what a lost batch left wrong); it keeps the others' per origin. Minutes and days are the
wall clock's, the same in every process, so one process's minute is everyone's.

A window's use is *sliding*: the current minute's tokens plus the previous minute's, weighted by the part of
it still inside the last 60 seconds (the same for days). Any 60 seconds then hold about the limit, not twice
it across a boundary.

What a process charged lately the others may not know yet (a batch and a hop later); it says so
(:attr:`Used.unconfirmed_input` ...), and the enforcer lets each of the processes it hears from have at most
its part of what is left unconfirmed at once, so that together they do not pass a limit they each still see
room under. *Lately* is ``confirm_s``, or twice the longest a charge of theirs took to reach it in the last
few seconds if that is more (the same link carries charges both ways): on a loaded host or a slow link a
charge stays unconfirmed for as long as the others take to hear of it (4 gateways on 2 starved cores passed
a limit by 14% with a fixed 50 ms).

Partition: while the link to the other replicas is down (Redis, when configured), their counts stop moving
and their requests are unseen; each replica then counts only its own workers' use against its *share* of
each limit, one over the replicas it last saw. Its workers still share through their own link.

Owner: :class:`SharedUsage` owns its own counts and its copy of every other process's.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.core.facts import Publish, ScopeRequests, UsageCharged, UsageSnapshot, unshared

MINUTE_S = 60.0
DAY_S = 86_400.0
MINUTES_A_DAY = 1440
# A replica not heard from for this long (while the link works) no longer counts as one the limits are shared by.
REPLICA_GONE_S = 60.0
# How long the others took to hear of a charge is taken over the last LAG_WINDOW_S; a charge counts as
# unconfirmed for at most MAX_CONFIRM_S (a clock skewed between hosts must not hold a limit back for long).
LAG_WINDOW_S = 5.0
MAX_CONFIRM_S = 2.0
# A request begun counts as unconfirmed for at least this long: a burst's first facts can take longer to
# arrive than any lag seen before it (4 gateways on one loaded event loop heard of each other's requests
# 115 ms late, and ran 7 of a key's ``max_concurrent: 4`` at once with 50 ms).
MIN_REQUEST_CONFIRM_S = 0.25


@dataclass(slots=True)
class _Counts:
    """One process's use: per scope, tokens (input, output) and requests begun per minute and per day (the
    last two of each), and requests in flight."""

    minutes: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    days: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    in_flight: Counter[str] = field(default_factory=Counter)

    def add(self, scope: str, minute: int, input_tokens: int, output_tokens: int, requests: int = 0) -> None:
        for windows, index in ((self.minutes, minute), (self.days, minute // MINUTES_A_DAY)):
            per = windows.setdefault(scope, {})
            counts = per.get(index)
            if counts is None:
                counts = per[index] = [0, 0, 0]
                for old in [i for i in per if i < index - 1]:
                    del per[old]
            counts[0] += input_tokens
            counts[1] += output_tokens
            counts[2] += requests


class _Recent:
    """One scope's charges of late, oldest first, and their running totals."""

    __slots__ = ("charges", "totals")

    def __init__(self) -> None:
        self.charges: deque[tuple[float, int, int, int]] = deque()
        self.totals = [0, 0, 0]  # input, output, requests

    def add(self, at: float, input_tokens: int, output_tokens: int, requests: int) -> None:
        self.charges.append((at, input_tokens, output_tokens, requests))
        totals = self.totals
        totals[0] += input_tokens
        totals[1] += output_tokens
        totals[2] += requests

    def since(self, when: float) -> tuple[int, int, int]:
        """The totals of the charges made at ``when`` or later (older ones forgotten)."""
        charges, totals = self.charges, self.totals
        while charges and charges[0][0] < when:
            _, input_tokens, output_tokens, requests = charges.popleft()
            totals[0] -= input_tokens
            totals[1] -= output_tokens
            totals[2] -= requests
        return totals[0], totals[1], totals[2]


@dataclass(frozen=True, slots=True)
class Used:
    """A scope's use over the sliding minute and day, in tokens and requests begun, and its requests in
    flight (``own_in_flight`` of them this process's); of them, what this process added in the last
    ``confirm_s`` (the others may not know it yet), and how many processes share the scope's limits."""

    input_minute: float = 0.0
    output_minute: float = 0.0
    input_day: float = 0.0
    output_day: float = 0.0
    in_flight: int = 0
    requests_minute: float = 0.0
    own_in_flight: int = 0
    unconfirmed_input: int = 0
    unconfirmed_output: int = 0
    unconfirmed_requests: int = 0
    processes: int = 1
    # How far into the current minute and day the clock is (0 to 1), and the previous minute's and day's
    # whole use (input, output, requests): what slides out by the current one's end.
    into_minute: float = 0.0
    into_day: float = 0.0
    minute_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    day_before: tuple[float, float, float] = (0.0, 0.0, 0.0)


class SharedUsage:
    def __init__(self, origin: str, publish: Publish = unshared, partitioned: Callable[[], bool] = lambda: False,
                 confirm_s: float = 0.05, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 stalled: Callable[[float], float] = lambda within_s: 0.0) -> None:
        self._origin = origin
        self._replica = origin.split("/", 1)[0]
        self._publish = publish
        self._partitioned = partitioned
        self._confirm_s = confirm_s
        self._clock = clock
        self._monotonic = monotonic
        # The longest this process's event loop stood still within the last given seconds (one under way
        # included): nothing here, nor in a process paused with it, heard anything meanwhile.
        self._stalled = stalled
        self._own = _Counts()
        self._remote: dict[str, _Counts] = {}
        # Per scope, this process's charges within the confirmation window: what the others may not know yet.
        self._recent: dict[str, _Recent] = {}
        self._recent_requests: dict[str, _Recent] = {}  # the same, of requests begun (a longer window)
        self._origins_seen: dict[str, float] = {}  # other process → when last heard from (monotonic)
        # How late the others' charges arrived of late, (when heard (monotonic), how late): a sliding maximum.
        self._lags: deque[tuple[float, float]] = deque()
        self._replicas = 1  # the replicas the limits were last shared by (while the link worked)

    # This process's use

    def minute(self) -> int:
        """The wall clock's minute now (its index since the epoch)."""
        return int(self._clock() // MINUTE_S)

    def charge(self, scope: str, input_tokens: int, output_tokens: int, minute: int | None = None,
               requests: int = 0) -> None:
        """Tokens used by ``scope`` now, or booked to an earlier ``minute`` (a correction may be negative), and
        requests begun (counted against requests per minute)."""
        if input_tokens or output_tokens or requests:
            minute = self.minute() if minute is None else minute
            self._own.add(scope, minute, input_tokens, output_tokens, requests)
            self._publish(UsageCharged(scope, minute, input_tokens, output_tokens, self._clock(), requests))
            if input_tokens > 0 or output_tokens > 0 or requests > 0:
                self._unconfirmed(scope, max(0, input_tokens), max(0, output_tokens), max(0, requests))

    def began(self, scope: str) -> None:
        """A request of ``scope`` is in flight here until :meth:`ended` (or until this process is no longer
        heard from: the others then forget it, :meth:`forget_origin`)."""
        self._own.in_flight[scope] += 1
        self._publish(ScopeRequests(scope, 1))

    def _unconfirmed(self, scope: str, input_tokens: int, output_tokens: int, requests: int) -> None:
        for recents, charged in ((self._recent, input_tokens or output_tokens), (self._recent_requests, requests)):
            if charged:
                recent = recents.get(scope)
                if recent is None:
                    recent = recents[scope] = _Recent()
                recent.add(self._monotonic(), input_tokens, output_tokens, requests)

    def ended(self, scope: str) -> None:
        self._own.in_flight[scope] -= 1
        if self._own.in_flight[scope] <= 0:
            del self._own.in_flight[scope]
        self._publish(ScopeRequests(scope, -1))

    # The others'

    def apply_remote(self, origin: str, fact: UsageCharged | ScopeRequests | UsageSnapshot) -> None:
        self._origins_seen[origin] = self._monotonic()
        if isinstance(fact, UsageSnapshot):
            counts = self._remote[origin] = _Counts()
            requests = fact.requests if len(fact.requests) == len(fact.minutes) else [0] * len(fact.minutes)
            for (scope, minute, input_tokens, output_tokens), begun in zip(fact.minutes, requests, strict=True):
                counts.minutes.setdefault(scope, {})[minute] = [input_tokens, output_tokens, begun]
            for scope, day, input_tokens, output_tokens in fact.days:
                counts.days.setdefault(scope, {})[day] = [input_tokens, output_tokens, 0]
            counts.in_flight.update(dict(zip(fact.scopes, fact.in_flight, strict=True)))
            return
        counts = self._remote.setdefault(origin, _Counts())
        if isinstance(fact, UsageCharged):
            counts.add(fact.scope, fact.minute, fact.input_tokens, fact.output_tokens, fact.requests)
            if fact.sent:
                self._heard_late(max(0.0, self._clock() - fact.sent))
        else:
            counts.in_flight[fact.scope] += fact.delta

    def snapshot(self) -> UsageSnapshot:
        own = self._own
        minutes = [(scope, index, t) for scope, per in own.minutes.items() for index, t in per.items()]
        return UsageSnapshot(
            [(scope, index, t[0], t[1]) for scope, index, t in minutes],
            [(scope, index, t[0], t[1]) for scope, per in own.days.items() for index, t in per.items()],
            list(own.in_flight), list(own.in_flight.values()), [t[2] for _, _, t in minutes])

    def forget_origin(self, origin: str) -> None:
        """A process gone silent: its requests are no longer in flight (the tokens it served stay counted)."""
        counts = self._remote.get(origin)
        if counts is not None:
            counts.in_flight.clear()

    # Reads

    def share(self) -> float:
        """Of each limit, the part this replica enforces: all of it while it hears the others, else one over
        the replicas it last heard."""
        if not self._partitioned():
            self._replicas = 1 + len({o.split("/", 1)[0] for o in self._heard(REPLICA_GONE_S)} - {self._replica})
            return 1.0
        return 1.0 / self._replicas

    def _heard(self, within_s: float) -> list[str]:
        now = self._monotonic()
        return [o for o, seen in self._origins_seen.items() if now - seen < within_s]

    def used(self, scope: str) -> Used:
        """``scope``'s use over the sliding minute and day, and its requests in flight, over every process
        (while partitioned: this replica's)."""
        now = self._clock()
        minute, day = int(now // MINUTE_S), int(now // DAY_S)
        into_minute, into_day = (now % MINUTE_S) / MINUTE_S, (now % DAY_S) / DAY_S
        partitioned = self._partitioned()
        in_minute, in_day = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
        minute_before, day_before = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
        in_flight = 0
        for origin, counts in [("", self._own), *self._remote.items()]:
            if partitioned and origin and origin.split("/", 1)[0] != self._replica:
                continue
            _slide(counts.minutes.get(scope), minute, into_minute, in_minute, minute_before)
            _slide(counts.days.get(scope), day, into_day, in_day, day_before)
            # A process's count below zero is an end whose start was forgotten (it was silent a while): none.
            in_flight += max(0, counts.in_flight.get(scope, 0))
        unconfirmed = self._recent_of(scope)
        heard = self._heard(REPLICA_GONE_S)
        processes = 1 + sum(1 for o in heard if not partitioned or o.split("/", 1)[0] == self._replica)
        return Used(in_minute[0], in_minute[1], in_day[0], in_day[1], max(0, in_flight), in_minute[2],
                    self._own.in_flight.get(scope, 0), *unconfirmed, processes, into_minute, into_day,
                    (minute_before[0], minute_before[1], minute_before[2]),
                    (day_before[0], day_before[1], day_before[2]))

    def _heard_late(self, lag_s: float) -> None:
        lags = self._lags  # the longest first: each entry is longer than every one heard after it
        while lags and lags[-1][1] <= lag_s:
            lags.pop()  # never the longest again while this later one is in the window
        lags.append((self._monotonic(), lag_s))

    def confirm_window_s(self) -> float:
        """How long this process's charges count as unconfirmed: ``confirm_s``, or twice the longest the others'
        charges took to arrive of late if that is more; and longer by a stall of this loop within that window.
        A stall is time no one heard anything: when the machine pauses, every process wakes at once with
        requests waiting, and charges made before it are not yet known to the others however old they are
        (4 gateways beside a CPU hog each stood still 1.5 s and ran 7 of a key's ``max_concurrent: 4``)."""
        lags, now = self._lags, self._monotonic()
        while lags and lags[0][0] < now - LAG_WINDOW_S:
            lags.popleft()
        longest = lags[0][1] if lags else 0.0
        window = min(MAX_CONFIRM_S, max(self._confirm_s, 2 * longest))
        return window + self._stalled(window)

    def _recent_of(self, scope: str) -> tuple[int, int, int]:
        """This process's tokens (input, output) and requests charged to ``scope`` that the others may not
        know of yet."""
        now, window = self._monotonic(), self.confirm_window_s()
        recent, requests = self._recent.get(scope), self._recent_requests.get(scope)
        input_tokens, output_tokens, _ = recent.since(now - window) if recent is not None else (0, 0, 0)
        request_window = max(window, MIN_REQUEST_CONFIRM_S + self._stalled(MIN_REQUEST_CONFIRM_S))
        begun = requests.since(now - request_window)[2] if requests is not None else 0
        return input_tokens, output_tokens, begun

    def debug(self, scope: str) -> dict[str, float]:
        used = self.used(scope)
        return {"input_tokens_minute": round(used.input_minute), "output_tokens_minute": round(used.output_minute),
                "input_tokens_day": round(used.input_day), "output_tokens_day": round(used.output_day),
                "requests_minute": round(used.requests_minute, 1), "in_flight": used.in_flight}


def _slide(per: dict[int, list[int]] | None, current: int, into: float, out: list[float],
           before: list[float]) -> None:
    """Add a window's sliding use to ``out``: all of the current one, the previous one's part still inside;
    and the previous one's whole to ``before``."""
    if not per:
        return
    for index, weight in ((current, 1.0), (current - 1, 1.0 - into)):
        counts = per.get(index)
        if counts is not None:
            for i, count in enumerate(counts):
                out[i] += count * weight
    if (counts := per.get(current - 1)) is not None:
        for i, count in enumerate(counts):
            before[i] += count

