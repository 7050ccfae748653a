"""Which of a server's updates close the rounds that workers' push messages opened: the flow keys the timeline links them by.

A worker keys each push message's round by its first key part (kvps.worker.tracing):
``['r', worker rank, key, part, seq]``. The server notes that key when the message arrives,
and hands it to the span of the update that applies it: in dist_sync the update of round
``seq`` of that key part (a key part's n-th round holds each worker's n-th push), in
dist_async the next update of it (each push is applied alone, at once or with its message's
other keys). Only used while the timeline records.
"""

from ..timeline import recording


class FlowNotes:
    """Flow keys of push messages waiting for the update of their round, per key part."""

    def __init__(self):
        self._waiting = {}   # (key, part) -> [(round or None, flow key)]

    def pushed(self, worker, item, sync):
        """Worker identity ``worker``'s push message starts with PushItem ``item``."""
        rank = int(worker.rsplit(b'-', 1)[1])   # (protocol.worker_identity: b'worker-N')
        flow = ['r', rank, item.key, item.part, item.seq]
        self._waiting.setdefault((item.key, item.part), []).append(
            (item.seq if sync else None, flow))

    def applied(self, entries, counted=True):
        """The flow keys of the rounds just applied to ``entries`` (``counted``: their
        versions count them already), or None."""
        if not self._waiting:
            return None
        flows = []
        for entry in entries:
            waiting = self._waiting.get((entry.key, entry.part))
            if not waiting:
                continue
            done = entry.version - counted
            flows += [flow for round_, flow in waiting if round_ is None or round_ <= done]
            left = [w for w in waiting if w[0] is not None and w[0] > done]
            if left:
                self._waiting[entry.key, entry.part] = left
            else:
                del self._waiting[entry.key, entry.part]
        return flows or None

    def span(self, start, entries, counted=True):
        """The span of an update of ``entries`` that began at ``start``, with the arrows of
        the rounds it closed (see ``applied``)."""
        recorder = recording.RECORDER
        if recorder is not None:
            recorder.span('update', 'update', start, {'keys': len(entries)},
                          self.applied(entries, counted))
