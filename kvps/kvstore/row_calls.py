"""The KVStore's row-sparse calls: pushes of some rows, and pulls of some rows or of the rows
changed since the last look.

Each takes the store's keys (kvps.kvstore.keys.StoreKeys: checks, shapes, parts, copies) and its
backend explicitly; the store has checked that it is open.
"""

import numpy as np

from .. import arrays, devices, rows
from ..errors import ShapeError
from ..wire.protocol import DTYPES, ROW_SPARSE


def push_item(keys, backend, key, values):
    """The backend's push item for ``values`` of ``key`` when some are row-sparse: the rows
    alone (one payload per part), or the dense sum where the key is split inside its rows."""
    shape, dtype = keys.known(key)
    pieces = [rows.host_rows(v, shape, dtype, key) for v in values if rows.is_row_sparse(v)]
    ids, table = rows.union_sum(pieces, rows.width_of(shape), dtype)
    dense = [v for v in values if not rows.is_row_sparse(v)]
    edges = _row_edges(keys, key, shape)
    if dense or edges is None:
        whole = np.zeros((shape[0], rows.width_of(shape)), table.dtype)
        whole[ids] = table
        return (key, *_dense_sum(keys, key, [whole.reshape(shape), *dense]))
    pieces = rows.split(ids, table, edges)
    blocks = backend.stage([i.nbytes + r.nbytes for i, r in pieces])
    return key, [rows.encode(i, r, block) for (i, r), block in zip(pieces, blocks)], ROW_SPARSE


def _dense_sum(keys, key, values):
    """``(flat copy, dtype)``: the sum of dense ``values`` (a host one first)."""
    if len(values) > 1 and any(devices.on_gpu(v) for v in values):
        values = [values[0], *(arrays.as_numpy(devices.as_torch(v).cpu()) for v in values[1:])]
    return keys.host_copies([(key, values)])[0], keys.known(key)[1]


def _row_edges(keys, key, shape):
    """First row of every part of ``key`` and the end, or None where a part starts inside a
    row (a key with fewer rows than servers)."""
    width = rows.width_of(shape)
    parts = keys.parts(key)
    if any(start % width for _, _, start, _ in parts):
        return None
    return [start // width for _, _, start, _ in parts] + [parts[-1][3] // width]


def pull(keys, backend, key, out, row_ids=None, marks=None, priority=0):
    """Write rows ``row_ids`` of each key into its ``out`` (MXNet's row_sparse_pull); with
    ``marks`` instead (a dict per key, kept by the caller between calls), the rows changed
    since the last such pull. Everything is checked before anything is asked (``priority``:
    the store's, checked)."""
    pull_begin(keys, backend, key, out, row_ids, marks, priority)()


def pull_begin(keys, backend, key, out, row_ids=None, marks=None, priority=0):
    """``pull``'s requests sent now; returns the wait for their answers."""
    asked, landings = [], []
    for k, o, i in _per_key(key, out, row_ids, marks):
        k = keys.check_key(k)
        targets = list(o) if isinstance(o, (list, tuple)) else [o]
        each = list(i) if _one_per_target(i) else [i] * len(targets)
        if len(each) != len(targets):
            raise ValueError(f'key {k!r}: {len(targets)} targets but {len(each)} row_ids')
        for target, wanted in zip(targets, each):
            table, landing = _table(keys, k, target, wanted, marks)
            asked.append((k, table, landing[1],
                          None if marks is None else marks.setdefault(k, {})))
            landings.append(landing)
    wait = backend.pull_rows_begin(
        [item for item in asked if not _pulled_whole(keys, backend, priority, *item)],
        priority)

    def landed():
        wait()
        for target, ids_pulled, table in landings:
            if target is not None:
                devices.put_rows(target, ids_pulled, table[ids_pulled])
    return landed


def _per_key(key, out, row_ids, marks):
    """``(key, out, row_ids)`` of each key of a call (a key, or a list of keys)."""
    if not isinstance(key, (list, tuple)):
        return [(key, out, row_ids)]
    ids = row_ids if marks is None else [None] * len(key)
    if not (isinstance(out, (list, tuple)) and isinstance(ids, (list, tuple))
            and len(out) == len(ids) == len(key)):
        raise ValueError('row_sparse_pull of a list of keys takes a list of out and a list '
                         'of row_ids, one per key')
    return zip(key, out, ids)


def _one_per_target(row_ids):
    """Whether ``row_ids`` is a list of id arrays, one per target (not a list of ids)."""
    return isinstance(row_ids, (list, tuple)) and any(
        not isinstance(i, (int, np.integer)) for i in row_ids)


def _pulled_whole(keys, backend, priority, key, table, ids, marks):
    """Pull ``key`` whole into ``table``'s rows ``ids`` (None: all) if its parts split rows
    (a key with fewer rows than servers: a few rows, so little to save); True if it did."""
    whole = _whole_if_split(keys, backend, key, priority)
    if whole is None:
        return False
    if ids is None:
        table[...] = whole
    else:
        table[ids] = whole[ids]
    return True


def _whole_if_split(keys, backend, key, priority=0):
    """Where ``key``'s parts start inside rows, its value pulled whole as a 2-D (rows x
    width) host table; else None (its parts answer row requests)."""
    shape, dtype = keys.known(key)
    if _row_edges(keys, key, shape) is not None:
        return None
    whole = np.empty((shape[0], rows.width_of(shape)), DTYPES[dtype])
    backend.pull([(key, whole.reshape(-1), dtype)], priority)
    return whole


def _table(keys, key, target, wanted, marks):
    """``(table, landing)`` for one target: the 2-D view the backend writes rows into, and
    ``(GPU target or None, ids, table)`` that copies them from a host table to a GPU."""
    shape, dtype = keys.known(key)
    if rows.is_row_sparse(target):
        raise TypeError(f'key {key!r}: pull into a dense array or tensor of the key\'s shape')
    arrays.check_like(target, shape, dtype, key, 'pull target')
    ids = None if marks is not None else _checked_ids(key, wanted, shape[0])
    view, = devices.check_targets([target], key)
    width = rows.width_of(shape)
    if view is not None and view.flags.c_contiguous:
        return view.reshape(shape[0], width), (None, ids, None)
    if ids is None:   # the rows changed are known only from the answers
        raise ShapeError(f'key {key!r}: pulling the rows changed needs a contiguous target in '
                         'host memory')
    # A GPU target, or one whose rows are not side by side: the rows land in a host table
    # first (np.empty: only the pages of rows written are ever touched).
    table = np.empty((shape[0], width), DTYPES[dtype])
    return table, (target, ids, table)


def _checked_ids(key, wanted, num_rows):
    """Row ids as sorted unique int64; errors name the key."""
    if wanted is None:
        raise TypeError(f'row_sparse_pull of key {key!r} needs row_ids (the rows to pull)')
    return np.unique(rows.checked_ids(wanted, num_rows, key))


def pull_live_begin(keys, backend, asked_keys, priority=0):
    """Ask for the rows of each key's value that its last push of rows made (servers without
    an optimizer: the round's summed rows; every row of a dense value); returns the wait,
    which gives {key: (sorted ids, rows as a 2-D host array)}. A key split inside its rows
    is pulled whole."""
    sinks, whole, items = {}, {}, []
    for key in asked_keys:
        table = _whole_if_split(keys, backend, key, priority)
        if table is not None:
            whole[key] = table
            continue
        shape, dtype = keys.known(key)
        sinks[key] = []
        items.append((key, rows.width_of(shape), DTYPES[dtype], sinks[key]))
    wait = backend.pull_live_begin(items, priority)

    def landed():
        wait()
        found = {key: (np.arange(len(table), dtype=rows.ROW_ID), table)
                 for key, table in whole.items()}
        for key, pieces in sinks.items():
            found[key] = (np.concatenate([ids for ids, _ in pieces]),
                          np.concatenate([values for _, values in pieces]))
        return found
    return landed
