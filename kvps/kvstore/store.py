"""KVStore, MXNet's KVStore API over a backend (in this process, or the job's servers), and
`create(name)`."""

import numpy as np

from .. import arrays, compression, rows
from ..errors import ConfigError, DuplicateInitError, KeyNotInitializedError, StoreClosedError
from ..optimizer import states
from ..timeline.recording import traced
from ..wire.protocol import NOTHING
from . import pulls, row_calls
from .base import KVStoreBase, registered
from .job import dist_backend, forked_message
from .keys import StoreKeys, checked_priority
from .local import LocalBackend
from .types import CAPABILITIES, check_compression_type, parse_type

_NOTHING = np.empty(0, np.uint8)   # the payload of an abstention (kvps.wire.protocol.NOTHING)


class KVStore(KVStoreBase):
    """Keys to arrays, shared by every worker of the job (MXNet's KVStore interface).

    The threads of a process may share a store, as ps-lite's KVWorker allows: push and pull
    may be called from several threads at once (a pull waiting on a server does not hold
    back another thread's push). Give each thread its own keys: in dist_sync every worker must
    push a key once per round, and a compressed key's residual is not shared between
    pushes made at once. The collective calls (init, set_optimizer, load_optimizer_states,
    barrier) must come in the same order on every worker, so make them from one thread. A
    push's error is raised by the next call that waits, in whichever thread. close() is not
    meant to race with other calls: a call still under way, or made after it, raises
    StoreClosedError.

    Besides MXNet's calls it has a few of kvps's own, which kvps.Trainer uses: pull_begin,
    pull_changed_rows_begin, pull_pushed_rows_begin, get/set_optimizer_states, agree, all_sum,
    balance_keys, keep_keys_whole and gradient_buffer."""

    OPTIMIZER = 'optimizer'    # MXNet's name of the one capability (is_capable)

    def __init__(self, name, backend):
        """``backend``: a kvps.kvstore.backend.Backend (LocalBackend, or the job's DistClient)."""
        self._type = name
        self._backend = backend
        # GPU values are taken by device stores only
        self._keys = StoreKeys(name, backend, device=parse_type(name)[2])
        self._codec = None         # gradient compression of pushes (set_gradient_compression)
        self._pull_codec = None    # the type pulls travel in ('fp16', 'bf16'), or None
        self._residuals = {}       # what compressed pushes have not sent yet, per key part

    # -- identity -------------------------------------------------------------------------
    @property
    def type(self):
        return self._type

    @property
    def rank(self):
        return self._backend.rank

    @property
    def num_workers(self):
        return self._backend.num_workers

    @property
    def num_hosts(self):
        """The hosts the job's workers and servers were on when it formed (kvps's)."""
        return self._backend.num_hosts

    @property
    def joining(self):
        """Whether this worker joined a running elastic job and has not pushed yet (a kvps
        extension): its init checks the job's keys, and set_optimizer is the job's."""
        return self._backend.joining

    @property
    def notes(self):
        """What an elastic job's Trainer reads of the job (Backend.notes; kvps's)."""
        return self._backend.notes

    def is_capable(self, capability):
        """MXNet's capability query: kvps stores can all run optimizers on the servers. As in
        MXNet, a capability it does not know is a ValueError (not False: a misspelled name
        must not read as "unsupported")."""
        if capability.lower() not in CAPABILITIES:
            raise ValueError(f'Unknown capability: {capability}')
        return True

    # -- the data API ---------------------------------------------------------------------
    @traced('init', 'init')
    def init(self, key, value):
        """Initialize keys (collective: every worker calls it; rank 0's values are stored)."""
        self._open()
        items = []
        for k, values in self._keys.pairs(key, value):
            if k in self._keys.meta:
                raise DuplicateInitError(f'key {k!r} is already initialized')
            if len(values) > 1:   # MXNet: a duplicate init of the key
                raise DuplicateInitError(f'init takes one value per key; key {k!r} got '
                                         f'{len(values)}')
            v = values[0]
            if rows.is_row_sparse(v):   # it has no shape of its own: the table's is unknown
                raise TypeError(f'key {k!r}: init takes a dense value of the whole key (zeros '
                                'for an embedding); rows are pushed once it exists')
            shape, dtype = arrays.shape_of(v), arrays.dtype_name(v)
            items.append((k, self._keys.host_copies([(k, [v])])[0], shape, dtype))
        self._backend.init(items, device=self._keys.device)
        for k, _, shape, dtype in items:
            self._keys.meta[k] = (shape, dtype)

    @traced('push', 'push')
    def push(self, key, value, priority=0):
        """Send values (a list per key is summed first); returns without waiting. Requests of
        a higher ``priority`` (an int) leave and are served ahead of lower ones still waiting,
        never ahead of this worker's earlier requests of the same key (MXNet's priority)."""
        self._open()
        priority = checked_priority(priority)
        # every key encoded before any leaves: sent wave by wave, a push followed by pulls of
        # the same keys ran slower (bench_hosts h4-64mb, fp16: 546 -> 751 ms). Each worker's
        # pull requests wait behind all of its pushes on the socket either way, and a worker
        # whose next pushes start sooner takes a late worker's link while its answers are due.
        self._backend.push([item for run in self._push_waves(key, value) for item in run],
                           priority)

    def abstain(self, key, priority=0):
        """Take part in each key's open sync round without a gradient (kvps's): the round
        waits for this worker, whose pull after it sees the round's result, but neither its
        sum nor the workers its scale divides by count it (an elastic joiner's Trainer)."""
        self._open()
        keys = [self._keys.check_key(k) for k in (key if isinstance(key, list) else [key])]
        self._backend.push([(k, [_NOTHING] * len(self._keys.parts(k)), NOTHING) for k in keys],
                           checked_priority(priority))

    def _push_waves(self, key, value):
        """What the backend sends for a push, in runs of items: every value checked before
        anything is sent, then kvps-owned copies, one run; with compression on, payloads
        encoded run by run as the caller takes them (a generator: a pushpull's first run and
        its pulls are on the link while the next is encoded)."""
        plain = None if self._codec is not None else self._keys.plain_copies(key, value)
        if plain is not None:   # (many keys of one numpy array each)
            return [plain]
        pairs = self._keys.pairs(key, value)
        sparse = {}
        for k, values in pairs:
            shape, dtype = self._keys.known(k)
            for v in values:
                if rows.is_row_sparse(v):
                    sparse[k] = True    # checked as its rows are read
                else:
                    arrays.check_like(v, shape, dtype, k, 'pushed value')
        codec = self._codec   # read once: another thread may turn compression off meanwhile
        dense = [p for p in pairs if p[0] not in sparse] if sparse else pairs
        if codec is not None:
            for k, _ in dense:
                compression.check_compressible(k, self._keys.meta[k][1], codec.name)
        if not sparse:
            return self._dense_waves(dense, codec)
        # some rows travel alone (never compressed), the rest as below: one run
        items = [row_calls.push_item(self._keys, self._backend, k, values) if k in sparse
                 else None
                 for k, values in pairs]
        dense_items = iter([item for run in self._dense_waves(dense, codec) for item in run])
        return [[item or next(dense_items) for item in items]]

    def _dense_waves(self, pairs, codec):
        if codec is not None:
            return self._keys.encoded_waves(codec, pairs)
        meta = self._keys.meta
        copies = self._keys.host_copies(pairs, stage=True)
        return [[(k, copy, meta[k][1]) for (k, _), copy in zip(pairs, copies)]]

    def set_gradient_compression(self, compression_params):
        """Compress pushed gradients, as MXNet does: ``{'type': '2bit', 'threshold': 0.5}``
        sends each element as +threshold, -threshold or 0 and keeps the difference on this
        worker for later pushes (``None`` or type 'none': off); also 'fp16', 'bf16', '1bit'
        and 'topk' (``ratio``), each with that error feedback. Pulls stay exact unless
        ``'pull': 'fp16'`` (or 'bf16') rounds the float32 and float64 values they bring.
        Every worker should set the same; see kvps.compression and docs/api.md. 'device' and
        'dist*' stores only, as in MXNet: any other type raises ConfigError."""
        check_compression_type(self._type)
        self._codec, self._pull_codec = compression.parse(compression_params, self._residuals)

    @traced('pull', 'pull')
    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Write the current values into ``out`` (in place), after this worker's pushes
        (``priority``: as push's)."""
        if out is None:
            raise TypeError('pull needs out= (the arrays to write into)')
        self._open()
        priority = checked_priority(priority)
        landings, items = pulls.plan(self._keys, self._backend, key, out)
        self._backend.pull(items, priority, self._pull_codec)
        pulls.land(landings)

    def pull_begin(self, key, out, priority=0):
        """A pull started now and waited for later (a kvps extension of MXNet's API): sends
        pull's requests and returns a function that waits for the answers (and lands them on
        GPUs). The Trainer pulls a key right behind its push this way, so its result comes
        back while backward still runs."""
        self._open()
        priority = checked_priority(priority)
        landings, items = pulls.plan(self._keys, self._backend, key, out)
        return pulls.landed_after(self._backend.pull_begin(items, priority, self._pull_codec),
                                  landings)

    @traced('row_sparse_pull', 'pull')
    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        """Write rows ``row_ids`` of the key's current value into those rows of ``out`` (an
        array or tensor of the key's shape; its other rows are left as they are), after this
        worker's pushes, as MXNet's: an embedding's worker pulls the rows its next batch
        reads. A list of keys takes a list of ``out`` and of ``row_ids``; a key with several
        targets, one row_ids per target (or one for all). Ids may repeat and come in any
        order."""
        if out is None:
            raise TypeError('row_sparse_pull needs out= (the arrays to write rows into)')
        self._open()
        row_calls.pull(self._keys, self._backend, key, out, row_ids,
                       priority=checked_priority(priority))

    def pull_changed_rows_begin(self, key, out, marks, priority=0):
        """Rows changed since a mark (a kvps extension of MXNet's API): write into ``out``
        (contiguous, host memory) the rows of ``key`` that changed since the last such pull
        with the same ``marks`` (a dict the caller keeps; empty: every row), as the Trainer
        pulls an embedding that its servers update row by row. Sends the requests now and
        returns the wait for their answers."""
        self._open()
        return row_calls.pull_begin(self._keys, self._backend, key, out, marks=marks,
                                    priority=checked_priority(priority))

    def pull_pushed_rows_begin(self, keys, priority=0):
        """The rows of the last push (a kvps extension of MXNet's API): sends requests for
        the rows each of ``keys`` got from its last push of rows (the Trainer's summed sparse
        gradients, on servers without an optimizer); returns the wait, which gives {key:
        (sorted ids, rows as a 2-D host array)}."""
        self._open()
        return row_calls.pull_live_begin(self._keys, self._backend, keys,
                                         checked_priority(priority))

    @traced('pushpull', 'push')
    def pushpull(self, key, value, out=None, priority=0):
        """Push then pull; with ``out=None`` the result is written into ``value``. Every
        value and target is checked before anything is sent; on a dist store each key's pull
        request follows its push closely, so results come back while later keys are still
        being pushed."""
        self._open()
        priority = checked_priority(priority)
        targets = value if out is None else out
        landings, items = pulls.plan(self._keys, self._backend, key, targets)
        # (copies as one run, cut into waves by the backend; or encoded run by run as the
        # backend takes them, a run's pulls sent before the next is encoded)
        self._backend.pushpull(self._push_waves(key, value), items, priority,
                               self._pull_codec)
        pulls.land(landings)

    def broadcast(self, key, value, out, priority=0):
        """Initialize with rank 0's ``value`` and pull it into ``out`` on every worker."""
        checked_priority(priority)   # before the collective init
        self.init(key, value)
        self.pull(key, out, priority)

    def on_membership_change(self, callback):
        """Call ``callback(num_workers, ranks)`` on this worker at its first store call after
        each change of an elastic job's workers (docs/elastic.md); None: no more calls."""
        if callback is not None and not callable(callback):
            raise TypeError(f'on_membership_change takes a callable or None, got '
                            f'{type(callback).__name__}')
        self._backend.on_membership_change(callback)

    @traced('barrier', 'barrier')
    def barrier(self):
        """Wait until every worker arrives and all of this worker's pushes are applied."""
        self._open()
        self._backend.barrier()

    _barrier = barrier     # MXNet's spelling

    @traced('agree', 'barrier')
    def agree(self, value):
        """A barrier at which every worker offers ``value`` (bytes, at most 64: a digest of
        what must be the same everywhere); returns the ranks whose value differs from rank
        0's, [] when all agree. Collective; a kvps extension of the MXNet API."""
        self._open()
        value = bytes(value)
        if len(value) > 64:
            raise ValueError(f'agree takes at most 64 bytes (a digest), got {len(value)}')
        return self._backend.barrier(value, call='agree')

    @traced('all_sum', 'barrier')
    def all_sum(self, values):
        """A barrier at which each worker brings ``values`` (at most 8192 numbers: metrics,
        counts) and gets their float64 sum over the workers, in its shape (kvps's)."""
        self._open()
        values = np.asarray(values, dtype=np.float64)
        if not 0 < values.size <= 8192:
            raise ValueError(f'all_sum takes 1 to 8192 numbers, got {values.size}')
        total = self._backend.all_sum(np.ascontiguousarray(values, '<f8').tobytes())
        return np.frombuffer(total, '<f8').reshape(values.shape).copy()

    @traced('set_optimizer', 'collective')
    def set_optimizer(self, optimizer):
        """Run ``optimizer`` on the servers for every later push (collective). Setting the
        same kind of optimizer again changes its hyper-parameters and keeps its state."""
        if isinstance(optimizer, dict):
            spec = optimizer
        elif hasattr(optimizer, 'to_spec'):
            spec = optimizer.to_spec()
        else:
            raise TypeError('set_optimizer takes a kvps optimizer (kvps.optimizer.create(...)) '
                            f'or its spec, got {type(optimizer).__name__}')
        self._open()
        self._backend.set_optimizer(spec)

    def _set_updater(self, updater):
        """MXNet's push updater for a store in this process ('local', 'device'): every later
        push runs ``updater(key, merged, stored)``, which changes ``stored`` in place (numpy
        arrays of the key's shape) instead of replacing it; set_optimizer replaces it. A
        distributed store refuses: its servers run only optimizers sent as data, never code."""
        if not callable(updater):
            raise TypeError(f'the updater must be callable, got {type(updater).__name__}')
        self._open()
        self._backend.set_updater(updater)

    set_updater = _set_updater

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Save the servers' optimizer state (every shard, whole keys) to ``fname``."""
        states.write_file(fname, self.get_optimizer_states(dump_optimizer))

    def load_optimizer_states(self, fname):
        """Load a file from save_optimizer_states into the servers (collective in dist
        stores: every worker calls it; rank 0 sends). A file that does not fit the store
        changes no server's state, and the error names it."""
        merged = states.read_file(fname)
        try:
            self.set_optimizer_states(merged)
        except (ConfigError, KeyNotInitializedError) as exc:
            exc.args = (f'{fname}: {exc}',) + exc.args[1:]
            raise

    def get_optimizer_states(self, dump_optimizer=False):
        """Optimizer state as whole keys (a kvps extension of MXNet's API): the servers'
        state of every key, its parts joined (kvps.optimizer.states' file contents), which
        save_optimizer_states writes; ``dump_optimizer``: with the optimizer."""
        self._open()
        return states.merge(self._backend.get_states(dump_optimizer), self._keys.parts)

    def set_optimizer_states(self, merged):
        """Install whole-key state (as get_optimizer_states gives it; a kvps extension of
        MXNet's API) on the servers, in place of theirs (collective, as
        load_optimizer_states): a state that does not fit changes no server's state."""
        self._open()
        for key, _, _ in merged.get('keys', ()) if isinstance(merged, dict) else ():
            self._keys.known(key)
        self._backend.set_states(states.split(merged, self._backend.num_servers,
                                              self._keys.parts))

    def balance_keys(self, total):
        """A placement hint (a kvps extension, the Trainer's): a model of ``total`` elements
        is about to be initialized; split its keys so that servers carry about equal bytes."""
        self._backend.balance_keys(total)

    def keep_keys_whole(self):
        """A placement hint (a kvps extension): keys initialized from now on on one server
        each, whatever their size, for an optimizer reading weights whole (LAMB), set later."""
        self._backend.keep_keys_whole()

    def gradient_buffer(self, like):
        """A flat tensor like GPU tensor ``like``, in GPU memory this worker's servers map,
        kept for the job (a kvps extension, the Trainer's fused gradients): a push of it goes
        from where it lies, no copy; write it again only once a pull of its key, made after
        that push, has returned. None where there is none (docs/shared-memory.md)."""
        self._open()
        return self._keys.gradient_buffer(like)

    def scale_rounds(self):
        """An elastic dist_sync job's rounds as a fixed job's (kvps's, the Trainer's): each
        round of the keys initialized from now on is scaled by N / (the workers who pushed
        into it), N the job's size, so rescale_grad keeps its meaning as workers leave and
        join; returns N, or None where rounds never change size. docs/elastic.md."""
        self._open()
        return self._backend.scale_rounds()

    def stats(self):
        """Counts since this worker joined (a kvps extension): push and pull calls, rounds,
        bytes pushed and pulled by route (``'shm'``, ``'socket'``, ``'ipc'``), messages and
        answers, waits for answers and for room to push (and their seconds), requests sent
        again to a restarted server, what is in flight now. Any thread may call it."""
        return self._backend.stats()

    def close(self):
        """Flush and leave the job (also done at interpreter exit)."""
        self._backend.close()

    def _open(self):
        """Refuse a call on a closed store, or from a process forked from its owner."""
        backend = self._backend
        if backend.closed:
            raise StoreClosedError(f'this {self._type!r} store is closed (kv.close() or '
                                   'interpreter exit); it takes no more calls')
        if backend.forked:
            raise StoreClosedError(forked_message(backend.pid))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def create(name='local'):
    """Create a KVStore: 'local'/'device' in this process, 'dist_*' across the job; or a store
    of one's own registered under ``name`` with KVStoreBase.register (MXNet 2.0's rule)."""
    own = registered(name)
    if own is not None:
        return own()
    distributed, sync, _ = parse_type(name)
    backend = dist_backend(sync) if distributed else LocalBackend()
    return KVStore(name, backend)
