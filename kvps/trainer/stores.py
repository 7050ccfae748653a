"""The Trainer's view of its store, chosen once: a kvps KVStore, or one of the user's own with
MXNet 1.x's surface (init, push, pull) or MXNet 2.0's protocol (broadcast, pushpull)."""

import warnings

from .. import kvstore as kvstore_mod
from ..errors import DuplicateInitError
from ..kvstore.base import registered
from ..optimizer import states
from .early_pulls import NO_EARLY_PULLS, EarlyPulls
from .params import check_same_everywhere

# What a store of the user's own must have: MXNet 1.x's KVStore surface, or MXNet 2.0's
# custom-store protocol (kvps.kvstore.KVStoreBase, as Horovod and BytePS plug into Gluon 2.0);
# is_capable, set_gradient_compression and save/load_optimizer_states are optional, and so
# are kvps's agree and placement hints (used when present).
MXNET_SURFACE = ('type', 'init', 'push', 'pull')
KVSTOREBASE_SURFACE = ('type', 'broadcast', 'pushpull')


def open_store(kvstore, requested):
    """(store view or None, update_on_kvstore) as Gluon decides them for one device per
    process.

    - None, or a non-'dist' name: no store (one device: nothing to reduce), local updates;
    - a 'dist*' name: that store; a store object: itself;
    - async stores force update_on_kvstore=True (an explicit False is a ValueError);
    - an explicit True/False wins otherwise (MXNET_UPDATE_ON_KVSTORE's default is on);
    - a store that cannot run optimizers falls back to local updates (explicit True: ValueError).
    """
    if requested is not None and not isinstance(requested, bool):
        raise TypeError(f'update_on_kvstore must be None, True or False, got {requested!r}')
    store = _view(kvstore)
    if store is None:
        return None, False
    update = True
    if store.distributed and 'async' in store.type:
        if requested is False:
            raise ValueError('update_on_kvstore=False is not possible with an async store: '
                             'its servers apply every push as it comes, so they must run the '
                             'optimizer. Use update_on_kvstore=True (or None), or a sync store')
    elif requested is not None:
        update = requested
    if update and not store.runs_optimizers():
        if requested:
            raise ValueError(f'update_on_kvstore=True, but the store {type(store.kv).__name__} '
                             'cannot run optimizers; use update_on_kvstore=False')
        update = False
    return store, update


def check_compression(kvstore, compression_params):
    """compression_params with a type name that cannot compress: the store's own error at
    construction (a 'local' name makes no store here, so nothing else would refuse them and
    they would be ignored without a word)."""
    if compression_params and isinstance(kvstore, str) and registered(kvstore) is None:
        kvstore_mod.check_compression_type(kvstore)


def _view(kvstore):
    """The view of what the user passed as ``kvstore``, or None for no store."""
    if kvstore is None:
        return None
    if isinstance(kvstore, str):
        if registered(kvstore) is not None:   # a KVStoreBase of one's own, by its name
            return _view(kvstore_mod.create(kvstore))
        distributed, _, _ = kvstore_mod.parse_type(kvstore)   # rejects unknown names
        # One device per process: a local store would only copy gradients onto themselves.
        return KvpsStore(kvstore_mod.create(kvstore)) if distributed else None
    if isinstance(kvstore, kvstore_mod.KVStore):
        return KvpsStore(kvstore)
    has = [name for name in {*MXNET_SURFACE, *KVSTOREBASE_SURFACE} if hasattr(kvstore, name)]
    if isinstance(kvstore, kvstore_mod.KVStoreBase) or (
            set(KVSTOREBASE_SURFACE) <= set(has) and not set(MXNET_SURFACE) <= set(has)):
        return PushPullStore(kvstore)
    if set(MXNET_SURFACE) <= set(has):
        return UserStore(kvstore)
    raise TypeError(
        'kvstore must be None, a type name (e.g. \'dist_sync\'), a kvps KVStore, or a store '
        f'with MXNet\'s surface ({", ".join(MXNET_SURFACE)}) or MXNet 2.0\'s (a '
        f'kvps.kvstore.KVStoreBase: {", ".join(KVSTOREBASE_SURFACE)}); got '
        f'{type(kvstore).__name__}, which has {", ".join(sorted(has)) or "none of them"}')


class _Surface:
    """MXNet's surface of a store, as both kinds of view pass it on."""

    def __init__(self, kv):
        self.kv = kv

    @property
    def type(self):
        return self.kv.type

    @property
    def distributed(self):
        return 'dist' in self.kv.type

    @property
    def num_hosts(self):
        """kvps's KVStore.num_hosts; 1 for a store without it."""
        return getattr(self.kv, 'num_hosts', 1)

    def broadcast(self, keys, values):
        """Rank 0's ``values`` of ``keys`` into ``values`` on every worker: init, then pull
        (collective; a key initialized before raises DuplicateInitError)."""
        self.init(keys, values)
        self.pull(keys, out=values)

    def init(self, keys, values):
        self.kv.init(keys, values)

    def gradient_buffer(self, like):
        """Where a fused key's gradients are gathered: None, a tensor of the Trainer's own."""
        return None

    def push(self, keys, values, priority=0):
        self.kv.push(keys, values, priority=priority)

    def pull(self, keys, out, priority=0):
        self.kv.pull(keys, out=out, priority=priority)

    def set_optimizer(self, spec):
        self.kv.set_optimizer(spec)


class UserStore(_Surface):
    """A store of the user's own making, used through MXNet's surface: no early pulls, no
    fused keys, no pulls of rows; kvps's agree and placement hints only if it has them.
    KvpsStore has the same methods, doing what a kvps store can."""

    fuses = False       # fused keys need the state calls that translate them (KvpsStore)

    def __init__(self, kv):
        super().__init__(kv)
        # The optional members, looked up once here: a store of one's own may lack them
        self._is_capable = getattr(kv, 'is_capable', None)
        self._compress = getattr(kv, 'set_gradient_compression', None)
        self._save = getattr(kv, 'save_optimizer_states', None)
        self._load = getattr(kv, 'load_optimizer_states', None)
        self._agree = getattr(kv, 'agree', None)
        self._balance = getattr(kv, 'balance_keys', None)
        self._keep_whole = getattr(kv, 'keep_keys_whole', None)

    def runs_optimizers(self):
        try:
            return self._is_capable is not None and bool(self._is_capable('optimizer'))
        except NotImplementedError:   # KVStoreBase's own, not overridden
            return False

    def early_pulls(self, weights, gradient_buffer):
        """Nothing is pulled before step(): MXNet's surface has no pull that returns early."""
        return NO_EARLY_PULLS

    def sends_rows(self, param):
        """A sparse gradient is pushed dense: its rows alone would need kvps's row pulls."""
        return False

    def pull_rows_begin(self, keys, weights, marks, on_servers, priority):
        raise _lacks('pulls of rows')   # never asked: sends_rows is False

    def agree_on(self, params, layout_digest):
        """With kvps's ``agree``, as for a kvps store. Without, nothing to check with: MXNet's
        surface has no collective that compares a value across workers, and one built from
        push and pull would need keys of the Trainer's own in the user's store. The user
        keeps the workers' models alike, as with MXNet."""
        if self._agree is not None:
            check_same_everywhere(self.kv, params, layout_digest)

    def prepare_init(self, total, keep_whole):
        """kvps's placement hints, if the store has them (MXNet's surface has none)."""
        if self._balance is not None:
            self._balance(total)
        if keep_whole and self._keep_whole is not None:
            self._keep_whole()

    def scale_rounds(self):
        return None   # a store of one's own: its rounds are its own business

    def set_compression(self, compression_params):
        if self._compress is None:
            warnings.warn(f'the store {type(self.kv).__name__} has no '
                          'set_gradient_compression; compression_params are ignored and '
                          'gradients travel at full precision', stacklevel=3)
        else:
            self._compress(compression_params)

    def barrier(self):
        raise _lacks('barrier')   # never asked: only fused keys need one, and fuses is False

    def unfuse_server_states(self, ranges):
        raise _lacks('fused keys')   # never asked: fuses is False

    def save_server_states(self, fname, layout):
        _call_or_refuse(self._save, 'save_states', fname, dump_optimizer=True)

    def load_server_states(self, fname, layout):
        _call_or_refuse(self._load, 'load_states', fname)


class PushPullStore(UserStore):
    """A store of MXNet 2.0's protocol (a kvps.kvstore.KVStoreBase), used as Gluon 2.0 uses
    it: ``broadcast`` for the initial weights, ``pushpull`` per key for the exchange. A push
    is its pushpull, at once, into a buffer of the view's (the gradient leaves when kvps
    sends it, as with any store); the pull of the key copies it to where the Trainer wants."""

    def __init__(self, kv):
        super().__init__(kv)
        self._results = {}    # key -> the buffer its last pushpull wrote

    def broadcast(self, keys, values):
        for key, value in zip(keys, values):
            self.kv.broadcast(key, value, out=value)

    def init(self, keys, values):
        raise _lacks('init: MXNet 2.0\'s protocol broadcasts')   # never asked: fuses is False

    def push(self, keys, values, priority=0):
        for key, value in zip(keys, values):
            out = self._results.get(key)
            if out is None or out.shape != value.shape or out.dtype != value.dtype \
                    or out.device != value.device:
                out = self._results[key] = value.detach().new_empty(value.shape)
            self.kv.pushpull(key, value, out=out, priority=priority)

    def pull(self, keys, out, priority=0):
        for key, target in zip(keys, out):
            target.detach().copy_(self._results[key].reshape(target.shape))


class KvpsStore(_Surface):
    """A kvps KVStore: MXNet's surface and kvps's extensions (early pulls, fused keys, pulls
    of rows, the agree collective, placement hints, optimizer state as whole keys)."""

    fuses = True

    def runs_optimizers(self):
        return self.kv.is_capable('optimizer')

    def early_pulls(self, weights, gradient_buffer):
        """Each pushed key's pull sent right behind its push (see early_pulls)."""
        return EarlyPulls(self.kv, weights, gradient_buffer)

    def gradient_buffer(self, like):
        """GPU memory the servers map, where the store has some (KVStore.gradient_buffer)."""
        return self.kv.gradient_buffer(like)

    def sends_rows(self, param):
        """A host parameter's sparse gradient is pushed as its rows alone."""
        return param.tensor.device.type == 'cpu' and param.tensor.is_contiguous()

    def pull_rows_begin(self, keys, weights, marks, on_servers, priority):
        """The pulls of parameters whose gradients went as rows: the rows their servers
        changed since ``marks`` into ``weights`` (servers update), or the rows of the summed
        gradients (workers update). Returns the wait."""
        if on_servers:
            return self.kv.pull_changed_rows_begin(keys, weights, marks, priority)
        return self.kv.pull_pushed_rows_begin(keys, priority)

    def agree_on(self, params, layout_digest):
        check_same_everywhere(self.kv, params, layout_digest)

    def prepare_init(self, total, keep_whole):
        """Keys of a model of ``total`` elements balanced over servers; ``keep_whole``: for
        an optimizer that reads each weight whole, which the servers get after init."""
        self.kv.balance_keys(total)
        if keep_whole:
            self.kv.keep_keys_whole()

    def scale_rounds(self):
        """An elastic dist_sync job's size, to which its rounds are scaled (else None)."""
        return self.kv.scale_rounds()

    def abstain(self, keys):
        """Take part in the rounds of ``keys`` without a gradient (an elastic joiner)."""
        self.kv.abstain(keys)

    def set_compression(self, compression_params):
        self.kv.set_gradient_compression(compression_params)

    def barrier(self):
        self.kv.barrier()

    def unfuse_server_states(self, ranges):
        """Collective: the servers' state of fused keys (``ranges``: their members' ranges)
        moved under the members' own keys. No worker may push meanwhile: the state is read,
        then written back."""
        merged = self.kv.get_optimizer_states(dump_optimizer=True)
        self.kv.set_optimizer_states(states.unfuse(merged, ranges))

    def save_server_states(self, fname, layout):
        """The servers' optimizer state (optimizer included) into ``fname``, per parameter
        (``layout``: the Trainer's fused keys, split back into their members)."""
        if not layout.fused:
            self.kv.save_optimizer_states(fname, dump_optimizer=True)
            return
        merged = states.unfuse(self.kv.get_optimizer_states(dump_optimizer=True),
                               layout.ranges())
        merged['optimizer'] = layout.file_spec(merged['optimizer'])
        states.write_file(fname, merged)

    def load_server_states(self, fname, layout):
        """Collective: every worker calls it; the store installs the file on its servers
        (with the members of ``layout``'s fused keys joined)."""
        if not layout.fused:
            self.kv.load_optimizer_states(fname)
            return
        merged = states.fuse(states.read_file(fname), layout.ranges())
        if 'optimizer' in merged:   # it replaces the servers' own: it must know the fused keys
            merged['optimizer'] = layout.server_spec(merged['optimizer'])
        self.kv.set_optimizer_states(merged)


def _call_or_refuse(method, what, *args, **kwargs):
    """The store's optimizer-state call; a store without one (or KVStoreBase's own, which
    raises NotImplementedError) is refused, saying what to do instead."""
    if method is None:
        raise no_server_states(what)
    try:
        method(*args, **kwargs)
    except NotImplementedError as exc:
        raise no_server_states(what) from exc


def _lacks(what):
    return NotImplementedError(f'a store of your own making has no {what} (kvps stores do)')


def no_server_states(what):
    return NotImplementedError(
        f'{what} needs the optimizer state held by the servers, and this store cannot read or '
        'write it (KVStore.save_optimizer_states/load_optimizer_states). Create the Trainer '
        'with update_on_kvstore=False: gradients are still summed by the servers, and every '
        'worker then holds the optimizer state itself')


def one_trainer_per_store(exc):
    """The DuplicateInitError of a Trainer whose store already held keys (``exc``)."""
    return DuplicateInitError(
        f'{exc}: this store already holds keys (another Trainer, or kv.init calls of your '
        'own), and a Trainer\'s keys are its parameters\' positions from 0. One store serves '
        'one Trainer (its servers run one optimizer): give one Trainer every model\'s '
        'parameters (a GAN\'s generator and discriminator too); it trains those requiring '
        'grad at each step, so freeze the other model with requires_grad_(False), and '
        'lr_mult/wd_mult attributes on parameters set their own rates')
