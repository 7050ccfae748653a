"""Device memory shared between the processes of one host: a buffer exported as a handle, opened
by a peer as a device array of its own, closed; and interprocess events that order them (the
exporter's writes before a peer's reads; a peer's reads and writes before its answer).

Two implementations behind one interface (a Sharing): CUDA IPC through cupy
(``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle`` and interprocess events, in
kvps.wire.device_cuda; cupy imported only when it is made), and a host stand-in on which the
CPU suite runs the same protocol: a buffer is a 0600 shared-memory segment that its handle
names (kvps.wire.shm), an event a count.
What both share (handles checked before use, sizes, idempotent closes, the count of what is
open) lives here once, so that the stand-in's tests cover it for CUDA too. The stand-in also
models the ordering CUDA gives through events, so that a missing record or wait fails a test:
an event's count is shared; a server finds a block taken after its worker's latest record
unwritten, and a worker finds a block its server worked on after the latest record of the
server's event it waited for still in use.

A handle is a capability: whoever holds it may read and write the buffer. Handles travel only
in requests of authenticated job members, and a server opens only those of workers on its own
host (kvps.server.regions). A buffer stays valid while its exporter keeps it: the exporter
closes it last, once it leaves the job; a killed exporter's buffers go with it.
"""

import os
import struct

import numpy as np

from ..errors import ConfigError, KVPSError, ProtocolError
from .shm import ALIGN, HEADER_BYTES, NONCE_BYTES, SHM_DIR, Mapping, Segment

HANDLE_BYTES = 64          # cudaIpcMemHandle_t and cudaIpcEventHandle_t: 64 bytes each
MAX_BUFFER_BYTES = 1 << 40
# The stand-in's handle: a segment's name (NUL-padded), its nonce, the exporter's pid and fd.
_HOLDER = '<II'
_NAME_BYTES = HANDLE_BYTES - NONCE_BYTES - struct.calcsize(_HOLDER)
_COUNT_BYTES = ALIGN       # the stand-in event's shared memory: its count of records first


def check_handle(handle, what='buffer'):
    """``handle`` if it is HANDLE_BYTES of bytes; else ProtocolError (it came from a peer)."""
    if not isinstance(handle, bytes) or len(handle) != HANDLE_BYTES:
        raise ProtocolError(f'a device {what} handle must be {HANDLE_BYTES} bytes')
    return handle


def check_size(nbytes):
    if not (type(nbytes) is int and 0 < nbytes <= MAX_BUFFER_BYTES):
        raise ProtocolError(f'a shared device buffer of {nbytes!r} bytes is out of range')
    return nbytes


class Shared:
    """A buffer of shared device memory in this process: ``array`` (a flat uint8 device array,
    or None once closed), its ``handle`` and ``nbytes``; ``exported`` when this process made
    it. ``close`` frees it (exported) or unmaps it (opened); idempotent."""

    def __init__(self, sharing, array, handle, release, exported):
        self.array, self.handle, self.nbytes = array, handle, array.nbytes
        self.exported, self._sharing, self._release = exported, sharing, release
        sharing.open_buffers += 1

    @property
    def closed(self):
        return self.array is None

    def close(self):
        if self.array is None:
            return
        self.array, release, self._release = None, self._release, None
        self._sharing.open_buffers -= 1
        release()


class Event:
    """An interprocess event: its maker ``record``s it on the stream of its work, a peer that
    opened its ``handle`` ``wait``s on it before its own (on its own stream: no host-side
    wait), or ``synchronize``s with it (on the host). ``recorded()``: the records made so far
    as this process sees them (the stand-in's; None where that cannot be known); ``seen``:
    that count when this process last waited or synchronised (None before). ``close``:
    idempotent."""

    def __init__(self, handle, record, wait, release, recorded=lambda: None,
                 synchronize=lambda: None):
        self.handle, self._record, self._wait, self._release = handle, record, wait, release
        self.recorded, self._synchronize = recorded, synchronize
        self.records = self.waits = 0
        self.seen = None

    def record(self, stream=None):
        """Record it on CUDA ``stream`` (a handle; None: the legacy default stream) behind
        the work issued there so far, and behind the previous record (on whatever stream):
        a wait on it then covers every write recorded before too. Callers serialise."""
        self.records += 1
        self._record(stream or 0)

    def wait(self):
        self.waits += 1
        self.seen = self.recorded()
        self._wait()

    def synchronize(self):
        """Wait on the host for the work behind the latest record."""
        self.seen = self.recorded()
        self._synchronize()

    def close(self):
        release, self._release = self._release, None
        if release is not None:
            release()


class Sharing:
    """What a kind of device memory shares between processes (subclasses give ``_alloc``,
    ``_map``, ``_event``, ``_open_event``); ``open_buffers``: exported and opened buffers
    not yet closed (tests check that it returns to 0)."""

    name = ''

    def __init__(self):
        self.open_buffers = 0

    def export(self, nbytes):
        """A persistent buffer of ``nbytes`` in this process's device memory that peers may
        open by its handle (a Shared); KVPSError when there is no room."""
        array, handle, release = self._alloc(check_size(nbytes))
        return Shared(self, array, handle, release, True)

    def open(self, handle, nbytes):
        """A peer's exported buffer mapped here (a Shared); ProtocolError for a handle that
        is malformed, unknown here (another host, a buffer closed) or of another size."""
        array, release = self._map(check_handle(handle), check_size(nbytes))
        return Shared(self, array, handle, release, False)

    def piece(self, shared, offset, nbytes):
        """``(array, anchor)``: ``nbytes`` of ``shared`` at ``offset`` as a flat uint8 device
        array, and an object that lives while that array or any view of it does (a
        finalizer on it tells when the piece may be reused)."""
        return self._piece(shared.array, offset, nbytes)

    def ordered(self, shared, event, offset):
        """Whether a peer's read of the block at ``offset`` of ``shared`` (opened) is ordered
        after its exporter's writes to it by ``event``: True where a wait on the event is
        what orders them (CUDA); the stand-in checks that a record came after the block was
        taken."""
        return True

    def worked_on(self, array, event):
        """Work of this process's reads or writes ``array`` (a piece of a peer's buffer this
        process opened, or an array of its own), work that ``event`` will be recorded behind
        before it answers (the stand-in notes it)."""

    def answered(self, shared, offset, nbytes, event):
        """Whether the exporter of ``shared`` may reuse or read its ``nbytes`` at ``offset``
        after a peer's answer: True where a wait on the peer's ``event`` is what orders them
        (CUDA); the stand-in checks that the exporter waited for a record that came after the
        peer worked on them."""
        return True

    def event(self):
        """A new interprocess Event of this process, to record."""
        return self._event()

    def open_event(self, handle):
        """A peer's Event, to wait on; ProtocolError for a handle that is not one."""
        return self._open_event(check_handle(handle, 'event'))


class HostSharing(Sharing):
    """The stand-in on the host: a buffer is a shared-memory segment of ``directory``
    (kvps.wire.shm: 0600, a random name and nonce, pages reserved at once) whose name goes at
    once; its handle names the segment, its nonce and the exporter's open file, through which
    peers map it (/proc/<pid>/fd/<fd>, checked). As a CUDA allocation, it goes with its
    exporter, even one killed: nothing is ever left in /dev/shm. Host writes are done when
    they return, so an event only counts its records, in shared memory of its own that a
    peer maps. A buffer keeps two stamps per cache line (in tables after its bytes): the count
    of its exporter's last event when a piece of it was taken, so that a peer can tell a
    block that no record followed (``ordered``: CUDA would read it before the writes land);
    and one past the count of a peer's event when the peer last worked on it (0: not since it
    was taken), so that the exporter can tell a block whose answer no record of the peer's
    preceded, or that it did not wait for (``answered``: CUDA would reuse or read it while
    the peer's work on it still runs)."""

    name = 'host'

    def __init__(self, directory=SHM_DIR):
        super().__init__()
        self.directory = directory
        self._count = None    # the count of the last event made here (pieces stamp it)
        # id(Shared's array) -> (its address, its size, its stamp tables), while it is open
        self._buffers = {}

    def _segment(self, nbytes):
        """``(data, handle, segment)``: a fresh segment of ``nbytes`` past its header."""
        try:
            segment = Segment.create(HEADER_BYTES + nbytes, self.directory)
        except KVPSError as exc:
            raise KVPSError(f'cannot export a device buffer (the stand-in\'s): {exc}') from None
        segment.unlink()
        handle = (segment.name.encode().ljust(_NAME_BYTES, b'\0') + segment.nonce
                  + struct.pack(_HOLDER, os.getpid(), segment.fd))
        return _data(segment.view(HEADER_BYTES, nbytes)), handle, segment

    def _alloc(self, nbytes):
        data, handle, segment = self._segment(nbytes + _stamp_bytes(nbytes))
        array, release = self._stamped(data, nbytes, segment.close)
        return array, handle, release

    def _stamped(self, data, nbytes, release):
        """``(the buffer's array, release)`` of a mapping ``data`` of a buffer of ``nbytes``
        and its stamp table."""
        array = data[:nbytes]
        tables = data[nbytes:].view(np.uint32).reshape(2, -1)   # [taken, worked on] per line
        self._buffers[id(array)] = self.address(array), nbytes, tables

        def released():
            self._buffers.pop(id(array), None)
            release()
        return array, released

    def _map(self, handle, nbytes):
        mapping = self._mapping(handle, nbytes + _stamp_bytes(nbytes))
        return self._stamped(_data(mapping.view(HEADER_BYTES, nbytes + _stamp_bytes(nbytes))),
                             nbytes, mapping.release)

    def _mapping(self, handle, nbytes):
        name = handle[:_NAME_BYTES].rstrip(b'\0')
        nonce = handle[_NAME_BYTES:_NAME_BYTES + NONCE_BYTES]
        holder = struct.unpack(_HOLDER, handle[_NAME_BYTES + NONCE_BYTES:])
        try:
            name = name.decode('ascii')
        except UnicodeDecodeError:
            raise ProtocolError('not a device buffer handle of this host') from None
        return Mapping.open(name, nonce, HEADER_BYTES + nbytes, self.directory, holder=holder)

    def piece(self, shared, offset, nbytes):
        taken, touched = self._tables(shared)[:, _lines(offset, nbytes)]
        taken[:] = 0 if self._count is None else self._count[0]
        touched[:] = 0
        return super().piece(shared, offset, nbytes)

    def ordered(self, shared, event, offset):
        return int(self._tables(shared)[0, offset // ALIGN]) < event.recorded()

    def worked_on(self, array, event):
        start = self.address(array)
        for base, nbytes, tables in self._buffers.values():
            if base <= start < base + nbytes:
                tables[1, _lines(start - base, array.nbytes)] = event.recorded() + 1
                return

    def answered(self, shared, offset, nbytes, event):
        # (only the lines wholly inside: a key's parts for two servers may share one at their
        # edge, each server stamping it with its own count)
        inner = slice(-(-offset // ALIGN), (offset + nbytes) // ALIGN)
        touched = int(self._tables(shared)[1, inner].max(initial=0))
        return touched == 0 or event.seen is not None and touched <= event.seen

    def _tables(self, shared):
        """The stamp tables of ``shared`` (open here)."""
        return self._buffers[id(shared.array)][2]

    @staticmethod
    def _piece(array, offset, nbytes):
        piece = np.frombuffer(memoryview(array)[offset:offset + nbytes], np.uint8)
        return piece, piece   # every numpy view of an array made from a buffer has it as .base

    @staticmethod
    def address(array):
        """Where ``array``'s bytes start."""
        return array.__array_interface__['data'][0]

    @staticmethod
    def to_host(array):
        """A host copy of device ``array``."""
        return array.copy()

    def _event(self):
        data, handle, segment = self._segment(_COUNT_BYTES)
        count = self._count = data[:8].view(np.uint64)

        def record(stream):
            count[0] += 1
        return Event(handle, record, _nothing, segment.close, lambda: int(count[0]))

    def _open_event(self, handle):
        try:
            mapping = self._mapping(handle, _COUNT_BYTES)
        except ProtocolError as exc:
            raise ProtocolError(f'not a device event handle of this host ({exc})') from None
        count = _data(mapping.view(HEADER_BYTES, 8)).view(np.uint64)
        return Event(handle, _nothing, _nothing, mapping.release, lambda: int(count[0]))


def _stamp_bytes(nbytes):
    """The stand-in's stamp tables of a buffer of ``nbytes``: two uint32 per cache line."""
    return 8 * -(-nbytes // ALIGN)


def _lines(offset, nbytes):
    """The cache lines of the ``nbytes`` at ``offset`` (a slice of a stamp table)."""
    return slice(offset // ALIGN, -(-(offset + nbytes) // ALIGN))


def _data(view):
    return np.frombuffer(view, np.uint8)


def _nothing():
    pass


def sharing_for(setting, device=None):
    """The Sharing a KVPS_IPC value names: 'cuda' (CudaSharing on CUDA ``device``; ConfigError
    without cupy), 'host' (the stand-in: tests without a GPU), or None for 'off'."""
    if setting == 'off':
        return None
    if setting == 'host':
        return HostSharing()
    if setting == 'cuda':
        from .device_cuda import CudaSharing  # (cupy only where CUDA IPC is asked for)
        return CudaSharing(device)
    raise ConfigError(f'KVPS_IPC: {setting!r} is not one of off, cuda, host')
