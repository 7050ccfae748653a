"""Socket pushes held in the worker while zmq still queues a server's earlier ones, so that the
pulls queued behind them leave first.

Handed to zmq at once, a step's pushes queue in front of the pull requests that follow them:
across a 1 Gbit/s link a worker's 48 MiB of pushes take 400 ms to leave, every pull request
waits that long behind them, and no result comes back before the last push is out (the
workers then drift out of step, see benchmarks/RESULTS.md). Held here while more than
KVPS_SOCKET_QUEUE bytes of the worker's pushes are still in zmq's queues (its servers'
connections together: they share the worker's link; one push per server always goes), the
pushes leave as fast as the link takes them (the kernel's socket buffers keep it busy), and a
pull of a key whose push has left goes ahead of the pushes still held: its result comes back
while later keys are pushed, as a pushpull's do. Pushes through shared memory put no bytes on
the socket and are never held.

Nothing overtakes what it must follow (kvps.wire.ordering): a request naming a key part of a
held one, and any message other than a push or a pull, wait for the held ones before them.
"""

from ..wire import protocol as P
from ..wire.ordering import key_parts

# A tracked push wakes the I/O thread once zmq has taken it (transport.Socket.send_taken);
# while it holds any, it also looks this often, should a wake-up be late.
POLL_S = 0.01
# About this many bytes of pushes to a server share one tracked message, the last of them: a
# tracked message costs a wake-up of pyzmq's garbage collector thread, and zmq takes messages
# in order, so one stands for those before it (the queue is then undercounted by less).
TRACK_BYTES = 1 << 20


class Holdback:
    """Per server: the pushes sent and not yet taken by zmq (its SocketQueue) and the requests
    held, in the order they came. Entries are the I/O thread's ``(node, header, buffers,
    request)``; ``payload`` is the bytes a push puts on the socket (0 for other requests).
    ``limit``: the bytes of pushes zmq may queue, all servers' together (0: no limit)."""

    def __init__(self, limit):
        self.limit = limit
        self._held = {}      # node -> [(entry, its key parts, payload)], in arrival order
        self._queues = {}    # node -> SocketQueue

    def __bool__(self):
        """Whether any request is held."""
        return any(self._held.values())

    def __len__(self):
        return sum(map(len, self._held.values()))

    def admit(self, entry, payload):
        """Whether ``entry`` may be sent now; if not, it is held until ``next_ready`` gives it
        back."""
        node = entry[0]
        held = self._held.get(node)
        if not held:
            if not payload or self._fits(node, payload):
                return True
            self._held[node] = [(entry, key_parts(entry[1]), payload)]
            return False
        parts = key_parts(entry[1])
        if self._may_pass(node, parts, payload, held):
            return True
        held.append((entry, parts, payload))
        return False

    def on_taken(self, node, payload, wake):
        """What zmq is to call when it has taken the push of ``payload`` bytes to ``node``
        about to be sent (it then calls ``wake``), or None when that push is not tracked."""
        if not self.limit or not payload:
            return None
        queue = self._queues.get(node)
        if queue is None:
            queue = self._queues[node] = SocketQueue()
        return queue.sending(payload, wake)

    def next_ready(self, everything=False):
        """A held entry that may be sent now (taken out of the hold), or None: the earliest
        of a server's that may pass every entry still held before it (``everything``: the
        earliest, whatever it waits for, as the I/O thread ends)."""
        for node, held in self._held.items():
            for index, (entry, parts, payload) in enumerate(held):
                if everything or self._may_pass(node, parts, payload, held[:index]):
                    del held[index]
                    return entry
        return None

    def _may_pass(self, node, parts, payload, earlier):
        """Whether a request naming ``parts`` with ``payload`` bytes may go ahead of the held
        ``earlier`` ones: it follows none of them, and a push fits and passes no held push
        (pushes keep their order: small ones never keep a big one waiting)."""
        if _follows(parts, earlier):
            return False
        if not payload:
            return True
        return not any(n for _, _, n in earlier) and self._fits(node, payload)

    def release(self, node):
        """Every entry held for ``node``, taken out of the hold (in order), and its queue
        forgotten: a server lost or back has a new socket, and nothing waits for the old."""
        self._queues.pop(node, None)
        return [entry for entry, _, _ in self._held.pop(node, ())]

    def release_all(self):
        """Every entry held, taken out of the hold (the I/O thread is ending)."""
        return [entry for node in list(self._held) for entry in self.release(node)]

    def _fits(self, node, payload):
        """Whether ``payload`` more bytes may go to ``node`` now: zmq queues nothing of this
        worker's pushes to it (a push goes alone whatever its size), or of its pushes to every
        server, which share its link, it queues at most the limit with this one."""
        queue = self._queues.get(node)
        if queue is None or not queue.queued():
            return True
        return sum(each.queued() for each in self._queues.values()) + payload <= self.limit


class SocketQueue:
    """The pushes to one server that zmq may still queue: tracked ones, each standing for
    itself and the untracked ones sent since the one before."""

    def __init__(self):
        self._sent = []        # [bytes, taken] of each tracked push zmq may still hold
        self._untracked = 0    # bytes of pushes sent since the last tracked one

    def sending(self, payload, wake):
        """A push of ``payload`` bytes is about to be sent: what zmq is to call once it has
        taken it (which calls ``wake``), or None while the untracked ones are under
        TRACK_BYTES."""
        self._untracked += payload
        if self._untracked < TRACK_BYTES:
            return None
        record = [self._untracked, False]
        self._sent.append(record)
        self._untracked = 0

        def taken():   # (on pyzmq's garbage collector thread)
            record[1] = True
            wake()
        return taken

    def queued(self):
        """The bytes of tracked pushes zmq has not taken yet."""
        self._sent = [record for record in self._sent if not record[1]]
        return sum(record[0] for record in self._sent)


def _follows(parts, held):
    """Whether a request naming ``parts`` (None: not a push or pull) must wait for ``held``."""
    if parts is None:
        return bool(held)
    return any(other is None or not parts.isdisjoint(other) for _, other, _ in held)


def pushed_bytes(header, buffers, request):
    """The bytes a request puts on the socket if it is a push that may be held, else 0 (a
    pushpull paces its pushes itself, which come with no ``pusher``: its pulls follow each
    wave, kvps.worker.credit)."""
    if header['op'] != P.PUSH or not buffers or request.pusher is None:
        return 0
    return socket_bytes(buffers)


def socket_bytes(frames):
    """The bytes of a message's ``frames`` (what it puts on the socket beside its header)."""
    return sum(memoryview(frame).nbytes for frame in frames)
