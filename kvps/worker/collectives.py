"""A worker's collective setup calls: keys initialized and checked; the optimizer and its state."""

import msgpack

from .. import rows
from ..errors import ConfigError, KVPSError, RemoteError
from ..optimizer.optimizers import Optimizer, registered_class
from ..wire import protocol as P
from ..wire.items import CheckItem, InitItem
from ..wire.pieces import continued, state_pieces
from .messages import describe, fuse, fuse_bytes, server_name, state_collector

_REFUSED = b'refused'   # rank 0's word at the barrier ending a collective the servers refused


class Collectives:
    """The collective calls of one worker, made with what its DistClient gives: ``config``
    (KVPS_TIMEOUT, KVPS_MAX_MESSAGE_BYTES), ``sync`` (the store's mode), its ``rank``, the
    ``sharding`` of its keys, ``request(server, what, header, buffers=(), on_data=None)``
    that sends one message and returns its Operation, ``barrier(digest=None, call=...)``
    (the job's, answering the ranks that differ), ``wait_pushes()`` and ``step()`` (the sync
    push step it has reached: a new optimizer or loaded states count later steps from it)."""

    def __init__(self, config, sync, rank, sharding, request, barrier, wait_pushes, step):
        self.config, self.sync, self.rank, self.sharding = config, sync, rank, sharding
        self._request, self._barrier, self._wait_pushes = request, barrier, wait_pushes
        self._step = step
        # joining(counts=None): whether this worker joined a running elastic job and has not
        # pushed yet (its setup calls are then checks against the job's: the servers have the
        # keys and the optimizer); ``counts`` hands it the push counts its CHECKs answered
        self.joining = lambda counts=None: False
        self.scale_to = 0   # elastic dist_sync: rounds of keys initialized now are scaled to it

    def init(self, items, device=False):
        """``items``: [(key, flat array, shape, dtype name)]. Rank 0's values win. ``device``:
        a device-side store asks servers to keep these keys on their GPUs if they have one."""
        for key, flat, shape, _ in items:
            self.sharding.place(key, flat.size, flat.itemsize, rows.width_of(shape))
        if self.joining():
            counts = {}
            self._wait_all(self._send_keys(P.CHECK, items, {}, counts))
            self.joining(counts)
            return
        fields = {'sync': self.sync, 'device': device}
        if self.scale_to:
            fields['scale_to'] = self.scale_to
        self._by_rank_0('init', lambda: self._wait_all(self._send_keys(P.INIT, items, fields)))
        if self.rank != 0:
            self._wait_all(self._send_keys(P.CHECK, items, {}))

    def _send_keys(self, op, items, fields, counts=None):
        """INIT (every part of each key, with its values) or CHECK (part 0: where rank 0's
        init put it) of ``items``, many keys per message as ``fuse`` cuts them; returns the
        operations to wait on, in the order of their first keys. ``counts`` (a dict, CHECK):
        gets (server node, (key, part)) -> the pushes the server counts of it."""
        init = op == P.INIT
        parts = []
        for key, flat, shape, dtype in items:
            places = self.sharding.parts(key)
            for part in places if init else places[:1]:
                parts.append((key, part, flat[part.start:part.stop] if init else None, dtype,
                              list(shape)))
        ops = []
        for server, batch in fuse(parts, _init_bytes if init else _no_bytes, shaped=True,
                                  most_bytes=fuse_bytes(self.config)):
            keys = [InitItem(key, part.part, dtype, part.stop - part.start, shape) if init
                    else CheckItem(key, part.part, dtype, shape)
                    for key, part, _, dtype, shape in batch]
            ops.append(self._request(server, describe('init', batch),
                                     {'op': op, 'keys': keys, **fields},
                                     [values for _, _, values, _, _ in batch] if init else (),
                                     None if counts is None else _counter(counts, server, keys)))
        return ops

    def set_optimizer(self, spec):
        """Rank 0 installs the optimizer on every server; everyone returns when all have it.
        A spec that any server would refuse is refused first on every worker alike (see
        _reads_whole), and no server gets it."""
        blob = msgpack.packb(spec, use_bin_type=True)
        self._require_whole_keys(spec, self._reads_whole(spec, blob))
        if self.joining():   # the servers run the job's optimizer already
            return
        self._by_rank_0('set_optimizer', lambda: self._wait_all([
            self._request(s, 'set_optimizer', {'op': P.SET_OPTIMIZER, 'step': self._step()},
                          (blob,))
            for s in range(self.sharding.num_servers)]), after_pushes=True)

    def get_states(self, dump_optimizer):
        """Every server's updater state, once this worker's pushes are applied."""
        self._wait_pushes()
        servers = range(self.sharding.num_servers)
        blobs = [None] * len(servers)

        def keeper(server):
            def keep(blob):
                blobs[server] = msgpack.unpackb(blob, raw=False, strict_map_key=False)
            return state_collector(keep)
        self._wait_all([self._request(s, 'save_optimizer_states',
                                      {'op': P.GET_STATES, 'dump': dump_optimizer,
                                       'step': self._step()},
                                      on_data=keeper(s)) for s in servers])
        return blobs

    def set_states(self, per_server):
        """Rank 0 loads each server's share; everyone returns when all servers have it. Every
        server checks its share before any installs it: a share one server refuses changes
        no server's state."""
        if per_server and 'optimizer' in per_server[0]:
            spec = per_server[0]['optimizer']
            self._require_whole_keys(spec, self._reads_whole(
                spec, msgpack.packb(spec, use_bin_type=True)))

        if self.joining():   # the servers hold the job's state already
            return

        def send():
            what = 'load_optimizer_states'
            self._wait_all([op for s, states in enumerate(per_server)
                            for op in self._send_state(s, states, what)])
            self._wait_all([self._request(s, what, {'op': P.COMMIT_STATES, 'step': self._step()})
                            for s in range(len(per_server))])
        self._by_rank_0('load_optimizer_states', send, after_pushes=True)

    def _send_state(self, server, states, what):
        """SET_STATES of ``states`` (staged) to ``server``, in pieces if it is big; returns
        the operations to wait on."""
        pieces = state_pieces(msgpack.packb(states, use_bin_type=True),
                                self.config.max_message_bytes)
        headers = continued({'op': P.SET_STATES, 'stage': True}, len(pieces))
        return [self._request(server, what, header, (piece,))
                for header, piece in zip(headers, pieces)]

    def _by_rank_0(self, what, send, after_pushes=False):
        """A collective that rank 0 carries out alone (``send``: its requests to the servers,
        waited for), then a barrier at which rank 0 tells whether the servers took it: their
        refusal is raised on every rank, so that no worker goes on as if it had happened and
        the next barriers stay in step. ``after_pushes``: rank 0 sends only once every
        worker's earlier pushes are applied (a barrier first), so that they meet the state
        they were pushed for: else, in async, a worker still behind would have its last
        gradients applied by an optimizer set after them (at a new learning rate)."""
        if after_pushes:
            self._barrier(call=what)
        failure = None
        if self.rank == 0:
            try:
                send()
            except KVPSError as exc:
                failure = exc
        try:
            refused = self._barrier(_REFUSED if failure is not None else None, call=what)
        except KVPSError:
            if failure is None:
                raise
        if failure is not None:   # the cause, also when the barrier it left behind failed
            raise failure
        if refused:   # rank 0 offered _REFUSED; the others offered nothing
            raise RemoteError(f'{what} failed: the servers refused it on rank 0, which raised '
                              'their reason', remote_type='CollectiveRefused', node='rank 0')

    def _reads_whole(self, spec, blob):
        """Whether the optimizer of ``spec`` reads each weight whole. One of kvps's own is
        checked here (ConfigError for bad parameters) and its class says. Any other (a
        plugin's: servers import it from KVPS_SERVER_PLUGINS, this worker may not have it) is
        checked by every server, asked by every worker: a server that does not run it, or
        refuses its parameters, raises its ConfigError on every worker alike, before rank 0
        sets it anywhere; and every worker places keys by the same answer."""
        cls = registered_class(spec)
        if cls is not None:
            Optimizer.from_spec(spec)
            if cls.__module__.startswith('kvps.'):
                return cls.whole_tensor
        answers = []
        self._wait_all([self._request(
            s, 'set_optimizer', {'op': P.SET_OPTIMIZER, 'check': True}, (blob,),
            on_data=lambda header, _: answers.append(bool(header.get('whole'))))
            for s in range(self.sharding.num_servers)])
        if len(set(answers)) > 1:
            raise ConfigError(f'the servers disagree on whether optimizer {spec["name"]!r} reads '
                              'each weight whole: install one version of its plugin on every '
                              'server host')
        return answers[0]

    def _require_whole_keys(self, spec, whole):
        """An optimizer whose update reads each weight whole (LAMB's norms, an update written
        in Python) would get a slice on every server of a split key, and a different answer:
        refuse it there (every rank alike: placement is the same everywhere), else keep later
        keys whole."""
        if not whole:
            return
        split = self.sharding.split_keys()
        if split:
            raise ConfigError(
                f'{spec["name"]} reads each weight whole, but key(s) '
                f'{", ".join(map(repr, split[:5]))} are split across servers (KVPS_BIGARRAY_BOUND '
                'elements or more, or over KVPS_PARTITION_BYTES): set the optimizer before '
                'init (kvps then keeps keys whole), raise KVPS_BIGARRAY_BOUND and '
                'KVPS_PARTITION_BYTES, or update on the workers '
                '(Trainer(update_on_kvstore=False))')
        self.sharding.keep_whole = True


    def _wait_all(self, ops):
        for op in ops:
            op.wait(self.config.timeout)


def refuse_updater(fn):
    """A distributed store's set_updater: a Python updater would have to run on the servers,
    which run only optimizers sent as plain data."""
    raise ConfigError(
        'a distributed store cannot take a Python updater: its servers run only '
        'optimizers named as plain data (kvps never sends code). Use '
        'kv.set_optimizer(kvps.optimizer.create(...)), write an Optimizer subclass and '
        'install it on the servers (KVPS_SERVER_PLUGINS, docs/plugins.md), or update on '
        'the workers (kvps.Trainer(..., update_on_kvstore=False))')


def _counter(counts, server, keys):
    """The on_data of a CHECK to ``server``: its ACK's push count of each of ``keys``."""
    def take(header, _):
        node = server_name(server)
        for item, count in zip(keys, header.get('counts', ())):
            counts[(node, (item.key, item.part))] = count
    return take


def _init_bytes(item):
    return item[2].nbytes


def _no_bytes(item):
    return 0
