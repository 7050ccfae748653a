"""The shared-memory segments workers on this host lent the server, and the payloads in them.

A worker's ATTACH names its segment; the server maps it only for that worker's identity, and
every offset a later header gives is checked against that mapping (ProtocolError otherwise).
Push payloads are read in place and pull replies written in place; the bytes never touch
the socket.
"""

from .. import protocol as P
from ..errors import ConfigError, ProtocolError
from ..shm import SHM_DIR, Mapping


class Regions:
    """Worker identity -> its mapped segment."""

    def __init__(self, enabled=True, directory=SHM_DIR):
        self.enabled, self.directory = enabled, directory
        self._by_worker = {}

    def attach(self, identity, header):
        """Map the segment of ATTACH ``header`` for ``identity`` (replacing an older one: views
        already taken from it keep it mapped until they are gone)."""
        self._by_worker.pop(identity, None)   # a failed attach leaves the socket only
        if not self.enabled:
            raise ConfigError('shared memory is off on this server (KVPS_SHM=0)')
        self._by_worker[identity] = Mapping.open(header['name'], header['nonce'],
                                                 header['size'], self.directory)

    def view(self, identity, at, nbytes):
        """``nbytes`` of ``identity``'s segment at ``at``; ProtocolError when that worker has
        no segment here or the range is outside it."""
        mapping = self._by_worker.get(identity)
        if mapping is None:
            raise ProtocolError('a shared-memory offset from a worker whose segment this server '
                                'has not attached')
        return mapping.view(at, nbytes)

    def payloads(self, identity, items, frames):
        """One payload per PUSH item, in order: its data frame, or its bytes in the segment.
        A range that fails its check becomes the ProtocolError itself, for that key alone."""
        frames = iter(frames)
        out = []
        for item in items:
            at = item[P.AT[P.PUSH]]
            if at is None:
                out.append(next(frames))
                continue
            try:   # read-only: an update must not clobber the worker's copy (it may resend it)
                out.append(self.view(identity, at, P.nbytes(item[2], item[3])).toreadonly())
            except ProtocolError as exc:
                out.append(exc)
        return out
