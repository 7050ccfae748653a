"""Multi-tensor apply for the numpy kernels: small keys of one rule run as one pass, in place where their arrays lie end to end."""

import bisect
import collections
import threading

import numpy as np

from . import common

# Keys of at most this many elements are packed with others of the same rule and scalars into
# one pass: a kernel call costs tens of microseconds of Python, more than copying such a key
# in and back out; for much bigger keys the copies cost more than the calls they save.
PACK_UP_TO = 4096
PACK_ELEMENTS = 1 << 19   # per pass: bounds the scratch memory packing keeps (per thread)
# Rules whose every output element depends on the same element of the inputs only: packing
# keys side by side changes no bit of their results. (LAMB, LARS, LANS and LBSGD read
# each weight's norms; SGLD's noise is drawn by element index.)
ELEMENTWISE = frozenset({'sgd_update', 'nag_update', 'adam_update', 'adamw_update',
                         'adagrad_update', 'rmsprop_update', 'ftrl_update', 'signum_update',
                         'test_update', 'adadelta_update', 'adamax_update', 'nadam_update',
                         'ftml_update', 'dcasgd_update', 'adabelief_update'})
LAYOUTS_KEPT = 256        # column layouts remembered per thread (see _runs)
MIN_KEYS_PER_RUN = 8      # a column in more pieces than this allows is copied (see _runs)
_local = threading.local()   # .buffers: {(slot, dtype): scratch}, .runs: (see _runs)


def multi_update(calls, kernels):
    """Many keys at once, calls: [(fn_name, args, kwargs)], args = (weight, grad, *states),
    the functions found in ``kernels`` (a name -> function mapping). Small keys of one
    elementwise rule with equal scalars run as packed passes; the rest one by one. Each key
    is updated once (a key given twice: everything in order)."""
    if len(calls) < 2 or len({id(args[0]) for _, args, _ in calls}) < len(calls):
        _each(calls, kernels)
        return
    packs, alone, scalars = {}, [], {}
    for call in calls:
        kind = _pack_kind(*call, scalars)
        if kind is None:
            alone.append(call)
        else:
            packs.setdefault(kind, []).append(call)
    _each(alone, kernels)
    for group in packs.values():
        start, size = 0, 0
        for end, (_, args, _) in enumerate(group):
            if size and size + args[0].size > PACK_ELEMENTS:
                _packed(group[start:end], kernels)
                start, size = end, 0
            size += args[0].size
        _packed(group[start:], kernels)


def _each(calls, kernels):
    for name, args, kwargs in calls:
        kernels[name](*args, **kwargs)


def _pack_kind(name, args, kwargs, scalars):
    """What a call must share with others to be packed with them (None: run it alone): the
    rule, every scalar, and the dtype of every array. ``scalars``: {id(kwargs): their part of
    the answer}, for calls that share one kwargs dict (the updater's keys mostly do)."""
    weight = args[0]
    if name not in ELEMENTWISE or not 0 < weight.size <= PACK_UP_TO:
        return None
    shape, dtypes = weight.shape, []
    for arr in (*args, kwargs.get('weight32')):
        if arr is None:
            dtypes.append(None)
            continue
        for a in arr if type(arr) is tuple else (arr,):
            if type(a) is not np.ndarray or a.shape != shape or not a.flags.c_contiguous:
                return None   # run alone: the kernel's own checks say what is wrong
            dtypes.append(a.dtype)
        dtypes.append(type(arr))
    known = scalars.get(id(kwargs))
    if known is None:
        # kwargs are built in one order by one optimizer: equal scalars give equal tuples
        named = {k: v for k, v in kwargs.items() if k != 'weight32'}
        known = scalars[id(kwargs)] = (*named, *common.signed_key(named.values()))
    return name, tuple(dtypes), known


def _packed(group, kernels):
    """Run one rule over the keys of ``group`` laid end to end, then put back what it wrote
    (weights, states, master copies; a grad is scratch). Columns whose arrays mostly lie end
    to end (weights in a server's chunks, states from Slabs) are updated where they lie, in
    one pass per stretch that every such column has end to end; the other columns are
    copied into scratch buffers and back."""
    name, first, kwargs = group[0]
    if len(group) == 1:
        kernels[name](*first, **kwargs)
        return
    columns = [[args[i] for _, args, _ in group] for i in range(len(first))]
    columns.append([kw.get('weight32') for _, _, kw in group])
    runs = [None if column[0] is None or slot == 1 else _runs(column)
            for slot, column in enumerate(columns)]
    copied = [slot for slot, column in enumerate(columns)
              if column[0] is not None and runs[slot] is None]
    scratch = {slot: _grads(columns[1], first[0]) if slot == 1 else
               _cat(columns[slot], slot) for slot in copied}
    ends = np.cumsum([0] + [args[0].size for _, args, _ in group]).tolist()
    cuts = sorted({start for r in runs if r is not None for start in r[0]} | {0, len(group)})
    for a, b in zip(cuts, cuts[1:]):
        packed = [None] * len(columns)
        for slot, column_runs in enumerate(runs):
            if column_runs is not None:
                packed[slot] = _stretch(column_runs, ends, a, b)
            elif slot in scratch:
                packed[slot] = _cut(scratch[slot], ends[a], ends[b])
        kernels[name](*packed[:-1], **dict(kwargs, weight32=packed[-1]))
    for slot in copied:
        if slot == 1:
            continue   # the grad was scratch
        whole = scratch[slot]
        for array, lo, hi in zip(columns[slot], ends, ends[1:]):
            np.copyto(array.reshape(-1), whole[lo:hi])


def _cut(packed, lo, hi):
    """Elements [lo, hi) of a packed column (a tuple grad: of each of its parts)."""
    return tuple(p[lo:hi] for p in packed) if type(packed) is tuple else packed[lo:hi]


def _stretch(column_runs, ends, a, b):
    """The view over arrays [a, b) of a column, which lie inside one of its runs."""
    starts, views = column_runs
    r = bisect.bisect_right(starts, a) - 1
    base = ends[starts[r]]
    return views[r][ends[a] - base:ends[b] - base]


def _runs(column):
    """``(starts, views)``: the stretches of ``column`` whose arrays lie end to end (the
    index of each one's first array, and one flat writable view over each), or None when
    there are too many to gain from. Weights and states are the same arrays round after
    round, so the answer is kept per layout (the arrays' ids; the entry holds the arrays, so
    no id is reused while it is kept): finding an address costs microseconds per array."""
    kept = getattr(_local, 'runs', None)
    if kept is None:
        kept = _local.runs = collections.OrderedDict()
    ids = tuple(map(id, column))
    known = kept.get(ids)
    if known is not None:
        kept.move_to_end(ids)
        return known[1]
    kept[ids] = (column, _find_runs(column))
    if len(kept) > LAYOUTS_KEPT:
        kept.popitem(last=False)
    return kept[ids][1]


def _find_runs(column):
    if not all(a.flags.writeable for a in column):
        return None
    starts, views, end = [], [], None
    for i, a in enumerate(column + [None]):
        at = None if a is None else a.__array_interface__['data'][0]
        if at is None or at != end:
            if starts:   # the run from starts[-1] ends before i
                first = column[starts[-1]]
                views.append(np.lib.stride_tricks.as_strided(
                    first.reshape(-1), shape=(sum(x.size for x in column[starts[-1]:i]),)))
            if a is not None:
                starts.append(i)
        if a is not None:
            end = at + a.nbytes
    # A pass per run costs a kernel call: worth it only while runs hold several keys each.
    return (starts, views) if len(starts) <= 1 + len(column) // MIN_KEYS_PER_RUN else None


def _cat(column, slot):
    """The arrays of ``column`` end to end in this thread's scratch buffer for ``slot`` (a
    tuple grad: each of its parts so)."""
    if type(column[0]) is tuple:
        return tuple(_cat(list(parts), (slot, i)) for i, parts in enumerate(zip(*column)))
    out = scratch(_local, slot, sum(a.size for a in column), column[0].dtype, PACK_ELEMENTS)
    return np.concatenate([_flat(a) for a in column], out=out)


def _grads(column, weight):
    """The grad column end to end in scratch. Tuple grads (a sync round's last pushes, for
    the kernel to add in its pass) whose parts are of the weight's dtype, itself the
    compute dtype (float32, float64), are summed here instead, in order, as the kernel
    would: one column written and read, not one per part. Anything else is laid out as it
    is (the kernel checks it and says what is wrong)."""
    first, dtype = column[0], weight.dtype
    if type(first) is not tuple or len(first) < 2 \
            or common.compute_dtype_name(weight) != common.storage_name(weight) \
            or any(part.dtype != dtype for part in first):   # (one kind: all calls alike)
        return _cat(column, 1)
    out = scratch(_local, 1, sum(parts[0].size for parts in column), dtype, PACK_ELEMENTS)
    at = 0
    for parts in column:
        n = parts[0].size
        flat = parts if parts[0].ndim == 1 else [_flat(part) for part in parts]   # (alike)
        add_parts(flat, 0, n, out[at:at + n])
        at += n
    return out


def add_parts(parts, lo, hi, out):
    """``out`` = the sum of elements [lo, hi) of the flat ``parts``, added in order (the
    order fixes the rounding: the kernels' block loop and a packed pass must agree)."""
    np.add(parts[0][lo:hi], parts[1][lo:hi], out=out)
    for more in parts[2:]:
        out += more[lo:hi]
    return out


def _flat(array):
    # (a server's arrays are flat already; reshape costs as much as copying a small key)
    return array if array.ndim == 1 else array.reshape(-1)


def scratch(pool, slot, n, dtype, least):
    """``n`` elements of this thread's reusable buffer for ``slot`` in ``pool`` (a module's
    own threading.local, so that two modules' slots never share a buffer), made at least
    ``least`` long. Reused: a fresh buffer each pass would fault in its pages again and
    start out of cache."""
    buffers = getattr(pool, 'buffers', None)
    if buffers is None:
        buffers = pool.buffers = {}
    buffer = buffers.get((slot, dtype))
    if buffer is None or buffer.size < n:
        buffer = buffers[(slot, dtype)] = np.empty(max(n, least), dtype)
    return buffer[:n]


class Slabs:
    """Small zeroed arrays cut end to end from big chunks, one run per name and dtype: the
    optimizer states of small keys, made in the order of their first update, then lie side
    by side as their weights do, and a packed pass updates them in place (no copy in or
    out). Space is never reused: states are made once per key (and again after a restore)."""

    CHUNK = 1 << 20   # elements; np.zeros: pages are committed only as states use them

    def __init__(self):
        self._runs = {}   # (name, dtype) -> (chunk, elements used)

    def zeros(self, name, shape, dtype):
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64))
        chunk, used = self._runs.get((name, dtype), (None, 0))
        if chunk is None or used + n > chunk.size:
            chunk, used = np.zeros(max(self.CHUNK, n), dtype), 0
        self._runs[(name, dtype)] = (chunk, used + n)
        return chunk[used:used + n].reshape(shape)

    def copy(self, name, array):
        out = self.zeros(name, array.shape, array.dtype)
        np.copyto(out, array)
        return out
