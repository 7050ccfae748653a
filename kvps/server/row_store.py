"""Rows of a key part on a server: row pushes decoded and summed, rows changed since a look."""

import numpy as np

from .. import rows
from ..errors import ShapeError
from .records import Rows


class RowGrad:
    """Some rows of a key part's gradient: sorted unique ``ids`` (from the part's first row)
    and their ``rows`` (len(ids) x width, in the key's storage dtype)."""

    __slots__ = ('ids', 'rows')

    def __init__(self, ids, rows):
        self.ids, self.rows = ids, rows


class RowLog:
    """When each row of a key part last changed, so that a worker can pull only those rows.
    ``count`` ticks at every change of the weight; a change of some rows stamps them, a
    change of the whole weight (a dense update, a replacing push) sets ``whole``."""

    __slots__ = ('count', 'whole', 'stamps')

    def __init__(self):
        self.count = self.whole = 1      # the init value: a worker that saw nothing lacks it
        self.stamps = None               # per row: the count of its last change

    def changed_all(self):
        self.count += 1
        self.whole = self.count

    def changed_rows(self, ids, num_rows):
        self.count += 1
        if self.stamps is None:
            self.stamps = np.zeros(num_rows, np.int64)
        self.stamps[ids] = self.count

    def since(self, count, num_rows):
        """Ids of the rows changed after ``count``."""
        if count < self.whole:
            return np.arange(num_rows, dtype=rows.ROW_ID)
        if self.stamps is None:
            return np.empty(0, rows.ROW_ID)
        return np.flatnonzero(self.stamps > count).astype(rows.ROW_ID, copy=False)


def width(entry):
    """Elements per row of ``entry``; ShapeError if its part does not hold whole rows (a key
    with fewer rows than servers is split by elements: push and pull it whole)."""
    w = rows.width_of(entry.shape)
    if entry.n % w:
        raise ShapeError(f'key {entry.key!r} of shape {entry.shape} is split between servers '
                         'inside its rows (it has fewer rows than servers): push and pull it '
                         'whole')
    return w


def num_rows(entry):
    return entry.n // width(entry)


def decode_push(entry, data):
    """The RowGrad a PUSH item of dtype 'rows' carries for ``entry``."""
    ids, values = rows.decode(data, width(entry), entry.weight.dtype, num_rows(entry))
    return RowGrad(ids, entry.arrays.received(values, entry.dtype).reshape(values.shape)
                   if entry.arrays.name != 'cpu' else values)


def summed(entry, pieces):
    """One RowGrad: the sum of a round's row pushes."""
    if len(pieces) == 1:
        return pieces[0]
    host = [(p.ids, entry.arrays.to_host(p.rows)) for p in pieces]
    ids, values = rows.union_sum(host, width(entry), entry.dtype)
    return RowGrad(ids, values if entry.arrays.name == 'cpu'
                   else entry.arrays.received(values, entry.dtype).reshape(values.shape))


def dense(entry, grad):
    """``grad`` as a whole part's gradient: its rows, zeros elsewhere (a store without an
    optimizer replaces the value with it, as MXNet's does with a row_sparse push)."""
    xp = entry.arrays.xp
    out = xp.zeros((num_rows(entry), width(entry)), entry.weight.dtype)
    out[xp.asarray(grad.ids)] = grad.rows
    return out.reshape(-1)


def replace(entry, weight, grad):
    """A store without an optimizer: ``weight`` (the entry's, writable) becomes ``grad``'s
    rows, zeros elsewhere. Where it already was such a value (``entry.live``: its rows), only
    those rows are cleared, not the whole part. Returns the ids of the rows changed, None
    for all of them."""
    xp = entry.arrays.xp
    table = weight.reshape(-1, width(entry))
    if entry.live is None:
        table.fill(0)
        changed = None
    else:
        table[xp.asarray(entry.live)] = 0
        changed = np.union1d(entry.live, grad.ids)
    table[xp.asarray(grad.ids)] = grad.rows
    return changed


def requested(entry, buffer):
    """The row ids a PULL_ROWS asks for: int64, sorted, unique and inside the part."""
    ids = np.frombuffer(buffer, rows.ROW_ID)
    bound = num_rows(entry)
    if not rows.ordered_below(ids, bound):
        raise ShapeError(f'key {entry.key!r} part {entry.part}: pulled row ids must be sorted, '
                         f'unique and below {bound}')
    return ids


# ``since`` of a pull that asks for the rows of the value a push of rows made (a store
# without an optimizer: the round's summed rows), every row if the value is dense
LIVE = 'live'


def answer(entry, epoch, ids=None, since=None):
    """The Rows of a ROWS reply: rows ``ids``, or those changed since
    ``since`` ([epoch, count] of an earlier reply; another epoch: every row), or with LIVE
    the rows of the value (all when it is dense), or every row."""
    if ids is None and since == LIVE:
        ids = entry.live if entry.live is not None else \
            np.arange(num_rows(entry), dtype=rows.ROW_ID)
    elif ids is None:
        count = since[1] if since is not None and since[0] == epoch else 0
        ids = entry.rowlog.since(count, num_rows(entry))
    table = entry.weight.reshape(-1, width(entry))
    if entry.arrays.name == 'cpu':
        return Rows(epoch, entry.rowlog.count, rows.encode_rows_of(table, ids))
    picked = entry.arrays.to_host(table[entry.arrays.xp.asarray(ids)])
    return Rows(epoch, entry.rowlog.count, rows.encode(ids, picked))
