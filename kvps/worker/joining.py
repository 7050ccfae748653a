"""A worker's view of an elastic job's membership: changes told to a callback, and a joiner's
catching up with the job's setup (docs/elastic.md)."""


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
        """The membership changed since the last call: tell the callback, once per change."""
        epoch, ranks = self.io.membership
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
