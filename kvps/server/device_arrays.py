"""A shard's arrays on a device (GPU shards): payloads copied in and weights copied out once,
straight between the device and host memory, page-locked where it is shared memory.

A push from a worker on this host lies in the worker's segment, which this server maps: the
range is page-locked (kvps.pinning) and copied to the device by one asynchronous DMA. A payload
that came through the socket (or from memory that could not be locked) is copied once into a
pinned buffer and from there to the device. A pull is copied from the device straight into the
block the worker gave in its segment, or into a pinned buffer sent as the frame. Copies run on
the device's current stream, behind the updates, and ``settle`` waits for them: before the
acknowledgements that free the workers' blocks, and before each answer that carries values.

A push from a worker whose device segment this server maps (CUDA IPC, kvps.wire.device_sharing)
is a device array already: it is read where it is, kept by reference as a shared-memory push
on a host shard is (a sync round's first push is the round's sum until the second is added to
it, into the merge buffer), and a pull is copied into the worker's device segment on the
device; no byte touches the host. The worker reuses a block only once its push is answered,
and ``settle`` waits for the reads of it before that.

The copying is a Transfers' (cupy's in CudaArrays); the choices (which buffer, locked or not)
are DeviceArrays', so tests run them on the host with a stand-in (HostStandIn: also what a
job with KVPS_IPC=host keeps device-store keys in).
"""

import numpy as np

from .. import pinning
from ..errors import ConfigError
from ..optimizer.kernels import numpy_kernels
from ..wire.device_sharing import CudaSharing, HostSharing
from ..wire.protocol import DTYPES, as_array
from .host_arrays import HostArrays

# Bytes of socket payloads staged in pinned buffers before their copies are waited for (as a
# burst of requests usually is, at its end): an init of a whole model, or a restore, would
# otherwise hold pinned memory of its size, which cupy's pinned pool then keeps for good.
STAGING_BYTES = 64 << 20


class DeviceArrays(HostArrays):
    """Arrays of ``xp`` (a device's array module) updated by ``kernels``; every byte in or out
    moved by ``transfers``: ``empty(shape, dtype)``, ``upload(device, host, spans)`` (from
    page-locked host memory), ``download(host, device, spans)`` (``spans``: kvps.pinning's
    pieces of a page-locked host range, or None: pageable memory, a copy waited for),
    ``pinned(nbytes)`` (a uint8 host array, page-locked), ``hold(array)`` (keep it until
    ``settle``, which then waits: a copy on the device) and ``settle()`` (wait for every copy
    issued). ``sharing``: the kvps.wire.device_sharing its workers' device segments are mapped
    with (None: they are not)."""

    name = 'device'
    lends = True         # a pull reply holds the weight itself (copy-on-write) until settled
    on_device = True     # ... and copies it out: into the worker's segment or a pinned frame
    sums_in_update = ()

    def __init__(self, xp, kernels, transfers, sharing=None):
        super().__init__()
        self.xp, self._kernels, self.transfers, self.sharing = xp, kernels, transfers, sharing
        self._staged = 0   # bytes in pinned staging buffers not yet waited for

    @property
    def kernels(self):
        return self._kernels

    @property
    def route(self):
        return ('GPU shards: copied straight between the GPU and local workers\' page-locked '
                'shared memory (one DMA each way), socket payloads through pinned buffers')

    def received(self, data, dtype):
        """A device array holding a received buffer (a push's): a worker's device segment's
        bytes (a device array) as they are, read in place and never written; else a new
        one, by one DMA from a worker's page-locked segment, or through a pinned buffer from
        a socket frame (or memory that could not be locked)."""
        if type(data) is self.xp.ndarray:
            view = data.view(DTYPES[dtype])
            if type(view) is np.ndarray:   # (the stand-in's: kernels may scribble on a
                view.flags.writeable = False   # writable grad, and the worker may resend it)
            self.transfers.hold(view)          # the reads of it are waited for by settle
            return view
        return self.owned(data, dtype)

    def owned(self, data, dtype):
        """A new device array holding a copy of a received buffer (an init's, a push's)."""
        if type(data) is self.xp.ndarray:
            out = data.view(DTYPES[dtype]).copy()
            self.transfers.hold(out)
            return out
        host = as_array(data, dtype)
        spans = _spans(host)
        if spans is None:
            staging = self.transfers.pinned(host.nbytes)
            staging[...] = host.view(np.uint8)
            host, spans = staging.view(host.dtype), [(0, host.nbytes)]
            self._staged += host.nbytes
        out = self.transfers.empty(host.shape, host.dtype)
        self.transfers.upload(out, host, spans)
        if self._staged > STAGING_BYTES:
            self.settle()
        return out

    def copy_out(self, array, view):
        """Copy device ``array`` into ``view``, the block of a worker's segment it placed the
        pull in: one DMA when that block is page-locked; on the device when it is a block of
        the worker's device segment."""
        if type(view) is self.xp.ndarray:
            view.view(array.dtype)[...] = array
            self.transfers.hold(view)
            return
        host = np.frombuffer(view, array.dtype)
        self.transfers.download(host, array, _spans(host))

    def framed(self, array):
        """A pinned host copy of device ``array``, to send as a frame (settle first)."""
        host = self.transfers.pinned(array.nbytes).view(array.dtype)
        self.transfers.download(host, array, [(0, host.nbytes)])
        return host

    def settle(self):
        self._staged = 0
        self.transfers.settle()

    def to_host(self, array):
        """A host copy, waited for (checkpoints, rows)."""
        return self.xp.asnumpy(array) if hasattr(self.xp, 'asnumpy') else array.copy()

    def empty_like(self, array, dtype=None):
        return self.xp.empty_like(array, dtype=dtype)

    def copy(self, array):
        return array.copy()


def _spans(host):
    """kvps.pinning's spans of host array ``host`` (page-locked now if it lies in shared
    memory this process maps), or None."""
    return pinning.REGISTRY.spans(host.ctypes.data, host.nbytes)


class CudaArrays(DeviceArrays):
    """cupy arrays on the current CUDA device; the CUDA kernels update them."""

    name = 'cuda'

    def __init__(self, ipc='auto'):
        """``ipc``: KVPS_IPC (workers' device segments mapped through CUDA IPC, or not)."""
        try:
            import cupy
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # ImportError, or CUDA's own errors without a driver
            raise ConfigError(f'needs cupy and a CUDA GPU on this server '
                              f'(pip install "kvps[cuda]"): {exc!r}') from None
        if count < 1:
            raise ConfigError('this server sees no CUDA GPU')
        from ..optimizer.kernels import cuda_kernels  # imports cupy: only now
        super().__init__(cupy, cuda_kernels, CupyTransfers(cupy),
                         CudaSharing() if ipc in ('auto', 'cuda') else None)
        pinning.REGISTRY.use(CupyLocker(cupy.cuda.runtime))

    @property
    def route(self):
        return f'{super().route}, on cuda:{self.xp.cuda.Device().id}'


class CupyTransfers:
    """Copies between host memory and the current CUDA device on cupy's current stream (the
    update kernels'); what they read from or write into is held until ``settle``."""

    def __init__(self, cupy):
        self.cupy, self.runtime = cupy, cupy.cuda.runtime
        self._held = []   # host buffers of copies issued and not yet waited for

    def empty(self, shape, dtype):
        return self.cupy.empty(shape, dtype)

    def hold(self, array):
        self._held.append(array)

    def upload(self, device, host, spans):
        self._copy(device.data.ptr, host.ctypes.data, spans, self.runtime.memcpyHostToDevice)
        self._held.append(host)

    def download(self, host, device, spans):
        if spans is None:   # pageable: cupy copies and waits (the driver stages it)
            device.get(out=host.reshape(device.shape))
            return
        self._copy(host.ctypes.data, device.data.ptr, spans, self.runtime.memcpyDeviceToHost)
        self._held.append(host)

    def _copy(self, dst, src, spans, kind):
        stream = self.cupy.cuda.get_current_stream().ptr
        for at, nbytes in spans:
            self.runtime.memcpyAsync(dst + at, src + at, nbytes, kind, stream)

    def pinned(self, nbytes):
        memory = self.cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
        return np.frombuffer(memory, np.uint8, nbytes)   # holds the memory until it goes

    def settle(self):
        if self._held:
            self.cupy.cuda.get_current_stream().synchronize()
            self._held.clear()


class HostStandIn(DeviceArrays):
    """GPU shards emulated on the host (KVPS_IPC=host: tests without a GPU): numpy arrays and
    kernels, every copy a numpy copy, workers' device segments mapped through the host
    stand-in of CUDA IPC."""

    name = 'host stand-in'

    def __init__(self):
        super().__init__(np, numpy_kernels, HostCopies(), HostSharing())

    @property
    def route(self):
        return f'{super().route} (emulated on the host: KVPS_IPC=host)'


class HostCopies:
    """A device's transfers, on the host: numpy copies, done when they return."""

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def upload(self, device, host, spans):
        device[...] = host

    def download(self, host, device, spans):
        host[...] = device

    def pinned(self, nbytes):
        return np.empty(nbytes, np.uint8)

    def hold(self, array):
        pass

    def settle(self):
        pass


class CupyLocker:
    """kvps.pinning's Locker on a server: cudaHostRegister through cupy's runtime."""

    def __init__(self, runtime):
        self.runtime = runtime

    def lock(self, address, nbytes, writable):
        flags = pinning.PORTABLE if writable else pinning.PORTABLE | pinning.READ_ONLY
        try:
            self.runtime.hostRegister(address, nbytes, flags)
        except Exception as exc:  # cupy's CUDARuntimeError, whatever the driver refused
            raise pinning.LockFailed(f'cudaHostRegister of {nbytes} bytes: {exc}') from None

    def unlock(self, address):
        try:
            self.runtime.hostUnregister(address)
        except Exception as exc:
            raise pinning.LockFailed(f'cudaHostUnregister: {exc}') from None
