"""A multi-key request on a server: per-key answers, gathered into one reply."""

from ..wire.protocol import PULL


class Batch:
    """Keys of one multi-key message (PUSH, PULL, INIT, CHECK) settle one by one (a sync
    round may finish later for some keys than for others); the worker gets one answer once
    every key has settled."""

    __slots__ = ('identity', 'req_id', 'op', 'results', 'remaining', 'error', 'places',
                 'reader')

    def __init__(self, identity, req_id, op, size, reader=None):
        self.identity, self.req_id, self.op, self.reader = identity, req_id, op, reader
        self.results = [None] * size
        self.remaining = size
        self.error = None
        self.places = [None] * size   # PULL: (offset, view) where the worker's shm takes a key

    def settle(self, index, kind, payload):
        """Record key ``index``'s answer; return True when the whole batch is settled."""
        if self.results[index] is not None:
            return False
        self.results[index] = (kind, payload)
        self.remaining -= 1
        if kind == 'error' and self.error is None:
            self.error = payload
        return self.remaining == 0

    def outcome(self):
        """``(kind, payload)`` of the one reply for a settled batch: its first error, else an
        ack (PUSH, INIT, CHECK) or ``(reader, parts)`` (PULL): the worker's arena Reader or
        None, and every key's ``(entry, array, lease, place)`` in the order asked (place:
        None, or where in the worker's shared memory to write it)."""
        if self.error is not None:
            return 'error', self.error
        if self.op != PULL:
            return 'ack', None
        return 'data', (self.reader, [(*payload, place) for (_, payload), place
                                      in zip(self.results, self.places)])
