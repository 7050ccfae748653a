"""Row-sparse values (MXNet's row_sparse): some rows of a key, their sums and their wire payload.

A key of shape (R, *rest) has R rows of ``width = prod(rest)`` elements (a 1-D key: rows of
one element). An embedding's gradient touches a few rows of a large table: pushing those rows
alone costs bytes in proportion to the batch, not to the table, and the server then updates
only those rows and their optimizer state (MXNet's lazy update).

Wire payload of one key part (a PUSH item of dtype 'rows', and a ROWS reply): the row ids as
int64, counted from the part's first row, sorted and unique, then their values, row after row,
in the key's dtype (bfloat16 as its 16 bits).
"""

import functools

import numpy as np

from . import arrays
from .errors import DTypeError, ProtocolError, ShapeError

ROW_ID = np.dtype(np.int64)


class RowSparse:
    """Rows of a key whose other rows are zero (an embedding's gradient, MXNet's
    RowSparseNDArray): ``values[i]`` is row ``row_ids[i]``. Push it as any value:
    ``kv.push(key, kvps.RowSparse(ids, rows))``; ids may come in any order and repeat (their
    rows are summed). A torch sparse COO tensor (``nn.Embedding(sparse=True)``'s gradient) is
    taken as it is."""

    __slots__ = ('row_ids', 'values')

    def __init__(self, row_ids, values):
        self.row_ids, self.values = row_ids, values

    def __repr__(self):
        return f'RowSparse({len(self.row_ids)} rows)'


def is_row_sparse(value):
    """True for RowSparse values and torch sparse COO tensors."""
    if type(value) is np.ndarray:   # the common case, answered first: asked per key and call
        return False
    return type(value) is RowSparse or (arrays.is_torch(value) and
                                        getattr(value, 'layout', None) is not None and
                                        str(value.layout) == 'torch.sparse_coo')


@functools.lru_cache(maxsize=4096)
def width_of(shape):
    """Elements per row of a key of ``shape`` (a tuple)."""
    return int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1


def host_rows(value, shape, dtype, key):
    """``(ids, rows)`` of a row-sparse ``value`` for a key of ``shape`` and ``dtype``: int64
    ids, sorted and unique, and a 2-D (len(ids), width) numpy array of their summed rows (a
    copy: the caller's value is never touched); errors name the key."""
    ids, values = _parts_of(value)
    ids = checked_ids(ids, shape[0], key)
    width = width_of(shape)
    if arrays.dtype_name(values) != dtype:
        raise DTypeError(f'key {key!r}: pushed rows have dtype {arrays.dtype_name(values)}, '
                         f'but the key was initialized with dtype {dtype}')
    rows = arrays.as_numpy(values)
    if rows.ndim == 0 or rows.shape[0] != ids.size or rows.size != ids.size * width:
        raise ShapeError(f'key {key!r}: {ids.size} row ids with values of shape '
                         f'{tuple(rows.shape)}; rows of shape {tuple(shape[1:])} expected')
    return coalesce(ids, rows.reshape(ids.size, width), dtype)


def _parts_of(value):
    """(int64 ids on the host, values) of a RowSparse or a torch sparse COO tensor."""
    if type(value) is RowSparse:
        ids, values = value.row_ids, value.values
    else:
        if value.sparse_dim() != 1:
            raise ShapeError(f'a torch sparse tensor pushed as rows must be sparse in its '
                             f'first dimension only; this one has sparse_dim {value.sparse_dim()}')
        ids, values = value._indices()[0], value._values()
    if arrays.is_torch(values) and values.device.type != 'cpu':
        values = values.detach().cpu()
    return ids, values


def checked_ids(ids, num_rows, key):
    """``ids`` (any integer sequence, a torch tensor too) as a 1-D int64 numpy array; a
    ShapeError naming the key unless each is a row of a key of ``num_rows`` rows."""
    if arrays.is_torch(ids):
        ids = ids.detach().cpu().numpy()
    ids = np.asarray(ids)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ShapeError(f'key {key!r}: row ids must be a 1-D array of integers, got shape '
                         f'{ids.shape} of {ids.dtype}')
    ids = ids.astype(ROW_ID, copy=False)
    low, high = (ids.min(), ids.max()) if ids.size else (0, -1)
    if low < 0 or high >= num_rows:
        raise ShapeError(f'key {key!r}: row id {int(low if low < 0 else high)} is out of '
                         f'range: the key has {num_rows} rows')
    return ids


def ordered_below(ids, bound):
    """Whether ``ids`` (int64) are sorted, unique and in [0, bound): a payload's promise."""
    return not ids.size or (ids[0] >= 0 and ids[-1] < bound and bool(np.all(ids[1:] > ids[:-1])))


def coalesce(ids, rows, dtype):
    """Sorted unique ids and the sum of the rows of each (a new array: never ``rows``)."""
    if ids.size and np.all(ids[1:] > ids[:-1]):
        return ids.copy(), np.array(rows, copy=True, order='C')
    order = np.argsort(ids, kind='stable')
    ids = ids[order]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]]) if ids.size else ids
    return ids[starts], sum_at(rows[order], starts, dtype)


def sum_at(rows, starts, dtype):
    """Rows summed over the runs that begin at ``starts`` (bfloat16 bits summed in float32
    and rounded once), each run added in order, first row to last."""
    if len(starts) == rows.shape[0]:
        return np.array(rows, copy=True, order='C')
    wide = dtype == 'bfloat16'
    if wide:
        from .optimizer.kernels import common
        rows = common.bf16_to_f32(rows)
    out = rows[starts]   # a copy: each run's first row
    # The rest, in rounds: each run's next row at a time (np.add.reduceat along rows costs
    # ten times this). Most runs are short: a few rounds.
    later = np.ones(rows.shape[0], bool)
    later[starts] = False
    rest = np.flatnonzero(later)
    run = np.searchsorted(starts, rest, side='right') - 1
    while rest.size:
        first = np.r_[True, run[1:] != run[:-1]]
        out[run[first]] += rows[rest[first]]
        rest, run = rest[~first], run[~first]
    return common.f32_to_bf16(out) if wide else out


def union_sum(pieces, width, dtype):
    """``(ids, rows)``: the sum of several ``(ids, rows)`` pieces (each sorted and unique)."""
    if len(pieces) == 1:
        return pieces[0]
    ids = np.concatenate([p[0] for p in pieces])
    rows = np.concatenate([p[1].reshape(-1, width) for p in pieces])
    return coalesce(ids, rows, dtype)


def split(ids, rows, row_edges):
    """``[(ids counted from the part's first row, rows), ...]`` per part, the parts holding
    rows [row_edges[i], row_edges[i + 1])."""
    cuts = np.searchsorted(ids, row_edges)
    return [(ids[a:b] - first, rows[a:b])
            for first, a, b in zip(row_edges, cuts, cuts[1:])]


def encode(ids, rows, out=None):
    """The wire payload of ``(ids, rows)``: one contiguous uint8 array (``out``, a block of
    exactly its bytes, when given: a worker's shared memory, where servers read it)."""
    if out is None:
        out = np.empty(ids.nbytes + rows.nbytes, np.uint8)
    out[:ids.nbytes] = ids.astype(ROW_ID, copy=False).view(np.uint8)
    out[ids.nbytes:] = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
    return out


def encode_rows_of(table, ids):
    """The wire payload of rows ``ids`` of a host ``table`` (rows x width), gathered straight
    into it."""
    out = np.empty(ids.nbytes + len(ids) * table.shape[1] * table.itemsize, np.uint8)
    out[:ids.nbytes] = ids.astype(ROW_ID, copy=False).view(np.uint8)
    np.take(table, ids, axis=0,
            out=out[ids.nbytes:].view(table.dtype).reshape(len(ids), table.shape[1]))
    return out


def decode(buffer, width, storage, num_rows):
    """``(ids, rows)`` read in place from a payload; ProtocolError unless it holds whole
    rows of ``width`` elements of numpy dtype ``storage``, with ids sorted, unique and below
    ``num_rows``."""
    data = np.frombuffer(buffer, np.uint8)
    row_bytes = ROW_ID.itemsize + width * storage.itemsize
    if data.size % row_bytes:
        raise ProtocolError(f'a rows payload of {data.size} bytes does not hold whole rows of '
                            f'{width} {storage.name} elements')
    count = data.size // row_bytes
    ids = data[:count * ROW_ID.itemsize].view(ROW_ID)
    if not ordered_below(ids, num_rows):
        raise ProtocolError(f'rows payload: row ids must be sorted, unique and below '
                            f'{num_rows}')
    rows = data[count * ROW_ID.itemsize:].view(storage).reshape(count, width)
    return ids, rows
