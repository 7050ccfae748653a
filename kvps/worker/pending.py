"""Pure request bookkeeping: what each API call waits for, and matching replies to requests."""

import threading

from .. import protocol as P
from ..errors import RequestTimeout, from_remote


class Operation:
    """One API call (a push, a pull, a barrier...) that completes when all its parts answer."""

    def __init__(self, what, parts, on_error=None):
        self.what = what
        self.remaining = parts
        self.error = None
        self.on_error = on_error
        self.done = threading.Event()
        self.waiting_on = set()      # node names still owing an answer, for timeout messages
        if parts == 0:
            self.done.set()

    def part_done(self):
        self.remaining -= 1
        if self.remaining <= 0:
            self.done.set()

    def fail(self, exc):
        if self.error is None:
            self.error = exc
            if self.on_error is not None:
                self.on_error(exc)
        self.done.set()

    def wait(self, timeout, hint=''):
        """Block until complete; raise its error, or RequestTimeout naming who never answered
        (``hint``: what may hold them up, appended)."""
        if not self.done.wait(timeout):
            raise self.timed_out(timeout, hint)
        if self.error is not None:
            raise self.error

    def timed_out(self, timeout, hint=''):
        """The RequestTimeout for a wait of ``timeout`` s that this outlasted."""
        who = ', '.join(sorted(self.waiting_on)) or 'the cluster'
        return RequestTimeout(f'{self.what}: no answer from {who} within {timeout:g} s '
                              f'(KVPS_TIMEOUT){hint}')


class Request:
    """One message to one node, belonging to an Operation; ``on_data`` consumes a DATA reply.
    ``message`` (header, buffers) is kept until answered, to be sent again to a server that
    rejoins the job after it was lost. ``keep``: the shared-memory blocks its header points
    into; they return to the segment when the request is answered and dropped (or lost), so
    never while a server may still read or write them."""

    __slots__ = ('op', 'node', 'on_data', 'message', 'keep')

    def __init__(self, op, node, on_data=None, keep=()):
        self.op, self.node, self.on_data, self.keep = op, node, on_data, keep
        self.message = None


class PendingTable:
    """Requests sent and not yet answered, by id. Used by the I/O thread only."""

    def __init__(self):
        self._by_id = {}
        self._next_id = 0

    def add(self, request):
        self._next_id += 1
        self._by_id[self._next_id] = request
        request.op.waiting_on.add(request.node)
        return self._next_id

    def __len__(self):
        return len(self._by_id)

    def resolve(self, header, buffers):
        """Complete the request a reply answers; unknown ids (late replies) are ignored."""
        request = self._by_id.pop(header.get('id'), None)
        if request is None:
            return
        op = header['op']
        if op == P.ERROR:
            request.op.fail(from_remote(header['type'], header['message'],
                                        header.get('traceback', ''), header.get('node', '')))
            return
        try:
            if op in (P.DATA, P.STATES, P.ACK) and request.on_data is not None:
                request.on_data(header, buffers)
        except Exception as exc:  # a bad reply fails the call; it must not kill the I/O thread
            request.op.fail(exc)
            return
        request.op.part_done()

    def of_node(self, node):
        """Unanswered requests to ``node``, oldest first."""
        return [r for _, r in sorted(self._by_id.items()) if r.node == node]

    def fail_node(self, node, exc):
        """Fail every request waiting on ``node`` (it is lost)."""
        for req_id in [i for i, r in self._by_id.items() if r.node == node]:
            self._by_id.pop(req_id).op.fail(exc)

    def fail_all(self, exc):
        for request in self._by_id.values():
            request.op.fail(exc)
        self._by_id.clear()
