"""Messages taken by priority: the highest first, arrival order within one priority, and never one
ahead of an earlier message it must follow.

A worker's I/O thread sends its queued requests in this order, and a server serves a burst of
received ones in it (the header's ``priority``, MXNet's: a higher one goes first; absent: 0).
What must keep its order, whatever the priorities: two data requests (PUSH, PULL, PULL_ROWS)
between the same worker and server that name a key part in common (a key part's pushes keep
their ``seq`` order, and a pull never overtakes the push before it); and any other message
(init, optimizer, states, barrier, attach, resume...), which nothing passes and which passes
nothing. A message that may not overtake an earlier one takes it along instead: the earlier
goes first, at once (it holds the later one back wherever it is answered after it anyway).
"""

import collections
import heapq
import itertools

from . import protocol as P

_UNKNOWN = object()


def key_parts(header):
    """The ``(key, part)`` pairs a data request names; None for any other message."""
    op = header['op']
    if op == P.PUSH or op == P.PULL:
        return frozenset([(item[0], item[1]) for item in header['keys']])   # (key, part)
    if op == P.PULL_ROWS:
        return frozenset([(header['key'], header['part'])])
    return None


class _Waiting:
    """One message in the order; its key parts are read only if it is ever compared."""

    __slots__ = ('peer', 'header', 'item', 'number', 'taken', '_parts')

    def __init__(self, peer, header, item, number):
        self.peer, self.header, self.item, self.number = peer, header, item, number
        self.taken = False
        self._parts = _UNKNOWN

    @property
    def parts(self):
        if self._parts is _UNKNOWN:
            self._parts = key_parts(self.header)
        return self._parts

    def must_follow(self, earlier):
        """Whether this message may not go ahead of ``earlier`` (which arrived before it)."""
        mine, theirs = self.parts, earlier.parts
        if mine is None or theirs is None:
            return True
        return self.peer == earlier.peer and not mine.isdisjoint(theirs)


class PriorityOrder:
    """Messages ``add``-ed, given back by ``pop`` highest priority first (see the module)."""

    def __init__(self):
        self._heap = []                        # (-priority, number, _Waiting)
        self._arrivals = collections.deque()   # every message not taken, oldest first (taken
        #                                        ones are dropped when they reach the front)
        self._ahead = collections.deque()      # taken along by a later one: they go first
        self._number = 0
        self._waiting = 0

    def __len__(self):
        return self._waiting

    def add(self, peer, header, item):
        """Queue ``item``: a message to or from ``peer`` (a server's name, or a worker's
        identity), whose ``header`` says its op, key parts and priority."""
        waiting = _Waiting(peer, header, item, self._number)
        heapq.heappush(self._heap, (-header.get('priority', 0), self._number, waiting))
        self._arrivals.append(waiting)
        self._number += 1
        self._waiting += 1

    def pop(self):
        """The next item to send or serve; None when none waits."""
        if self._ahead:
            self._waiting -= 1
            return self._ahead.popleft().item
        heap, arrivals = self._heap, self._arrivals
        while heap:
            waiting = heapq.heappop(heap)[2]
            if waiting.taken:
                continue
            while arrivals[0].taken:
                arrivals.popleft()
            if arrivals[0] is waiting:   # the oldest overtakes nothing (all of priority 0)
                arrivals.popleft()
                waiting.taken = True
                self._waiting -= 1
                return waiting.item
            chain = self._chain(waiting)
            for each in chain:
                each.taken = True
            self._ahead.extend(chain[1:])
            self._waiting -= 1
            return chain[0].item
        return None

    def take_run(self, peer, accept, scan=4096):
        """Take, in arrival order, the waiting items for ``peer`` that ``accept(item)`` takes,
        for as long as it takes them, to go with the item just popped: the run ends at the
        first one for ``peer`` it refuses, at any message that is not a data request (nothing
        passes it), and at one of a lower priority than another still waiting (``pop`` would
        give that one first). Data requests for other peers are passed over (none must follow
        another peer's). Looks at ``scan`` items at most; takes none while items taken along
        wait to go first."""
        run = []
        if self._ahead:
            return run
        heap = self._heap
        for waiting in itertools.islice(self._arrivals, scan):
            if waiting.taken:
                continue
            if waiting.parts is None:
                break
            if waiting.peer != peer:
                continue
            while heap[0][2].taken:   # (the waiting one itself is in the heap)
                heapq.heappop(heap)
            if -heap[0][0] > waiting.header.get('priority', 0) or not accept(waiting.item):
                break
            waiting.taken = True
            self._waiting -= 1
            run.append(waiting.item)
        return run

    def _chain(self, waiting):
        """``waiting`` and the earlier messages that must go before it, in arrival order: those
        it must follow, and, in turn, those they must follow."""
        earlier = []
        for each in self._arrivals:
            if each.number >= waiting.number:
                break
            if not each.taken:
                earlier.append(each)
        chain = [waiting]
        for each in reversed(earlier):   # (every later one that must follow it is in chain)
            if any(later.must_follow(each) for later in chain):
                chain.append(each)
        chain.reverse()
        return chain


def by_priority(messages):
    """``messages`` (``(peer, header, ...)`` tuples in arrival order) in the order to serve them
    (see the module); the list itself when they all have one priority (the common case: 0)."""
    if not messages:
        return messages
    first = messages[0][1].get('priority', 0)
    for message in messages:
        if message[1].get('priority', 0) != first:
            break
    else:
        return messages
    order = PriorityOrder()
    for message in messages:
        order.add(message[0], message[1], message)
    return [order.pop() for _ in range(len(messages))]
