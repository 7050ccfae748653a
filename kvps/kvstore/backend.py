"""The one seam between a KVStore and what carries its keys: Backend, a contract per member."""

from typing import Protocol, runtime_checkable


@runtime_checkable
class Backend(Protocol):
    """What a KVStore asks of its backend: LocalBackend (this process is the job) or
    DistClient (a worker of a job with servers). Both conform; a test holds them to it.

    Who copies: the store hands the backend kvps-owned arrays (copies of the caller's values,
    maybe in blocks from ``stage``) and checked targets; the backend may send from what it
    is handed after the call returns, never writes it, and keeps no caller memory. What
    blocks: push returns without waiting for the servers; every wait (pull, a ``*_begin``
    call's wait, barrier, collectives) is bounded by KVPS_TIMEOUT. What raises: kvps's errors
    (kvps.errors); an error a server reports for a push is raised by that push or by the
    next call that waits, in whichever thread. Keys are checked and known (the store checks
    kinds, shapes, dtypes and init) before the backend sees them.
    """

    rank: int             # this worker's rank, 0 .. num_workers - 1
    num_workers: int
    num_servers: int      # how many parts get_states returns and set_states takes
    num_hosts: int        # the hosts the job's workers and servers were on when it formed
    sync: bool            # dist_sync rounds (True), or every push applied alone (False)
    # key -> (shape, dtype name) of every key initialized through any store on this backend:
    # written by the stores, so that every store of one job membership sees the same keys
    keys: dict
    closed: bool          # close() was called: the store refuses further calls
    # this worker joined a running elastic job and has not pushed yet: its setup calls (init,
    # set_optimizer, barriers) check the job's setup rather than make it
    joining: bool
    # What an elastic job's Trainer reads of the job (a worker's JobNotes, kvps.worker.joining):
    # ``me`` and ``members()``, (rank, incarnation) pairs; ``epoch``, moving at each change;
    # ``rounds()``, the most pushes this worker made of any key; the job's named blobs on
    # server 0, ``put(name, bytes)`` (replacing that name's, blocking) and ``get(name)`` (b''
    # when there is none); ``claim(key, epoch, size, count)`` -> (positions, end), an elastic
    # Sampler's (blocking). A one-process job is its one member, its blobs its own.
    notes: object
    # This process was forked from the one that made the backend, and cannot use it (a
    # distributed backend's sockets and I/O thread stay with its maker, ``pid``).
    forked: bool
    pid: int

    def init(self, items, device=False):
        """Store ``items`` ([(key, flat copy, shape, dtype name)]); collective: every worker
        calls it, rank 0's values win. Blocks until the servers hold the keys. ``device``:
        keep them on the servers' GPUs where there are some."""

    def stage(self, sizes, device=False):
        """Where a push's copies of ``sizes`` bytes should be made: per size a writable
        uint8 block the backend sends from (shared memory), or None (make it anywhere).
        ``device``: blocks of GPU memory the servers map (the ipc route: a GPU value is
        copied into one on the device, kvps.devices.PushCopies), None where there are none;
        asked only where ``device_route`` is direct."""

    def device_written(self, stream=None):
        """The copies into device blocks from ``stage`` were issued on CUDA ``stream`` (its
        handle; None: no stream, the host stand-in's): the servers' reads of them are to wait
        for them (an event recorded there), not this caller. Before the push that names
        them; returns at once."""

    def device_buffer(self, nbytes):
        """A uint8 block of ``nbytes`` of GPU memory the servers map, kept for the job (a
        buffer the caller gathers pushes into: a push of a value lying in it goes from
        where it lies, no copy; the caller writes it again only once a pull of that key,
        sent after the push, has returned), or None (no such memory, or no room). Asked
        only where ``device_route`` is direct."""

    def device_route(self, device=None):
        """``(direct, how)``: ``direct`` when GPU values may go straight between a GPU and
        page-locked shared memory (kvps.pinning), or GPU memory the servers map (``device``:
        the CUDA device the values are on): a push's GPU copies into blocks from ``stage``,
        and a pull's ``out`` may be a kvps.devices.Landing (written with ``out[start:stop] =
        host array`` or a device block inside ``with out.writing():``, whose end waits for
        the writes, before those bytes are let go). ``how``: the route GPU values take,
        in words (logged). Cheap: asked at every push and pull of GPU values."""

    def push(self, items, priority=0):
        """Send ``items`` ([(key, flat copy | [copy per part], dtype name | codec name |
        ROW_SPARSE | NOTHING: an abstention, one empty payload per part, kvps.server.members
        .abstain)]) to be summed into the key's round; returns without waiting for the
        servers (an in-process backend has applied it already). ``priority`` (an int in
        kvps.wire.protocol.PRIORITIES, checked), here and in every pull: requests of a higher
        one are sent and served ahead of those of a lower one still waiting, never ahead of
        this worker's earlier requests of the same key; a backend with nothing in flight
        ignores it."""

    def pull(self, items, priority=0, codec=None):
        """Write each key's value into ``out`` of ``items`` ([(key, out, dtype name)]: out a
        writable numpy array of the key's size, or a Landing where ``device_route`` allows)
        after this worker's earlier pushes of it are applied. Blocks; raises any error
        pending from pushes. ``codec`` ('fp16', 'bf16' or None), here and in every pull:
        float32 and float64 values come rounded to that type (kvps.compression.half), widened
        exactly into ``out``."""

    def pull_begin(self, items, priority=0, codec=None):
        """``pull(items)``'s requests sent now; returns the wait, after which ``out`` holds
        the values (nothing writes into them after it returns)."""

    def pushpull(self, runs, pulls, priority=0, codec=None):
        """``push`` of each run of ``runs`` then ``pull(pulls)`` (the same keys, in the same
        order); blocks until every pull has landed. ``runs``: a list of one run of copies
        (a remote backend cuts it into waves itself), or an iterable of runs (the store's
        encoded ones, made as they are taken), each pushing the next ``len(run)`` keys of
        ``pulls``."""

    def pull_rows_begin(self, items, priority=0):
        """Requests for some rows of each ``(key, table, ids, marks)`` sent now: ``table`` a
        writable 2-D (rows x width) numpy view of the key, ``ids`` sorted unique row ids, or
        None for the rows changed since ``marks`` (a dict the backend updates). Returns the
        wait; only the rows asked for (or changed) are written."""

    def pull_live_begin(self, items, priority=0):
        """Requests, per ``(key, width, numpy dtype, sink)``, for the rows the key's last
        push of rows made (every row of a dense value) sent now; the answers append ``(ids,
        rows)`` per part to ``sink`` in part order. Returns the wait."""

    def set_optimizer(self, spec):
        """Run the optimizer of ``spec`` (plain data) on every later push; collective. The
        same kind again changes hyper-parameters and keeps state. Raises ConfigError for a
        spec the servers refuse (on rank 0; the other ranks get RemoteError)."""

    def set_updater(self, fn):
        """Run ``fn(key, merged, stored)`` on every later push, in this process; a backend
        whose servers run elsewhere raises ConfigError (kvps never sends code)."""

    def get_states(self, dump_optimizer):
        """Every server's optimizer state (a list, one per server) once this worker's pushes
        are applied; ConfigError where no state can be saved (a Python updater)."""

    def set_states(self, per_server):
        """Install one share per server (as get_states gives them); collective. A share any
        server refuses raises ConfigError and changes no server's state."""

    def barrier(self, digest=None, call='barrier'):
        """Block until every worker is here and this worker's pushes are applied; returns the
        ranks whose ``digest`` (bytes) differs from rank 0's, [] when all agree. ``call``: the
        store call it is part of; workers that meet from different calls raise ConfigError."""

    def all_sum(self, values):
        """A barrier at which every worker brings ``values`` (float64 bytes): their sum over
        the workers, as bytes (ConfigError where the workers' calls differ)."""

    def on_membership_change(self, callback):
        """Call ``callback(num_workers, ranks)`` at the first call after each change of the
        job's workers (elastic jobs; a fixed job's never change); None: no more calls."""

    def wait_pushes(self):
        """Block until every push so far, of any thread, is applied; raise the first error
        a server reported for one."""

    def stats(self):
        """This worker's counts since it joined (kvps.timeline.counters.WorkerCounts
        as_dict): calls, bytes by route, messages, waits, retries, and what is in flight."""

    def close(self):
        """Flush and leave the job; idempotent. Later calls through a store raise
        StoreClosedError (``closed`` is True)."""

    def parts(self, key, size):
        """``[(server, part, start, stop)]``: where the elements of ``key`` (``size`` of
        them, initialized) lie, in order, covering ``range(size)``."""

    def scale_rounds(self):
        """In an elastic dist_sync job: the keys initialized from now on have each round's
        sum scaled by N / (the workers of the round), N the job's DMLC_NUM_WORKER, so that a
        round weighs as a round of N workers; returns N. Elsewhere nothing changes: None."""

    def balance_keys(self, total):
        """Hint: a model of ``total`` elements is about to be initialized; split its keys
        so that servers carry about the same bytes."""

    def keep_keys_whole(self):
        """Hint: keys initialized from now on are placed whole, one server each."""
