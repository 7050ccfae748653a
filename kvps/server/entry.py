"""One key part on a server (Entry: its weight, round state and buffers) and the Lease that lends a buffer to a reply."""

import dataclasses

from . import row_store
from .storage import HostArrays


class Lease:
    """A buffer lent to an outgoing reply. Until the transport is done with it (the loop sets
    ``tracker``), the local store has copied it (``released``), or the worker reading it in
    the arena has seen reply ``number`` (the loop sets ``reader``), it must not be written."""

    __slots__ = ('tracker', 'released', 'reader', 'number')

    def __init__(self):
        self.tracker, self.released, self.reader, self.number = None, False, None, 0

    @property
    def done(self):
        if self.reader is not None:
            return self.reader.seen >= self.number
        return self.released or (self.tracker is not None and self.tracker.done)


def _in_use(leases):
    for lease in leases:   # (a loop, not any() over a generator: asked per key and round)
        if not lease.done:
            return True
    return False


@dataclasses.dataclass(eq=False)
class Entry:
    """One key part held by this server."""
    key: object
    part: int
    dtype: str
    shape: tuple
    sync: bool
    weight: object                        # an array of ``arrays``' kind (numpy or cupy)
    merge: object = None                  # the buffer sums are made in
    summed: object = None                 # the gradient to apply: a received array or merge
    version: int = 0                      # rounds completed (sync) / pushes applied (async)
    step: int = 0                         # sync: the open round's pushes' highest step
    pushed: dict = dataclasses.field(default_factory=dict)   # worker -> pushes received
    merged: set = dataclasses.field(default_factory=set)     # workers in the open round
    held: list = dataclasses.field(default_factory=list)     # tokens acked at round end
    queued: list = dataclasses.field(default_factory=list)   # (worker, round, data, token, step)
    rows: list = dataclasses.field(default_factory=list)     # the open round's row pushes
    # (round needed, token, rows asked: None for the whole value, else (ids, since))
    deferred: list = dataclasses.field(default_factory=list)
    rowlog: row_store.RowLog = dataclasses.field(default_factory=row_store.RowLog)
    live: object = None      # after a push of rows replaced the value: its rows (zeros elsewhere)
    weight_leases: list = dataclasses.field(default_factory=list)
    merge_leases: list = dataclasses.field(default_factory=list)
    restored: bool = False                # from a checkpoint, not yet claimed by an init
    arrays: object = dataclasses.field(default_factory=HostArrays)   # where the arrays live
    device: bool = False                  # a device-side store asked for the GPU

    @property
    def n(self):
        return self.weight.size

    def holds(self, dtype, shape):
        """Whether this is the key a worker describes as ``shape`` of ``dtype``."""
        return self.dtype == dtype and self.shape == tuple(shape)

    def lend(self):
        """``(weight, lease)`` for a pull reply: the weight itself, not a copy. Replies leave
        the process after later updates may run, so writers copy a lent buffer first
        (copy-on-write): a pull costs no copy unless an update overtakes its send."""
        if self.weight_leases:
            self.weight_leases = [l for l in self.weight_leases if not l.done]
        lease = Lease()
        self.weight_leases.append(lease)
        return self.weight, lease

    def writable_weight(self):
        if _in_use(self.weight_leases):
            self.weight = self.arrays.copy(self.weight)
        self.weight_leases = []
        return self.weight

    def writable_merge(self):
        """The buffer a round's sum is made in: the weight's dtype, float32 for bfloat16."""
        if self.merge is None or _in_use(self.merge_leases):
            wide = 'float32' if self.dtype == 'bfloat16' else None
            self.merge = self.arrays.empty_like(self.weight, wide)
        self.merge_leases = []
        return self.merge

    def take_summed(self):
        """The round's gradient (a received buffer or the merge buffer), handed to the
        update; the next round starts afresh."""
        summed, self.summed = self.summed, None
        return summed
