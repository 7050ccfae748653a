"""The in-process backend for 'local' and 'device' stores: the server's Shard, no sockets."""

import functools
import os
import threading

import numpy as np

from .. import rows
from ..arrays import flat_view
from ..compression import land_pulled, pulled_dtype, round_pulled
from ..errors import ConfigError
from ..server import ledger
from ..server.records import ReplyKind
from ..server.row_store import LIVE
from ..server.shard import Shard
from ..timeline.counters import WorkerCounts
from ..wire.protocol import PUSH_CODECS

_ME = b'local'


class FunctionUpdater:
    """MXNet's push updater: ``fn(key, merged, stored)`` changes ``stored`` in place, given as
    numpy arrays of the key's shape. It runs in this process, where the caller wrote it."""

    def __init__(self, fn, shape_of):
        self.fn, self._shape_of = fn, shape_of
        self._failure = None

    def update(self, key, weight, grad, part=0):
        if isinstance(grad, tuple):   # a round's pushes handed over unsummed
            grad = np.add.reduce(grad)
        shape = self._shape_of(key)
        try:
            self.fn(key, grad.reshape(shape), weight.reshape(shape))   # views: in place
        except Exception as exc:  # the push raises it once its round is closed, so the
            self._failure = self._failure or exc   # store stays usable (pulls see the key)

    def raise_failure(self):
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def update_many(self, items, step=0, failures=None):
        """A Python updater has no lr scheduler: ``step`` means nothing to it; its failure is
        raised by the push (raise_failure), not kept per key."""
        for key, part, weight, grad in items:
            self.update(key, weight, grad, part)

    def retune(self, spec):
        return False     # an optimizer set later replaces the function

    def get_states(self, dump_optimizer, step=None):
        raise ConfigError('the store runs a Python updater (set with _set_updater): it keeps '
                          'no optimizer state kvps can save')

    set_states = checked_states = get_states


class LocalNotes:
    """Backend.notes of a job that is this one process: its one member, blobs in a dict."""

    me = (0, 0)
    epoch = 0

    def __init__(self, shard):
        self._shard, self._blobs = shard, {}

    def rounds(self):
        return max((entry.version for entry in self._shard.entries.values()), default=0)

    def claim(self, key, epoch, size, count):
        entry = self._shard.entries.get((key, 0))
        header = {'key': key, 'part': 0, 'epoch': epoch, 'size': size, 'count': count,
                  'round': 0 if entry is None else entry.version}
        (reply,) = ledger.claim(self._shard, None, _ME, header)
        return reply.payload['positions'], reply.payload['end']

    def members(self):
        return [self.me]

    def put(self, name, blob):
        self._blobs[name] = bytes(blob)

    def get(self, name):
        return self._blobs.get(name, b'')


def _serialized(method):
    """One call at a time: the shard's rounds are not thread-safe, and a store may be shared
    by the threads of a process (MXNet's engine serializes calls too)."""
    @functools.wraps(method)
    def serialized(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return serialized


class LocalBackend:
    """One process is the whole job: rank 0 of 1, every push is a complete round. A
    kvps.kvstore.backend.Backend: the contracts of its methods are written there."""

    rank = 0
    num_workers = 1
    joining = False   # (one process is the whole job)
    num_servers = 1
    num_hosts = 1
    sync = True
    forked = False   # plain memory and no threads of its own: a forked child may use its copy

    def __init__(self):
        self.shard = Shard(num_workers=1)
        self.lock = threading.RLock()
        self.keys = {}            # key -> (shape, dtype name), as the KVStore checks them
        self.closed = False
        self.pid = os.getpid()
        self.counts = WorkerCounts()   # calls only: nothing travels
        self.notes = LocalNotes(self.shard)

    def on_membership_change(self, callback):
        """One process is the whole job: its workers never change."""

    @_serialized
    def init(self, items, device=False):
        """In this process, keys stay in host memory; device values are summed on their GPU
        before they get here."""
        for key, flat, shape, dtype in items:
            self.shard.init(None, key, 0, dtype, shape, True, memoryview(flat).cast('B'))

    def stage(self, sizes, device=False):
        """Pushes are applied before push returns: a copy anywhere will do."""
        return [None] * len(sizes)

    def device_written(self, stream=None):
        """No device blocks are ever given here."""

    def device_buffer(self, nbytes):
        return None

    def device_route(self, device=None):
        return False, 'pinned host buffers <-> this process\'s own store'

    @_serialized
    def push(self, items, priority=0):
        """Applied at once: ``priority`` orders nothing in one process (as in every pull)."""
        self.counts.push_calls += 1

        def push_each():   # updates together, as a server does for one message
            replies = []
            for key, flat, dtype in items:
                data = flat[0] if dtype in PUSH_CODECS else flat   # encoded: one part
                replies += self.shard.push(None, _ME, key, 0, dtype, True,
                                           memoryview(data).cast('B'))
            return replies
        replies = self.shard.together(push_each)
        if isinstance(self.shard.updater, FunctionUpdater):
            self.shard.updater.raise_failure()
        for reply in replies:   # a key the optimizer could not update
            if reply.kind is ReplyKind.ERROR:
                raise reply.payload

    def pushpull(self, runs, pulls, priority=0, codec=None):
        """Each run pushed, then its keys pulled: nothing to overlap in one process."""
        done = 0
        for run in runs:
            self.push(run)
            self.pull(pulls[done:done + len(run)], codec=codec)
            done += len(run)

    def pull_begin(self, items, priority=0, codec=None):
        """Pull now (nothing is in flight in one process); the wait is a no-op."""
        self.pull(items, codec=codec)
        return lambda: None

    @_serialized
    def pull(self, items, priority=0, codec=None):
        """With a ``codec``, values are rounded as a server answers such a pull."""
        self.counts.pull_calls += 1
        for key, out, dtype in items:
            (reply,) = self.shard.pull(None, _ME, key, 0)
            value, lease = reply.payload.array, reply.payload.lease
            flat = flat_view(out)
            target, value = (flat, value) if flat is not None else \
                (out, value.reshape(out.shape))
            if pulled_dtype(codec, dtype) != dtype:
                land_pulled(target, round_pulled(value, codec))
            else:
                np.copyto(target, value)
            lease.released = True

    def pull_rows_begin(self, items, priority=0):
        """Pull the rows now (nothing is in flight in one process); the wait is a no-op."""
        self.pull_rows(items)
        return lambda: None

    @_serialized
    def pull_rows(self, items):
        """As DistClient.pull_rows: some rows of each key into its table."""
        for key, table, ids, marks in items:
            since = marks.get(0) if ids is None else None
            asked = None if ids is None else memoryview(ids).cast('B')
            (reply,) = self.shard.pull(None, _ME, key, 0, (asked, since))
            answer = reply.payload
            got, values = rows.decode(answer.data, table.shape[1], table.dtype, table.shape[0])
            table[got] = values
            if ids is None:
                marks[0] = [answer.epoch, answer.count]

    @_serialized
    def pull_live_begin(self, items, priority=0):
        """As DistClient.pull_live_begin, answered at once."""
        for key, width, dtype, sink in items:
            (reply,) = self.shard.pull(None, _ME, key, 0, (None, LIVE))
            sink.append(rows.decode(reply.payload.data, width, dtype,
                                    self.shard.entries[key, 0].n // width))
        return lambda: None

    @_serialized
    def set_optimizer(self, spec):
        self.shard.set_optimizer(spec)

    @_serialized
    def set_updater(self, fn):
        self.shard.updater = FunctionUpdater(fn, lambda key: self.shard.entries[key, 0].shape)

    @_serialized
    def get_states(self, dump_optimizer):
        return [self.shard.get_states(dump_optimizer)]

    @_serialized
    def set_states(self, per_server):
        self.shard.set_states(per_server[0])

    def keep_keys_whole(self):
        pass      # one shard holds every key whole

    def balance_keys(self, total):
        pass

    def scale_rounds(self):
        return None   # one worker: its rounds never change size

    def parts(self, key, size):
        return [(0, 0, 0, size)]

    def barrier(self, digest=None, call='barrier'):
        return []     # one worker always agrees with itself

    def all_sum(self, values):
        return bytes(values)   # one worker's values are the sum

    def wait_pushes(self):
        pass

    def stats(self):
        """As DistClient.stats: every push is a round, and nothing is ever in flight."""
        return self.counts.as_dict(self.counts.push_calls, 0, 0)

    def close(self):
        self.closed = True
