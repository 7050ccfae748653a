"""Which of a server's spans close the rounds that workers' push messages opened: the flow keys the timeline links them by.

A worker keys each push message's round by its first key part (kvps.worker.tracing):
``['r', worker rank, key, part, seq]``. The server notes that key when the message arrives,
with the version its key part must pass: in dist_sync the round ``seq`` (a key part's n-th
round holds each worker's n-th push), in dist_async the version it has then (each push is
applied alone). The first span to end after that version is passed carries the arrow: the
optimizer update that closed the round, or, where a round only replaces the value (no
optimizer: no span of its own, which would cost more than the round), the span of the
message whose push completed it. Only used while the timeline records; nothing here runs
per key.
"""

from ..timeline import recording
from ..wire.identities import worker_rank


class FlowNotes:
    """Flow keys of push messages whose rounds have not closed yet (``entries``: the
    shard's, where their versions are read)."""

    def __init__(self, entries):
        self._entries = entries
        self._waiting = []   # (Entry, the version it must pass, flow key)

    def pushed(self, worker, item, sync):
        """Worker identity ``worker``'s push message starts with PushItem ``item``."""
        entry = self._entries.get((item.key, item.part))
        if entry is None:   # (the push fails: it has no round)
            return
        rank = worker_rank(worker)
        self._waiting.append((entry, item.seq if sync else entry.version,
                              ['r', rank, item.key, item.part, item.seq]))

    def closed(self, updating=()):
        """The flow keys of the rounds closed since the last call, or None; entries in
        ``updating`` count as one version further (updated, not counted yet)."""
        if not self._waiting:
            return None
        ahead = {id(entry) for entry in updating}
        flows, left = [], []
        for note in self._waiting:
            if note[0].version + (id(note[0]) in ahead) > note[1]:
                flows.append(note[2])
            else:
                left.append(note)
        self._waiting = left
        return flows or None

    def span(self, start, keys, updating=()):
        """The span of an optimizer update of ``keys`` key parts that began at ``start``,
        with the arrows of the rounds it closed (``updating``: as ``closed`` takes it)."""
        recorder = recording.RECORDER
        if recorder is not None:
            recorder.span('update', 'update', start, {'keys': keys}, self.closed(updating))
