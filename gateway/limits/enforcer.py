"""Whether an API key's request may start now, against its key's and its tenant's limits (``limits``).

A request is refused (429, with a Retry-After) when, for its key or its key's tenant:

- ``max_concurrent`` of its requests are already in flight;
- the sliding minute's requests reached ``requests_per_minute`` (a key's own ``auth.keys[].requests_per_minute``
  is its key scope's, unless ``limits.keys`` gives one; a window with nothing in it takes one request);
- the sliding minute's (or day's) input tokens plus its prompt would pass the limit (a window with nothing in
  it takes one request of any size: a prompt larger than the limit is not refused for ever);
- the sliding minute's (or day's) output tokens already reached the limit.

An admitted request is charged its prompt and its ``max_tokens`` (what it may generate) at once, so that a
burst cannot pass the limit while its answers run; when it ends, the charge is corrected to the engine's
own usage (nothing, if no pod answered it). Limits are held across workers and replicas
(:mod:`gateway.limits.shared`); while this replica cannot hear the others, it enforces its share of each.
A request is in flight from its admission until it ends, however it ends (answered, failed, its client
gone: the request's completion, which always runs); in a process that dies, until the others stop hearing
from it (``shared_state.peer_timeout_s``: a lease).

Owner: :class:`KeyLimits` owns the limits in force (replaced on reload); the use is :class:`SharedUsage`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import msgspec

from gateway.config import ApiKeyConfig, LimitsConfig, UsageLimits
from gateway.core.errors import ErrorKind, GatewayError
from gateway.limits.shared import DAY_S, MINUTE_S, SharedUsage, Used


@dataclass(slots=True)
class Admission:
    """What an admitted request was charged, and to which scopes."""

    scopes: tuple[str, ...]
    input_tokens: int
    output_tokens: int
    minute: int  # the wall-clock minute it was charged in


def limited_name(key: ApiKeyConfig) -> str:
    """The name a key's limits and usage are kept under: its ``name``, or (a key without one) ``#`` and the
    start of its digest, the same in every process of every replica."""
    return key.name or f"#{key.hash[:12]}"


def key_rates(keys: Iterable[ApiKeyConfig]) -> dict[str, float]:
    """Each key's own request rate (``auth.keys[].requests_per_minute``), by its limited name."""
    return {limited_name(k): k.requests_per_minute for k in keys if k.requests_per_minute}


class KeyLimits:
    def __init__(self, config: LimitsConfig, usage: SharedUsage, tenant_of: Callable[[str], str],
                 key_rates: Mapping[str, float] | None = None) -> None:
        self.usage = usage
        self._tenant_of = tenant_of
        # Each key's own request rate (``auth.keys[].requests_per_minute``, by limited name): its key scope's
        # requests_per_minute where ``limits.keys`` gives none.
        self._key_rates = dict(key_rates or {})
        self.reconfigure(config)

    def reconfigure(self, config: LimitsConfig) -> None:
        """A reloaded config: from the next request on (those in flight end against the scopes they began in)."""
        self.config = config
        keys = dict(config.keys)
        for key, rate in self._key_rates.items():
            limits = keys.get(key)
            if limits is None or limits.requests_per_minute is None:
                keys[key] = msgspec.structs.replace(limits or UsageLimits(), requests_per_minute=rate)
        self._keys = keys

    def limited_scopes(self) -> list[str]:
        return [*(f"key:{k}" for k in self._keys), *(f"tenant:{t}" for t in self.config.tenants)]

    def scopes(self, key: str) -> list[tuple[str, UsageLimits, str]]:
        """The limited scopes of the key named ``key``: (scope, its limits, who it is in a message)."""
        out = []
        if (limits := self._keys.get(key)) is not None:
            out.append((f"key:{key}", limits, "this API key"))
        tenant = self._tenant_of(key)
        if (limits := self.config.tenants.get(tenant)) is not None:
            out.append((f"tenant:{tenant}", limits, f"tenant {tenant}"))
        return out

    def counts_input(self, key: str) -> bool:
        """Whether the input tokens of the key named ``key`` are limited (its prompts are counted exactly)."""
        return bool(key) and any(limits.input_tokens_per_minute is not None or limits.input_tokens_per_day is not None
                                 for _, limits, _ in self.scopes(key))

    def admit(self, key: str, input_tokens: int, output_tokens: int) -> Admission | None:
        """Charge the request to its scopes, or raise the 429 of the first limit it would pass (None: the key
        has no limits)."""
        scopes = self.scopes(key)
        if not scopes:
            return None
        share = self.usage.share()
        for scope, limits, who in scopes:
            _check(self.usage.used(scope), limits, share, input_tokens, who)
        minute = self.usage.minute()
        for scope, _, _ in scopes:
            self.usage.began(scope)
            self.usage.charge(scope, input_tokens, output_tokens, minute, requests=1)
        return Admission(tuple(s for s, _, _ in scopes), input_tokens, output_tokens, minute)

    def finish(self, admission: Admission, input_tokens: int, output_tokens: int) -> None:
        """The request ended having used this much (the engine's usage): the charge corrected to it. One made
        in an earlier minute is taken back from that minute, and the use charged now: a correction booked in
        the next minute (or day) would be a negative use there while the earlier one slides out."""
        minute = self.usage.minute()
        for scope in admission.scopes:
            self.usage.ended(scope)
            if admission.minute == minute:
                self.usage.charge(scope, input_tokens - admission.input_tokens,
                                  output_tokens - admission.output_tokens, minute)
            else:
                self.usage.charge(scope, -admission.input_tokens, -admission.output_tokens, admission.minute)
                self.usage.charge(scope, input_tokens, output_tokens, minute)


def _check(used: Used, limits: UsageLimits, share: float, prompt: int, who: str) -> None:
    if limits.max_concurrent is not None:
        allowed = max(1, math.floor(limits.max_concurrent * share))
        # Of this process's requests begun lately, only those still in flight here can be in flight unknown to
        # the others: one that ended is no longer anyone's (counting it refused a client sending one at a time).
        unconfirmed = min(used.unconfirmed_requests, used.own_in_flight)
        if used.in_flight >= allowed or _past_its_part(used.in_flight, unconfirmed, 1, allowed, used):
            raise GatewayError(ErrorKind.RATE_LIMITED, f"Concurrency limit reached for {who}: "
                               f"{limits.max_concurrent} requests at once.", code="concurrency_limit_exceeded",
                               retry_after_s=1)
    for window in _windows(used, limits, prompt):
        if window.limit is None:
            continue
        allowed = window.limit * share
        over = window.used + window.need - allowed if window.need else window.used - allowed + 1
        if window.used > 0 and over > 0:
            retry = _seconds_to_shed(over, window.used, window.before, window.into, window.span_s)
            raise _over(who, window, f"; retry after {retry} s", retry)
        if _past_its_part(window.used, window.unconfirmed, window.need, allowed, used):
            raise _over(who, window, "", 1)


@dataclass(frozen=True, slots=True)
class _Window:
    """One sliding-window limit as a request meets it: its use so far, and what the request would add."""

    limit: float | None
    used: float
    unconfirmed: float
    need: int  # what the request adds: 1 request, its prompt's tokens, or 0 (output is charged as it comes)
    what: str  # the limit's name, as the 429 says it
    tokens: bool  # a limit on tokens (else on requests): the 429's code
    span_s: float
    before: float  # the previous window's use, sliding out
    into: float  # how far into the current window


def _windows(used: Used, limits: UsageLimits, prompt: int) -> tuple[_Window, ...]:
    return (
        _Window(limits.requests_per_minute, used.requests_minute, used.unconfirmed_requests, 1,
                "requests per minute", False, MINUTE_S, used.minute_before[2], used.into_minute),
        _Window(limits.input_tokens_per_minute, used.input_minute, used.unconfirmed_input, prompt,
                "input tokens per minute", True, MINUTE_S, used.minute_before[0], used.into_minute),
        _Window(limits.input_tokens_per_day, used.input_day, used.unconfirmed_input, prompt,
                "input tokens per day", True, DAY_S, used.day_before[0], used.into_day),
        _Window(limits.output_tokens_per_minute, used.output_minute, used.unconfirmed_output, 0,
                "output tokens per minute", True, MINUTE_S, used.minute_before[1], used.into_minute),
        _Window(limits.output_tokens_per_day, used.output_day, used.unconfirmed_output, 0,
                "output tokens per day", True, DAY_S, used.day_before[1], used.into_day),
    )


def _over(who: str, window: _Window, retry_text: str, retry_s: int) -> GatewayError:
    """The 429 of a limit reached (``rate_limit_exceeded`` for requests, ``token_limit_exceeded`` for tokens);
    nearly reached when the retry is not said (this process's part of what is left is taken)."""
    kind, code = ("Token", "token_limit_exceeded") if window.tokens else ("Rate", "rate_limit_exceeded")
    nearly = "" if retry_text else "nearly "
    limit = window.limit or 0.0
    amount = int(limit) if limit == int(limit) else limit
    return GatewayError(ErrorKind.RATE_LIMITED,
                        f"{kind} limit {nearly}reached for {who}: {amount} {window.what}{retry_text}.",
                        code=code, retry_after_s=retry_s)


def _seconds_to_shed(over: float, window_used: float, before: float, into: float, span_s: float) -> int:
    """How long until the sliding window's use has fallen by ``over``: the previous window's part still inside
    slides out by the current one's end, at its own pace; the current one's only after that, at its own (all
    of it: a request larger than the limit waits for an empty window)."""
    leaving = before * (1 - into)
    if over <= leaving:
        wait = span_s * over / before
    else:
        current = window_used - leaving
        wait = span_s * (1 - into) + (span_s * min(1.0, (over - leaving) / current) if current > 0 else 0.0)
    return max(1, math.ceil(wait))


def _past_its_part(window_used: float, unconfirmed: float, need: float, allowed: float, used: Used) -> bool:
    """Whether this process would have more than its part of what is left under the limit unconfirmed: what
    the others may not know yet. Each of the processes that share the limit takes at most its part, so that
    together they cannot pass it before they hear of each other. A process with nothing unconfirmed may
    always take one more (no one waits for room that never comes)."""
    if unconfirmed <= 0 or used.processes <= 1:
        return False
    left = allowed - (window_used - unconfirmed)
    return unconfirmed + need > left / used.processes
