"""CUDA IPC through cupy's runtime (kvps.wire.device_sharing's Sharing for a GPU): buffers as
allocations of their own, interprocess events; cupy is imported only when one is made."""

from ..errors import ConfigError, KVPSError, ProtocolError
from .device_sharing import Event, Sharing, _nothing


class CudaSharing(Sharing):
    """CUDA IPC on the current device, through cupy's runtime: a buffer is an allocation of its
    own (cudaMalloc, not cupy's pool: a handle names a whole allocation), opened with peer
    access enabled lazily; events are interprocess, waited for on the current stream."""

    name = 'cuda'

    def __init__(self, device=None):
        """``device``: the CUDA device its buffers and events are made on (None: cupy's
        current one)."""
        super().__init__()
        try:
            import cupy
        except ImportError as exc:
            raise ConfigError(f'CUDA IPC needs cupy (pip install "kvps[cuda]"): {exc}') from None
        self.cupy, self.runtime = cupy, cupy.cuda.runtime
        self.device = cupy.cuda.Device(device)

    def _array(self, memory, nbytes):
        cupy = self.cupy
        return cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))

    def _alloc(self, nbytes):
        try:
            with self.device:
                memory = self.cupy.cuda.Memory(nbytes)
            handle = bytes(self.runtime.ipcGetMemHandle(memory.ptr))
        except Exception as exc:  # cupy's OutOfMemoryError, CUDARuntimeError
            raise KVPSError(f'cannot export {nbytes} bytes of device memory: {exc}') from None
        return self._array(memory, nbytes), handle, lambda: None   # freed as its views go

    def _map(self, handle, nbytes):
        try:
            pointer = self.runtime.ipcOpenMemHandle(handle)
        except Exception as exc:  # another host, a device without peer access, a stale one
            raise ProtocolError(f'cannot open a device buffer handle: {exc}') from None
        memory = self.cupy.cuda.UnownedMemory(pointer, nbytes, self)
        return self._array(memory, nbytes), lambda: self.runtime.ipcCloseMemHandle(pointer)

    def _piece(self, array, offset, nbytes):
        # cupy's views share the memory object, not the array: the anchor is the memory's
        # owner, which every view keeps through it
        anchor = _Anchor()
        memory = self.cupy.cuda.UnownedMemory(array.data.ptr + offset, nbytes, anchor)
        return self._array(memory, nbytes), anchor

    @staticmethod
    def address(array):
        return array.data.ptr

    def to_host(self, array):
        return self.cupy.asnumpy(array)

    def _event(self):
        try:
            with self.device:
                event = self.cupy.cuda.Event(block=False, disable_timing=True,
                                             interprocess=True)
            handle = bytes(self.runtime.ipcGetEventHandle(event.ptr))
        except Exception as exc:  # cupy's CUDARuntimeError
            raise KVPSError(f'cannot make an interprocess event: {exc}') from None
        runtime, recorded = self.runtime, [False]

        def record(stream):
            # One event per worker, recorded again for each push: a server's wait sees the
            # latest record when it is made, never an earlier one, so it may wait longer than
            # its push needs, never too little, on one stream. Pushes from other streams (API
            # threads of their own, values on another device) are chained: each record waits
            # for the one before, so the latest covers every write recorded so far.
            if recorded[0]:
                runtime.streamWaitEvent(stream, event.ptr, 0)
            runtime.eventRecord(event.ptr, stream)
            recorded[0] = True
        return Event(handle, record, _nothing, _nothing,
                     synchronize=lambda: runtime.eventSynchronize(event.ptr))

    def _open_event(self, handle):
        # (on this sharing's device: a worker opens and waits for its servers' events on its
        # I/O thread, whose current device may be another)
        try:
            with self.device:
                pointer = self.runtime.ipcOpenEventHandle(handle)
        except Exception as exc:
            raise ProtocolError(f'cannot open a device event handle: {exc}') from None

        def wait():
            stream = self.cupy.cuda.get_current_stream().ptr
            self.runtime.streamWaitEvent(stream, pointer, 0)

        def synchronize():
            with self.device:
                self.runtime.eventSynchronize(pointer)
        return Event(handle, _nothing, wait, lambda: self.runtime.eventDestroy(pointer),
                     synchronize=synchronize)


class _Anchor:
    """An object to hang a finalizer on (cupy's memory keeps its owner)."""
