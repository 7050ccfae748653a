"""A shard's arrays in host memory (numpy): wire buffers read in place, weights lent to pull
replies, big ones in the server's shared-memory arena once it has one."""

import numpy as np

from ..optimizer.kernels import numpy_kernels
from ..optimizer.kernels.numpy_packing import PACK_UP_TO
from ..wire.protocol import as_array
from ..wire.shm import MIN_BYTES

SMALL_CHUNK_BYTES = 1 << 20   # small keys' weights are cut end to end from chunks of this


class HostArrays:
    """numpy arrays in this process's memory; from ``arena`` (a kvps.wire.shm.Segment, set when
    a worker on this host attaches) for arrays of MIN_BYTES and more, while it has room."""

    name = 'cpu'
    lends = True        # a pull reply may send the stored weight itself, without a copy
    on_device = False   # a pull reply sends or lends the weight as it is (host memory)
    sharing = None      # workers' device segments are not mapped (kvps.wire.device_sharing)
    route = ('kept in host memory (numpy kernels): read from and lent to local workers in '
             'shared memory')
    # An update may take a sync round's last pushes unsummed (the kernels add them in the
    # pass of the update, the numpy ones and the CUDA ones alike): float32/float64 only, whose
    # sum is the same there as in a merge (a half type's is rounded there, in float32 here).
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

    def reading(self, grad):
        """Work issued in this request reads a round's gradient ``grad`` (an array, a tuple
        of them, or None): on the host, that work is done when it returns."""

    def settle(self):
        """Wait for the copies made so far (a device's); on the host they are done."""

    def order(self):
        """Before answers go out: the copies they depend on done or ordered (a device's)."""
