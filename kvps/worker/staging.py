"""The worker's shared-memory segment: which servers mapped it, blocks for pushes and pulls, and
shared-memory items turned back into data frames for a server that cannot see the segment;
and the servers' arenas this worker maps to copy pulls out of.

One segment per worker, attached by every server on its host: a key split across servers is
copied once, into one block, and each server reads its part of it in place. The I/O thread
changes which servers are attached and reads their arenas; API threads only read that, and
take blocks (never waiting: a payload that finds no room goes through the socket).
"""

import logging
import os
import threading
import weakref

import numpy as np

from .. import pinning
from ..errors import KVPSError, ProtocolError
from ..wire import protocol as P
from ..wire.device_segments import DEVICE_BASE
from ..wire.identities import members_on
from ..wire.shm import HEADER_BYTES, MIN_BYTES, SHM_DIR, Mapping, Segment, aligned, segment_bytes

log = logging.getLogger('kvps.worker')

# Takes of at most CUT_MOST bytes are cut from a chunk of CHUNK_BYTES of the segment (at most
# a sixteenth of it): taking a block costs ~3 us (its allocation and finalizer), a cut a tenth
# of that, and a loop of one-key calls takes two blocks a key (its push and its pull).
CHUNK_BYTES = 1 << 20
CUT_MOST = 64 << 10


class Arena:
    """One server's arena as this worker reads it: the read-only mapping, how many of the
    server's lending replies have been copied out of it (sent back as ``seen``), and the key
    parts its last answers lent (their next pulls ask for no block)."""

    __slots__ = ('mapping', 'seen', 'lent_keys')

    def __init__(self, mapping):
        self.mapping, self.seen, self.lent_keys = mapping, 0, set()

    def view(self, at, nbytes):
        """The bytes a reply lent at ``at`` (range checked: ProtocolError)."""
        return self.mapping.view(at, nbytes)

    def note(self, key_part, lent):
        """Whether the server answered ``key_part``'s pull from here."""
        (self.lent_keys.add if lent else self.lent_keys.discard)(key_part)


class Staging:
    """A worker's segment and the servers that have mapped it."""

    def __init__(self, segment):
        self.segment = segment
        self.attached = frozenset()   # node names; replaced whole, so readers need no lock
        self._asked = set()           # node names whose ATTACH is unanswered
        self._all_answered = threading.Event()   # set while _asked is empty
        self._all_answered.set()
        self.arenas = {}              # node name -> Arena this worker maps
        self._locks = None            # whether a GPU could page-lock the segment (tried once)
        # the ipc route's kvps.worker.device_staging.DeviceStaging, once GPU values moved and
        # KVPS_IPC allows it (set once, by the API thread that set it up)
        self.device = None
        self.device_tried = False     # whether that was tried (the first GPU push or pull)
        self._cutting = threading.Lock()
        self._chunk = (lambda: None, 0, 0)   # (weakref to the block, its offset, bytes cut)
        self._chunk_bytes = min(CHUNK_BYTES, max(CUT_MOST, segment.size // 16))

    @classmethod
    def for_job(cls, config, welcome, host):
        """A Staging for a worker on ``host`` in the job of ``welcome`` when a server shares
        the host (by address): others could never map its segment, whose pages would only
        sit reserved in /dev/shm. Else None."""
        servers = members_on(welcome, host, 'server')
        if not servers:
            return None
        return cls.create(config, servers + members_on(welcome, host, 'worker'))

    @classmethod
    def create(cls, config, sharers=1):
        """A Staging with a fresh segment, or None (KVPS_SHM=0, or no room: logged).
        ``sharers``: the job's processes on this host, which split /dev/shm when its size is
        KVPS_SHM_BYTES=auto."""
        if not config.shm:
            return None
        size = segment_bytes(config.shm_bytes, sharers)
        if not size:
            log.warning('no shared memory for array payloads: %d processes of this job share '
                        'too small a %s (set KVPS_SHM_BYTES to choose a size); they go through '
                        'the socket', sharers, SHM_DIR)
            return None
        try:
            return cls(Segment.create(size, grows=True))
        except KVPSError as exc:
            log.warning('no shared memory for array payloads (%s); they go through the socket',
                        exc)
            return None

    def device_route(self):
        """``(direct, how)`` (kvps.kvstore.backend.Backend.device_route): direct once the
        segment's first step is page-locked (tried the first time GPU values move)."""
        registry = pinning.REGISTRY
        if registry.working and self._locks is None:
            self._locks = registry.spans(self.segment.address, HEADER_BYTES) is not None
        if registry.working and self._locks:
            return True, ('page-locked shared memory <-> the servers on this host (one DMA '
                          'each way); pinned host buffers <-> the socket for any other')
        why = registry.failed or 'no CUDA device to page-lock it for'
        return False, f'pinned host buffers, a copy more each way ({why})'

    def attach_header(self, node):
        """The ATTACH message that asks ``node`` to map the segment."""
        self._asked.add(node)
        self._all_answered.clear()
        return {'op': P.ATTACH, **self.segment.describe()}

    def wait_answered(self, timeout):
        """Wait (up to ``timeout`` s) until every server asked to map the segment answered:
        the servers that did are ``attached``."""
        self._all_answered.wait(timeout)

    def answered(self, node, error=None):
        """``node`` mapped the segment (or could not: ``error``). Once every server answered,
        the name goes: the mappings stay, and a killed worker leaves nothing in /dev/shm."""
        self._asked.discard(node)
        if error is None:
            self.attached = self.attached | {node}
        else:
            log.info('%s cannot map this worker\'s shared memory (%s); its payloads go through '
                     'the socket', node, error)
        if not self._asked:
            self.segment.unlink()
            self._all_answered.set()

    def detach(self, node):
        """``node`` is lost: its replacement has not mapped the segment (nor we its arena).
        Its arena is released (unlocked, if a GPU copy locked it; views still taken keep it
        mapped until they go)."""
        self.attached = self.attached - {node}
        self._drop_arena(node)
        if self.device is not None:
            self.device.detach(node)

    def _drop_arena(self, node):
        arena = self.arenas.pop(node, None)
        if arena is not None:
            arena.mapping.release()

    def close(self):
        """This worker is leaving: the segment and every arena released, the segment's file
        closed (the pages go with the last mapping). Idempotent."""
        for node in list(self.arenas):
            self._drop_arena(node)
        self.segment.close()
        if self.device is not None:
            self.device.close()

    def map_arena(self, node, header):
        """Map the arena an ATTACH answer describes (if any): ``node`` may then lend pulled
        values in it. One that cannot be mapped only costs a copy on the server."""
        arena = header.get('arena')
        if arena is None:
            return
        try:
            if not isinstance(arena, dict):
                raise ProtocolError('the arena description is not a map')
            mapping = Mapping.open(arena.get('name'), arena.get('nonce'), arena.get('size'),
                                   os.path.dirname(self.segment.path), writable=False)
        except ProtocolError as exc:
            log.info('cannot map the arena of %s (%s); its pulls are copied into ours', node,
                     exc)
            return
        self._drop_arena(node)
        self.arenas[node] = Arena(mapping)

    def copied(self, node, lease):
        """Every value of ``node``'s reply ``lease`` has been copied out of its arena."""
        arena = self.arenas.get(node)
        if arena is not None:
            arena.seen = max(arena.seen, lease)

    def stage(self, sizes, device=False):
        """Blocks for a push's copies of values of ``sizes`` bytes, None for each that is small
        (or when no server has mapped the segment, or there is no room). ``device``: blocks
        of the device segment (None unless every server has mapped it)."""
        source = self.device if device else self.segment
        mapped = self.attached if not device else source is not None and source.ready
        wanted = [n if n >= MIN_BYTES and mapped else 0 for n in sizes]
        return [None if taken is None else taken[1] for taken in self._take_all(wanted, source)]

    def _take_all(self, sizes, source=None):
        """``(offset, block)`` for each of ``sizes`` (None for 0), cut from one allocation: a
        message of many keys takes the allocator once (taking and freeing a block of its own
        costs ~5 us, a slice half a microsecond). When that finds no room, each gets a block
        of its own while they last. The allocation is reused once every slice is gone.
        ``source``: what to take them from (the segment, or the device segment)."""
        source = source or self.segment
        spans = [aligned(n) if n else 0 for n in sizes]
        total = sum(spans)
        if not total:
            taken = None
        elif total <= CUT_MOST and source is self.segment:
            taken = self._cut(total)
        else:
            taken = source.take(total)
        if taken is None:
            return [source.take(n) if n else None for n in sizes]
        (offset, block), out, at = taken, [], 0
        for n, span in zip(sizes, spans):
            out.append((offset + at, block[at:at + n]) if n else None)
            at += span
        return out

    def _cut(self, nbytes):
        """``(offset, block)`` of ``nbytes`` (aligned) cut from the current chunk of the
        segment, or from a new one; where no chunk fits, a block of its own (None: none fits
        either). The chunk is held weakly: it returns to the segment once its last cut is
        gone, as a block of its own would, and a thread that stops taking pins nothing."""
        with self._cutting:
            ref, offset, used = self._chunk
            chunk = ref()
            if chunk is None or used + nbytes > chunk.size:
                taken = self.segment.take(self._chunk_bytes)
                if taken is None:
                    return self.segment.take(nbytes)
                (offset, chunk), used = taken, 0
            self._chunk = (weakref.ref(chunk), offset, used + nbytes)
            return offset + used, chunk[used:used + nbytes]

    def offset_in(self, node, array):
        """Where ``array`` (part of a staged block) lies for ``node``, or None: send it as a
        frame. A device array lies in the device segment (the stand-in's are numpy arrays)."""
        if type(array) is np.ndarray:
            at = self.segment.offset_of(array) if node in self.attached else None
            if at is not None or self.device is None:
                return at
        return self.device.offset_in(node, array)

    def would_place(self, node, nbytes):
        """Whether a pulled part of ``nbytes`` from ``node`` asks for a block (it may still
        find no room)."""
        return nbytes >= MIN_BYTES and node in self.attached

    def blocks_for(self, node, parts, gpu=None):
        """``(offset, block)`` for ``node`` to write each pulled part of one message into,
        ``parts`` as ``(nbytes, key part)``, or None: also for a key part that ``node`` lent
        in its arena last time (it will again, most likely). ``gpu``: whether each lands on
        a GPU, which takes a block of the device segment where the ipc route applies."""
        device = self.device
        if gpu is not None and device is not None and device.ready and True in gpu:
            on = self._take_all([n if wants and n >= MIN_BYTES else 0
                                 for (n, _), wants in zip(parts, gpu)], device)
            rest = self.blocks_for(node, [(0, part[1]) if block else part
                                          for part, block in zip(parts, on)])
            return [block or other for block, other in zip(on, rest)]
        arena = self.arenas.get(node)
        lent = arena.lent_keys if arena is not None else ()
        return self._take_all([nbytes if self.would_place(node, nbytes) and key_part not in lent
                               else 0 for nbytes, key_part in parts])

    def readable(self, node, header, buffers):
        """``(header, buffers)`` that ``node`` can read: if it has not mapped the segment (a
        replacement server, or a request made before it was lost), a copy in which every
        shared-memory item becomes a frame (a push's bytes are viewed in place) or asks for
        one (a pull)."""
        op = header['op']
        if op not in (P.PUSH, P.PULL) or node in self.attached and (
                self.device is None or self.device.readable_by(node)):
            return header, buffers
        frames, items, out = iter(buffers), [], []
        for item in header['keys']:
            if op == P.PUSH:
                out.append(next(frames) if item.at is None else self._bytes_at(item))
            items.append(item if item.at is None else item._replace(at=None))
        return {**header, 'keys': items}, out

    def _bytes_at(self, item):
        """A push item's payload, staged at ``item.at``: a view of the segment, or a host copy
        of the device segment's bytes."""
        nbytes = P.nbytes(item.dtype, item.n)
        if item.at < DEVICE_BASE:
            return self.segment.view(item.at, nbytes)
        return self.device.host_copy(item.at, nbytes)
