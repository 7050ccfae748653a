"""The optimizer-state files of a Trainer whose workers update, in the servers' format.

One format everywhere (kvps.optimizer.states), per parameter: a file saved by servers loads
into local updates and back; fused keys' state is split into their members' on the way out
and joined on the way in.
"""

import math

from ..errors import ConfigError
from ..optimizer import states
from ..optimizer.optimizers import Optimizer


def save_local_states(updater, fname, sizes, fused):
    """A local Updater's state (flat per key, as servers keep it) in the store's file format,
    per parameter (``fused``: {fused key: its members' ranges} for state kept per fused key;
    ``sizes``: elements per parameter)."""
    states.write_file(fname, local_states(updater, sizes, fused))


def local_states(updater, sizes, fused):
    """What save_local_states writes: the file's map."""
    merged = states.merge([updater.get_states(dump_optimizer=True)], _local_parts(sizes, fused))
    return states.unfuse(merged, fused)


def _local_parts(sizes, fused):
    """The parts_of function of a local Updater's keys: the parameters' (``sizes``) and the
    fused keys' (``fused``: their members' ranges), each one whole part."""
    every = {**sizes, **{key: ranges[-1][2] for key, ranges in fused.items()}}
    return lambda key: [(0, 0, 0, every[key])]


def load_local_states(updater, fname, sizes, fused, weights=None):
    """Restore a local Updater from any optimizer-state file, checking it fits the params
    (``sizes``; ``weights``: {(key, 0): weight}, their dtypes), with the members of ``fused``
    keys joined (see save_local_states)."""
    install_local_states(updater, states.read_file(fname), sizes, fused, weights, fname)


def install_local_states(updater, merged, sizes, fused, weights=None, fname='the state'):
    """load_local_states of a file's map ``merged`` (read from ``fname``, named in errors)."""
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
