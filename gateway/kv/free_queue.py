"""Each pod's queue of free cached blocks, in the order its engine will evict them, as the gateway infers it.

vLLM (0.32, ``BlockPool``) keeps a block cached after the request holding it ends, in a free queue: a
finished request's blocks go to its back, tail first; a prefix hit takes its blocks out until that request
ends; a new block is taken from the front, evicting what the front block cached. SGLang's radix cache is
LRU by last access, the same order for what matters here. So how soon a cached block will be evicted is
how many free cached blocks are ahead of it, against how fast the pod takes blocks.

The gateway sees every request it routes start and end, with the hashes of its prompt's full blocks, and
every block the pod evicts (its ``BlockRemoved`` events). From those it keeps the queue here. Blocks it
does not see freed (another router's requests, an answer's blocks, other workers' requests) are missing
from it: a block's place is then an undercount, and the gateway thinks it nearer eviction than it is.

What a request costs here is what it adds, not its context. Block hashes are chained, so a prompt's blocks
are a path from a root, and the blocks a pod knows form a tree. The tree is kept in *runs*: stretches of one
path whose blocks share one state (held by so many requests, free in the queue, or gone). A free run sits
in the queue whole, its deepest block first (a request frees its tail first), so a continuing conversation
takes its earlier prompt out of the queue as one run and puts it back, grown by its new blocks, as one run.
A request walks its prompt run by run (bisecting where its path leaves a run) and touches each block only
when it is new; a run is cut where requests part ways or an eviction falls inside it, and the side with
fewer blocks is renumbered. The queue is a linked list of free runs; how many blocks are ahead of each is
summed in one pass, when first asked after a change (keep-warm asks once per tick).

Owner: the :class:`FreeQueues`. Its writers, each through its own method: the request pipeline's recency
step (a request takes its blocks out of the queue when dispatched, returns them when it ends), the keep-warm
refresher (its own requests, the same way), and the prefix index (blocks evicted, a pod's cache cleared, a pod gone).
The keep-warm decisions read it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class QueueStats:
    evicted_first: int = 0  # evicted blocks that were at the front of the queue, as the engine's order says
    evicted_out_of_order: int = 0  # evicted blocks with others ahead of them: blocks the queue never saw
    evicted_unknown: int = 0  # evicted blocks the queue did not hold (never freed through the gateway)
    # The work that grows with blocks: a block entered or left a run's map (new, renumbered, gone).
    block_writes: int = 0
    runs_walked: int = 0  # runs a request's prompt passed through


class _Run:
    """Blocks ``chain[lo:hi]`` of one prompt's path, in one state: held by ``holders`` requests; else free
    and in the queue (``cached``), or gone, kept only as the way to the runs below it."""

    __slots__ = ("cached", "chain", "children", "hi", "holders", "lo", "next", "parent", "prev")

    def __init__(self, chain: Sequence[int], lo: int, hi: int, parent: _Run | None, holders: int,
                 cached: bool) -> None:
        self.chain, self.lo, self.hi, self.parent = chain, lo, hi, parent
        self.holders, self.cached = holders, cached
        self.children: dict[int, _Run] = {}  # the runs that go on from depth ``hi``, by their first block
        self.prev: _Run | None = None  # in the queue: the run ahead, and the run behind (the order's to write)
        self.next: _Run | None = None

    @property
    def free(self) -> bool:
        return not self.holders and self.cached

    @property
    def gone(self) -> bool:
        return not self.holders and not self.cached

    def match(self, chain: Sequence[int], end: int) -> int:
        """How deep ``chain`` (whose block ``lo`` is this run's) goes along the run, up to ``end``: by
        bisection, since chained hashes equal at one depth are equal at every depth before it."""
        low, high = self.lo + 1, min(self.hi, end)
        mine = self.chain
        if mine is chain or mine[high - 1] == chain[high - 1]:
            return high
        while low < high:
            mid = (low + high) // 2
            if mine[mid] == chain[mid]:
                low = mid + 1
            else:
                high = mid
        return low


class _EvictionOrder:
    """A pod's free runs in the order its engine evicts them, a ring linked through the runs' ``prev`` (the run
    ahead) and ``next``, which only it writes; and the free blocks ahead of each run, summed in one pass when
    first asked after a change. Which runs join it and when, and how many blocks it holds, is the
    :class:`_PodQueue`'s."""

    def __init__(self) -> None:
        self.end = _Run((), 0, 0, None, 0, False)  # where the ring closes: the head behind it, the tail ahead
        self.end.prev = self.end.next = self.end
        self._ahead: dict[_Run, int] | None = None  # the blocks ahead of each run; None: to sum (the order changed)

    def unlink(self, run: _Run) -> None:
        run.prev.next, run.next.prev = run.next, run.prev
        run.prev = run.next = None
        self._ahead = None

    def link_after(self, run: _Run, ahead: _Run) -> None:
        """``run`` right behind ``ahead`` (:attr:`end`: at the head)."""
        run.prev, run.next = ahead, ahead.next
        ahead.next.prev = run
        ahead.next = run
        self._ahead = None

    def ahead_of(self, run: _Run) -> int:
        """Free blocks ahead of the run's deepest block."""
        if self._ahead is None:
            self._ahead, total, at = {}, 0, self.end.next
            while at is not self.end:
                self._ahead[at] = total
                total += at.hi - at.lo
                at = at.next
        return self._ahead[run]


class _RunTree:
    """The runs a pod's blocks form, from ``roots`` by their first block, and ``run_of``, each held or free
    block's run: it walks a prompt's path, cuts runs and joins them (a free one keeping its place in the
    :class:`_EvictionOrder`) and forgets their blocks. Which state a run is in, and when it changes, is the
    :class:`_PodQueue`'s."""

    def __init__(self, order: _EvictionOrder, stats: QueueStats) -> None:
        self.order, self.stats = order, stats
        self.roots: dict[int, _Run] = {}
        self.run_of: dict[int, _Run] = {}

    def path(self, chain: Sequence[int]) -> list[_Run]:
        """The runs ``chain`` follows from the root, the last one cut where the chain leaves it (so that the
        last run ends at the depth the chain reaches)."""
        path: list[_Run] = []
        siblings, depth, n = self.roots, 0, len(chain)
        while depth < n and (run := siblings.get(chain[depth])) is not None:
            self.stats.runs_walked += 1
            end = run.match(chain, n)
            if end < run.hi:
                run = self.split(run, end)[0]
            path.append(run)
            siblings, depth = run.children, end
        return path

    def split(self, run: _Run, at: int) -> tuple[_Run, _Run]:
        """Cut ``run`` at depth ``at`` (inside it) into the upper part and the lower, its only child, in the
        same state; free, the lower one is right ahead of the upper in the queue. The new object takes the
        side with fewer blocks, whose blocks are renumbered."""
        chain = run.chain
        if at - run.lo <= run.hi - at:  # a new upper part
            upper = _Run(chain, run.lo, at, run.parent, run.holders, run.cached)
            self._siblings(run)[chain[run.lo]] = upper
            run.lo, run.parent, lower = at, upper, run
            upper.children[chain[at]] = lower
            if upper.free:
                self.order.link_after(upper, lower)
            if not upper.gone:
                self.assign(upper, upper.lo, at)
        else:  # a new lower part
            lower = _Run(chain, at, run.hi, run, run.holders, run.cached)
            lower.children, run.children, run.hi, upper = run.children, {chain[at]: lower}, at, run
            for child in lower.children.values():
                child.parent = lower
            if lower.free:
                self.order.link_after(lower, upper.prev)
            if not lower.gone:
                self.assign(lower, at, lower.hi)
        return upper, lower

    def merge(self, upper: _Run, lower: _Run) -> _Run:
        """Join a free run and its only child, right ahead of it in the queue, into one (returned)."""
        if upper.hi - upper.lo <= lower.hi - lower.lo:  # ``lower`` takes the blocks of ``upper``
            self.order.unlink(upper)
            self._siblings(upper)[upper.chain[upper.lo]] = lower
            lower.lo, lower.parent = upper.lo, upper.parent
            self.assign(lower, upper.lo, upper.hi)
            return lower
        self.order.unlink(lower)
        upper.chain, upper.hi, upper.children = lower.chain, lower.hi, lower.children
        for child in upper.children.values():
            child.parent = upper
        self.assign(upper, lower.lo, lower.hi)
        return upper

    def forget(self, run: _Run) -> None:
        """The run's blocks (cached no more) leave the map; it stays, gone, while runs below it need the way."""
        run_of = self.run_of
        for block in run.chain[run.lo : run.hi]:
            if run_of.get(block) is run:
                del run_of[block]
        self.stats.block_writes += run.hi - run.lo
        while run is not None and run.gone and not run.children:
            del self._siblings(run)[run.chain[run.lo]]
            run = run.parent

    def assign(self, run: _Run, lo: int, hi: int) -> None:
        self.run_of.update(dict.fromkeys(run.chain[lo:hi], run))
        self.stats.block_writes += hi - lo

    def _siblings(self, run: _Run) -> dict[int, _Run]:
        return run.parent.children if run.parent is not None else self.roots


class _PodQueue:
    """One pod's queue: what its requests and evictions do to its runs (held, free in its
    :class:`_EvictionOrder`, or gone), and how many blocks are held and free; the runs' shape is its
    :class:`_RunTree`'s."""

    def __init__(self, stats: QueueStats) -> None:
        self.stats = stats
        self.order = _EvictionOrder()
        self.tree = _RunTree(self.order, stats)
        self.free = 0  # blocks in the queue
        self.held = 0  # blocks requests hold

    # A request's prompt

    def take(self, chain: Sequence[int]) -> None:
        path = self.tree.path(chain)
        for run in path:
            self._hold(run)
        parent = path[-1] if path else None
        if (depth := parent.hi if parent else 0) < len(chain):
            self._grow(parent, parent.children if parent else self.tree.roots, chain, depth)

    def give_back(self, chain: Sequence[int], cached: int) -> None:
        path = self.tree.path(chain)
        for run in reversed(path):  # tail first: the deepest run is evicted first
            self._release(run, cached)
        if path:  # heal the cuts that no longer part anything: a free run and its only child, just ahead
            upper = path[0]
            for lower in path[1:]:
                if lower.parent is upper and upper.free and lower.free and lower.next is upper \
                        and len(upper.children) == 1:
                    upper = self.tree.merge(upper, lower)
                else:
                    upper = lower

    def _grow(self, parent: _Run | None, siblings: dict[int, _Run], chain: Sequence[int], depth: int) -> None:
        """The prompt's blocks from ``depth`` on are new here: they join ``parent`` where only this request
        holds it and nothing goes on from it, else make a run of their own."""
        if parent is not None and parent.holders == 1 and not parent.children:
            parent.chain, parent.hi, run = chain, len(chain), parent
        else:
            run = siblings[chain[depth]] = _Run(chain, depth, len(chain), parent, 1, False)
        self.tree.assign(run, depth, len(chain))
        self.held += len(chain) - depth

    def _hold(self, run: _Run) -> None:
        if not run.holders:
            if run.cached:
                self.order.unlink(run)
                self.free -= run.hi - run.lo
                run.cached = False  # whether it is cached is said again when it is given back
            else:  # gone: its blocks are back in a prompt
                self.tree.assign(run, run.lo, run.hi)
            self.held += run.hi - run.lo
        run.holders += 1

    def _release(self, run: _Run, cached: int) -> None:
        if run.holders != 1:  # others still hold it (none: it was not this request's)
            run.holders = max(0, run.holders - 1)
            return
        self.held -= run.hi - run.lo
        if run.lo < cached < run.hi:
            run, tail = self.tree.split(run, cached)  # cut while held: both keep their blocks' map
            run.holders = tail.holders = 0
            self._append(run)  # before its uncached tail goes, which would take the way to it along
            self.tree.forget(tail)
        else:
            run.holders = 0
            if run.hi <= cached:
                self._append(run)
            else:
                self.tree.forget(run)

    # Evictions

    def drop_block(self, block: int, count: bool) -> None:
        """The pod no longer caches ``block``: out of the queue if it was there (a held one stays held)."""
        run = self.tree.run_of.get(block)
        if run is None or not run.free:
            if count:
                self.stats.evicted_unknown += 1
            return
        depth = run.hi - 1 if run.chain[run.hi - 1] == block else run.chain.index(block, run.lo, run.hi - 1)
        if count:
            if run is self.order.end.next and depth == run.hi - 1:  # the head's deepest block
                self.stats.evicted_first += 1
            else:
                self.stats.evicted_out_of_order += 1
        if depth + 1 < run.hi:
            run = self.tree.split(run, depth + 1)[0]
        if depth > run.lo:
            run = self.tree.split(run, depth)[1]
        self._evict(run)

    def drop_all_free(self) -> None:
        while (run := self.order.end.next) is not self.order.end:
            self._evict(run)

    def _evict(self, run: _Run) -> None:
        self.order.unlink(run)
        self.free -= run.hi - run.lo
        run.cached = False
        self.tree.forget(run)

    # Reads

    def ahead(self, block: int) -> int | None:
        run = self.tree.run_of.get(block)
        if run is None or not run.free:
            return None
        return self.order.ahead_of(run) + run.hi - 1 - run.chain.index(block, run.lo, run.hi)

    def first_to_go(self, chain: Sequence[int]) -> tuple[int, int] | None:
        found: tuple[int, int] | None = None
        siblings, depth, n = self.tree.roots, 0, len(chain)
        while depth < n and (run := siblings.get(chain[depth])) is not None:
            end = run.match(chain, n)
            if run.free:  # its deepest block of the prompt, and the run's blocks ahead of it
                found = (end - 1, self.order.ahead_of(run) + run.hi - end)
            if end < run.hi:
                break
            siblings, depth = run.children, end
        return found

    def _append(self, run: _Run) -> None:
        run.cached = True
        self.free += run.hi - run.lo
        self.order.link_after(run, self.order.end.prev)


class FreeQueues:
    def __init__(self) -> None:
        self._pods: dict[str, _PodQueue] = {}
        self.stats = QueueStats()

    def _queue(self, pod: str) -> _PodQueue:
        queue = self._pods.get(pod)
        if queue is None:
            queue = self._pods[pod] = _PodQueue(self.stats)
        return queue

    # Writes

    def taken(self, pod: str, blocks: Sequence[int]) -> None:
        """A request on ``pod`` holds these blocks, a prompt's chain (a prefix hit takes cached ones out of
        the queue)."""
        if blocks:
            self._queue(pod).take(blocks)

    def returned(self, pod: str, blocks: Sequence[int], cached: int) -> None:
        """A request on ``pod`` ended: it lets go of ``blocks`` (those it took), of which the first ``cached``
        are cached on the pod now; those no other request holds join the back of the queue, tail first."""
        queue = self._pods.get(pod)
        if queue is not None and blocks:
            queue.give_back(blocks, cached)

    def evicted(self, pod: str, blocks: Iterable[int]) -> None:
        """The pod reused the slots of these cached blocks."""
        queue = self._pods.get(pod)
        if queue is not None:
            for block in blocks:
                queue.drop_block(block, count=True)

    def cleared(self, pod: str, blocks: Iterable[int]) -> None:
        """The pod no longer caches these blocks (its cache was cleared, or it restarted): they leave the queue.
        Blocks freed since, which its events have not stored yet, stay; the requests running there still
        hold theirs, and return them when they end."""
        queue = self._pods.get(pod)
        if queue is not None:
            for block in blocks:
                queue.drop_block(block, count=False)

    def dropped(self, pod: str) -> None:
        """The pod left: none of its blocks is free and cached any more (the requests running there still hold
        theirs)."""
        queue = self._pods.get(pod)
        if queue is not None:
            queue.drop_all_free()

    # Reads

    def ahead(self, pod: str, block: int) -> int | None:
        """Free cached blocks the pod will evict before ``block`` (None: it is not free, or not known)."""
        queue = self._pods.get(pod)
        return queue.ahead(block) if queue is not None else None

    def first_to_go(self, pod: str, blocks: Sequence[int]) -> tuple[int, int] | None:
        """Of a prompt's blocks, the free one the pod will evict first (the tail's, freed first) and the
        free cached blocks ahead of it: (index of the block, blocks ahead); None if none of them is free."""
        queue = self._pods.get(pod)
        return queue.first_to_go(blocks) if queue is not None else None

    def free_blocks(self, pod: str) -> int:
        queue = self._pods.get(pod)
        return queue.free if queue is not None else 0

    def held_blocks(self, pod: str) -> int:
        queue = self._pods.get(pod)
        return queue.held if queue is not None else 0
