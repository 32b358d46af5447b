"""The steps of API keys' limits and usage (:mod:`gateway.limits`).

- :class:`KeyLimitsStep`, admit: the request's key and tenant limits (:class:`~gateway.limits.enforcer.KeyLimits`),
  checked once per request (a fallback target is not charged again), before flow control, so that a key
  over its limit takes no place in the queue; complete: the charge corrected to the engine's usage;
- :class:`UsageAccounting`, complete: requests and tokens per key, tenant and public model
  (:class:`~gateway.limits.usage.UsageTally`).

Owner: :class:`KeyLimitsStep` owns what each request in flight was charged.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.limits.enforcer import Admission, KeyLimits, limited_name
from gateway.limits.usage import UsageTally
from gateway.proxy.outcome import Ending, RelayOutcome
from gateway.request.types import ClientRequest, CompletedRequest
from gateway.routing.policy import Policy, RoutingRequest

NO_KEY = "-"


class KeyLimitsStep:
    def __init__(self, limits: KeyLimits) -> None:
        self._limits = limits
        self._admitted: dict[ClientRequest, Admission] = {}

    def admit(self, request: ClientRequest, policy: Policy, routing: RoutingRequest) -> None:
        key = request.key
        if key is None or request in self._admitted:
            return
        parsed = request.parsed
        output = parsed.max_completion_tokens or parsed.max_tokens or routing.predicted_output_tokens
        admission = self._limits.admit(limited_name(key.config), request.prompt_tokens(routing), output)
        if admission is not None:
            self._admitted[request] = admission

    def completed(self, done: CompletedRequest) -> None:
        """However the request ended (answered, failed, its client gone): no longer in flight."""
        admission = self._admitted.pop(done.request, None)
        if admission is not None:
            self._limits.finish(admission, *served(done.outcome, admission.input_tokens))


def served(outcome: RelayOutcome | None, prompt: int) -> tuple[int, int]:
    """(input, output) tokens an answer used: the engine's usage; without one, the prompt and about a token
    per streamed event; nothing if no pod answered."""
    if outcome is None or outcome.ending is Ending.FAILED:
        return 0, 0
    usage = outcome.usage
    if usage is not None:
        return usage.prompt_tokens, usage.completion_tokens
    return prompt, max(0, outcome.streamed_events - 2)


class UsageAccounting:
    def __init__(self, tally: UsageTally, tenant_of: Callable[[str], str]) -> None:
        self._tally = tally
        self._tenant_of = tenant_of

    def completed(self, done: CompletedRequest) -> None:
        if done.last is None:  # refused before any pod: nothing used
            return
        key = done.request.key
        name = key.config.name if key is not None and key.config.name else NO_KEY
        outcome = done.outcome
        usage = outcome.usage if outcome is not None else None
        prompt = done.request.prompt_tokens(done.routing)
        input_tokens, output_tokens = served(outcome, prompt)
        cached = (usage.cached_tokens or 0) if usage is not None else 0
        self._tally.add(name, self._tenant_of(name) if name != NO_KEY else NO_KEY, done.model, input_tokens, cached,
                        output_tokens)
