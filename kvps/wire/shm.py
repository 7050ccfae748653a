"""Shared-memory segments that carry bulk array bytes between a worker and servers on its host.

The worker creates one segment in /dev/shm (mode 0600, a random nonce at its start, pages
reserved as blocks need them) and allocates blocks in it from a Ring; each server maps it by
name once the nonce proves it sees the same file, and from then on reads pushes from it and
writes pulls into it at offsets that headers carry. A server likewise keeps the weights of big
keys in an arena of its own (blocks from a Heap), which workers map read-only and copy pulls
out of. Headers still travel over ZeroMQ, so ordering, authentication and errors are
unchanged. Everything a peer names here (segment name, size, offsets, lengths) is checked
before use and rejected with ProtocolError. Each mapping is a region of kvps.pinning, which a
GPU copy page-locks step by step as it reaches them; ``release`` unlocks it before the mapping
may go.
"""

import collections
import ctypes
import glob
import mmap
import os
import re
import secrets
import stat
import threading
import weakref

import numpy as np

from .. import pinning
from ..errors import KVPSError, ProtocolError

SHM_DIR = '/dev/shm'
NONCE_BYTES = 16
HEADER_BYTES = 4096          # the nonce's page; blocks start after it
ALIGN = 64                   # every block starts on a cache line
# Payloads below this go through the socket (no block). A frame costs far more than its bytes:
# zmq calls, a Frame object and a memoryview on each side, and through the kernel, copies
# on a busy core. At 1 KiB, not 64 KiB, 400 keys of 10 KB step in half the CPU (W2 S1); below
# it, a frame and a block cost about the same.
MIN_BYTES = 1 << 10
MAX_SEGMENT_BYTES = 1 << 40
# A segment that grows (a worker's, a server's arena) reserves its pages this much at a time.
RESERVE_STEP = 16 << 20
# A smaller share holds too few blocks to be worth a segment.
MIN_SHARE_BYTES = 2 << 20
_NAME = re.compile(r'kvps-[0-9]{1,10}-[0-9a-f]{16}')


def aligned(nbytes):
    """The space a block of ``nbytes`` takes: whole cache lines, at least one."""
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


def share_of(sharers, directory=SHM_DIR):
    """Bytes one of ``sharers`` kvps processes on this host may reserve in ``directory``: half
    of the filesystem split among them; 0 when that is under 2 MiB or the size cannot be
    read. Half, because others need it too (a torch DataLoader's workers pass every batch
    through /dev/shm), and a container's /dev/shm is often only 64 MiB. No cap below that:
    segments reserve their pages only as blocks need them."""
    try:
        vfs = os.statvfs(directory)
    except OSError:
        return 0
    share = vfs.f_blocks * vfs.f_frsize // 2 // max(1, sharers)
    share = min(share, MAX_SEGMENT_BYTES) // MIN_BYTES * MIN_BYTES
    return share if share >= MIN_SHARE_BYTES else 0


def segment_bytes(setting, sharers, directory=SHM_DIR):
    """KVPS_SHM_BYTES as given, or for 'auto' this process's ``share_of`` ``directory``."""
    return share_of(sharers, directory) if setting == 'auto' else setting


class _Blocks:
    """What Ring and Heap share: offsets of blocks in [start, stop), handed out only below a
    ``limit`` (the pages reserved so far, which may rise). ``alloc`` never waits: None when no
    block of ``nbytes`` fits below ``limit`` (default: stop). ``free`` may run on any thread,
    even inside a garbage collection that interrupts ``alloc``: it only queues the offset (an
    atomic append), and ``alloc`` reclaims queued offsets under its lock."""

    def __init__(self, start, stop):
        self.start, self.stop = start, stop
        self._freed = collections.deque()
        self._lock = threading.Lock()

    def alloc(self, nbytes, limit=None):
        with self._lock:
            self._reclaim()
            return self._alloc(aligned(nbytes), self.stop if limit is None else limit)

    def free(self, offset):
        self._freed.append(offset)

    def reach(self, nbytes):
        """The limit a block of ``nbytes`` needs when none fits below the present one; None
        when no limit within stop would do."""
        with self._lock:
            self._reclaim()
            end = self._end()
        if end is None or end + aligned(nbytes) > self.stop:
            return None
        return end + aligned(nbytes)


class Ring(_Blocks):
    """Offsets of blocks handed out in order around a circular region; blocks may be freed in
    any order, and space is reused once every block allocated before it is free. It wraps at
    the limit when the start is free, so a segment that grows holds its peak in-flight bytes,
    not every byte that ever passed through it."""

    def __init__(self, start, stop):
        super().__init__(start, stop)
        self._blocks = {}        # offset -> [size, freed], in allocation order (dict order)
        self._head = self._tail = start

    def _alloc(self, size, limit):
        offset = self._place(size, limit)
        if offset is not None:
            self._blocks[offset] = [size, False]
            self._head = offset + size
        return offset

    def _place(self, size, limit):
        """Where a block of ``size`` fits. Live blocks lie in [tail, head) or, wrapped, in
        [tail, limit) and [start, head); head == tail only when there are none, so a wrapped
        head must stay strictly below tail."""
        if self._head >= self._tail:
            if self._head + size <= limit:
                return self._head
            return self.start if self.start + size < self._tail else None
        return self._head if self._head + size < self._tail else None

    def _end(self):
        """Where a block goes past the limit: at the head, unless live blocks wrap around
        (then none can, before the ones at the end are freed)."""
        return self._head if self._head >= self._tail else None

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


class Heap(_Blocks):
    """Offsets of long-lived blocks (a server's weights): each freed block is kept for the
    next block of its size, so keys of fixed sizes reuse their space for ever."""

    def __init__(self, start, stop):
        super().__init__(start, stop)
        self._top = start
        self._sizes = {}                                 # offset -> size, while allocated
        self._spare = collections.defaultdict(list)      # size -> freed offsets

    def _alloc(self, size, limit):
        if self._spare[size]:
            offset = self._spare[size].pop()
        elif self._top + size <= limit:
            offset, self._top = self._top, self._top + size
        else:
            return None
        self._sizes[offset] = size
        return offset

    def _end(self):
        """Where a block goes past the limit: at the top."""
        return self._top

    def _reclaim(self):
        while self._freed:
            offset = self._freed.popleft()
            self._spare[self._sizes.pop(offset)].append(offset)

    def __len__(self):
        """Blocks allocated and not yet freed."""
        return len(self._sizes) - len(self._freed)


class Segment:
    """One side's own file: creates it, maps it, hands out blocks as numpy arrays that give
    their space back when the last reference to them goes (a worker's segment: from a Ring;
    a server's arena: from a Heap)."""

    def __init__(self, name, nonce, memory, allocator=Ring, fd=None, reserved=None):
        self.name, self.nonce, self._memory = name, nonce, memory
        self.fd = fd   # kept open: a peer that comes after the name is gone opens it through us
        self.size = len(memory)
        self._view = memoryview(memory)
        self.address = self._address = np.frombuffer(memory, dtype=np.uint8).ctypes.data
        self.blocks = allocator(HEADER_BYTES, self.size)
        self._linked = True
        self.reserved = self.size if reserved is None else reserved   # pages held so far
        self._reserving = threading.Lock()
        self.region = pinning.REGISTRY.add(self, memory, self.address, self.size, RESERVE_STEP,
                                           True, f'shared-memory segment {name}')

    def describe(self):
        """What a peer needs to map it (an ATTACH, or its answer): ``{name, nonce, size}``, and
        ``pid`` and ``fd``, the open file a peer on this host reaches through /proc once the
        name is gone (a server restarted during the job)."""
        return {'name': self.name, 'nonce': self.nonce, 'size': self.size,
                'pid': os.getpid(), 'fd': self.fd}

    @classmethod
    def create(cls, size, directory=SHM_DIR, allocator=Ring, grows=False):
        """A fresh segment of ``size`` bytes; KVPSError (nothing left behind) when /dev/shm is
        missing or too full. Its pages are reserved now, or with ``grows`` a step at a time as
        blocks need them (a worker's segment then holds its peak in-flight bytes, not its size;
        a server's arena, weights that would otherwise take heap memory), so a full /dev/shm
        can never SIGBUS a writer later: a block finding no room is None."""
        if not HEADER_BYTES + ALIGN <= size <= MAX_SEGMENT_BYTES:
            raise KVPSError(f'shared-memory size {size} out of range')
        reserve = min(size, RESERVE_STEP) if grows else size
        name = f'kvps-{os.getpid()}-{secrets.token_hex(8)}'
        path = os.path.join(directory, name)
        try:
            vfs = os.statvfs(directory)
            if vfs.f_bavail * vfs.f_frsize < reserve:
                raise KVPSError(f'{directory} has {vfs.f_bavail * vfs.f_frsize} bytes free, '
                                f'{reserve} needed')
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise KVPSError(f'cannot create shared memory in {directory}: {exc}') from None
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, reserve)
            memory = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise KVPSError(f'cannot reserve {reserve} bytes of shared memory: {exc}') from None
        nonce = secrets.token_bytes(NONCE_BYTES)
        memory[:NONCE_BYTES] = nonce
        segment = cls(name, nonce, memory, allocator, fd, reserve)
        segment.path = path
        return segment

    def take(self, nbytes):
        """``(offset, uint8 array of nbytes)`` in the segment, or None when it is full. The
        block is reused only after the array and every view of it are gone. It lies in pages
        already reserved; more are reserved only when it fits nowhere among them."""
        offset = self.blocks.alloc(nbytes, self.reserved)
        if offset is None and self._reserve(self.blocks.reach(nbytes)):
            offset = self.blocks.alloc(nbytes, self.reserved)   # None: taken meanwhile
        if offset is None:
            return None
        # An array made from a buffer is the .base of every view numpy derives from it, so the
        # finalizer runs only once the block and all its slices and views are gone.
        block = np.frombuffer(self._view[offset:offset + nbytes], dtype=np.uint8)
        weakref.finalize(block, self.blocks.free, offset)
        return offset, block

    def _reserve(self, end):
        """Hold the pages up to ``end`` (whole steps, within the size); False when /dev/shm
        has no room for them, or ``end`` is None (more pages would not help)."""
        if end is None:
            return False
        with self._reserving:
            if end <= self.reserved:
                return True
            upto = min(self.size, -(-end // RESERVE_STEP) * RESERVE_STEP)
            try:
                os.posix_fallocate(self.fd, self.reserved, upto - self.reserved)
            except OSError:
                return False
            self.reserved = upto
            return True

    def offset_of(self, array):
        """The offset of ``array`` if its bytes lie in this segment (a block from take)."""
        offset = _address(array) - self._address
        return offset if HEADER_BYTES <= offset and offset + array.nbytes <= self.size else None

    def view(self, offset, nbytes):
        """The worker's own bytes at ``offset`` (offsets it chose: no check needed)."""
        return self._view[offset:offset + nbytes]

    @property
    def name_gone(self):
        return not self._linked

    def unlink(self):
        """Remove the name: mappings stay valid, only a peer told our ``pid`` and ``fd`` can
        still open it. Idempotent."""
        if self._linked:
            self._linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def release(self):
        """Unlock whatever a GPU copy page-locked of it (kvps.pinning); the mapping may go
        once the last block does. Idempotent."""
        pinning.REGISTRY.remove(self.region)

    def close(self):
        """Unlink, release, and close the file: once the mappings go, so do the pages.
        Idempotent."""
        self.unlink()
        self.release()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _address(array):
    """Where ``array``'s bytes start; asked per key part on every push and pull, so by the
    fastest way numpy allows (a third of ``__array_interface__``'s cost)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except (TypeError, ValueError):   # read-only, or empty
        return array.ctypes.data


class Mapping:
    """A peer's segment, opened by name only if its nonce matches: a server maps its workers'
    segments, a worker its servers' arenas (read-only)."""

    def __init__(self, memory, name='', writable=True):
        self.size = len(memory)
        self._view = memoryview(memory)
        self.address = np.frombuffer(memory, dtype=np.uint8).ctypes.data
        self.region = pinning.REGISTRY.add(self, memory, self.address, self.size, RESERVE_STEP,
                                           writable, f'shared-memory mapping of {name}')

    @classmethod
    def open(cls, name, nonce, size, directory=SHM_DIR, writable=True, holder=None):
        """Map the segment a peer announced; ProtocolError when the name is not one kvps
        makes, the file is missing, not a plain file of ``size`` bytes, or its nonce differs
        (another host, another /dev/shm, another user). ``holder``: the ``(pid, fd)`` the peer
        keeps it open as, the way in once its name is gone."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ProtocolError(f'attach: {name!r} is not a kvps segment name')
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            raise ProtocolError('attach: the nonce must be 16 bytes')
        if not HEADER_BYTES + ALIGN <= size <= MAX_SEGMENT_BYTES:
            raise ProtocolError(f'attach: size {size} out of range')
        flags = os.O_RDWR if writable else os.O_RDONLY
        try:
            fd = os.open(os.path.join(directory, name), flags | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = _open_held(name, holder, directory, flags)
        except OSError as exc:
            raise ProtocolError(f'attach: cannot open {name}: {exc.strerror}') from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                raise ProtocolError(f'attach: {name} is not a segment of {size} bytes')
            memory = mmap.mmap(fd, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable
                                                               else 0))
        except OSError as exc:
            raise ProtocolError(f'attach: cannot map {name}: {exc}') from None
        finally:
            os.close(fd)
        if memory[:NONCE_BYTES] != nonce:
            memory.close()
            raise ProtocolError(f'attach: {name} is not the segment announced (nonce differs)')
        return cls(memory, name, writable)

    def release(self):
        """Unlock whatever a GPU copy page-locked of it (kvps.pinning), before it is dropped:
        it is unmapped once the last view of it goes. Idempotent."""
        pinning.REGISTRY.remove(self.region)

    def view(self, offset, nbytes):
        """A zero-copy view of ``nbytes`` at ``offset``, after checking both lie in the data
        area: offsets come from the network."""
        if not (isinstance(offset, int) and isinstance(nbytes, int)
                and HEADER_BYTES <= offset and 0 <= nbytes <= self.size - offset):
            raise ProtocolError(f'shared-memory range {offset!r}+{nbytes!r} is outside the '
                                f'segment ({self.size} bytes)')
        return self._view[offset:offset + nbytes]


def _open_held(name, holder, directory, flags):
    """Open an unlinked segment through the process holding it, /proc/<pid>/fd/<fd>. It must be
    a plain file of the same filesystem as ``directory``, checked before it is opened: a peer's
    word never makes this process open a device or a pipe."""
    pid, fd = holder if isinstance(holder, (list, tuple)) and len(holder) == 2 else (None, None)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (pid, fd)):
        raise ProtocolError(f'attach: {name} is gone, and no process holding it was named')
    path = f'/proc/{pid}/fd/{fd}'
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_dev != os.stat(directory).st_dev:
            raise ProtocolError(f'attach: {path} is not a shared-memory file')
        opened = os.open(path, flags)
    except OSError as exc:
        raise ProtocolError(f'attach: {name} is gone and {path} cannot be opened: '
                            f'{exc.strerror}') from None
    now = os.fstat(opened)
    if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):   # swapped in between
        os.close(opened)
        raise ProtocolError(f'attach: {path} changed while it was opened')
    return opened


def remove_leftovers(pid, directory=SHM_DIR):
    """Unlink the segments of process ``pid``, which is gone: a worker killed in the moment
    between creating its segment and its servers mapping it leaves the name behind."""
    for path in glob.glob(os.path.join(directory, f'kvps-{int(pid)}-*')):
        if _NAME.fullmatch(os.path.basename(path)):
            try:
                os.unlink(path)
            except OSError:   # gone already, or not ours to remove
                pass
