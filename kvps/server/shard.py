"""Pure key store of one server: init, sync rounds and async pushes, ordered pulls, updates.

Every method takes a ``token`` naming the request (opaque here: the loop uses it to address
the reply) and returns a list of Reply records (kvps.server.records). Nothing here touches a
socket, so every rule below is unit-tested directly.

Sync rounds: the n-th push of a key from a worker belongs to round n. A round completes when
every worker has pushed into it; only then is the update applied and the pushers acked.
A fast worker's push for a later round is queued, untouched, until its round opens. A pull
from a worker is answered once the round of that worker's latest push has completed, so
``pull`` after ``push`` always sees that round's result.
"""

import os

from .. import compression
from ..errors import (ConfigError, DTypeError, DuplicateInitError, KeyNotInitializedError,
                      ShapeError)
from ..timeline import recording
from ..wire.items import new
from ..wire.protocol import GRADIENT_CODECS, NOTHING, ROW_SPARSE
from . import members, row_store
from .entry import Deferred, Entry, Queued
from .flows import FlowNotes
from .optimizer_states import OptimizerStates
from .records import Reply, ReplyKind
from .row_store import RowGrad
from .storage import HostArrays, Storage

ACK, DATA, ERROR, ROWS = ReplyKind.ACK, ReplyKind.DATA, ReplyKind.ERROR, ReplyKind.ROWS
_CODED = frozenset(GRADIENT_CODECS)   # (a set: every push asks)


def _reply(token, failure):
    return new(Reply, (ACK, token, None) if failure is None else (ERROR, token, failure))


class Shard:
    """The keys one server holds and the rules for changing them."""

    def __init__(self, num_workers, updater=None, storage=None, elastic=False):
        self.num_workers = num_workers   # the members every round waits for (less late ones)
        # An elastic job's: the open rounds' pushes are kept, so that a lost worker's can be
        # taken out (kvps.server.members)
        self.keep_pushes = elastic
        # (an optimizer written in Python sees a key this server holds whole in its shape)
        self.optimizer = OptimizerStates(updater, lambda k, p: self.entries[k, p].whole_shape)
        self.storage = storage or Storage(HostArrays())   # host or a CUDA device
        self.entries = {}          # (key, part) -> Entry
        self.finished = {}         # worker -> pushes it made per key, frozen at finish
        self.updates = 0           # updates applied over all keys (drives checkpoints)
        self._due = None           # while gathering: (key, part) -> Entry whose update waits
        self._released = []        # while gathering: replies the applied updates freed
        # Names this shard's row change counts (kvps.server.row_store): a worker's count from
        # another shard (before a restart) asks for every row.
        self.epoch = int.from_bytes(os.urandom(7), 'little')
        self.flows = FlowNotes(self.entries)   # the rounds' arrows, while the timeline records

    # -- init -----------------------------------------------------------------------------
    def init(self, token, key, part, dtype, shape, sync, data, device=False, scale_to=0):
        """``device``: a device-side store asks for the key on this server's GPU;
        ``scale_to``: its rounds are scaled to that many workers (members.scaled)."""
        members.check_scale(key, dtype, scale_to)
        existing = self.entries.get((key, part))
        if existing is not None and existing.restored:
            existing.scale_to = scale_to
            return self._claim_restored(token, existing, dtype, shape, sync, len(data), device)
        if existing is not None:
            raise DuplicateInitError(f'key {key!r} is already initialized')
        self.entries[(key, part)] = self.new_entry(key, part, dtype, shape, sync, data, device,
                                                   scale_to=scale_to)
        return [Reply(ACK, token, None)]

    def new_entry(self, key, part, dtype, shape, sync, data, device, **more):
        """An Entry holding a copy of ``data`` where its placement says."""
        arrays = self.storage.for_key(device)
        return Entry(key, part, dtype, tuple(shape), sync, arrays.owned(data, dtype),
                     arrays=arrays, device=device, **more)

    def _claim_restored(self, token, entry, dtype, shape, sync, nbytes, device):
        """A resumed job inits a key the checkpoint holds: the checkpoint's value wins (moved
        to where this init asks for it)."""
        if not entry.holds(dtype, shape) or nbytes != entry.weight.nbytes:
            raise ShapeError(f'key {entry.key!r}: init with {tuple(shape)} {dtype}, but the '
                             f'checkpoint holds {entry.shape} {entry.dtype}')
        arrays = self.storage.for_key(device)
        if arrays is not entry.arrays:
            host = entry.arrays.to_host(entry.weight)
            entry.weight, entry.merge, entry.arrays = arrays.owned(host, dtype), None, arrays
        entry.restored, entry.sync, entry.device = False, sync, device
        return [Reply(ACK, token, None)]

    def check(self, token, key, part, dtype, shape, worker=None):
        """Confirm that another worker's view of a key matches what rank 0 initialized; the
        ack carries ``worker``'s count of pushes of it (sync), where an elastic job's joiner
        numbers its pushes from."""
        entry = self._entry(key, part)
        if not entry.holds(dtype, shape):
            error = ShapeError if tuple(shape) != tuple(entry.shape) else DTypeError
            raise error(f'key {key!r}: this worker has {tuple(shape)} {dtype}, but rank 0 '
                        f'initialized {entry.shape} {entry.dtype}')
        return [Reply(ACK, token, entry.pushed.get(worker, 0) if entry.sync else 0)]

    # -- push -----------------------------------------------------------------------------
    def push(self, token, worker, key, part, dtype, sync, data, seq=None, step=0):
        """``seq``: the worker's count of its earlier pushes of this key (None: not counted).
        A push whose ``seq`` is already counted was resent to a restarted server: it is
        acknowledged, not applied again. ``step`` (sync): the most pushes the worker has
        made of any key; the round's update counts at least that many (lr scheduler)."""
        entry = self._entry(key, part)
        if dtype in _CODED:   # a compressed gradient: decoded, then as any other push
            compression.check_compressible(key, entry.dtype, dtype)
            data = memoryview(compression.decode(dtype, data, entry.n, entry.dtype)).cast('B')
            dtype = entry.dtype
        elif dtype == ROW_SPARSE:   # some rows: merged and applied as rows (row_store)
            data, dtype = row_store.decode_push(entry, data), entry.dtype
        elif dtype == NOTHING:   # in the round without a gradient (members.abstain)
            data, dtype = members.abstain(entry, sync, worker), entry.dtype
        self._check_push(entry, dtype, sync, data)
        count = entry.pushed.get(worker, 0)
        if seq is not None and seq < count:
            return self._acknowledge_again(entry, seq, token)
        if not entry.sync:
            entry.pushed[worker] = count + 1 if seq is None else seq + 1
            if not self._gather(entry, type(data) is RowGrad):
                return [_reply(token, self._apply(entry, data))]
            entry.summed = entry.arrays.received(data, entry.dtype)   # applied by together
            entry.held.append(token)
            return []
        round_index = count
        if self.finished:   # (some worker is done: rounds it left open can never complete)
            members.check_round_possible(self.finished, entry, round_index)
        entry.pushed[worker] = round_index + 1
        if round_index > entry.version:   # a fast worker is ahead: keep it for its round
            entry.queued.append(Queued(worker, round_index, data, token, step))
            return []
        self._merge(entry, worker, data, token, step)
        return self.close_rounds(entry)

    @staticmethod
    def _acknowledge_again(entry, seq, token):
        """A resent push that was counted before: async pushes and completed rounds are
        acknowledged now; one of the open round (resent after a reconnect) with that round."""
        if not entry.sync or seq < entry.version:
            return [Reply(ACK, token, None)]
        entry.held.append(token)
        return []

    def _check_push(self, entry, dtype, sync, data):
        if dtype != entry.dtype:
            raise DTypeError(f'key {entry.key!r}: pushed {dtype}, initialized as {entry.dtype}')
        if type(data) is not RowGrad and data is not None and len(data) != entry.weight.nbytes:
            raise ShapeError(f'key {entry.key!r} part {entry.part}: pushed '
                             f'{len(data) // entry.weight.itemsize} elements, expected {entry.n}')
        if sync != entry.sync:
            mode = 'dist_sync' if entry.sync else 'dist_async'
            raise ConfigError(f'key {entry.key!r} was initialized by a {mode} store; every '
                              'worker must create the same kvstore type')

    def _merge(self, entry, worker, data, token, step=0):
        """Add one worker's push to the open round. The first is kept as received (the
        buffer stays valid until its ack) and added to the second straight into the merge
        buffer: the round's sum costs no copy. With an optimizer on float32/float64 keys
        (host or GPU) the last push is not added: the update gets (sum so far, last push)
        and adds them in its own pass, so the merge buffer is neither written nor read back.
        bfloat16 pushes are summed in float32, rounded once where the sum becomes the weight
        (an optimizer takes the float32 sum as it is)."""
        self.add_push(entry, worker, data)
        entry.held.append(token)
        entry.step = max(entry.step, step)

    def add_push(self, entry, worker, data):
        """Add ``worker``'s push ``data`` to ``entry``'s open round."""
        if type(data) is RowGrad:
            entry.rows.append(data)
        elif data is None:   # an abstention: counted in the round, adding nothing to it
            entry.abstained += 1
        else:
            self._add_to_round(entry, entry.arrays.received(data, entry.dtype),
                               len(entry.merged) + 1 == self.need(entry))
        entry.merged.add(worker)
        if self.keep_pushes:
            entry.pushes.append((worker, data))

    def need(self, entry):
        """How many pushes ``entry``'s open round waits for: every member's, less those of
        joiners whose first round is a later one."""
        return self.num_workers - len(entry.late) if entry.late else self.num_workers

    def _add_to_round(self, entry, grad, last=False):
        """Add a dense ``grad`` to the open round's sum (``last``: no push follows it)."""
        if entry.summed is None:
            entry.summed = grad
        elif (last and self.optimizer.updater is not None
              and entry.dtype in entry.arrays.sums_in_update):
            entry.summed = (entry.summed, grad)
        elif entry.summed is entry.merge:
            entry.arrays.add(entry.merge, grad, out=entry.merge)
        else:
            entry.summed = entry.arrays.add(entry.summed, grad, out=entry.writable_merge())

    def _round_gradient(self, entry):
        """The closing round's gradient: a RowGrad when only rows were pushed; else dense,
        with any pushed rows added in (their zeros count as elsewhere)."""
        pieces, entry.rows = entry.rows, []
        if not pieces:
            return entry.take_summed()
        grad = row_store.summed(entry, pieces)
        if entry.summed is None:
            return members.scaled_rows(entry, grad, entry.pushers)
        if type(entry.summed) is tuple:
            first, second = entry.summed
            entry.summed = None
            self._add_to_round(entry, first)
            self._add_to_round(entry, second)
        self._add_to_round(entry, row_store.dense(entry, grad))
        return entry.take_summed()

    def close_rounds(self, entry):
        """Apply every round that is now complete; answer what waited on it."""
        replies = []
        while len(entry.merged) == self.need(entry) and not self._gather(entry,
                                                                              bool(entry.rows)):
            failure = self._apply(entry)
            replies += self._finish_round(entry, failure)
        return replies

    def _finish_round(self, entry, failure=None):
        """The round's update is applied (or failed with ``failure``, which its pushers get;
        the pulls that waited for it get the weight as it is, after those errors): answer
        them, and merge the pushes queued for the next round."""
        kind, payload = (ACK, None) if failure is None else (ERROR, failure)
        replies = [new(Reply, (kind, token, payload)) for token in entry.held]
        entry.held, entry.merged = [], set()
        if entry.pushes or entry.late or entry.abstained:   # (kvps.server.members)
            entry.next_round()
        if entry.claims is not None:   # (an elastic Sampler's: kvps.server.ledger)
            replies += entry.claims.closed(entry.version)
        if entry.deferred:
            replies += [self._answer(entry, pull.token, pull.rows)
                        for pull in entry.ready_pulls()]
        if entry.queued:   # (most rounds have none: every worker pushes once per round)
            ready = [q for q in entry.queued if q.round == entry.version]
            entry.queued = [q for q in entry.queued if q.round != entry.version]
            for push in ready:
                self._merge(entry, push.worker, push.data, push.token, push.step)
        return replies

    # -- updates of many keys together (multi-tensor apply) -------------------------------
    def together(self, handle):
        """Run ``handle()`` (pushes of many keys, e.g. one message) with the optimizer updates
        it makes due gathered, then apply them in one multi-tensor pass: on a GPU many small
        keys cost a few kernel launches, not one each. Returns handle's replies and those
        that waited on the updates."""
        self._due, self._released = {}, []
        try:
            replies = handle()
        finally:   # even when handle fails part way, what it merged is applied, not lost
            try:
                while self._due:   # a finished round may merge, and complete, the next one
                    self._apply_due()
                released = self._released
            finally:
                self._due, self._released = None, []
        return replies + released

    def _gather(self, entry, rows=False):
        """Leave ``entry``'s update to the end of ``together`` if updates are gathered; a key
        met again first has the updates gathered so far applied (its order is kept). Row
        updates (``rows``) run at once, after those."""
        if self._due is None or self.optimizer.updater is None:
            return False
        if (entry.key, entry.part) in self._due:
            self._apply_due()
        if rows:
            return False
        self._due[(entry.key, entry.part)] = entry
        return True

    def _apply_due(self):
        due = list(self._due.values())
        self._due.clear()
        start = recording.now() if recording.RECORDER is not None else None
        failed = self.optimizer.update([(e.key, e.part, e.writable_weight(), e.take_summed())
                                    for e in due], max(e.step for e in due))
        if start is not None:
            self.flows.span(start, len(due), updating=due)
        for index, entry in enumerate(due):
            failure = failed.get(index)
            self._count_update(entry, failure)
            if entry.sync:
                self._released += self._finish_round(entry, failure) + self.close_rounds(entry)
            else:
                self._released += [_reply(t, failure) for t in entry.held]
                entry.held = []

    def _count_update(self, entry, failure, ids=None):
        entry.count_update(failure, ids)
        if failure is None:
            self.updates += 1

    def _apply(self, entry, data=None):
        """Run the update with one push's ``data`` (async) or, without it, the round's sum
        (sync); with no optimizer the value is replaced. Returns the exception that failed
        the update (the weight is then unchanged), or None."""
        if recording.RECORDER is None or self.optimizer.updater is None:
            return self._update(entry, data)   # (a replaced value: its message's span shows it)
        start = recording.now()
        failure = self._update(entry, data)
        self.flows.span(start, 1)
        return failure

    def _update(self, entry, data):
        if data is None:
            grad = self._round_gradient(entry)
        else:
            grad = data if type(data) is RowGrad else entry.arrays.received(data, entry.dtype)
        if type(grad) is RowGrad:
            updater = self.optimizer.updater
            if updater is None:
                return self._replace_rows(entry, grad)
            if not getattr(updater, 'updates_rows', False):
                grad = row_store.dense(entry, grad)   # the dense update it stands for
            else:
                return self._apply_rows(entry, grad)
        failure = None
        if self.optimizer.updater is not None:
            failure = self.optimizer.update([(entry.key, entry.part, entry.writable_weight(),
                                          grad)], entry.step).get(0)
        elif grad is entry.merge and grad.dtype == entry.weight.dtype:
            # the merge buffer becomes the weight, the old one scratch
            entry.weight, entry.merge = entry.merge, entry.weight
            entry.weight_leases, entry.merge_leases = [], entry.weight_leases
        else:
            entry.arrays.assign(entry.writable_weight(), grad)
        self._count_update(entry, failure)
        return failure

    def _replace_rows(self, entry, grad):
        """No optimizer: the value becomes the pushed rows, zeros elsewhere (as MXNet's); once
        it is such a value, a round costs its rows, not the whole part."""
        changed = row_store.replace(entry, entry.writable_weight(), grad)
        self._count_update(entry, None, changed)
        entry.live = grad.ids.copy()   # (a view of the received message)
        return None

    def _apply_rows(self, entry, grad):
        """Run the optimizer on the rows of ``grad`` only (MXNet's lazy update)."""
        failure = self.optimizer.update_rows(entry.key, entry.part, entry.writable_weight(),
                                             grad.ids, grad.rows, row_store.width(entry))
        self._count_update(entry, failure, grad.ids)
        return failure

    # -- pull -----------------------------------------------------------------------------
    def pull(self, token, worker, key, part, rows=None):
        """The value of a key part once ``worker``'s pushes of it are applied; ``rows``:
        only some rows, ``(ids, since)`` as row_store.answer takes them (a 'rows' reply)."""
        entry = self._entry(key, part)
        if rows is not None:
            row_store.width(entry)   # a key split inside its rows says so now
            if rows[0] is not None:
                rows = row_store.requested(entry, rows[0]), None
        needed = entry.needed_by(worker)
        if needed > entry.version:
            entry.deferred.append(new(Deferred, (needed, token, rows)))
            return []
        return [self._answer(entry, token, rows)]

    def ready_for(self, worker, items):
        """The entries of a multi-key pull's ``items`` (PullItem) when every one exists and
        none waits for a round of ``worker``'s (the common case: the pull can be answered at
        once, whole); else None (``pull`` then takes each key its own way)."""
        entries, found = self.entries, []
        for item in items:
            entry = entries.get((item.key, item.part))
            if entry is None or entry.needed_by(worker) > entry.version:
                return None
            found.append(entry)
        return found

    def _answer(self, entry, token, rows):
        if rows is None:
            return new(Reply, (DATA, token, entry.pulled()))
        return Reply(ROWS, token, row_store.answer(entry, self.epoch, *rows))

    # -- the optimizer (OptimizerStates) ----------------------------------------------------
    @property
    def updater(self):
        """The optimizer's Updater (None: a push replaces the value)."""
        return self.optimizer.updater

    @updater.setter
    def updater(self, updater):
        self.optimizer.updater = updater

    def set_optimizer(self, spec, step=0):
        self.optimizer.set_optimizer(spec, step)

    def get_states(self, dump_optimizer, step=None):
        return self.optimizer.get_states(dump_optimizer, step)

    def set_states(self, states, stage=False, step=None):
        """OptimizerStates.set_states, each state checked against its key part's weight."""
        weights = {where: entry.weight for where, entry in self.entries.items()}
        self.optimizer.set_states(states, weights, stage, step)

    def commit_states(self, step=0):
        self.optimizer.commit_states(step)

    # -- lookup ---------------------------------------------------------------------------
    def _entry(self, key, part):
        entry = self.entries.get((key, part))
        if entry is None:
            raise KeyNotInitializedError(
                f'key {key!r} is not initialized on this server; call kv.init({key!r}, value) '
                'on every worker first (in the same order on every worker)')
        return entry
