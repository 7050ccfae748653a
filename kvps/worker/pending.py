"""Pure request bookkeeping: what each API call waits for, and matching replies to requests."""

import collections
import threading

from ..errors import KVPSError, RequestTimeout, from_remote
from ..timeline import recording
from ..wire import protocol as P
from ..wire.items import ResumeItem

# Why a dist_sync server may rightly keep a push (and a pull after it) unanswered: a timeout's
# message ends with it.
SYNC_ROUND_HINT = ('; in dist_sync a server answers a push of a key, and a pull of it after the '
                   'push, once every worker has pushed that key in the round: is some worker '
                   'not pushing it, or stalled?')


class Operation:
    """One API call (a push, a pull, a barrier...) that completes when all its parts answer."""

    def __init__(self, what, parts, on_error=None, counts=None):
        self.what = what
        self.counts = counts         # the worker's WorkerCounts, where its waits count
        self.remaining = parts
        self.error = None
        self.on_error = on_error
        self.done = Completion()
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
        if not waited(self.done, timeout, 'wait', self.what, self.counts):
            raise self.timed_out(timeout, hint)
        if self.error is not None:
            raise self.error

    def timed_out(self, timeout, hint=''):
        """The RequestTimeout for a wait of ``timeout`` s that this outlasted; ``hint`` (or
        what it returns, asked now) says what may have held it up."""
        who = ', '.join(sorted(self.waiting_on)) or 'the cluster'
        hint = hint() if callable(hint) else hint
        return RequestTimeout(f'{self.what}: no answer from {who} within {timeout:g} s '
                              f'(KVPS_TIMEOUT){hint}')


class Completion:
    """``threading.Event``'s ``set``, ``is_set`` and ``wait``, the Event made only once a wait
    must block: most calls are answered before anything waits on them, and an Event (a
    Condition and its lock) cost a few microseconds of every call of a loop of one-key calls."""

    __slots__ = ('_set', '_event')
    _making = threading.Lock()

    def __init__(self):
        self._set, self._event = False, None

    def is_set(self):
        return self._set

    def set(self):
        self._set = True
        event = self._event   # (read after the flag: a waiter that made it sees either)
        if event is not None:
            event.set()

    def wait(self, timeout=None):
        if self._set:
            return True
        with Completion._making:
            if self._event is None:
                self._event = threading.Event()
        if self._set:   # set before the Event was there to be set
            return True
        return self._event.wait(timeout)


class Attaching(Operation):
    """The answer to an ATTACH or ATTACH_DEVICE: tells ``answered(node, error=None)`` whether
    ``node`` mapped the segment."""

    def __init__(self, what, answered, node):
        super().__init__(what, 1)
        self._answered, self._node = answered, node

    def part_done(self):
        super().part_done()
        self._answered(self._node)

    def fail(self, exc):
        super().fail(exc)
        self._answered(self._node, exc)


def waited(event, timeout, kind, what, counts=None):
    """``event.wait(timeout)``, counted in ``counts`` (WorkerCounts: ``kind`` 'wait' or
    'backpressure') when it blocks, and a span of that kind while the timeline records
    (``what``: the call waited for)."""
    if event.is_set():
        return True
    recorder = recording.RECORDER
    if recorder is None and counts is None:
        return event.wait(timeout)
    start = recording.now()
    try:
        return event.wait(timeout)
    finally:
        if recorder is not None:
            recorder.span(kind, kind, start, {'for': what})
        if counts is not None:
            counts.count_wait(kind, recording.now() - start)


class Request:
    """One message to one node, belonging to an Operation; ``on_data`` consumes a DATA reply.
    ``message`` (header, buffers) is kept until answered, to be sent again to a server that
    rejoins the job after it was lost. ``keep``: the shared-memory blocks its header points
    into; they return to the segment when the request is answered and dropped (or lost), so
    never while a server may still read or write them. ``after``: called with the request
    when its answer comes, before anything else (where it names blocks of the device segment:
    kvps.worker.device_staging.DeviceStaging.answer_of). ``pusher``: the thread that made a
    push, which may share a request with its next ones (kvps.worker.joined); None for other
    requests and a pushpull's pushes, which its waves pace: never held back
    (kvps.worker.holdback) nor joined."""

    __slots__ = ('op', 'node', 'on_data', 'message', 'keep', 'after', 'pusher')

    def __init__(self, op, node, on_data=None, keep=(), pusher=None):
        self.op, self.node, self.on_data, self.keep = op, node, on_data, keep
        self.message = self.after = None
        self.pusher = pusher


class PushCounts:
    """Per server, how many pushes of each key part this worker has queued: the next one's
    ``seq``. A push is numbered and queued under ``lock``, so that a key part's pushes reach
    its server in the order of their numbers (it takes a number it has seen for a resend)."""

    def __init__(self):
        self.lock = threading.Lock()
        self._by_node = {}   # node name -> {(key, part): pushes queued}
        # node name -> {(key, part): the first round} of a worker that joined a running job
        self.firsts = {}

    def of(self, node):
        """``node``'s counts, to number pushes by (under ``lock``)."""
        counts = self._by_node.get(node)
        if counts is None:
            counts = self._by_node[node] = {}
        return counts

    def start(self, node, where, count):
        """A joiner's pushes of key part ``where`` on ``node`` start at round ``count``."""
        self.of(node)[where] = count
        self.firsts.setdefault(node, {})[where] = count

    def copy(self, node):
        """A copy of ``node``'s counts (under ``lock``)."""
        return dict(self._by_node.get(node, {}))

    def resumed(self, node, counts, waiting):
        """The RESUME items for restarted ``node``: per key part, the pushes it acknowledged,
        ``counts`` (a copy of the pushes numbered) lowered to the first of those still
        ``waiting`` (Requests) for an answer, and where a joiner's numbering began."""
        for request in waiting:
            header = request.message[0]
            for item in header['keys'] if header['op'] == P.PUSH else ():
                where = (item.key, item.part)
                counts[where] = min(counts[where], item.seq)
        firsts = self.firsts.get(node, {})
        return [ResumeItem(key, part, count, firsts.get((key, part), 0))
                for (key, part), count in counts.items()]


class PushWindow:
    """A worker's pushes not yet known complete and their bytes: the back-pressure window,
    shared by every API thread that pushes."""

    def __init__(self, limit, counts=None):
        self.limit = limit           # KVPS_MAX_INFLIGHT_BYTES
        self.counts = counts         # the worker's WorkerCounts, where its waits count
        self.nbytes = 0
        self._ops = collections.deque()   # (Operation, bytes, the thread that pushed), in order
        self._lock = threading.Lock()

    def add(self, op, nbytes):
        with self._lock:
            self._ops.append((op, nbytes, threading.get_ident()))
            self.nbytes += nbytes

    def make_room(self, nbytes, timeout, hint=''):
        """Return once a push of ``nbytes`` fits, waiting meanwhile for the oldest push of the
        calling thread; a thread with none in flight goes on. Waiting for another thread's
        push could deadlock in dist_sync: its round may need a push that the matching thread
        of another worker holds back, waiting in turn for one of ours. A server's queue is
        then bounded by workers x (window + one push per pushing thread)."""
        me = threading.get_ident()
        while True:
            with self._lock:
                self._retire()
                if self.nbytes + nbytes <= self.limit:
                    return
                oldest = next((op for op, _, owner in self._ops
                               if owner == me and not op.done.is_set()), None)
            if oldest is None:
                return
            if not waited(oldest.done, timeout, 'backpressure', oldest.what, self.counts):
                raise oldest.timed_out(timeout, hint)

    def wait_all(self, timeout, hint=''):
        """Block until every push added so far, by any thread, is complete. They stay in the
        window while waited for: a barrier another thread makes meanwhile waits for them too."""
        with self._lock:
            ops = [op for op, _, _ in self._ops]
        for op in ops:
            if not op.done.wait(timeout):
                raise op.timed_out(timeout, hint)
        with self._lock:
            self._retire()

    def _retire(self):
        """Drop the completed pushes at the head (under ``_lock``)."""
        ops = self._ops
        while ops and ops[0][0].done.is_set():
            self.nbytes -= ops.popleft()[1]


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
        """Complete the request a reply answers (and those of the acks a DATA carries);
        unknown ids (late replies) are ignored. A STATES with ``more`` is one piece of the
        answer: the request waits for the rest."""
        for acked in header.get('acks', ()):   # (a DATA carrying plain acks of pushes)
            self.resolve({'op': P.ACK, 'id': acked}, ())
        req_id = header.get('id')
        request = self._by_id.pop(req_id, None)
        if request is None:
            return
        if request.after is not None:
            try:
                request.after(request)
            except KVPSError as exc:
                request.op.fail(exc)
                return
        op = header['op']
        if op == P.ERROR:
            request.op.fail(from_remote(header['type'], header['message'],
                                        header.get('traceback', ''), header.get('node', '')))
            return
        try:
            if op in (P.DATA, P.STATES, P.ACK, P.ROWS) and request.on_data is not None:
                request.on_data(header, buffers)
        except Exception as exc:  # a bad reply fails the call; it must not kill the I/O thread
            request.op.fail(exc)
            return
        if op == P.STATES and header.get('more'):
            self._by_id[req_id] = request
        else:
            request.op.part_done()

    def fail(self, req_id, exc):
        """Fail the request ``req_id`` (if still waiting) with ``exc``."""
        request = self._by_id.pop(req_id, None)
        if request is not None:
            request.op.fail(exc)

    def refused(self, frames, exc):
        """An answer that could not be read (``exc``, a ProtocolError saying why): its request
        fails with ``exc``; the pushes whose plain acks ride on it are answered (their server
        applied them: a later close() must not wait for acks that were sent)."""
        req_id, acks = P.request_ids(frames)
        self.fail(req_id, exc)
        for acked in acks:
            self.resolve({'op': P.ACK, 'id': acked}, ())

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
