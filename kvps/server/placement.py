"""Where a shard keeps its arrays: host memory (numpy) or a CUDA device (cupy, KVPS_SERVER_DEVICE).

The Shard never calls numpy or cupy directly for its weights, merge buffers and received
gradients; it asks its placement. Host arrays read wire buffers in place and lend the weight
itself to a pull reply (copy-on-write leases); device arrays copy a received buffer to the
device once and copy the weight back to a fresh host array for each pull.
"""

import numpy as np

from ..errors import ConfigError
from ..protocol import DTYPES


class HostArrays:
    """numpy arrays in this process's memory."""

    name = 'cpu'
    lends = True        # a pull reply may send the stored weight itself, without a copy
    xp = np

    def received(self, data, dtype):
        """A read-only array over a received buffer (no copy)."""
        return np.frombuffer(data, dtype=DTYPES[dtype])

    def owned(self, data, dtype):
        """A new array holding a copy of a received buffer."""
        return np.frombuffer(data, dtype=DTYPES[dtype]).copy()

    def to_host(self, array):
        return array


class CudaArrays(HostArrays):
    """cupy arrays on the current CUDA device; the optimizer kernels follow them there."""

    name = 'cuda'
    lends = False       # a pull reply needs the weight in host memory: a fresh copy each time

    def __init__(self):
        try:
            import cupy
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # ImportError, or CUDA's own errors without a driver
            raise ConfigError(f'KVPS_SERVER_DEVICE=cuda needs cupy and a CUDA GPU on this '
                              f'server (pip install "kvps[cuda]"): {exc!r}') from None
        if count < 1:
            raise ConfigError('KVPS_SERVER_DEVICE=cuda, but this server sees no CUDA GPU')
        self.xp = cupy

    def received(self, data, dtype):
        return self.xp.asarray(super().received(data, dtype))

    owned = received      # the copy to the device is already a copy

    def to_host(self, array):
        return self.xp.asnumpy(array)


def for_device(device):
    """The placement for a KVPS_SERVER_DEVICE value."""
    return CudaArrays() if device == 'cuda' else HostArrays()
