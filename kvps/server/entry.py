"""One key part on a server (Entry: its weight, rounds, buffers) and the Leases on its buffers."""

import dataclasses
import math
from typing import NamedTuple

from ..wire.items import new
from . import members, row_store
from .records import Pulled
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


class Queued(NamedTuple):
    """A push for a later round than the open one (a fast worker's), kept untouched."""
    worker: object
    round: int
    data: object
    token: object
    step: int


class Deferred(NamedTuple):
    """A pull waiting for a round to complete."""
    need: int       # the version it must see
    token: object
    rows: object    # None for the whole value, else (ids, since) as row_store.answer takes them


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
    summed: object = None   # the gradient to apply: a received array, merge, or a pair of them
    version: int = 0                      # rounds completed (sync) / pushes applied (async)
    step: int = 0                         # sync: the open round's pushes' highest step
    pushed: dict = dataclasses.field(default_factory=dict)   # worker -> pushes received
    merged: set = dataclasses.field(default_factory=set)     # workers in the open round
    held: list = dataclasses.field(default_factory=list)     # tokens acked at round end
    queued: list = dataclasses.field(default_factory=list)   # Queued pushes
    rows: list = dataclasses.field(default_factory=list)     # the open round's row pushes
    deferred: list = dataclasses.field(default_factory=list)   # Deferred pulls
    rowlog: row_store.RowLog = dataclasses.field(default_factory=row_store.RowLog)
    live: object = None      # after a push of rows replaced the value: its rows (zeros elsewhere)
    weight_leases: list = dataclasses.field(default_factory=list)
    merge_leases: list = dataclasses.field(default_factory=list)
    restored: bool = False                # from a checkpoint, not yet claimed by an init
    arrays: object = dataclasses.field(default_factory=HostArrays)   # where the arrays live
    device: bool = False                  # a device-side store asked for the GPU
    # the weight as compressed pulls answer it: (version, weight, codec, rounded copy), shared
    # by every such pull until the weight changes (the copy is never written)
    rounded: tuple = None
    # elastic jobs (kvps.server.members): the open round's (worker, data), and the joiners
    # whose first round is a later one (worker -> that round)
    pushes: list = dataclasses.field(default_factory=list)
    late: dict = dataclasses.field(default_factory=dict)
    # elastic jobs: each round's sum is scaled to this many workers (0: summed as pushed)
    scale_to: int = 0
    # workers in the open round without a gradient (members.abstain)
    abstained: int = 0
    # an elastic Sampler's claim ledgers tied to this key part's rounds (kvps.server.ledger)
    claims: object = None

    @property
    def n(self):
        return self.weight.size

    @property
    def pushers(self):
        """The workers whose gradients the open round sums (its abstentions left out)."""
        return len(self.merged) - self.abstained

    @property
    def whole_shape(self):
        """The key's shape if this entry holds all of it, else None (a part of a split key)."""
        return self.shape if self.n == math.prod(self.shape) else None

    def needed_by(self, worker):
        """The version a pull by ``worker`` must see: in sync, that of the round of its
        latest push (a pull waits until then); else any."""
        return self.pushed.get(worker, 0) if self.sync else 0

    def holds(self, dtype, shape):
        """Whether this is the key a worker describes as ``shape`` of ``dtype``."""
        return self.dtype == dtype and self.shape == tuple(shape)

    def pulled(self):
        """The Pulled value for a pull reply: in host memory the weight itself, not a copy.
        Replies leave the process after later updates may run, so writers copy a lent buffer
        first (copy-on-write): a pull costs no copy unless an update overtakes its send. From
        a device, a fresh host copy (nothing to lease)."""
        lease = Lease()
        if not self.arrays.lends:
            lease.released = True
            return new(Pulled, (self, self.arrays.to_host(self.weight), lease))
        if self.weight_leases:
            self.weight_leases = [l for l in self.weight_leases if not l.done]
        self.weight_leases.append(lease)
        return new(Pulled, (self, self.weight, lease))

    def ready_pulls(self):
        """The Deferred pulls whose round has completed, taken out of ``deferred``."""
        ready, waiting = [], []
        for pull in self.deferred:   # (one pass: most keys hold one pull)
            (ready if pull.need <= self.version else waiting).append(pull)
        self.deferred = waiting
        return ready

    def count_update(self, failure, ids=None):
        """A round (sync) or push (async) is over, updated or failed: a failed one is not
        retried (its pushers get the error), so the key goes on with the next. ``ids``: the
        only rows it changed (a row update)."""
        self.version += 1
        self.step = 0
        self.live = None
        if failure is None:
            if ids is None:
                self.rowlog.changed_all()
            else:
                self.rowlog.changed_rows(ids, row_store.num_rows(self))

    def drop_rounds_from(self, made):
        """Rounds from index ``made`` on can never complete (a worker finished after ``made``
        pushes): drop them; returns the tokens of the pushes and pulls that waited for them."""
        doomed = []
        if self.version >= made and self.merged:
            doomed += self.held
            self.held, self.merged, self.summed, self.rows = [], set(), None, []
            self.pushes, self.abstained = [], 0
        doomed += [q.token for q in self.queued if q.round >= made]
        self.queued = [q for q in self.queued if q.round < made]
        doomed += [d.token for d in self.deferred if d.need > made]
        self.deferred = [d for d in self.deferred if d.need <= made]
        return doomed

    def next_round(self):
        """A round is over: its kept pushes and abstentions go, and joiners whose first round
        opens count."""
        self.pushes, self.abstained = [], 0
        if self.late:
            self.late = {w: first for w, first in self.late.items() if first > self.version}

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
        update; the next round starts afresh. A sync round of another size than the key's
        ``scale_to`` is scaled to it (members.scaled). It may be a tuple (sum so far, last
        push: Shard._add_to_round), which the update adds in its own pass."""
        self.arrays.reading(self.summed)
        if self.abstained and self.summed is None:   # nobody pushed a gradient: zeros
            self.summed = members.zeros(self)
        if self.scale_to and self.sync and self.pushers not in (self.scale_to, 0):
            return members.scaled(self, self.pushers)
        summed, self.summed = self.summed, None
        return summed
