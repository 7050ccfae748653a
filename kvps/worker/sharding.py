"""Pure key placement: big arrays split across every server (and cut into parts of at most KVPS_PARTITION_BYTES), small keys balanced by bytes.

Every worker computes the same placement because init is collective: the same keys, sizes
and order everywhere. A worker that diverges gets a clear 'not initialized' error from the
server it wrongly addresses, never silent corruption.
"""

import dataclasses
import math

import numpy as np

# Keys below this many elements stay whole when a model is balanced: splitting them would
# cost more messages than the balance saves.
BALANCE_FLOOR = 1 << 16


@dataclasses.dataclass(frozen=True)
class Part:
    """Elements [start, stop) of a key's flattened array, held by ``server``."""
    server: int
    part: int
    start: int
    stop: int


class Sharding:
    """Decides and remembers which server holds which part of every key."""

    def __init__(self, num_servers, bigarray_bound, partition_bytes=None):
        self.num_servers = num_servers
        self.bound = bigarray_bound
        self.partition_bytes = partition_bytes   # None: keys are never cut for their size
        self.load = [0] * num_servers          # bytes placed on each server
        self._parts = {}
        self.keep_whole = False   # place later keys on one server each, whatever their size

    def balance(self, total):
        """About to place a model of ``total`` elements: split keys from total / (2 S)
        elements on (never above the bound set, nor below BALANCE_FLOOR). A whole key then
        weighs at most half a server's share, so the greedy placement keeps every server's
        bytes, and so its link's load, within 1.5x of even; with MXNet's bound alone, a model
        of a few big tensors (three of 3-4 MB on four servers) put one tensor whole on some
        server and the job ran at that server's pace."""
        if self.num_servers > 1:
            self.bound = min(self.bound, max(BALANCE_FLOOR, total // (2 * self.num_servers)))

    def place(self, key, size, itemsize, width=1):
        """Assign ``key`` (``size`` elements, rows of ``width``) to servers; return its parts.
        A split key is cut between rows where it has a row for every part, so that each
        row lies on one server (pushes and pulls of some rows, kvps.rows)."""
        if key in self._parts:
            return self._parts[key]
        pieces = self._pieces(size, itemsize)
        if pieces > 1:
            unit = width if size // width >= pieces else 1
            edges = np.linspace(0, size // unit, pieces + 1).astype(np.int64) * unit
            # Rotate the start so that uneven remainders do not always land on server 0.
            first = int(np.argmin(self.load))
            parts = [Part((first + i) % self.num_servers, i, int(edges[i]), int(edges[i + 1]))
                     for i in range(pieces)]
        else:
            server = int(np.argmin(self.load))  # lowest load, lowest rank on ties
            parts = [Part(server, 0, 0, size)]
        for p in parts:
            self.load[p.server] += (p.stop - p.start) * itemsize
        self._parts[key] = parts
        return parts

    def _pieces(self, size, itemsize):
        """How many parts a key of ``size`` elements gets: one per server from the bound on
        (as MXNet), and for more than ``partition_bytes``, parts of at most that many bytes
        in whole rounds of the servers (as BytePS: a server sums, updates and answers a part
        while the next one arrives; messages of hundreds of MB ran at half the speed)."""
        if self.keep_whole:
            return 1
        pieces = self.num_servers if size >= self.bound and self.num_servers > 1 else 1
        if self.partition_bytes and size * itemsize > self.partition_bytes:
            rounds = math.ceil(math.ceil(size * itemsize / self.partition_bytes) / self.num_servers)
            pieces = max(pieces, rounds * self.num_servers)
        return min(pieces, size)

    def parts(self, key):
        return self._parts[key]

    def split_keys(self):
        return [key for key, parts in self._parts.items() if len(parts) > 1]
