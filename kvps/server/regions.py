"""The shared memory a server shares with the workers on its host: the segments they lent it,
the payloads in them, and the server's own arena of weights that they read pulls from.

A worker's ATTACH names its segment; the server maps it only for that worker's identity, and
every offset a later header gives is checked against that mapping (ProtocolError otherwise).
Push payloads are read in place and pull replies written in place; the bytes never touch
the socket. The first ATTACH also creates the arena, whose description goes back in the
answer: a worker that maps it gets big weights lent in place (DATA's ``lent``), and each
buffer so lent is kept alive, unchanged, until the worker's ``seen`` shows it has copied it.
"""

import collections
import logging
import math
import weakref

from ..errors import ConfigError, KVPSError, ProtocolError
from ..wire import protocol as P
from ..wire.device_segments import DEVICE_BASE, DeviceMapping
from ..wire.shm import SHM_DIR, Heap, Mapping, Segment

log = logging.getLogger('kvps.server')

# The arena's name goes from /dev/shm once every worker on this host has mapped it (its first
# `seen` says so), or at the latest this long after it was made (the mappings stay): every
# worker attaches as the job starts, and a killed server then leaves nothing behind.
ARENA_NAME_SECONDS = 30.0


class Reader:
    """One worker reading the arena: the replies lent to it and how many it has copied."""

    __slots__ = ('lent', 'seen', 'held', 'mapped')

    def __init__(self):
        self.lent = self.seen = 0
        self.mapped = False               # a `seen` came: it has mapped the arena
        self.held = collections.deque()   # (reply number, arrays): alive until seen

    def saw(self, seen):
        self.seen = max(self.seen, seen)
        while self.held and self.held[0][0] <= self.seen:
            self.held.popleft()


class Regions:
    """Worker identity -> its mapped segment; the arena; who reads it."""

    def __init__(self, enabled=True, directory=SHM_DIR, arena_bytes=1 << 28, neighbours=None):
        """``neighbours``: how many of the job's workers share this host (None: unknown)."""
        self.enabled, self.directory, self.arena_bytes = enabled, directory, arena_bytes
        self.neighbours = neighbours
        self._by_worker = {}
        self._devices = {}    # worker identity -> its device segment (DeviceMapping), mapped
        self.arena = None
        self._unlink_at = None
        self._readers = {}
        self._offsets = {}    # id(array) -> (weakref to it, its offset in the arena or None)

    def attach(self, identity, header, now=0.0):
        """Map the segment of ATTACH ``header`` for ``identity`` (replacing an older one: views
        already taken from it keep it mapped until they are gone). Returns the arena's
        description for the answer, or None when there is none."""
        self._drop_mapping(identity)   # a failed attach leaves the socket only
        if not self.enabled:
            raise ConfigError('shared memory is off on this server (KVPS_SHM=0)')
        self._by_worker[identity] = Mapping.open(
            header['name'], header['nonce'], header['size'], self.directory,
            holder=(header.get('pid'), header.get('fd')))
        if self.arena is None and self._unlink_at is None:
            self._unlink_at = now + ARENA_NAME_SECONDS   # one try: no room is logged once
            self.arena = self._new_arena()
        self._forget_reader(identity)
        self._readers[identity] = Reader()
        return None if self.arena is None or self.arena.name_gone else self.arena.describe()

    def attach_device(self, identity, header, sharing):
        """Map the device segment of ATTACH_DEVICE ``header`` for ``identity`` with
        ``sharing`` (this server's GPU shards' kvps.wire.device_sharing: the caller checked
        that it has some), replacing an older one. ProtocolError when it cannot."""
        self._drop_device(identity)
        self._devices[identity] = DeviceMapping(sharing, header)

    def _drop_device(self, identity):
        mapping = self._devices.pop(identity, None)
        if mapping is not None:
            mapping.close()

    def _new_arena(self):
        why = f'this server\'s share of {self.directory} is under 2 MiB'
        if self.arena_bytes:
            try:
                return Segment.create(self.arena_bytes, self.directory, Heap, grows=True)
            except KVPSError as exc:
                why = exc
        log.warning('no shared-memory arena for weights (%s); pulls are copied into each '
                    'worker\'s segment', why)
        return None

    def tick(self, now):
        if self.arena is not None and self._unlink_at is not None and now >= self._unlink_at:
            self.arena.unlink()

    def close(self):
        """Release every worker's segment and close the arena (the server is ending)."""
        for identity in list(self._by_worker):
            self._drop_mapping(identity)
        for identity in list(self._devices):
            self._drop_device(identity)
        if self.arena is not None:
            self.arena.close()

    def _drop_mapping(self, identity):
        """Release ``identity``'s segment (unlocked, if a GPU copy locked it) and drop it:
        views still taken keep it mapped until they go."""
        mapping = self._by_worker.pop(identity, None)
        if mapping is not None:
            mapping.release()

    def view(self, identity, at, nbytes):
        """``nbytes`` of ``identity``'s segment at ``at`` (its device segment's, a device array,
        from DEVICE_BASE on); ProtocolError when that worker has no segment here or the range
        is outside it."""
        mapping = (self._by_worker if at < DEVICE_BASE else self._devices).get(identity)
        if mapping is None:
            raise ProtocolError('a shared-memory offset from a worker whose segment this server '
                                'has not attached')
        return mapping.view(at, nbytes)

    def payloads(self, identity, items, frames):
        """One payload per PUSH item, in order: its data frame, or its bytes in the segment.
        A range that fails its check becomes the ProtocolError itself, for that key alone."""
        frames = iter(frames)
        out, waited = [], False
        for item in items:
            at = item.at
            if at is None:
                out.append(next(frames))
                continue
            try:   # read-only: an update must not clobber the worker's copy (it may resend it)
                if at < DEVICE_BASE:
                    out.append(self.view(identity, at, P.nbytes(item.dtype, item.n))
                               .toreadonly())
                    continue
                out.append(self._device_read(identity, at, P.nbytes(item.dtype, item.n)))
            except ProtocolError as exc:
                out.append(exc)
                continue
            if not waited:   # (a device array, only read) behind the worker's event, once
                waited = True
                self._devices[identity].event.wait()
        return out

    def _device_read(self, identity, at, nbytes):
        """A push's ``nbytes`` at ``at`` in ``identity``'s device segment (DeviceMapping.read)."""
        mapping = self._devices.get(identity)
        if mapping is None:
            raise ProtocolError('a device segment offset from a worker whose device segment '
                                'this server has not attached')
        return mapping.read(at, nbytes)

    # -- the arena -----------------------------------------------------------------------------
    def saw(self, identity, header):
        """Note the header's ``seen`` (present when the worker reads the arena); return the
        worker's Reader then, else None."""
        seen = header.get('seen')
        reader = self._readers.get(identity)
        if seen is None or reader is None or self.arena is None:
            return None
        reader.saw(seen)
        if not reader.mapped:
            reader.mapped = True
            if sum(r.mapped for r in self._readers.values()) == self.neighbours:
                self.arena.unlink()   # every worker on this host has it mapped
        return reader

    def lendable(self, array):
        """``array``'s offset in the arena, or None when it lives elsewhere. Kept while the
        array lives: a weight is lent round after round, and finding where an array's bytes
        are costs microseconds, a tenth of a small key's serving."""
        if self.arena is None:
            return None
        key = id(array)
        known = self._offsets.get(key)
        if known is not None and known[0]() is array:
            return known[1]
        gone = weakref.ref(array, lambda _, offsets=self._offsets: offsets.pop(key, None))
        self._offsets[key] = (gone, self.arena.offset_of(array))
        return self._offsets[key][1]

    @staticmethod
    def lend(reader, arrays):
        """Keep ``arrays`` (lent by one reply) alive until ``reader`` has seen that reply;
        returns its number."""
        reader.lent += 1
        reader.held.append((reader.lent, arrays))
        return reader.lent

    def forget(self, identity):
        """The worker left: nothing it was lent needs keeping, and its segment is released."""
        self._forget_reader(identity)
        self._drop_mapping(identity)
        self._drop_device(identity)

    def _forget_reader(self, identity):
        """Nothing ``identity`` was lent needs keeping (it left, or attached anew)."""
        reader = self._readers.pop(identity, None)
        if reader is not None:
            reader.saw(math.inf)
