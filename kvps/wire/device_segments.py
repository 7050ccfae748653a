"""A worker's device segment: one buffer of device memory it exports (kvps.wire.device_sharing)
and cuts into blocks for the payloads of its pushes and pulls, and the servers on its host that
map it; the device twin of a shared-memory segment (kvps.wire.shm).

Offsets into a device segment travel in the same item fields as those into the worker's host
segment (``at``), shifted by DEVICE_BASE: a host segment is at most 2**40 bytes, so an offset at
or above 2**41 names the device segment, and a server tells the two apart by one comparison.
Everything a peer names (handle, size, offsets, lengths) is checked before use
(ProtocolError). Ordering, both ways through interprocess events: the worker records its event
on the stream of the writes a message announces and sends the message without waiting, and
the server makes its stream wait on the event before it reads them; the server records its
own event behind its reads of the blocks a request names and its writes into them (a pull's
values) and answers without waiting, and the worker's I/O thread waits for that record
before it reads a pull's values from a block or lets a block be reused. Neither waits for
the GPU on the host before it sends.
"""

import threading
import weakref

from ..errors import KVPSError, ProtocolError
from .device_sharing import check_handle, check_size
from .shm import MAX_SEGMENT_BYTES, Ring, aligned

DEVICE_BASE = 2 * MAX_SEGMENT_BYTES


class DeviceSegment:
    """The worker's exported buffer (a kvps.wire.device_sharing.Shared) and its blocks; its
    event, recorded after the writes of each message that names blocks of it."""

    def __init__(self, sharing, nbytes):
        self.sharing = sharing
        self.buffer = sharing.export(nbytes)
        try:
            self.event = sharing.event()
        except KVPSError:   # nothing half-made stays
            self.buffer.close()
            raise
        self.blocks = Ring(0, nbytes)
        self._recording = threading.Lock()   # API threads record in turn (chained records)
        self._cutting = threading.Lock()     # a held block is cut where no block is out

    def record(self, stream=None):
        """The writes issued on CUDA ``stream`` (None: the default one) so far are those the
        next messages announce: record the event behind them."""
        with self._recording:
            if not self.buffer.closed:
                self.event.record(stream)

    def describe(self):
        """What a server needs to map it (ATTACH's ``device``)."""
        return {'kind': self.sharing.name, 'handle': self.buffer.handle,
                'size': self.buffer.nbytes, 'event': self.event.handle}

    def take(self, nbytes):
        """``(wire offset, uint8 device array of nbytes)``, or None when there is no room. The
        block is reused once it and every view of it are gone."""
        with self._cutting:
            blocks = self.blocks
            offset = None if self.buffer.closed else blocks.alloc(nbytes)
        if offset is None:
            return None
        block, anchor = self.sharing.piece(self.buffer, offset, nbytes)
        weakref.finalize(anchor, blocks.free, offset)
        return DEVICE_BASE + offset, block

    def hold(self, nbytes):
        """``(wire offset, uint8 device array of nbytes)`` kept as long as the segment lives
        (a buffer its owner writes pushes into, and sends from where they lie), or None: no
        room, or blocks are out (held ones are cut before any other is taken)."""
        with self._cutting:
            offset, end = self.blocks.start, self.blocks.start + aligned(nbytes)
            if self.buffer.closed or len(self.blocks) or end >= self.blocks.stop:
                return None
            self.blocks = Ring(end, self.blocks.stop)   # (the others go round it)
        return DEVICE_BASE + offset, self.sharing.piece(self.buffer, offset, nbytes)[0]

    def offset_of(self, array):
        """The wire offset of ``array`` if its bytes lie in this segment, else None (also for
        an array of another kind: a host array, where the segment is a GPU's)."""
        if self.buffer.closed or type(array) is not type(self.buffer.array):
            return None
        offset = self.sharing.address(array) - self.sharing.address(self.buffer.array)
        return DEVICE_BASE + offset if 0 <= offset and offset + array.nbytes <= \
            self.buffer.nbytes else None

    def host_copy(self, at, nbytes):
        """A host copy of the worker's own ``nbytes`` at wire offset ``at``, once the writes
        recorded so far have landed (they are on the streams of their writers)."""
        offset = at - DEVICE_BASE
        self.event.synchronize()
        return self.sharing.to_host(self.buffer.array[offset:offset + nbytes])

    def answered(self, block, event):
        """Whether ``block`` (an array; of this segment or not) may be reused or read once a
        server's answer about it came and its ``event`` was waited for: always on CUDA, where
        that wait is the order; the stand-in checks that the server recorded the event
        behind its work on the block, and that the wait came after (else CUDA would reuse or
        read the block while that work still runs)."""
        at = self.offset_of(block)
        return at is None or self.sharing.answered(self.buffer, at - DEVICE_BASE, block.nbytes,
                                                   event)

    def close(self):
        """Free the buffer and the event (this worker is leaving). Idempotent."""
        self.buffer.close()
        self.event.close()


class DeviceMapping:
    """A worker's device segment as a server maps it, and the worker's event."""

    def __init__(self, sharing, description):
        """Map ``description`` (ATTACH's ``device``) with ``sharing``; ProtocolError when it is
        malformed, of another kind of memory, or cannot be opened here."""
        if not isinstance(description, dict):
            raise ProtocolError('attach: the device segment description is not a map')
        kind = description.get('kind')
        if kind != sharing.name:
            raise ProtocolError(f'attach: a device segment of {kind!r} memory, this server '
                                f'shares {sharing.name!r}')
        handle = check_handle(description.get('handle'))
        event = check_handle(description.get('event'), 'event')
        self.sharing = sharing
        self.buffer = sharing.open(handle, check_size(description.get('size')))
        try:
            self.event = sharing.open_event(event)
        except ProtocolError:
            self.buffer.close()
            raise

    def view(self, at, nbytes):
        """The ``nbytes`` at wire offset ``at``, range checked: offsets come from the
        network."""
        offset = at - DEVICE_BASE
        if self.buffer.closed or not (type(nbytes) is int and 0 <= offset
                                      and 0 <= nbytes <= self.buffer.nbytes - offset):
            raise ProtocolError(f'device range {at!r}+{nbytes!r} is outside the worker\'s '
                                f'device segment')
        return self.buffer.array[offset:offset + nbytes]

    def read(self, at, nbytes):
        """``view`` of a push's bytes, which the worker's event orders after its writes (the
        stand-in checks it: ProtocolError for a block no record followed)."""
        view = self.view(at, nbytes)
        if not self.sharing.ordered(self.buffer, self.event, at - DEVICE_BASE):
            raise ProtocolError(f'device range {at!r}+{nbytes!r} was not recorded by the '
                                f'worker\'s event after it was written')
        return view

    def close(self):
        """Unmap the segment and close the event. Idempotent."""
        self.buffer.close()
        self.event.close()
