"""The Trainer's store decisions (Gluon's update_on_kvstore rules) and its access to server-side optimizer state."""

import math

from .. import kvstore as kvstore_mod
from ..errors import ConfigError
from ..optimizer import states
from ..optimizer.optimizers import Optimizer


def resolve(kvstore, requested):
    """(store or None, update_on_kvstore) as Gluon decides them for one device per process.

    - None, or a non-'dist' name: no store (one device: nothing to reduce), local updates;
    - a 'dist*' name: that store; a store object: itself;
    - async stores force update_on_kvstore=True (an explicit False is a ValueError);
    - an explicit True/False wins otherwise (MXNET_UPDATE_ON_KVSTORE's default is on);
    - a store that cannot run optimizers falls back to local updates (explicit True: ValueError).
    """
    if requested is not None and not isinstance(requested, bool):
        raise TypeError(f'update_on_kvstore must be None, True or False, got {requested!r}')
    kv = _store(kvstore)
    if kv is None:
        return None, False
    update = True
    if _distributed(kv) and 'async' in kv.type:
        if requested is False:
            raise ValueError('update_on_kvstore=False is not possible with an async store: '
                             'its servers apply every push as it comes, so they must run the '
                             'optimizer. Use update_on_kvstore=True (or None), or a sync store')
    elif requested is not None:
        update = requested
    is_capable = getattr(kv, 'is_capable', None)
    if update and not (is_capable is not None and is_capable('optimizer')):
        if requested:
            raise ValueError(f'update_on_kvstore=True, but the store {type(kv).__name__} cannot '
                             'run optimizers; use update_on_kvstore=False')
        update = False
    return kv, update


def check_compression(kvstore, compression_params):
    """compression_params with a type name that cannot compress: the store's own error at
    construction (a 'local' name makes no store here, so nothing else would refuse them and
    they would be ignored without a word)."""
    if compression_params and isinstance(kvstore, str):
        kvstore_mod.check_compression_type(kvstore)


def _store(kvstore):
    if kvstore is None:
        return None
    if isinstance(kvstore, str):
        distributed, _, _ = kvstore_mod.parse_type(kvstore)   # rejects unknown names
        # One device per process: a local store would only copy gradients onto themselves.
        return kvstore_mod.create(kvstore) if distributed else None
    if all(hasattr(kvstore, name) for name in ('type', 'init', 'push', 'pull')):
        return kvstore
    raise TypeError('kvstore must be None, a type name (e.g. \'dist_sync\') or a KVStore, got '
                    f'{type(kvstore).__name__}')


def _distributed(kv):
    return kv is not None and 'dist' in kv.type


# -- optimizer state ----------------------------------------------------------------------------
# One file format everywhere: kvps.optimizer.states' whole-key optimizer-state file, which the store's
# save_optimizer_states writes. A file saved by servers loads into local updates and back.

def save_server_states(kv, fname, layout):
    """The servers' optimizer state (optimizer included) into ``fname``, per parameter
    (``layout``: the Trainer's fused keys, split back into their members)."""
    if not layout.fused:
        if not hasattr(kv, 'save_optimizer_states'):
            raise no_server_states('save_states')
        kv.save_optimizer_states(fname, dump_optimizer=True)
        return
    merged = states.unfuse(kv.get_optimizer_states(dump_optimizer=True), layout.ranges())
    merged['optimizer'] = layout.file_spec(merged['optimizer'])
    states.write_file(fname, merged)


def load_server_states(kv, fname, layout):
    """Collective: every worker calls it; the store installs the file on its servers (with
    the members of ``layout``'s fused keys joined)."""
    if not layout.fused:
        if not hasattr(kv, 'load_optimizer_states'):
            raise no_server_states('load_states')
        kv.load_optimizer_states(fname)
        return
    merged = states.fuse(states.read_file(fname), layout.ranges())
    if 'optimizer' in merged:   # it replaces the servers' own: it must know the fused keys
        merged['optimizer'] = layout.server_spec(merged['optimizer'])
    kv.set_optimizer_states(merged)


def no_server_states(what):
    return NotImplementedError(
        f'{what} needs the optimizer state held by the servers, and this store cannot read or '
        'write it (KVStore.save_optimizer_states/load_optimizer_states). Create the Trainer '
        'with update_on_kvstore=False: gradients are still summed by the servers, and every '
        'worker then holds the optimizer state itself')


def save_local_states(updater, fname, sizes, fused):
    """A local Updater's state (flat per key, as servers keep it) in the store's file format,
    per parameter (``fused``: {fused key: its members' ranges} for state kept per fused key;
    ``sizes``: elements per parameter)."""
    merged = states.merge([updater.get_states(dump_optimizer=True)], _local_parts(sizes, fused))
    states.write_file(fname, states.unfuse(merged, fused))


def _local_parts(sizes, fused):
    """The parts_of function of a local Updater's keys: the parameters' (``sizes``) and the
    fused keys' (``fused``: their members' ranges), each one whole part."""
    every = {**sizes, **{key: ranges[-1][2] for key, ranges in fused.items()}}
    return lambda key: [(0, 0, 0, every[key])]


def load_local_states(updater, fname, sizes, fused, weights=None):
    """Restore a local Updater from any optimizer-state file, checking it fits the params
    (``sizes``; ``weights``: {(key, 0): weight}, their dtypes), with the members of ``fused``
    keys joined (see save_local_states)."""
    merged = states.read_file(fname)
    if not isinstance(merged, dict) or merged.get('format') != states.FILE_FORMAT:
        raise ValueError(f'{fname}: not a kvps optimizer-state file')
    for key, _, whole in merged.get('keys', ()):
        if key not in sizes:
            raise ValueError(f'{fname}: holds state for key {key!r}, which is not one of '
                             'this Trainer\'s parameters')
        for name, blob in whole.items():
            count = math.prod(blob['shape'])
            if count != sizes[key]:
                raise ValueError(f'{fname}: state {name!r} of key {key!r} holds {count} '
                                 f'elements; the parameter has {sizes[key]} (saved for other '
                                 'parameters?)')
    merged = states.fuse(merged, fused)
    try:
        updater.set_states(states.split(merged, 1, _local_parts(sizes, fused))[0], weights)
    except ConfigError as exc:
        raise ConfigError(f'{fname}: {exc}') from None


def split_local_state(updater, sizes, fused, key):
    """A local Updater's state under fused key ``key`` moved to its members (exactly: every
    update kvps runs on the workers is elementwise); ``sizes`` and ``fused`` as
    save_local_states takes them."""
    parts_of = _local_parts(sizes, fused)
    merged = states.merge([updater.get_states()], parts_of)
    merged = states.unfuse(merged, {key: fused[key]})
    updater.set_states(states.split(merged, 1, parts_of)[0])


def read_optimizer(fname, default):
    """The optimizer saved in a state file (a copy of ``default`` when it was saved without
    one), at the file's update count, as the servers that load the file take it."""
    merged = states.read_file(fname)
    spec = merged.get('optimizer') if isinstance(merged, dict) else None
    optimizer = Optimizer.from_spec(default.to_spec() if spec is None else spec)
    if isinstance(merged, dict):
        optimizer.num_update = int(merged.get('num_update', optimizer.begin_num_update))
    return optimizer
