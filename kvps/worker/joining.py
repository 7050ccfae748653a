"""A worker's view of an elastic job's membership: changes told to a callback, a joiner's
catching up with the job's setup, and what an elastic Trainer reads of the job (its notes)."""

from ..wire import protocol as P
from ..wire.pieces import continued, state_pieces
from .messages import state_collector


class Members:
    """What a DistClient knows of the job's workers beyond its I/O thread's ``membership``:
    the epoch its API threads last acted on, kv.on_membership_change's ``callback``, and
    whether this worker joined a running job and has not pushed yet (``catching_up``: its
    setup calls are then checks, not collectives). ``pushes``: the client's per-key push
    counts (the lr scheduler's step), which a joiner starts where the servers count."""

    def __init__(self, io, sync, pushes):
        self.io, self.sync, self._pushes = io, sync, pushes
        self.epoch = io.membership[0]
        self.callback = None
        self.catching_up = io.welcome.get('incarnation', 0) > 0

    def moved(self):
        """The membership changed since the last call: tell the callback, once per change
        and in order (the I/O thread keeps each change until an API thread takes it)."""
        changes = self.io.membership_changes
        while True:
            try:
                epoch, ranks, _ = changes.popleft()
            except IndexError:   # (another API thread may have taken the last one)
                break
            if epoch > self.epoch:
                self.epoch = epoch
                if self.callback is not None:
                    self.callback(len(ranks), list(ranks))

    def joining(self, counts=None):
        """Whether this worker is catching up. ``counts``: its CHECKs' answer, (server node,
        (key, part)) -> the pushes the server counts of it: this worker numbers its own pushes
        from there, so that its first push is the round the server expects it in."""
        if counts and self.catching_up and self.sync:
            push_counts = self.io.push_counts
            with push_counts.lock:
                for (node, where), count in counts.items():
                    push_counts.start(node, where, count)
                    self._pushes[where[0]] = max(self._pushes.get(where[0], 0), count)
        return self.catching_up


class JobNotes:
    """Made by a DistClient from its I/O thread ``io`` (the membership, the WELCOME),
    ``request(server, what, header, buffers, on_data)`` (one message, an Operation), its
    ``config``, ``sharding`` and ``pushes`` (key -> its sync pushes, counted from where the
    servers count them for a joiner)."""

    def __init__(self, io, request, config, sharding, pushes):
        self._io, self._request, self._config = io, request, config
        self._sharding, self._pushes = sharding, pushes
        welcome = io.welcome
        self.me = (welcome['rank'], welcome.get('incarnation', 0))

    def rounds(self):
        """The rounds this worker has pushed into: the most pushes of any key."""
        return max(self._pushes.values(), default=0)

    def claim(self, key, epoch, size, count):
        """``(positions, end)``: up to ``count`` positions of ``epoch``'s order of ``size``
        samples for this worker's next push of ``key`` (kvps.server.ledger), from the server
        holding the key; ``end``: the epoch is over for every member."""
        part = self._sharding.parts(key)[0]
        header = {'op': P.CLAIM, 'key': key, 'part': part.part, 'epoch': epoch, 'size': size,
                  'count': count, 'round': self._pushes.get(key, 0)}
        got = []
        self._request(part.server, f'claim of samples of epoch {epoch}', header, (),
                      lambda answer, _: got.append(answer)).wait(self._config.timeout)
        return got[0]['positions'], got[0]['end']

    @property
    def epoch(self):
        """The membership's epoch: it moves at every change (a fixed job's stays 0)."""
        return self._io.membership[0]

    def members(self):
        """The member workers, as ``(rank, incarnation)`` pairs."""
        return self._io.membership[2]

    def put(self, name, blob):
        """Make ``blob`` (bytes) the job's blob ``name``; returns once server 0 holds it."""
        pieces = state_pieces(blob, self._config.max_message_bytes)
        headers = continued({'op': P.PUT_BLOB, 'name': name}, len(pieces))
        for op in [self._request(0, f'put of blob {name!r}', header, (piece,))
                   for header, piece in zip(headers, pieces)]:
            op.wait(self._config.timeout)

    def get(self, name):
        """The job's blob ``name`` as server 0 holds it now (b'' when there is none)."""
        got = []
        self._request(0, f'get of blob {name!r}', {'op': P.GET_BLOB, 'name': name}, (),
                      state_collector(got.append)).wait(self._config.timeout)
        return bytes(got[0])


def membership_of(message):
    """``(epoch, member ranks, [(rank, incarnation)])`` of a WELCOME or MEMBERS (a fixed job:
    epoch 0, every rank, incarnation 0)."""
    if 'workers' not in message:
        ranks = list(range(message['num_workers']))
        return 0, ranks, [(rank, 0) for rank in ranks]
    workers = [tuple(pair) for pair in message['workers']]
    return message['epoch'], [rank for rank, _ in workers], workers
