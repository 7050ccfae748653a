"""A shard's arrays on a device (GPU shards): payloads copied in and weights copied out once,
straight between the device and host memory, page-locked where it is shared memory.

A push from a worker on this host lies in the worker's segment, which this server maps: the
range is page-locked (kvps.pinning) and copied to the device by one asynchronous DMA. A payload
that came through the socket (or from memory that could not be locked) is copied once into a
pinned buffer and from there to the device. A pull is copied from the device straight into the
block the worker gave in its segment, or into a pinned buffer sent as the frame. Copies run on
the device's current stream, behind the updates, and are waited for before the
acknowledgements that free the workers' blocks, and before each answer that carries values.

A push from a worker whose device segment this server maps (CUDA IPC, kvps.wire.device_sharing)
is a device array already: it is read where it is, kept by reference as a shared-memory push
on a host shard is (a sync round's first push is the round's sum until the second is added to
it, into the merge buffer), and a pull is copied into the worker's device segment on the
device; no byte touches the host. The server does not wait for that work: ``order`` records
its interprocess event behind it before the answers go, and the worker waits for the record
before it reuses or reads the blocks (kvps.server.transfers).

The copying is a Transfers' (kvps.server.transfers; cupy's in CudaArrays); the choices (which
buffer, locked or not) are DeviceArrays', so tests run them on the host with a stand-in
(HostStandIn: also what a job with KVPS_IPC=host keeps device-store keys in).
"""

import numpy as np

from .. import pinning
from ..errors import ConfigError
from ..optimizer.kernels import numpy_kernels
from ..wire.device_cuda import CudaSharing
from ..wire.device_sharing import HostSharing
from ..wire.protocol import DTYPES, as_array
from .host_arrays import HostArrays
from .transfers import CupyLocker, CupyTransfers, HostCopies

# Bytes of socket payloads staged in pinned buffers before their copies are waited for (as a
# burst of requests usually is, at its end): an init of a whole model, or a restore, would
# otherwise hold pinned memory of its size, which cupy's pinned pool then keeps for good.
STAGING_BYTES = 64 << 20


class DeviceArrays(HostArrays):
    """Arrays of ``xp`` (a device's array module) updated by ``kernels``; every byte in or out
    moved by ``transfers``: ``empty(shape, dtype)``, ``upload(device, host, spans)`` (from
    page-locked host memory), ``download(host, device, spans)`` (``spans``: kvps.pinning's
    pieces of a page-locked host range, or None: pageable memory, a copy waited for),
    ``pinned(nbytes)`` (a uint8 host array, page-locked), ``hold(array)`` (work on the
    device reads or writes it), ``settle()`` (wait for every copy issued) and
    ``order(event)`` (before answers: see kvps.server.transfers). ``sharing``: the
    kvps.wire.device_sharing its workers' device segments are mapped with (None: they are
    not)."""

    name = 'device'
    lends = True         # a pull reply holds the weight itself (copy-on-write) until settled
    on_device = True     # ... and copies it out: into the worker's segment or a pinned frame
    # (sums_in_update: a host shard's; CUDA kernels add a round's last pushes in the update,
    # as numpy's do, from a worker's device blocks too, read where they are)

    def __init__(self, xp, kernels, transfers, sharing=None):
        super().__init__()
        self.xp, self._kernels, self.transfers, self.sharing = xp, kernels, transfers, sharing
        self._staged = 0   # bytes in pinned staging buffers not yet waited for
        self._event = None   # this server's interprocess event (made when a worker maps)

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
            self._work(view)                   # answers are ordered behind the reads of it
            return view
        return self.owned(data, dtype)

    def owned(self, data, dtype):
        """A new device array holding a copy of a received buffer (an init's, a push's)."""
        if type(data) is self.xp.ndarray:
            out = data.view(DTYPES[dtype]).copy()
            self._work(data)
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
            self._work(view)
            return
        host = np.frombuffer(view, array.dtype)
        self.transfers.download(host, array, _spans(host))

    def framed(self, array):
        """A pinned host copy of device ``array``, to send as a frame (settle first)."""
        host = self.transfers.pinned(array.nbytes).view(array.dtype)
        self.transfers.download(host, array, [(0, host.nbytes)])
        return host

    def reading(self, grad):
        """Work issued in this request reads a round's gradient ``grad`` (an update, a sum with
        rows): where workers' device blocks are mapped (this server's event exists), it may
        hold one, read in place and pushed in an earlier request (a round closed by an
        abstention, or by rows): this request's answers, which let the worker reuse the
        block, are ordered behind the work."""
        if grad is not None and self._event is not None:
            for part in grad if type(grad) is tuple else (grad,):
                self._work(part)

    def _work(self, array):
        """Work issued on the device reads or writes ``array`` (a block of a worker's device
        segment, mostly): the answers are ordered behind it (the stand-in notes the block)."""
        self.transfers.hold(array)
        if self._event is not None:
            self.sharing.worked_on(array, self._event)

    def settle(self):
        self._staged = 0
        self.transfers.settle()

    def order(self):
        """Before answers go out: copies through host memory waited for, work on workers'
        device blocks ordered behind this server's event (kvps.server.transfers)."""
        self._staged = 0
        self.transfers.order(self._event)

    def order_event(self):
        """This server's interprocess event, which the workers that map their device segments
        here wait for (made on the first call)."""
        if self._event is None:
            self._event = self.sharing.event()
        return self._event

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
