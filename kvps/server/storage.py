"""Where a shard keeps each key's arrays: host memory (numpy) or a CUDA device (cupy).

The Shard never calls numpy or cupy directly for its weights, merge buffers and received
gradients; it asks the key's arrays (Storage.for_key). Host arrays read wire buffers in place
and lend the weight itself to a pull reply (copy-on-write leases); big ones live in the
server's shared-memory arena once it has one, where workers on this host copy pulls straight
out of them. Device arrays copy a received buffer to the device once and copy the weight back
to a fresh host array for each pull.
"""

import logging
import os

import numpy as np

from ..errors import ConfigError
from ..optimizer.kernels import numpy_kernels
from ..optimizer.kernels.numpy_packing import PACK_UP_TO
from ..wire.protocol import as_array
from ..wire.shm import MIN_BYTES

log = logging.getLogger('kvps.server')
SMALL_CHUNK_BYTES = 1 << 20   # small keys' weights are cut end to end from chunks of this


class HostArrays:
    """numpy arrays in this process's memory; from ``arena`` (a kvps.wire.shm.Segment, set when
    a worker on this host attaches) for arrays of MIN_BYTES and more, while it has room."""

    name = 'cpu'
    lends = True        # a pull reply may send the stored weight itself, without a copy
    # An update may take a sync round's last pushes unsummed (the numpy kernels add them in
    # the pass of the update): float32/float64 only, whose sum is the same there as in a merge.
    sums_in_update = ('float32', 'float64')
    xp = np

    def __init__(self):
        self.arena = None
        self._small_chunk, self._small_used = None, 0

    def received(self, data, dtype):
        """A read-only array over a received buffer (no copy)."""
        return as_array(data, dtype)

    def owned(self, data, dtype):
        """A new array holding a copy of a received buffer (a key's weight)."""
        source = as_array(data, dtype)
        if not 0 < source.size <= PACK_UP_TO:
            return self.copy(source)
        out = self._small(source.nbytes, source.itemsize).view(source.dtype)
        np.copyto(out, source)
        return out

    def _small(self, nbytes, itemsize):
        """``nbytes`` right after the last ones cut (a small key's weight): weights made one
        after another lie end to end, as the updater's states of small keys do, and a packed
        optimizer pass updates them in place instead of copying them in and out."""
        at = -(-self._small_used // itemsize) * itemsize
        if self._small_chunk is None or at + nbytes > self._small_chunk.size:
            self._small_chunk, at = self._empty((SMALL_CHUNK_BYTES,), np.uint8), 0
        self._small_used = at + nbytes
        return self._small_chunk[at:at + nbytes]

    @property
    def kernels(self):
        return numpy_kernels

    def empty_like(self, array, dtype=None):
        return self._empty(array.shape, array.dtype if dtype is None else dtype)

    def _empty(self, shape, dtype):
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self.arena is not None and nbytes >= MIN_BYTES:
            taken = self.arena.take(nbytes)
            if taken is not None:
                return taken[1].view(dtype).reshape(shape)
        return np.empty(shape, dtype)

    def add(self, a, b, out):
        """out = a + b. bfloat16 keys (uint16 bits) sum into a float32 ``out``: numpy and
        cupy have no bfloat16 and would add the bit patterns as integers."""
        if a.dtype == b.dtype == out.dtype:
            return self.xp.add(a, b, out=out)
        return self.kernels.add_widened(a, b, out)

    def assign(self, dst, src):
        """dst = src; a float32 sum of a bfloat16 key is rounded to nearest even."""
        if dst.dtype == src.dtype:
            self.xp.copyto(dst, src)
        else:
            self.kernels.narrow(src, dst)

    def copy(self, array):
        out = self.empty_like(array)
        np.copyto(out, array)
        return out

    def to_host(self, array):
        return array


class CudaArrays(HostArrays):
    """cupy arrays on the current CUDA device; the optimizer kernels follow them there."""

    name = 'cuda'
    lends = False       # a pull reply needs the weight in host memory: a fresh copy each time
    sums_in_update = ()

    def __init__(self):
        super().__init__()
        try:
            import cupy
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # ImportError, or CUDA's own errors without a driver
            raise ConfigError(f'needs cupy and a CUDA GPU on this server '
                              f'(pip install "kvps[cuda]"): {exc!r}') from None
        if count < 1:
            raise ConfigError('this server sees no CUDA GPU')
        self.xp = cupy

    def received(self, data, dtype):
        return self.xp.asarray(super().received(data, dtype))

    owned = received      # the copy to the device is already a copy

    def to_host(self, array):
        return self.xp.asnumpy(array)

    @property
    def kernels(self):
        from ..optimizer.kernels import cuda_kernels  # imports cupy only when it runs
        return cuda_kernels

    def empty_like(self, array, dtype=None):
        return self.xp.empty_like(array, dtype=dtype)

    def copy(self, array):
        return array.copy()


class Storage:
    """Where a new key goes: ``default`` for keys of host-side stores; for keys a device-side
    store (dist_sync_device, dist_async_device) initialises, ``device``, or what ``probe``
    finds the first time one is asked for (None from it: the default)."""

    def __init__(self, default, device=None, probe=None):
        self.default = default
        self._device, self._probe = device, probe

    def use_arena(self, arena):
        """Host arrays of MIN_BYTES and more come from ``arena`` from now on."""
        for arrays in (self.default, self._device):
            if arrays is not None:
                arrays.arena = arena

    def for_key(self, wants_device):
        if not wants_device:
            return self.default
        if self._device is None:
            self._device = (self._probe() if self._probe else None) or self.default
        return self._device


def gpu_if_present():
    """CUDA placement if this server can use a GPU, else None (logged once, not an error:
    a device-side store's values are the same wherever a server keeps them)."""
    try:
        return CudaArrays()
    except ConfigError as exc:
        log.info('a device-side store asked for the GPU; keys stay in host memory: a GPU '
                 'placement %s', exc)
        return None


def for_device(setting):
    """The storage for a KVPS_SERVER_DEVICE value: 'cpu' and 'cuda' put every key there
    (cuda fails at start without a GPU); 'auto' puts device-side stores' keys on a GPU when
    this server has one, probing (importing cupy) only when such a key arrives."""
    if setting == 'auto':
        return Storage(HostArrays(), probe=gpu_if_present)
    try:
        arrays = CudaArrays() if setting == 'cuda' else HostArrays()
    except ConfigError as exc:
        raise ConfigError(f'KVPS_SERVER_DEVICE=cuda: {exc}') from None
    return Storage(arrays, arrays)


def use_update_threads(setting):
    """Split big host updates over threads (KVPS_UPDATE_THREADS); 'auto': the cores this
    process may run on, at most 4 (the memory bandwidth a few cores reach). Returns the
    count."""
    if setting == 'auto':
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity')
                 else os.cpu_count() or 1)
        setting = min(4, cores)
    numpy_kernels.set_threads(setting)
    return setting
