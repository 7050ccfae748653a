"""Shared-memory segments that carry bulk array bytes between a worker and servers on its host.

The worker creates one segment in /dev/shm (mode 0600, pages reserved up front, a random
nonce at its start) and allocates blocks in it from a Ring; each server maps it by name once
the nonce proves it sees the same file, and from then on reads pushes from it and writes
pulls into it at offsets that headers carry. Headers still travel over ZeroMQ, so ordering,
authentication and errors are unchanged. Everything a peer names here (segment name, size,
offsets, lengths) is checked before use and rejected with ProtocolError.
"""

import collections
import glob
import mmap
import os
import re
import secrets
import stat
import threading
import weakref

import numpy as np

from .errors import KVPSError, ProtocolError

SHM_DIR = '/dev/shm'
NONCE_BYTES = 16
HEADER_BYTES = 4096          # the nonce's page; blocks start after it
ALIGN = 64                   # every block starts on a cache line
# Payloads below this go through the socket (cheap, and no block). At 64 KiB, not 256 KiB,
# 40 keys of 104 KB step in 6 ms instead of 16 (W2 S1): through the socket such a frame is
# copied into zmq and twice through the kernel, each copy on a busy core.
MIN_BYTES = 1 << 16
MAX_SEGMENT_BYTES = 1 << 40
_NAME = re.compile(r'kvps-[0-9]{1,10}-[0-9a-f]{16}')


class Ring:
    """Offsets of blocks handed out in order around a circular region; blocks may be freed in
    any order, and space is reused once every block allocated before it is free. ``alloc``
    never waits: None when there is no room. ``free`` may run on any thread, even inside a
    garbage collection that interrupts ``alloc``: it only queues the offset (an atomic append),
    and ``alloc`` reclaims queued offsets under its lock."""

    def __init__(self, start, stop):
        self.start, self.stop = start, stop
        self._blocks = {}        # offset -> [size, freed], in allocation order (dict order)
        self._head = self._tail = start
        self._freed = collections.deque()
        self._lock = threading.Lock()

    def alloc(self, nbytes):
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        entry = [size, False]
        with self._lock:
            self._reclaim()
            offset = self._place(size)
            if offset is not None:
                self._blocks[offset] = entry
                self._head = offset + size
            return offset

    def _place(self, size):
        """Where a block of ``size`` fits. Live blocks lie in [tail, head) or, wrapped, in
        [tail, stop) and [start, head); head == tail only when there are none, so a wrapped
        head must stay strictly below tail."""
        if self._head >= self._tail:
            if self._head + size <= self.stop:
                return self._head
            return self.start if self.start + size < self._tail else None
        return self._head if self._head + size < self._tail else None

    def free(self, offset):
        self._freed.append(offset)

    def _reclaim(self):
        while self._freed:
            self._blocks[self._freed.popleft()][1] = True
        while self._blocks:
            first = next(iter(self._blocks))
            if not self._blocks[first][1]:
                self._tail = first
                return
            del self._blocks[first]
        self._head = self._tail = self.start

    def __len__(self):
        """Blocks allocated and not yet reclaimed."""
        with self._lock:
            self._reclaim()
            return len(self._blocks)


class Segment:
    """The worker's side: creates the file, maps it, hands out blocks as numpy arrays that
    give their space back when the last reference to them goes."""

    def __init__(self, name, nonce, memory):
        self.name, self.nonce, self._memory = name, nonce, memory
        self.size = len(memory)
        self._view = memoryview(memory)
        self._address = np.frombuffer(memory, dtype=np.uint8).ctypes.data
        self.ring = Ring(HEADER_BYTES, self.size)
        self._linked = True

    @classmethod
    def create(cls, size, directory=SHM_DIR):
        """A fresh segment of ``size`` bytes; KVPSError (nothing left behind) when /dev/shm is
        missing or too full: the pages are reserved now, so a full /dev/shm can never SIGBUS
        a writer later."""
        if not HEADER_BYTES + ALIGN <= size <= MAX_SEGMENT_BYTES:
            raise KVPSError(f'shared-memory size {size} out of range')
        name = f'kvps-{os.getpid()}-{secrets.token_hex(8)}'
        path = os.path.join(directory, name)
        try:
            vfs = os.statvfs(directory)
            if vfs.f_bavail * vfs.f_frsize < size:
                raise KVPSError(f'{directory} has {vfs.f_bavail * vfs.f_frsize} bytes free, '
                                f'{size} needed')
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise KVPSError(f'cannot create shared memory in {directory}: {exc}') from None
        try:
            os.posix_fallocate(fd, 0, size)
            memory = mmap.mmap(fd, size)
        except OSError as exc:
            os.unlink(path)
            raise KVPSError(f'cannot reserve {size} bytes of shared memory: {exc}') from None
        finally:
            os.close(fd)
        nonce = secrets.token_bytes(NONCE_BYTES)
        memory[:NONCE_BYTES] = nonce
        segment = cls(name, nonce, memory)
        segment.path = path
        return segment

    def take(self, nbytes):
        """``(offset, uint8 array of nbytes)`` in the segment, or None when it is full. The
        block is reused only after the array and every view of it are gone."""
        offset = self.ring.alloc(nbytes)
        if offset is None:
            return None
        # An array made from a buffer is the .base of every view numpy derives from it, so the
        # finalizer runs only once the block and all its slices and views are gone.
        block = np.frombuffer(self._view[offset:offset + nbytes], dtype=np.uint8)
        weakref.finalize(block, self.ring.free, offset)
        return offset, block

    def offset_of(self, array):
        """The offset of ``array`` if its bytes lie in this segment (a block from take)."""
        address = array.__array_interface__['data'][0]
        offset = address - self._address
        return offset if HEADER_BYTES <= offset and offset + array.nbytes <= self.size else None

    def view(self, offset, nbytes):
        """The worker's own bytes at ``offset`` (offsets it chose: no check needed)."""
        return self._view[offset:offset + nbytes]

    def unlink(self):
        """Remove the name: mappings stay valid, nobody new can open it. Idempotent."""
        if self._linked:
            self._linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class Mapping:
    """The server's side: a worker's segment, opened by name only if its nonce matches."""

    def __init__(self, memory):
        self.size = len(memory)
        self._view = memoryview(memory)

    @classmethod
    def open(cls, name, nonce, size, directory=SHM_DIR):
        """Map the segment a worker announced; ProtocolError when the name is not one kvps
        makes, the file is missing, not a plain file of ``size`` bytes, or its nonce differs
        (another host, another /dev/shm, another user)."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ProtocolError(f'attach: {name!r} is not a kvps segment name')
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            raise ProtocolError('attach: the nonce must be 16 bytes')
        if not HEADER_BYTES + ALIGN <= size <= MAX_SEGMENT_BYTES:
            raise ProtocolError(f'attach: size {size} out of range')
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise ProtocolError(f'attach: cannot open {name}: {exc.strerror}') from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                raise ProtocolError(f'attach: {name} is not a segment of {size} bytes')
            memory = mmap.mmap(fd, size)
        except OSError as exc:
            raise ProtocolError(f'attach: cannot map {name}: {exc}') from None
        finally:
            os.close(fd)
        if memory[:NONCE_BYTES] != nonce:
            memory.close()
            raise ProtocolError(f'attach: {name} is not the segment announced (nonce differs)')
        return cls(memory)

    def view(self, offset, nbytes):
        """A zero-copy view of ``nbytes`` at ``offset``, after checking both lie in the data
        area: offsets come from the network."""
        if not (isinstance(offset, int) and isinstance(nbytes, int)
                and HEADER_BYTES <= offset and 0 <= nbytes <= self.size - offset):
            raise ProtocolError(f'shared-memory range {offset!r}+{nbytes!r} is outside the '
                                f'segment ({self.size} bytes)')
        return self._view[offset:offset + nbytes]


def remove_leftovers(pid, directory=SHM_DIR):
    """Unlink the segments of process ``pid``, which is gone: a worker killed in the moment
    between creating its segment and its servers mapping it leaves the name behind."""
    for path in glob.glob(os.path.join(directory, f'kvps-{int(pid)}-*')):
        if _NAME.fullmatch(os.path.basename(path)):
            try:
                os.unlink(path)
            except OSError:   # gone already, or not ours to remove
                pass
