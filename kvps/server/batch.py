"""A multi-key request on a server: per-key answers, gathered into one reply."""

from ..wire.protocol import CHECK, PULL
from .records import PullAnswer, Reply, ReplyKind


class Batch:
    """Keys of one multi-key message (PUSH, PULL, INIT, CHECK) settle one by one (a sync
    round may finish later for some keys than for others); the worker gets one answer once
    every key has settled. Each key's replies carry the token ``(batch, index)``."""

    __slots__ = ('identity', 'req_id', 'op', 'results', 'remaining', 'error', 'places',
                 'reader', 'codec')

    def __init__(self, identity, req_id, op, size, reader=None, codec=None):
        self.identity, self.req_id, self.op, self.reader = identity, req_id, op, reader
        self.codec = codec   # PULL: the type float32 and float64 values are answered in
        self.results = [None] * size
        self.remaining = size
        self.error = None
        self.places = [None] * size   # PULL: (offset, view) where the worker's shm takes a key

    def settle(self, index, reply):
        """Record key ``index``'s Reply; return True when the whole batch is settled."""
        if self.results[index] is not None:
            return False
        self.results[index] = reply
        self.remaining -= 1
        if reply.kind is ReplyKind.ERROR and self.error is None:
            self.error = reply.payload
        return self.remaining == 0

    def outcome(self):
        """The one Reply for a settled batch, to its request: its first error, else an ack
        (PUSH, INIT, CHECK) or the PullAnswer of every key, in the order asked (PULL)."""
        token = (self.identity, self.req_id)
        if self.error is not None:
            return Reply(ReplyKind.ERROR, token, self.error)
        if self.op == CHECK:   # each key's push count (an elastic job's joiner starts there)
            return Reply(ReplyKind.ACK, token, {'counts': [r.payload for r in self.results]})
        if self.op != PULL:
            return Reply(ReplyKind.ACK, token, None)
        pulled = [reply.payload for reply in self.results]
        return Reply(ReplyKind.DATA, token, PullAnswer(self.reader, pulled, self.places,
                                                       self.codec))
