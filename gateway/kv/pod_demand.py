"""Per pod, the resumable demand that placement weighs: the distinct blocks of the contexts resumable there
(a role prompt shared by ten workflows counts once) plus the growth they are still expected to add: each
context's average increment per stage times the stages it is expected to have left (from the stage counts
of completed contexts).

Owner: the :class:`~gateway.kv.working_set.ResumableWorkingSet` places a context on its pod's count when it
holds it and takes it off when the context moves, lapses or is released; placement reads through it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from gateway.kv.contexts import Context, exclusive_blocks


@dataclass(slots=True)
class PodDemand:
    refs: dict[int, int] = field(default_factory=dict)  # block hash → resumable contexts holding it
    block_size: int = 0
    growth: float = 0.0
    contexts: int = 0  # resumable contexts here, keyed or not
    keyed: int = 0  # keyed contexts resumable here
    idle_keyed: int = 0  # of those, between requests (thinking)

    @property
    def tokens(self) -> float:
        return len(self.refs) * self.block_size + self.growth


_NOTHING = PodDemand()  # a pod no resumable context is on (read, never written)


class PodDemands:
    """The :class:`PodDemand` of each pod that resumable contexts are on; the working set is its one writer."""

    def __init__(self) -> None:
        self._pods: dict[str, PodDemand] = {}

    def tokens(self, pod: str, exclude: Context | None = None) -> float:
        """Tokens the contexts resumable on ``pod`` hold or are expected to grow to, the share of ``exclude``
        (one of them) left out."""
        demand = self._pods.get(pod, _NOTHING)
        tokens = demand.tokens
        if exclude is not None:
            tokens -= exclusive_blocks(exclude.hashes, demand.refs) * exclude.block_size + exclude.expected_growth
        return tokens if tokens > 0.0 else 0.0  # not max(): this runs for every candidate pod of every request

    def others_on(self, pod: str, own: Context | None) -> bool:
        """Whether a context other than ``own`` is resumable on ``pod``."""
        return self._pods.get(pod, _NOTHING).contexts > (1 if own is not None and own.pod == pod else 0)

    def exclusive_blocks_of(self, ctx: Context) -> int:
        return exclusive_blocks(ctx.hashes, self._pods.get(ctx.pod, _NOTHING).refs)

    def resumable(self, pod: str) -> tuple[int, int]:
        demand = self._pods.get(pod, _NOTHING)
        return demand.keyed, demand.idle_keyed

    def debug(self, pod: str) -> dict[str, int]:
        demand = self._pods.get(pod, _NOTHING)
        return {"demand_tokens": round(demand.tokens), "distinct_blocks": len(demand.refs),
                "expected_growth_tokens": round(demand.growth), "contexts": demand.contexts,
                "keyed": demand.keyed, "thinking": demand.idle_keyed}

    def place(self, ctx: Context, kept: int = 0) -> None:
        """Count ``ctx`` on its pod; its first ``kept`` blocks are counted already."""
        demand = self._pods.setdefault(ctx.pod, PodDemand())
        demand.block_size = ctx.block_size
        refs = demand.refs
        for h in itertools.islice(ctx.hashes, kept, None):
            refs[h] = refs.get(h, 0) + 1
        demand.growth += ctx.expected_growth
        demand.contexts += 1
        demand.keyed += ctx.keyed

    def idled(self, ctx: Context) -> None:
        """``ctx`` started thinking: a keyed one counts as idle on its pod."""
        if ctx.keyed:
            self._pods[ctx.pod].idle_keyed += 1

    def unplace(self, ctx: Context, kept: int = 0) -> None:
        """Stop counting ``ctx`` on its pod, but for its first ``kept`` blocks."""
        demand = self._pods[ctx.pod]
        refs = demand.refs
        for h in itertools.islice(ctx.hashes, kept, None):
            n = refs.get(h, 0) - 1
            if n > 0:
                refs[h] = n
            else:
                refs.pop(h, None)
        demand.growth = max(0.0, demand.growth - ctx.expected_growth)
        demand.contexts -= 1
        if ctx.keyed:
            demand.keyed -= 1
            demand.idle_keyed -= ctx.thinking  # counted by idled()

    def forget(self, pod: str) -> None:
        self._pods.pop(pod, None)
