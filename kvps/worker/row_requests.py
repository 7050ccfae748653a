"""A worker's requests for some rows of a key (kvps.rows): the row calls of DistClient."""

import numpy as np

from ..wire import protocol as P
from .messages import live_collector, row_writer


class RowRequests:
    """DistClient's PULL_ROWS requests, one per part of each key (it gives ``sharding``,
    ``config``, ``_request``, ``_raise_pending_errors`` and ``_hint``)."""

    def pull_rows(self, items, priority=0):
        """Backend.pull_rows_begin's requests, waited for (``marks``: part -> [epoch, count],
        updated from the answers; empty: every row)."""
        self.pull_rows_begin(items, priority)()

    def pull_rows_begin(self, items, priority=0):
        """Send the requests of ``pull_rows(items)`` now; returns the wait for the answers."""
        self._raise_pending_errors()
        ops = []
        for key, table, ids, marks in items:
            width = table.shape[1]
            for part in self.sharding.parts(key):
                header = {'op': P.PULL_ROWS, 'key': key, 'part': part.part}
                if priority:
                    header['priority'] = priority
                first, buffers = part.start // width, ()
                if ids is not None:
                    a, b = np.searchsorted(ids, [first, part.stop // width])
                    local = ids[a:b] - first
                    if not local.size:
                        continue
                    header['ids'], buffers = True, (local,)
                elif marks.get(part.part) is not None:
                    header['since'] = marks[part.part]
                ops.append(self._request(part.server, f'pull of rows of key {key!r}', header,
                                         buffers, row_writer(table[first:part.stop // width],
                                                              marks, part.part)))
        return self._waiter(ops)

    def pull_live_begin(self, items, priority=0):
        """Backend.pull_live_begin: per ``(key, width, storage dtype, sink)``, the rows of
        its value a push of rows made (every row where it is dense) appended to ``sink``
        as ``(ids, rows)`` per part, in part order. Returns the wait for them."""
        self._raise_pending_errors()
        ops = []
        for key, width, dtype, sink in items:
            for part in self.sharding.parts(key):
                header = {'op': P.PULL_ROWS, 'key': key, 'part': part.part, 'live': True}
                if priority:
                    header['priority'] = priority
                sink.append(None)
                ops.append(self._request(part.server, f'pull of rows of key {key!r}', header, (),
                                         live_collector(sink, len(sink) - 1, part, width, dtype)))
        return self._waiter(ops)

    def _waiter(self, ops):
        """The wait for requests ``ops``: each answered, then any error a server reported."""
        def wait():
            for op in ops:
                op.wait(self.config.timeout, self._hint)
            self._raise_pending_errors()
        return wait
