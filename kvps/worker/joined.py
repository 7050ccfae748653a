"""Requests queued back to back for one server, sent as one message: a call per key (MXNet's
loop, `kv.push(k, v)` then `kv.pull(k, out)` key after key) otherwise costs a message each way
per key, and on a busy box those per-message costs, not the bytes, set the pace.

A thread's pushes join into one request (join_pushes); other requests ride in the same message
as a bundle (riders, kvps.wire.bundle), each with its own answer: a pull is answered once its
own key's round is in, whatever the others wait for.

Only a backlog is joined: the I/O thread sends what is queued as soon as it can, so a push never
waits for another. Joining keeps what a list push of the same keys would do: the server gets
the keys in their order, in one message, and answers it once all of them are in their rounds'
updates; every joined call counts that answer as its own. A push of a lower priority joins
(MXNet's Gluon loop gives each key its own) only while none waits of a higher one: it goes
when it would have gone alone (kvps.wire.ordering.PriorityOrder.take_run); the message keeps
the first's priority. Pushes of different threads are never joined (a thread waiting for
room for its pushes waits only on its own, kvps.worker.pending.PushWindow), nor a
pushpull's (it paces its own waves), nor pushes that name a key part in common (each keeps
its own round's answer).
"""

from ..wire import budget, protocol as P
from ..wire.bundle import INDEX_BYTES, MAX_MESSAGES
from .holdback import pushed_bytes, socket_bytes
from .pending import Request

_SAME = ('sync', 'step')   # header fields joined pushes must have alike


class Joined:
    """The Operations of the pushes that share one message: its answer is one part of each,
    its failure each one's."""

    __slots__ = ('ops', 'what', 'waiting_on')

    def __init__(self, ops):
        self.ops = ops
        self.what = ops[0].what
        self.waiting_on = set()   # (each op names the server itself: see join_pushes)

    def part_done(self):
        for op in self.ops:
            op.part_done()

    def fail(self, exc):
        for op in self.ops:
            op.fail(exc)


def join_pushes(entry, order, counts, most_bytes):
    """``entry`` ((node, header, buffers, request), just taken from ``order``, a
    kvps.wire.ordering.PriorityOrder) with the pushes queued right behind it that may share
    its message (see the module), taken from ``order`` too; ``entry`` itself where none may.
    ``counts.joined`` (the worker's WorkerCounts) counts the pushes that joined another's;
    the joined request puts at most ``most_bytes`` on the socket (messages.fuse_bytes)."""
    node, header, buffers, request = entry
    if header['op'] != P.PUSH or request.pusher is None:
        return entry
    joined = order.take_run(node, _Message(entry, most_bytes).takes)
    if not joined:
        return entry
    counts.joined += len(joined)
    everything = [entry, *joined]
    ops = [each[3].op for each in everything]
    for op in ops:
        op.waiting_on.add(node)
    keep = [block for each in everything for block in each[3].keep]
    return (node, {**header, 'keys': [item for each in everything for item in each[1]['keys']]},
            [frame for each in everything for frame in each[2]],
            Request(Joined(ops), node, keep=keep, pusher=request.pusher))


def riders(entry, order, holdback, most_bytes):
    """The requests taken from ``order`` to go in ``entry``'s message: the pulls and pushes
    queued right behind it for the same server that put no push bytes on the socket (those
    through shared memory), up to ``most_bytes`` of frames; none while socket pushes are
    held (kvps.worker.holdback tracks a message per socket push)."""
    if holdback or not _rides(entry):
        return []
    room = [most_bytes - socket_bytes(entry[2]), MAX_MESSAGES - 1,
            INDEX_BYTES - _listed_bytes(entry[1]['keys'])]

    def takes(later):
        if later[0] != entry[0] or not _rides(later):
            return False
        need = (socket_bytes(later[2]), 1, _listed_bytes(later[1]['keys']))
        if any(n > left for n, left in zip(need, room)):
            return False
        room[:] = [left - n for n, left in zip(need, room)]
        return True
    return order.take_run(entry[0], takes)


def _rides(entry):
    """Whether ``entry`` may share a message: a pull, or a push with no socket bytes to track."""
    header = entry[1]
    return header['op'] == P.PULL or (header['op'] == P.PUSH and not pushed_bytes(*entry[1:]))


class _Message:
    """The message a push starts, as later pushes join it: who may join, and what it holds."""

    def __init__(self, entry, most_bytes):
        self.node, self.header, buffers, request = entry
        self.most_bytes = most_bytes
        self.pusher = request.pusher
        self.parts = {(item.key, item.part) for item in self.header['keys']}
        self.socket = socket_bytes(buffers)
        self.listed = _listed_bytes(self.header['keys'])

    def takes(self, later):
        """Whether the push ``later`` (an entry as join_pushes's) joins; if so, it counts in."""
        node, header, frames, request = later
        if (node != self.node or header['op'] != P.PUSH or request.pusher != self.pusher
                or any(header.get(f) != self.header.get(f) for f in _SAME)):
            return False
        socket, listed = socket_bytes(frames), _listed_bytes(header['keys'])
        parts = {(item.key, item.part) for item in header['keys']}
        if (self.socket + socket > self.most_bytes or self.listed + listed > budget.ITEMS_BUDGET
                or not self.parts.isdisjoint(parts)):
            return False
        self.socket += socket
        self.listed += listed
        self.parts |= parts
        return True


def _listed_bytes(items):
    return sum(budget.item_bytes(item.key) for item in items)
