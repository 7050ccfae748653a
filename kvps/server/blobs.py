"""Named blobs a server keeps for the job's workers (an elastic Trainer's handover of its
weights and optimizer state): each put replaces the blob of its name, whole."""

from ..errors import ConfigError

MAX_BLOBS = 4096   # names held at once: enough for a handover per worker of a big job
MAX_NAME = 200


class Blobs:
    """The blobs, and the pieces of blobs too big for one message while they arrive."""

    def __init__(self):
        self._blobs = {}     # name -> bytes
        self._pieces = {}    # (worker, name) -> the pieces received so far

    def put(self, worker, header, buffer):
        """One PUT_BLOB from ``worker``: the blob replaces its name's once its last piece is
        in (a piece out of order, as after a restart of this server, is a ConfigError)."""
        name, piece = _name(header), header.get('piece', 0)
        pieces = self._pieces.pop((worker, name), []) if piece else []
        if piece != len(pieces):
            raise ConfigError(f'blob {name!r}: piece {piece} came after {len(pieces)} piece(s) '
                              '(this server restarted while it was sent?): put it again')
        pieces.append(bytes(buffer))
        if header.get('more'):
            self._pieces[(worker, name)] = pieces
            return
        if name not in self._blobs and len(self._blobs) >= MAX_BLOBS:
            raise ConfigError(f'this server already holds {MAX_BLOBS} blobs; blob {name!r} '
                              'is one too many')
        self._blobs[name] = b''.join(pieces)

    def get(self, header):
        """The blob of the GET_BLOB's name; b'' when there is none."""
        return self._blobs.get(_name(header), b'')

    def forget(self, worker):
        """``worker`` left: the pieces it was sending go."""
        for where in [where for where in self._pieces if where[0] == worker]:
            del self._pieces[where]


def _name(header):
    name = header['name']
    if not 0 < len(name) <= MAX_NAME:
        raise ConfigError(f'a blob name has 1 to {MAX_NAME} characters, got {len(name)}')
    return name
