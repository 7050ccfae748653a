"""The KVStore's keys and values as calls give them: keys checked (one kind per store, 64-bit
ints or short strs) and grouped with their values, values copied for the backend."""

import math
import operator
import threading

import numpy as np

from .. import arrays, devices, rows
from ..errors import KeyNotInitializedError, KeyTypeError
from ..timeline.recording import traced
from ..wire.protocol import DTYPES, MAX_KEY_CHARS, PRIORITIES

# Keys travel as msgpack ints: 64 bits, signed or unsigned.
_KEY_MIN, _KEY_END = -2 ** 63, 2 ** 64
# Compressed payload bytes a push hands its backend at a time: each run is on the link while
# the next is encoded (the link starts after the first key, not after the last), and small
# keys still share a run, so their parts still share messages.
ENCODE_WAVE_BYTES = 1 << 20


class StoreKeys:
    """A store's keys (their kind, shapes, dtypes and parts) and the copies of values it hands
    its backend; the store and its row calls hold one and ask it."""

    def __init__(self, name, backend, device):
        """``name``: the store's type; ``device``: GPU values take the device path."""
        self._name, self._backend, self.device = name, backend, device
        # key -> (shape, dtype name), kept by the backend: every store of one process's job
        # membership sees the keys any of them initialized, as the servers do
        self.meta = backend.keys
        self._key_kind = None
        self._kind_lock = threading.Lock()   # the first keys of two threads settle one kind
        # key -> its parts' bounds (None: one part); a key is placed once, at init, and asked
        # for at every push
        self._cut_cache = {}
        # id(tensor) -> (tensor, flat wire view of its memory) of the buffers gradient_buffer
        # gave: GPU memory the servers map, pushed from where it lies
        self._held = {}

    def pairs(self, key, value):
        """Normalize (key, value) into [(key, [values...])] as MXNet does: a key given
        more than once in a call is one key with all their values (pushed: summed; pulled:
        each written), in the order of its first appearance."""
        if not isinstance(key, (list, tuple)):
            return [(self.check_key(key), as_values(value))]
        if not isinstance(value, (list, tuple)) or len(value) != len(key):
            raise ValueError('a list of keys needs a list of values of the same length')
        grouped = {}
        check_key = self.check_key
        for k, v in zip(key, value):
            k = check_key(k)
            values = as_values(v)
            had = grouped.get(k)
            if had is None:
                grouped[k] = values
            else:
                had.extend(values)
        return list(grouped.items())

    def check_key(self, key):
        """The key as a plain int or str (numpy integers from ``np.arange``, IntEnum and str
        subclasses are taken by value; bool, float and the rest are refused)."""
        if type(key) is int and self._key_kind is int and _KEY_MIN <= key < _KEY_END:
            return key   # the common case, answered first: this runs for every key of a call
        if isinstance(key, bool) or not isinstance(key, (int, str, np.integer)):
            raise KeyTypeError(f'keys must be int or str, got {type(key).__name__}')
        key = str.__str__(key) if isinstance(key, str) else operator.index(key)
        if isinstance(key, int) and not _KEY_MIN <= key < _KEY_END:
            raise KeyTypeError(f'int keys must fit in 64 bits ([-2**63, 2**64)); got {key}')
        if isinstance(key, str) and len(key) > MAX_KEY_CHARS:
            raise KeyTypeError(f'str keys may have at most {MAX_KEY_CHARS} characters; got '
                               f'one of {len(key)}: {key[:40]!r}...')
        kind = type(key)
        if self._key_kind is None:
            with self._kind_lock:
                if self._key_kind is None:
                    self._key_kind = kind
        if kind is not self._key_kind:
            raise KeyTypeError(f'this store uses {self._key_kind.__name__} keys; got '
                               f'{kind.__name__} key {key!r} (one kind per store)')
        return key

    def known(self, key):
        """``(shape, dtype name)`` of an initialized key; KeyNotInitializedError else."""
        meta = self.meta.get(key)
        if meta is None:
            raise KeyNotInitializedError(f'key {key!r} is not initialized; call '
                                         f'kv.init({key!r}, value) first')
        return meta

    def encoded_waves(self, codec, pairs):
        """Runs of ``[(key, payloads, codec name)]`` for ``pairs`` of about ENCODE_WAVE_BYTES
        of payload each, a run encoded when the caller asks for it (a generator; one empty
        run for no pairs)."""
        run, held = [], 0
        for i, (key, values) in enumerate(pairs):
            payloads = self.encoded(codec, key, values)
            run.append((key, payloads, codec.name))
            held += sum(p.nbytes for p in payloads)
            if held >= ENCODE_WAVE_BYTES or i == len(pairs) - 1:
                yield run
                run, held = [], 0
        if not pairs:
            yield run

    @traced('compress', 'compress')
    def encoded(self, codec, key, values):
        """One compressed payload per part of the key (as the backend splits it), each in
        the memory the backend sends from when it has some."""
        if len(values) == 1 and type(values[0]) is np.ndarray:
            # read where it is: the encoding, made before this returns, only reads it
            grad = values[0].reshape(-1)
        else:
            grad = self.host_copies([(key, values)])[0]
        parts = self.parts(key)
        dtype = self.meta[key][1]
        sizes = [codec.nbytes(stop - start, dtype) for _, _, start, stop in parts]
        payloads = []
        for (_, part, start, stop), size, out in zip(parts, sizes, self._backend.stage(sizes)):
            out = np.empty(size, np.uint8) if out is None else out
            payloads.append(codec.encode(key, part, grad[start:stop], out))
        return payloads

    def on_gpu(self, key, values):
        """Whether ``values`` of ``key`` take the device path (summed on their GPU)."""
        if len(values) == 1 and type(values[0]) is np.ndarray:   # most calls: answered at once
            return False
        return devices.takes_device_path(values, self.device, self._name, key)

    def host_copies(self, pairs, stage=False):
        """What the backend is given for each ``(key, values)``: a kvps-owned flat host copy
        of the values' sum (the caller's memory is never handed over). With ``stage`` the
        copy is made straight into the memory the backend sends from (a worker's shared
        memory: the one copy a push makes), and for a key in several parts as a list of one
        copy per part, each in a block of its own: a value bigger than the free shared
        memory then still sends most of its parts through it, not all over the socket. Host
        values are summed by numpy; GPU values on their device, and copied from there into
        those blocks where the backend's shared memory is page-locked (kvps.devices.direct),
        else staged through pinned memory."""
        gpu = [self.on_gpu(key, values) for key, values in pairs]
        straight = stage and True in gpu and devices.direct(self._backend)
        held = self._held_flats(pairs) if straight and self._held else None
        cuts = [self.cuts(key) if stage and (straight or not on_gpu) else None
                for on_gpu, (key, _) in zip(gpu, pairs)]
        sizes = [[0] if on_gpu and not straight else [values[0].nbytes] if cut is None else
                 [(b - a) * values[0].itemsize for a, b in cut]
                 for on_gpu, cut, (_, values) in zip(gpu, cuts, pairs)]
        if held is not None:   # (sent from where they lie: no block)
            sizes = [size if flat is None else [0] * len(size)
                     for size, flat in zip(sizes, held)]
        blocks, mapped = self._blocks(sizes, gpu if straight else None) if stage else \
            ([None] * len(pairs), ())
        blocks = iter(blocks)
        copies, from_gpu = [], devices.PushCopies() if straight else None
        for index, (on_gpu, cut, (_, values)) in enumerate(zip(gpu, cuts, pairs)):
            taken = [next(blocks) for _ in cut or [0]] if on_gpu and straight else None
            if held is not None and held[index] is not None:
                copies.append(from_gpu.held(held[index], cut))
            elif taken is not None:
                copies.append(from_gpu.copy(values, taken, cut, mapped))
            elif on_gpu:
                next(blocks)
                copies.append(devices.host_sum(values))
            elif cut is None:
                copies.append(_summed(values, next(blocks)))
            else:
                flats = [v.reshape(-1) for v in values]   # torch or numpy: dtypes kept
                copies.append([_summed([f[a:b] for f in flats], next(blocks)) for a, b in cut])
        if straight:   # before the backend sends headers that point at the blocks
            from_gpu.finish(self._backend.device_written)
        return copies

    def plain_call(self, key, values):
        """``(keys, values, dtype names)`` as lists, of a call that lists int keys, each with
        one numpy array of the key's shape and dtype, no key twice (most calls of many keys;
        bfloat16 keys left out: a uint16 array of one is no such array), or names one such key
        and array (Gluon's loop makes a call per key); None for any other call."""
        if type(key) is int and type(values) is np.ndarray:
            key, values = [key], [values]
        elif type(key) is not list or type(values) is not list or len(key) != len(values):
            return None
        meta, wire, names = self.meta, DTYPES, []
        for k, a in zip(key, values):
            known = meta.get(k) if type(k) is int else None
            if known is None or type(a) is not np.ndarray or a.shape != known[0] \
                    or a.dtype is not wire.get(known[1]) or known[1] == 'bfloat16':
                return None
            names.append(known[1])
        return (key, values, names) if len(set(key)) == len(key) else None

    def plain_copies(self, key, value):
        """The backend items of a push that plain_call takes, none of its keys split over
        servers: their copies staged as host_copies stages them, without its checks; None
        for any other push (nothing is staged then)."""
        plain = self.plain_call(key, value)
        cuts = self._cut_cache
        if plain is None or any(cuts.get(k, 0) is not None for k in plain[0]):
            return None   # (a key placed in one part has None there)
        keys, values, names = plain
        blocks = self._backend.stage([v.nbytes for v in values])
        return [(k, arrays.flat_copy(v, block), name)
                for k, v, block, name in zip(keys, values, blocks, names)]

    def gradient_buffer(self, like):
        """A tensor like GPU tensor ``like`` (flat, contiguous) in GPU memory the servers
        map (Backend.device_buffer), whose pushes go from where they lie; None where there
        is none (not a device store, not a GPU value, no ipc route, no room)."""
        if not (self.device and devices.on_gpu(like) and devices.direct(self._backend)):
            return None
        block = self._backend.device_buffer(like.numel() * like.element_size())
        if block is None:
            return None
        tensor = devices.as_torch(block).view(like.dtype)
        self._held[id(tensor)] = (tensor, block.view(DTYPES[arrays.dtype_name(like)]))
        return tensor

    def _held_flats(self, pairs):
        """Per pair, the wire view of a buffer of gradient_buffer's that is its one value
        (sent from where it lies), or None."""
        held = self._held
        return [held[id(values[0])][1] if len(values) == 1 and id(values[0]) in held else None
                for _, values in pairs]

    def _blocks(self, sizes, gpu=None):
        """A block of the backend's for each part's size in ``sizes`` (a list per value), and
        the ids of those of GPU memory its servers map: where ``gpu`` says a value is a GPU's,
        a block of that memory if it has some (the ipc route: copied on the device), else of
        its shared memory."""
        flat = [n for each in sizes for n in each]
        if gpu is None or True not in gpu:
            return self._backend.stage(flat), ()
        on_device = self._backend.stage([n if g else 0 for g, each in zip(gpu, sizes)
                                         for n in each], device=True)
        host = self._backend.stage([0 if d is not None else n for d, n in zip(on_device, flat)])
        return [h if d is None else d for d, h in zip(on_device, host)], \
            {id(d) for d in on_device if d is not None}

    def parts(self, key):
        """``[(server, part, start, stop)]`` of an initialized key, as its backend placed it."""
        shape, _ = self.known(key)
        # math.prod, not np.prod: asked for every key of every push (np.prod costs ~5 us)
        return self._backend.parts(key, math.prod(shape))

    def cuts(self, key):
        """``[(start, stop)]`` of each part of a key in several, else None."""
        try:
            return self._cut_cache[key]
        except KeyError:
            parts = self.parts(key)
            cuts = None if len(parts) < 2 else [(start, stop) for _, _, start, stop in parts]
            self._cut_cache[key] = cuts
            return cuts


def checked_priority(priority):
    """A call's ``priority`` as a plain int (MXNet's: a higher one is sent and served first);
    TypeError for a non-integer, ValueError outside MXNet's C int."""
    if type(priority) is int and priority in PRIORITIES:   # every call: answered first
        return priority
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
        raise TypeError(f'priority must be an int, got {type(priority).__name__}')
    priority = operator.index(priority)
    if priority not in PRIORITIES:
        raise ValueError(f'priority must fit in 32 bits (a C int, as MXNet\'s); got {priority}')
    return priority


def as_values(value):
    """A call's value for one key as a list (a list of values: one per device, summed)."""
    if type(value) is np.ndarray:   # the common case, answered first: runs for every key
        return [value]
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values or not all(devices.is_value(v) or rows.is_row_sparse(v) for v in values):
        raise TypeError('values must be numpy arrays, torch tensors or cupy arrays, or '
                        'kvps.RowSparse rows (or lists of them)')
    return values


def _summed(values, into):
    """A flat copy of ``values``' sum (one value: itself), in ``into`` when given."""
    return arrays.sum_values(values, into) if len(values) > 1 else \
        arrays.flat_copy(values[0], into)

