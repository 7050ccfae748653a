"""The distributed backend of a KVStore on a worker: splits keys, pipelines requests, waits.

Pushes return as soon as their messages are queued; errors they meet are raised by the next
call that waits (pull, barrier, close), in whichever thread makes it. Pulls and barriers block,
bounded by KVPS_TIMEOUT. API threads may call at once: what they share here (the push window,
push counts, barrier numbers) changes under locks never held while waiting.
"""

import collections
import os
import threading

import numpy as np

from ..allocator import keep_freed_memory
from ..errors import ConfigError, KVPSError
from ..timeline import recording
from ..timeline.counters import WorkerCounts
from ..wire import protocol as P
from ..wire.device_segments import DEVICE_BASE
from ..wire.items import PullItem, PushItem, new
from .collectives import Collectives, refuse_updater
from .credit import Credit
from .device_staging import device_route
from .joining import JobNotes, Members
from .loop import SCHEDULER, WorkerIO
from .messages import (copier, describe, fuse, fuse_bytes, landing_on_gpu, part_nbytes, payload,
                       pull_targets, pushpull_waves, server_name)
from .pending import SYNC_ROUND_HINT, Operation, PushWindow, Request
from .row_requests import RowRequests
from .sharding import Sharding


# Forks between this process and the one that started, counted in each child: a store asks
# at every call whether it runs in a fork of its worker, and a count costs less than
# os.getpid(), a system call.
_FORKS = [0]
os.register_at_fork(after_in_child=lambda: _FORKS.__setitem__(0, _FORKS[0] + 1))


class DistClient(RowRequests):
    """One worker's membership in a job; at most one per process. A KVStore's backend: it
    conforms to kvps.kvstore.backend.Backend, where each method's contract is written. The
    collective calls (init, the optimizer and its states) are its Collectives'."""

    def __init__(self, config, sync):
        self.config = config.require_worker().require_cluster()
        self.sync = sync
        self.pid = os.getpid()    # the only process that may use it (a fork has no I/O thread)
        self._forks = _FORKS[0]
        keep_freed_memory(config.malloc_trim_bytes)
        self.counts = WorkerCounts()   # kv.stats()
        self.io = WorkerIO(config, self.counts)
        self.io.start()
        # Outlast the I/O thread's own registration bound, so its error (naming who is missing)
        # is the one raised.
        bound = config.connect_timeout + 10 + 2 * config.heartbeat_interval
        if not self.io.ready.wait(bound) or self.io.fatal is not None:
            self.io.stop(1.0)
            raise self.io.fatal or RuntimeError('worker I/O thread did not start')
        welcome = self.io.welcome
        self.rank = welcome['rank']
        recording.name_node(self.rank, f'worker {self.rank}')
        self.num_servers = welcome['num_servers']
        self.num_hosts = welcome.get('hosts') or 1
        self.sharding = Sharding(self.num_servers, config.bigarray_bound,
                                   config.partition_bytes)
        # elastic: keys stay whole, so that one server decides each round (docs/elastic.md)
        self.sharding.keep_whole = welcome.get('elastic', False) and sync
        self._window = PushWindow(config.max_inflight_bytes, self.counts)
        self._errors = collections.deque()     # errors of pushes, raised at the next wait
        self._lock = threading.Lock()   # push counts, barrier numbers, closing
        self._barrier_seq = welcome.get('barriers', 0)   # (a joiner's: the job's so far)
        self._pushes = {}         # key -> pushes made of it (sync: the lr scheduler's step)
        self._step = 0            # the most of any key
        self.keys = {}            # key -> (shape, dtype name), for every store of this process
        self.closed = False
        self._collectives = Collectives(self.config, sync, self.rank, self.sharding,
                                        self._request, self.barrier, self.wait_pushes,
                                        lambda: self._step)
        self.members = Members(self.io, sync, self._pushes)
        self._collectives.joining = self.members.joining
        self.notes = JobNotes(self.io, self._request, self.config, self.sharding, self._pushes)

    # The job's member workers now (an elastic job's change as workers leave and join)
    num_workers = property(lambda self: len(self.io.membership[1]))
    joining = property(lambda self: self.members.catching_up)

    def on_membership_change(self, callback):
        self.members.callback = callback

    @property
    def forked(self):
        """Whether this process is a fork of the worker that made the client (no I/O thread)."""
        return self._forks != _FORKS[0]

    def parts(self, key, size):
        return [(p.server, p.part, p.start, p.stop) for p in self.sharding.parts(key)]

    def set_updater(self, fn):
        refuse_updater(fn)   # (no Python runs on servers)

    # -- setup: collective (Collectives) or this worker's ----------------------------------
    def init(self, items, device=False):
        """Initialize keys collectively: Collectives.init."""
        self._collectives.init(items, device)

    def set_optimizer(self, spec):
        self._collectives.set_optimizer(spec)

    def get_states(self, dump_optimizer):
        return self._collectives.get_states(dump_optimizer)

    def set_states(self, per_server):
        self._collectives.set_states(per_server)

    def balance_keys(self, total):
        """A model of ``total`` elements is about to be initialized: see Sharding.balance."""
        self.sharding.balance(total)

    def keep_keys_whole(self):
        """Keys initialized from now on go to one server each (Backend.keep_keys_whole)."""
        self.sharding.keep_whole = True

    def scale_rounds(self):
        """Backend.scale_rounds: rounds scaled to DMLC_NUM_WORKER in an elastic dist_sync job."""
        if self.sync and self.io.welcome.get('elastic'):
            self._collectives.scale_to = self.config.num_workers
            return self.config.num_workers
        return None

    # -- data -----------------------------------------------------------------------------
    def stage(self, sizes, device=False):
        """Staging.stage (``device``: blocks of its device segment), or None each (anywhere)."""
        staging = self.io.staging
        return [None] * len(sizes) if staging is None else staging.stage(sizes, device)

    def device_written(self, stream=None):
        self.io.staging.device.record(stream)   # (asked only where it gave device blocks)

    def device_buffer(self, nbytes):
        device = self.io.staging.device   # (asked only where device_route is direct)
        return None if device is None else device.hold(nbytes)

    def device_route(self, device=None):
        return device_route(self.io, self.config, device)

    def push(self, items, priority=0):
        """Send each ``(key, flat, dtype)`` (``flat``: a kvps-owned contiguous copy, maybe in a
        block from ``stage``) to the key's servers, small parts fused into one message per
        server, ahead of queued requests of a lower ``priority``; do not wait."""
        self._push(items, priority, paced=False)

    def _push(self, items, priority, paced):
        """``push``; ``paced``: a pushpull's wave, which the I/O thread never holds back."""
        self._raise_pending_errors()
        self.members.catching_up = False
        self.counts.push_calls += 1
        step = self._count_pushes(items)
        nbytes = sum(sum(p.nbytes for p in flat) if type(flat) is list else flat.nbytes
                     for _, flat, _ in items)
        self._window.make_room(nbytes, self.config.timeout, self._hint)
        staging = self.io.staging
        parts = []   # (key, part, its payload, dtype, its offset in shared memory or None)
        for key, part, flat, dtype in self._parts_of(items):
            data = payload(part, flat)
            at = None if staging is None else staging.offset_in(server_name(part.server), data)
            parts.append((key, part, data, dtype, at))
        batches = fuse(parts, lambda item: 0 if item[4] is not None else item[2].nbytes,
                       most_bytes=fuse_bytes(self.config))
        op = Operation(describe('push', items), len(batches), on_error=self._errors.append,
                       counts=self.counts)
        self._send_pushes(batches, op, step, priority, paced)
        self._window.add(op, nbytes)

    def _send_pushes(self, batches, op, step, priority, paced):
        """One PUSH per batch, each item numbered (its ``seq``) as it is made: numbering and
        queueing under one lock keep a key part's pushes to a server in the order of their
        numbers, whichever threads push at once."""
        counts, in_bytes = self.io.push_counts, P.SIZED_IN_BYTES
        pusher = None if paced else threading.get_ident()   # (see pending.Request)
        with counts.lock:
            for server, batch in batches:
                node = server_name(server)
                numbered = counts.of(node)
                keys, frames, keep = [], [], []
                socket, shm = 0, [0, 0]   # (per message); shm[1]: the device segment's
                for key, part, data, dtype, at in batch:
                    where = (key, part.part)
                    seq = numbered.get(where, 0)
                    numbered[where] = seq + 1
                    n = data.nbytes if dtype in in_bytes else part.stop - part.start
                    keys.append(new(PushItem, (key, where[1], dtype, n, at, seq)))
                    if at is None:
                        frames.append(data)
                        socket += data.nbytes
                    else:
                        keep.append(data)
                        shm[at >= DEVICE_BASE] += data.nbytes
                self.counts.pushed_socket += socket
                self.counts.pushed_shm += shm[0]
                self.counts.pushed_ipc += shm[1]
                header = {'op': P.PUSH, 'sync': self.sync, 'keys': keys}
                if step:
                    header['step'] = step
                if priority:
                    header['priority'] = priority
                self._submit(server, header, frames,
                             Request(op, node, keep=keep, pusher=pusher))

    def _count_pushes(self, items):
        """The step a sync push carries (None in async): without it a server whose keys are
        pushed less often than others' would count fewer updates, and run its lr schedule
        behind the rest (split keys would even get two learning rates)."""
        if not self.sync:
            return None
        pushes = self._pushes
        with self._lock:   # threads pushing at once must not lose a count or lower the step
            for key, _, _ in items:
                count = pushes[key] = pushes.get(key, 0) + 1
                if count > self._step:
                    self._step = count
            return self._step

    def pull(self, items, priority=0, codec=None):
        """Fill each ``out`` of ``items`` ([(key, out, dtype)]: writable numpy arrays, as the
        store checks them) with the key's value once this worker's pushes of it are applied.
        Every request leaves before any answer is awaited, and small parts share one message
        per server. ``codec``: float32 and float64 values travel rounded to it."""
        self._raise_pending_errors()
        self.pull_begin(items, priority, codec)()

    def pull_begin(self, items, priority=0, codec=None):
        """Send the pull requests of ``items`` now; returns the wait for their answers."""
        sent = self._send_pulls(items, priority, codec)
        return lambda: self._finish_pull(*sent)

    def pushpull(self, runs, pulls, priority=0, codec=None):
        """Backend.pushpull in waves, each one's pull requests right behind its pushes:
        results flow back while later keys are pushed (both directions of a link busy), and
        a wave leaves once the earlier ones fit in the credit (kvps.worker.credit)."""
        self._raise_pending_errors()
        credit, sent = Credit.of(self.config.pushpull_credit, runs), []
        for pushes, wave, nbytes in pushpull_waves(runs, pulls, self.sharding, self.io.staging):
            credit.admit(nbytes)
            self._push(pushes, priority, paced=True)
            sent.append(self._send_pulls(wave, priority, codec))
            credit.add(sent[-1][0].done, nbytes)
        for waited in sent:
            self._finish_pull(*waited)

    def _send_pulls(self, items, priority, codec=None):
        """Send the pull requests of ``items``; returns what ``_finish_pull`` waits on. The
        parts are listed with the dtype their values travel in (``codec``'s, if it rounds
        them), which sizes their frames and shared-memory blocks."""
        targets, finish, landings = pull_targets(items, codec)
        staging = self.io.staging

        def wire_bytes(item):
            nbytes = part_nbytes(item)
            in_shm = staging is not None and staging.would_place(server_name(item[1].server),
                                                                 nbytes)
            return 0 if in_shm else nbytes
        batches = fuse(self._parts_of(targets), wire_bytes, most_bytes=fuse_bytes(self.config))
        self.counts.pull_calls += 1
        op = Operation(describe('pull', items), len(batches), counts=self.counts)
        for server, batch in batches:
            node = server_name(server)
            blocks = [None] * len(batch) if staging is None else staging.blocks_for(
                node, [(part_nbytes(item), (item[0], item[1].part)) for item in batch],
                landing_on_gpu(batch, codec, staging))
            header = {'op': P.PULL, 'keys': [
                new(PullItem, (key, part.part, None if block is None else block[0]))
                for (key, part, _, _), block in zip(batch, blocks)]}
            if priority:
                header['priority'] = priority
            if codec is not None:
                header['codec'] = codec
            self._submit(server, header, (),
                         Request(op, node, copier(batch, blocks, staging, node, self.counts,
                                                  self.io.trace, landings), keep=blocks))
        return op, finish

    def _finish_pull(self, op, finish):
        op.wait(self.config.timeout, self._hint)
        for out, target in finish:
            np.copyto(out, target.reshape(out.shape))
        # A push whose round failed on a server (its update raised) was answered before this
        # pull: the pull after it raises that error, as a local store's push does.
        self._raise_pending_errors()

    def _parts_of(self, items):
        """``(key, part, array, dtype)`` for every part of every item, in order."""
        return [(key, part, array, dtype) for key, array, dtype in items
                for part in self.sharding.parts(key)]

    def barrier(self, digest=None, call='barrier'):
        """Return when every worker is here and this worker's pushes are all applied: the
        ranks whose ``digest`` (bytes) differs from rank 0's, [] when all agree. ``call``: the
        store call it is part of (workers meeting from different ones raise ConfigError). An
        elastic job's joiner meets no one before its first push (the job is past its setup)."""
        if self.members.catching_up:
            return []
        return self._meet(digest=digest, call=call).get('differs', [])

    def all_sum(self, values):
        """A barrier at which every worker brings ``values`` (float64 bytes); their sum, as
        bytes, which the scheduler adds up (ConfigError where the workers' calls differ)."""
        if self.members.catching_up:
            raise ConfigError('all_sum: this worker joined a running elastic job and meets the '
                              'others only from its first push on; call it after a step')
        reply = self._meet(values=values, call='all_sum')
        if 'sum' not in reply:
            raise ConfigError(f'all_sum: {reply.get("sum_error", "no sum came back")}')
        return reply['sum']

    def _meet(self, digest=None, values=None, call='barrier'):
        """The job's next barrier, this worker's pushes applied first: the scheduler's
        answer (BARRIER_DONE's fields), once every worker has come (from the same ``call``)."""
        self.wait_pushes()
        with self._lock:   # one number per barrier, whichever threads call at once
            self._barrier_seq += 1
            seq = self._barrier_seq
        header = {'op': P.BARRIER, 'id': seq, 'seq': seq, 'call': call}
        if digest is not None:
            header['digest'] = bytes(digest)
        if values is not None:
            header['sum'] = bytes(values)
        answer = {}
        op = Operation('barrier', 1, counts=self.counts)
        self.io.submit(SCHEDULER, header, (), Request(
            op, SCHEDULER, lambda reply, _: answer.update(reply)))
        op.wait(self.config.timeout, '; a barrier returns once every worker has called it, each '
                                     'with its pushes applied')
        if 'mismatch' in answer:
            raise ConfigError(answer['mismatch'])
        return answer

    def wait_pushes(self):
        """Block until every push so far, of any thread, is acknowledged; raise the first
        error met."""
        self._window.wait_all(self.config.timeout, self._hint)
        self._raise_pending_errors()

    def stats(self):
        return self.counts.as_dict(self._step if self.sync else self.counts.push_calls,
                                   self.io.in_flight, self._window.nbytes)

    def close(self):
        """Flush, tell the scheduler this worker is done, stop the I/O thread. Idempotent.
        Not meant to race with calls from other threads: one still under way when the I/O
        thread stops raises StoreClosedError (a later one does on entry). In a process forked
        from this worker it does nothing: the job is the parent's to leave."""
        if self.forked:
            return
        with self._lock:   # two threads closing at once would send two FINISHes
            if self.closed:
                return
            self.closed = True
        try:
            if self.io.fatal is None:
                try:
                    self.wait_pushes()
                except KVPSError as exc:   # the job ends now, with why: a worker that went
                    self.io.abort(f'could not finish: {exc}', 2.0)   # on left it to time out
                    raise
                op = Operation('finish', 1)
                self.io.submit(SCHEDULER, {'op': P.FINISH, 'id': -1}, (), Request(op, SCHEDULER))
                op.wait(min(self.config.timeout, 30.0))
        finally:
            self.io.stop(5.0)

    def abandon(self, reason=None):
        """Stop without finishing: this process is failing. With a ``reason``, the scheduler
        is told (best effort, bounded), so the job ends now with it instead of the other
        workers waiting for this one until its silence is noticed."""
        if not self.closed:
            self.closed = True
            if reason is None:
                self.io.stop(1.0)
            else:
                self.io.abort(reason, 2.0)   # its link lingers up to 2 s to deliver it

    # -- helpers --------------------------------------------------------------------------
    def _request(self, server, what, header, buffers=(), on_data=None):
        """One message to one server, as an Operation to wait on."""
        op = Operation(what, 1, counts=self.counts)
        self._submit(server, header, buffers, Request(op, server_name(server), on_data))
        return op

    def _submit(self, server, header, buffers, request):
        self.io.submit(server_name(server), header, buffers, request)

    def _hint(self):
        """What may hold up a call that timed out (asked then): servers the job waits for to
        rejoin; else, in dist_sync, a round some worker has not pushed into."""
        lost = self.io.lost_servers
        if lost:
            return (f'; the job lost {", ".join(lost)} and waits for a replacement '
                    '(KVPS_RECOVERY_TIMEOUT, here longer than KVPS_TIMEOUT)')
        return SYNC_ROUND_HINT if self.sync else ''

    def _raise_pending_errors(self):
        if self.io.membership[0] != self.members.epoch:
            self.members.moved()
        if self._errors:
            try:
                exc = self._errors.popleft()
            except IndexError:   # another thread has just taken it to raise
                exc = None
            if exc is not None:
                self._errors.clear()
                raise exc
        if self.io.fatal is not None:
            raise self.io.fatal
