"""A context of the resumable working set (what one client keeps coming back with), what contexts have
shown so far of their think times, growth and stages (the working set's forecast of each one's return), and
the anonymous conversations recognised by their prompts.

Owner: the :class:`~gateway.kv.working_set.ResumableWorkingSet` makes and changes every context, its
forecast and the conversations; keep-warm and placement read them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from gateway.config import PlacementConfig
from gateway.kv.hashing import leading_run


class RunningMean:
    """An exponentially weighted mean that is ``None`` until it has seen a value."""

    __slots__ = ("_alpha", "value")

    def __init__(self, alpha: float) -> None:
        self.value: float | None = None
        self._alpha = alpha

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self._alpha * (x - self.value)

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


@dataclass(eq=False, slots=True)
class Context:
    key: str
    pod: str
    block_size: int
    hashes: list[int]  # the full blocks of its last prompt, as the prefix index hashes them on ``pod``
    prompt_tokens: int
    keyed: bool  # named by the client (workflow, session), not recognised by its prefix
    think: RunningMean
    growth: RunningMean  # prompt tokens added per stage
    stages: int = 1
    last_finish: float | None = None
    # Infinite while its requests run (or until their end is heard of); then the end of its think window.
    protected_until: float = math.inf
    expected_growth: float = 0.0  # tokens it is still expected to add (counted in its pod's demand)
    version: int = 0  # bumped whenever ``protected_until`` changes, so stale heap entries are skipped
    # How long its client declared it will reuse its prompt after each request (gateway.core.retention).
    retention_s: float | None = None

    @property
    def thinking(self) -> bool:
        """Between requests: its last one ended and its think window runs."""
        return self.protected_until != math.inf

    def retained(self, now: float) -> bool:
        """Within the retention its client declared: in use, or since its last request for the TTL."""
        if self.retention_s is None:
            return False
        return not self.thinking or (self.last_finish is not None and now < self.last_finish + self.retention_s)


def shared_blocks(old: list[int], new: list[int]) -> int:
    """How many leading blocks two prompts share. Block hashes are chained (each covers its parent), so
    equal hashes at one position mean equal prefixes up to it."""
    return leading_run(lambda i: old[i] == new[i], min(len(old), len(new)))


def exclusive_blocks(hashes: list[int], refs: dict[int, int]) -> int:
    """How many of a placed context's blocks no other context on its pod holds. Another context holding
    block ``i`` holds every block before it (hashes are chained), so the counts never rise along the
    prompt: the exclusive blocks are a tail."""
    return len(hashes) - leading_run(lambda i: refs.get(hashes[i], 0) > 1, len(hashes))


class ContextForecast:
    """What contexts have shown so far, per context and over all: the think time between their requests,
    the prompt tokens each stage adds, how many stages a completed workflow had. Owned by the working set."""

    # How slowly the share of thinking contexts that come back moves (a rate, not one context's habit).
    RETURN_SMOOTHING = 0.05

    def __init__(self, config: PlacementConfig) -> None:
        self.config = config
        self.think = RunningMean(config.smoothing)
        self.growth = RunningMean(config.smoothing)  # keyed contexts only
        self.stages = RunningMean(config.smoothing)
        # Of the contexts that stopped to think, the share that came back (1) rather than completed or
        # lapsed (0): keyed ones, and conversations recognised by their prompt.
        self.returns = {True: RunningMean(self.RETURN_SMOOTHING), False: RunningMean(self.RETURN_SMOOTHING)}

    def new_means(self) -> tuple[RunningMean, RunningMean]:
        return RunningMean(self.config.smoothing), RunningMean(self.config.smoothing)

    def returned(self, ctx: Context, prompt_tokens: int, now: float) -> None:
        """``ctx`` sends its next request: learn its think time and its growth."""
        if ctx.thinking and ctx.last_finish is not None:
            gap = max(0.0, now - ctx.last_finish)
            ctx.think.add(gap)
            self.think.add(gap)
            self.returns[ctx.keyed].add(1.0)
        if prompt_tokens > ctx.prompt_tokens:
            ctx.growth.add(prompt_tokens - ctx.prompt_tokens)
            if ctx.keyed:
                self.growth.add(prompt_tokens - ctx.prompt_tokens)

    def completed(self, ctx: Context) -> None:
        self.stages.add(ctx.stages)
        if ctx.thinking:  # it was waiting to come back (completed through the API or its TTL): it did not
            self.returns[ctx.keyed].add(0.0)

    def lapsed(self, ctx: Context) -> None:
        """``ctx`` thought past its window and was forgotten: it did not come back (in time)."""
        self.returns[ctx.keyed].add(0.0)

    def return_chance(self, ctx: Context) -> float:
        """The chance a thinking context comes back, as contexts of its kind did (before any did: that of a
        workflow with the default number of stages, or one in two for a recognised conversation)."""
        prior = 1.0 - 1.0 / self.config.default_stages if ctx.keyed else 0.5
        return self.returns[ctx.keyed].get(prior)

    def expected_return(self, ctx: Context) -> float:
        """When a thinking context is expected back (monotonic): its last request's end plus its predicted
        think time."""
        return (ctx.last_finish or 0.0) + self.think_s(ctx) if ctx.thinking else math.inf

    def think_s(self, ctx: Context) -> float:
        """Its predicted think time: its own average gap, or everyone's, or the default."""
        return ctx.think.get(self.think.get(self.config.default_think_s))

    def protection_s(self, ctx: Context) -> float:
        """How long an idle context stays resumable: margin x its predicted think time, within bounds."""
        c = self.config
        return min(c.max_protect_s, max(c.min_protect_s, c.protect_margin * self.think_s(ctx)))

    def expected_growth(self, context: Context | None, keyed: bool, stages_done: int) -> float:
        """Tokens a keyed context (a new one when ``None``) is still expected to add once ``stages_done``
        of its stages have run: its own growth per stage (or everyone's) times the stages left."""
        if not keyed:
            return 0.0
        everyone = self.growth.get(0.0)
        per_stage = context.growth.get(everyone) if context is not None else everyone
        total = self.stages.get(float(self.config.default_stages))
        return max(0.0, total - stages_done) * per_stage

    def debug(self) -> dict[str, Any]:
        return {"think_s": self.think.value, "growth_tokens_per_stage": self.growth.value, "stages": self.stages.value,
                "return_chance": {"keyed": self.returns[True].value, "recognised": self.returns[False].value}}


class Conversations:
    """The anonymous contexts (neither workflow nor session), recognised by their prompts: the last block hash
    of each one's last prompt → its key (a continuation contains it), and names for new ones, after the
    process that first saw them so that no two workers or replicas clash. The working set tells it each
    context it places and takes off."""

    def __init__(self, prefix: str) -> None:
        self._tails: dict[int, str] = {}
        self._names = itertools.count()
        self._prefix = prefix

    def continued(self, hashes: list[int], hint: int | None) -> str | None:
        """The key of the conversation whose last prompt these block hashes extend: looked for at block
        ``hint`` first (where the conversation's earlier prompt ended), then from the end."""
        if hint is not None and 0 <= hint < len(hashes) and (key := self._tails.get(hashes[hint])) is not None:
            return key
        for h in reversed(hashes):
            if (key := self._tails.get(h)) is not None:
                return key
        return None

    def new_key(self) -> str:
        return f"{self._prefix}{next(self._names)}"

    def placed(self, ctx: Context) -> None:
        if not ctx.keyed and ctx.hashes:
            self._tails[ctx.hashes[-1]] = ctx.key

    def unplaced(self, ctx: Context) -> None:
        if not ctx.keyed and ctx.hashes and self._tails.get(ctx.hashes[-1]) == ctx.key:
            del self._tails[ctx.hashes[-1]]
