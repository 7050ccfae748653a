"""Page-locking of shared-memory mappings for a GPU: a region per mapping, locked one step at a
time as copies reach it, unlocked before the mapping goes.

A GPU copies to and from page-locked host memory directly and asynchronously; from pageable
memory the driver stages every byte through a buffer of its own, at a fraction of the speed.
kvps's segments and arenas grow as they fill (their pages are reserved in steps of
``kvps.wire.shm.RESERVE_STEP``), so they are locked the same way: a copy asks for the ``spans``
of its range, and each step the range touches is locked then, once, and stays locked until
the region is removed. Only pages already reserved are ever locked: a block lies in them, and
the steps line up with the reservations.

The locking itself is a Locker's (``lock(address, nbytes, writable)``, ``unlock(address)``):
torch's cudart on a worker (TorchLocker, below), cupy's runtime on a server, installed by
whichever side moves GPU values (``use``); without one nothing is locked and neither library
is imported. Tests give a host stand-in.

- A region keeps its memory object while any step is locked, so a mapping is never unmapped
  while registered; ``remove`` unlocks every step (then the owner may unmap).
- Every copy to or from a locked range is waited for by the code that issued it before it
  returns, so unlocking never meets a copy in flight.
- A failed lock (RLIMIT_MEMLOCK, a filesystem the driver cannot pin) is no error: it is logged
  once, nothing more is locked in this process, and copies take pageable memory's way.
"""

import bisect
import logging
import threading
import weakref

log = logging.getLogger('kvps')

# cudaHostRegister's flags: seen as pinned by every device's context; read-only for the
# device (a mapping this process may only read: a server's arena, on a worker)
PORTABLE, READ_ONLY = 0x01, 0x08


class LockFailed(Exception):
    """A Locker could not lock (or unlock) a range: its message says why."""


class Region:
    """One mapping: where it lies, its memory object, the steps of it locked so far."""

    __slots__ = ('start', 'size', 'step', 'writable', 'what', 'locked', 'memory')

    def __init__(self, memory, start, size, step, writable, what):
        self.memory = memory  # held until removed: the mapping outlives its locks
        self.start, self.size, self.step = start, size, step
        self.writable, self.what = writable, what
        self.locked = {}      # step index -> the address locked

    def steps(self, offset, nbytes):
        """The indices of the steps that bytes [offset, offset + nbytes) touch."""
        return range(offset // self.step, (offset + nbytes - 1) // self.step + 1)

    def extent(self, index):
        """``(offset, nbytes)`` of step ``index``."""
        offset = index * self.step
        return offset, min(self.step, self.size - offset)


class Registry:
    """The regions of one process and its Locker; the lock on them all (any thread may copy;
    reentrant: a region whose owner is collected meanwhile is removed by the collector)."""

    def __init__(self, locker=None):
        self.locker = locker
        # why a lock failed, once one has, for writable and for read-only mappings (a GPU may
        # refuse to lock read-only memory and still lock the rest): no more of them are locked
        self._failed = {True: None, False: None}
        self._regions = []     # sorted by start: a few (a segment and some arenas)
        self._starts = []
        self._lock = threading.RLock()

    def use(self, locker):
        """Lock with ``locker`` from now on, unless one is in use already (the first wins)."""
        with self._lock:
            if self.locker is None:
                self.locker = locker

    @property
    def working(self):
        """Whether copies may find writable page-locked memory: a Locker, and no lock of a
        writable mapping has failed."""
        return self.locker is not None and self._failed[True] is None

    @property
    def failed(self):
        """Why locking a writable mapping failed (None: it has not)."""
        return self._failed[True]

    def add(self, owner, memory, start, size, step, writable, what):
        """A Region for ``memory`` (a mapping of ``size`` bytes at address ``start``, cut in
        steps of ``step`` bytes; ``what``: its name in logs); nothing is locked yet. Should
        ``owner`` (the object that maps it) be collected without ``remove``, the region is
        removed then."""
        region = Region(memory, start, size, step, writable, what)
        with self._lock:
            at = bisect.bisect(self._starts, start)
            self._starts.insert(at, start)
            self._regions.insert(at, region)
        weakref.finalize(owner, self.remove, region).atexit = False   # exit unlocks all
        return region

    def remove(self, region):
        """Unlock every step of ``region`` and forget it: the mapping may go now. Idempotent."""
        with self._lock:
            for at, each in enumerate(self._regions):
                if each is region:
                    del self._regions[at], self._starts[at]
                    break
            locked, region.locked, region.memory = region.locked, {}, None
            for address in locked.values():
                try:
                    self.locker.unlock(address)
                except LockFailed as exc:
                    log.warning('could not unlock %s: %s', region.what, exc)

    def region_of(self, address, nbytes):
        """The region holding every byte of [address, address + nbytes), or None."""
        at = bisect.bisect(self._starts, address) - 1
        if at < 0:
            return None
        region = self._regions[at]
        return region if address + nbytes <= region.start + region.size else None

    def spans(self, address, nbytes):
        """``[(offset, nbytes)]``: the range [address, address + nbytes) in pieces, cut where
        it crosses from one step into the next, each step locked now if it was not (a copy
        of one piece runs at pinned memory's speed); None when the range is not in one
        region, there is no Locker, or a lock fails (the copy takes pageable memory's
        way)."""
        if self.locker is None:
            return None
        if nbytes <= 0:
            return []
        with self._lock:
            region = self.region_of(address, nbytes)
            if region is None or self._failed[region.writable] is not None or \
                    not self._lock_steps(region, address - region.start, nbytes):
                return None
        return _cut(address - region.start, nbytes, region.step)

    def _lock_steps(self, region, offset, nbytes):
        for index in region.steps(offset, nbytes):
            if index in region.locked:
                continue
            at, size = region.extent(index)
            try:
                self.locker.lock(region.start + at, size, region.writable)
            except LockFailed as exc:
                why = self._failed[region.writable] = f'{region.what}: {exc}'
                log.warning('cannot page-lock %sshared memory for the GPU (%s); %s',
                            '' if region.writable else 'read-only ', why,
                            'device values take pinned staging buffers instead, a copy more '
                            'each way' if region.writable else 'copies from it to a GPU take '
                            'the driver\'s staging (slower)')
                return False
            region.locked[index] = region.start + at
        return True


def _cut(offset, nbytes, step):
    """[offset, offset + nbytes) as ``(relative offset, nbytes)`` pieces, cut at multiples of
    ``step``."""
    pieces, at = [], 0
    while at < nbytes:
        take = min(step - (offset + at) % step, nbytes - at)
        pieces.append((at, take))
        at += take
    return pieces


REGISTRY = Registry()


class TorchLocker:
    """A Locker on a worker: cudaHostRegister through torch's CUDA runtime (torch imported
    only when it locks: the worker moves GPU values, kvps.devices)."""

    def lock(self, address, nbytes, writable):
        import torch
        cudart = torch.cuda.cudart()
        flags = PORTABLE if writable else PORTABLE | READ_ONLY
        _checked(cudart.cudaHostRegister(address, nbytes, flags), 'cudaHostRegister')

    def unlock(self, address):
        import torch
        _checked(torch.cuda.cudart().cudaHostUnregister(address), 'cudaHostUnregister')


def _checked(error, call):
    """Raise LockFailed for a CUDA runtime error. The error would also wait for the next
    kernel launch's check (torch's cudaGetLastError) and fail unrelated code: one is
    launched here to take it."""
    if int(error) == 0:
        return
    import torch
    try:
        torch.ones(1, device='cuda').add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass
    raise LockFailed(f'{call}: CUDA error {int(error)} ({error})')
