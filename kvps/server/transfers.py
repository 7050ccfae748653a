"""The copies of GPU shards (kvps.server.device_arrays): cupy's on a CUDA device, numpy's in the
host stand-in, and how a server's answers are ordered behind them.

Two kinds of work are out at any time. Copies through host memory (a push uploaded from a
worker's page-locked segment or a pinned buffer, a pull downloaded into one) are waited for on
the host before the answers that free or carry those bytes: the worker's CPU and the socket
read host memory with no regard for CUDA streams. Work on the device alone (a worker's device
segment read in place, a pull copied into it: the ipc route) is only ordered: the server
records its interprocess event behind it before the answers go, and the worker waits for that
record before it reuses or reads the blocks (kvps.worker.device_staging). Its thread then never
waits for the GPU, which takes turns between the job's processes. ``settle`` waits for both
kinds (before a worker's segment is unmapped, or pinned memory is let go).
"""

import numpy as np

from .. import pinning


class Transfers:
    """A device's copies, and the answers ordered behind them (subclasses give ``_wait``:
    wait for the work issued, and ``_record(event)``: record an event behind it)."""

    def __init__(self):
        self._held = []          # host buffers of copies issued and not yet waited for
        self._unwaited = False   # work on the device issued since the last wait
        self._unordered = False  # ... since the last order: the next answers' record

    def hold(self, array):
        """Device ``array`` (a block of a worker's device segment, or a copy of one) is read
        or written by work issued on the stream: answers are ordered behind it."""
        self._unwaited = self._unordered = True

    def settle(self):
        """Wait for every copy and kernel issued. (Work since the last order is still
        recorded behind at the next: the answers it concerns go then, and the workers wait
        for a record, whatever waited here.)"""
        if self._held or self._unwaited:
            self._wait()
        self._held.clear()
        self._unwaited = False

    def order(self, event):
        """Before answers go out: the copies through host memory waited for, the work on the
        device ordered behind a record of ``event`` (this server's interprocess event, which
        the workers wait for; None: waited for too)."""
        if event is None or self._held:
            self.settle()
        if event is not None and self._unordered:
            self._record(event)
        self._unordered = False


class CupyTransfers(Transfers):
    """Copies between host memory and the current CUDA device on cupy's current stream (the
    update kernels')."""

    def __init__(self, cupy):
        super().__init__()
        self.cupy, self.runtime = cupy, cupy.cuda.runtime

    def empty(self, shape, dtype):
        return self.cupy.empty(shape, dtype)

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

    def _wait(self):
        self.cupy.cuda.get_current_stream().synchronize()

    def _record(self, event):
        event.record(self.cupy.cuda.get_current_stream().ptr)


class HostCopies(Transfers):
    """A device's transfers, on the host: numpy copies, done when they return."""

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def upload(self, device, host, spans):
        device[...] = host

    def download(self, host, device, spans):
        host[...] = device

    def pinned(self, nbytes):
        return np.empty(nbytes, np.uint8)

    def _wait(self):
        pass

    def _record(self, event):
        event.record()


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
