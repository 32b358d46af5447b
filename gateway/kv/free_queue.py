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

Owner: the :class:`FreeQueues`. Its writers, each through its own method: the request pipeline's recency
step (a request takes its blocks out of the queue when dispatched, returns them when it ends), the keep-warm
refresher (its own requests, the same way), and the prefix index (blocks evicted, a pod's cache cleared, a pod gone).
The keep-warm decisions read it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

MIN_PLACES = 1024  # places a pod's queue starts with; renumbered into twice its live blocks when they run out


@dataclass(slots=True)
class QueueStats:
    evicted_first: int = 0  # evicted blocks that were at the front of the queue, as the engine's order says
    evicted_out_of_order: int = 0  # evicted blocks with others ahead of them: blocks the queue never saw
    evicted_unknown: int = 0  # evicted blocks the queue did not hold (never freed through the gateway)


class _Places:
    """Live places in the queue, with how many live places lie before each (a Fenwick tree)."""

    __slots__ = ("_tree", "live")

    def __init__(self, size: int, live: int = 0) -> None:
        """``size`` places, the first ``live`` of them live."""
        if not live:
            self._tree = [0] * (size + 1)
        else:
            # Node i counts the live places among the lowbit(i) places before place i (places i - lowbit(i)
            # to i - 1): built whole at once, as a renumbering of a pod's thousands of blocks needs.
            self._tree = [0] + [max(0, min(i & -i, live - i + (i & -i))) for i in range(1, size + 1)]
        self.live = live

    @property
    def size(self) -> int:
        return len(self._tree) - 1

    def add(self, place: int, delta: int) -> None:
        tree = self._tree
        end, i = len(tree), place + 1
        while i < end:
            tree[i] += delta
            i += i & -i
        self.live += delta

    def before(self, place: int) -> int:
        """Live places before ``place``."""
        tree, i, total = self._tree, place, 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total


@dataclass(slots=True)
class _PodQueue:
    refs: dict[int, int] = field(default_factory=dict)  # block → requests holding it (out of the queue)
    place: dict[int, int] = field(default_factory=dict)  # block in the queue → its place (front: lowest)
    places: _Places = field(default_factory=lambda: _Places(MIN_PLACES))
    next_place: int = 0

    def append(self, block: int) -> None:
        if self.next_place >= self.places.size:
            self._repack()
        self.place[block] = self.next_place
        self.places.add(self.next_place, 1)
        self.next_place += 1

    def remove(self, block: int) -> int | None:
        """Take ``block`` out of the queue; the blocks that were ahead of it (None: it was not there)."""
        place = self.place.pop(block, None)
        if place is None:
            return None
        ahead = self.places.before(place)
        self.places.add(place, -1)
        return ahead

    def _repack(self) -> None:
        """Places only grow: renumber the live ones from 0, with room for as many again."""
        order = sorted(self.place, key=self.place.__getitem__)
        self.place = {block: place for place, block in enumerate(order)}
        self.places = _Places(max(MIN_PLACES, 2 * len(order)), live=len(order))
        self.next_place = len(order)


class FreeQueues:
    def __init__(self) -> None:
        self._pods: dict[str, _PodQueue] = {}
        self.stats = QueueStats()

    # Writes

    def taken(self, pod: str, blocks: Iterable[int]) -> None:
        """A request on ``pod`` holds these blocks (a prefix hit takes cached ones out of the queue)."""
        queue = self._pods.get(pod)
        if queue is None:
            queue = self._pods[pod] = _PodQueue()
        refs = queue.refs
        for block in blocks:
            held = refs.get(block, 0)
            if not held:
                queue.remove(block)
            refs[block] = held + 1

    def returned(self, pod: str, blocks: Sequence[int], cached: int) -> None:
        """A request on ``pod`` ended: it lets go of ``blocks`` (those it took), of which the first ``cached``
        are cached on the pod now; those no other request holds join the back of the queue, tail first."""
        queue = self._pods.get(pod)
        if queue is None:
            return
        refs = queue.refs
        for i in range(len(blocks) - 1, -1, -1):
            block = blocks[i]
            held = refs.get(block, 0) - 1
            if held > 0:
                refs[block] = held
                continue
            refs.pop(block, None)
            if i < cached and block not in queue.place:
                queue.append(block)

    def evicted(self, pod: str, blocks: Iterable[int]) -> None:
        """The pod reused the slots of these cached blocks."""
        queue = self._pods.get(pod)
        if queue is None:
            return
        for block in blocks:
            queue.refs.pop(block, None)
            ahead = queue.remove(block)
            if ahead is None:
                self.stats.evicted_unknown += 1
            elif ahead:
                self.stats.evicted_out_of_order += 1
            else:
                self.stats.evicted_first += 1

    def cleared(self, pod: str, blocks: Iterable[int]) -> None:
        """The pod no longer caches these blocks (its cache was cleared, or it restarted): they leave the queue.
        Blocks freed since, which its events have not stored yet, stay; the requests running there still
        hold theirs, and return them when they end."""
        queue = self._pods.get(pod)
        if queue is not None:
            for block in blocks:
                queue.remove(block)

    def dropped(self, pod: str) -> None:
        """The pod left: none of its blocks is free and cached any more (the requests running there still hold
        theirs)."""
        queue = self._pods.get(pod)
        if queue is not None:
            self._pods[pod] = _PodQueue(refs=queue.refs)

    # Reads

    def ahead(self, pod: str, block: int) -> int | None:
        """Free cached blocks the pod will evict before ``block`` (None: it is not free, or not known)."""
        queue = self._pods.get(pod)
        place = queue.place.get(block) if queue is not None else None
        return queue.places.before(place) if place is not None and queue is not None else None

    def first_to_go(self, pod: str, blocks: Sequence[int]) -> tuple[int, int] | None:
        """Of a prompt's blocks, the free one the pod will evict first (the tail's, freed first) and the
        free cached blocks ahead of it: (index of the block, blocks ahead); None if none of them is free."""
        queue = self._pods.get(pod)
        if queue is None:
            return None
        for i in range(len(blocks) - 1, -1, -1):
            place = queue.place.get(blocks[i])
            if place is not None:
                return i, queue.places.before(place)
        return None

    def free_blocks(self, pod: str) -> int:
        queue = self._pods.get(pod)
        return queue.places.live if queue is not None else 0

    def held_blocks(self, pod: str) -> int:
        queue = self._pods.get(pod)
        return len(queue.refs) if queue is not None else 0
