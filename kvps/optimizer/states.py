"""Optimizer-state files: per-server updater states merged into whole keys, and split back.

Servers hold optimizer state per (key, part), and how a key is split depends on the number
of servers. A file stores each key whole (its parts' flat state arrays concatenated in part
order), so a file saved by one job loads into another with any number of servers, or into a
'local' store.
"""

import logging

import msgpack

from ..atomic import write_atomically
from ..errors import ConfigError
from .updater import STATE_FORMAT, STATE_ITEMSIZE

FILE_FORMAT = 'kvps.optimizer_states/1'

log = logging.getLogger('kvps')


def merge(server_states, parts_of):
    """Whole-key state from ``server_states`` (one updater state dict per server).

    ``parts_of(key)`` gives the key's parts as ``[(server, part, start, stop), ...]``.
    """
    by_part, counts = {}, {}
    for states in server_states:
        for key, part, arrays in states['states']:
            by_part[(key, part)] = arrays
        for key, part, count in states['counts']:
            counts[(key, part)] = count
    keys = []
    for key in sorted({k for k, _ in by_part}, key=lambda k: (str(type(k)), k)):
        parts = parts_of(key)
        missing = [p for _, p, _, _ in parts if (key, p) not in by_part]
        if missing:
            # dist_async: the servers are read one after another while pushes go on, so a
            # key's first update may have reached some of its parts only. It is saved as a key
            # not yet updated (a load starts its state afresh), not as a failed save.
            log.warning('optimizer state of key %r left out of the file: its first update '
                        'had reached part(s) %s, not %s, when the servers were read', key,
                        sorted(set(p for _, p, _, _ in parts) - set(missing)), missing)
            continue
        names = by_part[(key, parts[0][1])].keys()
        whole = {name: _concat([by_part[(key, p)][name] for _, p, _, _ in parts])
                 for name in names}
        keys.append([key, max(counts.get((key, p), 0) for _, p, _, _ in parts), whole])
    merged = {'format': FILE_FORMAT,
              'num_update': max((s['num_update'] for s in server_states), default=0),
              'keys': keys}
    if server_states and 'optimizer' in server_states[0]:
        merged['optimizer'] = server_states[0]['optimizer']
    return merged


def split(merged, num_servers, parts_of):
    """Per-server updater state dicts for the current placement of every key."""
    _check_format(merged)
    out = [{'format': STATE_FORMAT, 'num_update': merged['num_update'], 'counts': [],
            'states': []} for _ in range(num_servers)]
    for key, count, whole in merged['keys']:
        parts = parts_of(key)
        size = max((stop for _, _, _, stop in parts), default=0)
        _check_whole(key, whole, size, len(parts) == 1)
        for server, part, start, stop in parts:
            out[server]['counts'].append([key, part, count])
            out[server]['states'].append([key, part, {   # (a key in one part: all of it)
                name: _slice(blob, start, stop if len(parts) > 1 else _count(blob))
                for name, blob in whole.items()}])
    if 'optimizer' in merged:
        for states in out:
            states['optimizer'] = merged['optimizer']
    return out


def unfuse(merged, fused):
    """``merged`` with each fused key's entry split into its members' entries.

    ``fused``: {fused key: [(member key, start, stop)]} (the Trainer's packed keys); members
    take the fused key's update count. Other entries are kept."""
    _check_format(merged)
    keys = []
    for key, count, whole in merged['keys']:
        if key not in fused:
            keys.append([key, count, whole])
            continue
        for member, start, stop in fused[key]:
            keys.append([member, count, {name: _slice(blob, start, stop)
                                         for name, blob in whole.items()}])
    return {**merged, 'keys': sorted(keys, key=lambda entry: (str(type(entry[0])), entry[0]))}


def fuse(merged, fused):
    """The inverse of unfuse: members' entries joined into their fused key's. A fused key
    some of whose members have no state in ``merged`` is left out (a load starts it afresh,
    as a key never updated), with a warning."""
    _check_format(merged)
    entries = {key: (count, whole) for key, count, whole in merged['keys']}
    members = {member for ranges in fused.values() for member, _, _ in ranges}
    keys = [[key, count, whole] for key, (count, whole) in entries.items() if key not in members]
    for key, ranges in fused.items():
        present = [member for member, _, _ in ranges if member in entries]
        if len(present) < len(ranges):
            if present:
                log.warning('optimizer state of parameters %s left out: the file holds none for '
                            '%s, which share one key with them', present,
                            [m for m, _, _ in ranges if m not in entries])
            continue
        parts = [entries[member] for member, _, _ in ranges]
        names = parts[0][1].keys()
        if any(whole.keys() != names for _, whole in parts):
            raise ConfigError(f'the file holds different optimizer states for parameters '
                              f'{present}, which share one key')
        keys.append([key, max(count for count, _ in parts),
                     {name: _concat([whole[name] for _, whole in parts]) for name in names}])
    return {**merged, 'keys': sorted(keys, key=lambda entry: (str(type(entry[0])), entry[0]))}


def _check_format(merged):
    if not isinstance(merged, dict) or merged.get('format') != FILE_FORMAT:
        raise ConfigError(f'not a kvps optimizer-state file (format {FILE_FORMAT!r} expected)')


def _check_whole(key, whole, size, one_part=False):
    """ConfigError naming ``key`` unless each of its state arrays holds ``size`` elements
    (the key's) in bytes of its dtype: a state of another key would be cut to fit, or
    split at the wrong bytes. A key held ``one_part`` whole may also have a state of one
    element per row (GroupAdaGrad's history), which its server checks against the rows."""
    if not isinstance(whole, dict):
        raise ConfigError(f'key {key!r}: its optimizer state is not a map of arrays')
    for name, blob in whole.items():
        try:
            count, nbytes = _count(blob), len(blob['data'])
            itemsize = STATE_ITEMSIZE.get(blob['dtype'])
        except (KeyError, TypeError) as exc:
            raise ConfigError(f'key {key!r}: optimizer state {name!r} is malformed '
                              f'({exc!r})') from None
        per_row = one_part and 0 < count < size and size % count == 0
        if itemsize is None or (count != size and not per_row) or nbytes != count * itemsize:
            raise ConfigError(f'key {key!r}: optimizer state {name!r} holds {count} '
                              f'{blob["dtype"]} elements in {nbytes} bytes, but the key has '
                              f'{size} elements: the state was saved for another key')


def _concat(blobs):
    dtype = blobs[0]['dtype']
    if any(b['dtype'] != dtype for b in blobs):
        raise ConfigError('parts of one key hold optimizer state of different dtypes')
    return {'dtype': dtype, 'shape': [sum(_count(b) for b in blobs)],
            'data': b''.join(b['data'] for b in blobs)}


def _count(blob):
    count = 1
    for dim in blob['shape']:
        count *= dim
    return count


def _slice(blob, start, stop):
    itemsize = len(blob['data']) // max(_count(blob), 1)
    if stop > _count(blob):
        raise ConfigError(f'optimizer state holds {_count(blob)} elements, the key has {stop}')
    return {'dtype': blob['dtype'], 'shape': [stop - start],
            'data': blob['data'][start * itemsize:stop * itemsize]}


def write_file(path, merged):
    """Write atomically: a crash mid-write leaves the previous file intact."""
    write_atomically(path, msgpack.packb(merged, use_bin_type=True))


def read_file(path):
    with open(path, 'rb') as f:
        try:
            return msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types on garbage
            raise ConfigError(f'{path}: not a kvps optimizer-state file ({exc})') from None
