"""A worker's messages in the timeline: each push or pull sent and each answer landed, with bytes by route and the flow keys that follow a round.

A round's arrow is keyed ``['r', worker rank, key, part, seq]`` by the first key part of
each push message: the worker's push span carries it, the server's update that closes that
round carries it (kvps.server.flows), and the span landing this worker's next pull of that
key part carries it last. Only the I/O thread uses this, and only while the timeline
records (``WorkerIO.trace`` is None otherwise).
"""

from ..timeline import recording
from ..wire import protocol as P
from ..wire.device_segments import DEVICE_BASE

SENT = {op: f'send {op}' for op in (P.PUSH, P.PULL)}   # span names, made once


class MessageTrace:
    """The I/O thread's record of messages, and the rounds whose arrows await their pull."""

    def __init__(self, rank):
        self.rank = rank
        self._heads = {}    # (server, key, part) -> seq of the push a pull's arrow ends

    def sent(self, start, node, header, buffers, keep, device=False):
        """The span of a PUSH or PULL sent to ``node``: encoding and handing it to ZeroMQ
        (``keep``: the request's payloads in shared memory, or in the worker's device segment
        where it has one: ``device``)."""
        recorder = recording.RECORDER
        if recorder is None:   # (paused: kvps.timeline.pause)
            return
        items = header['keys']
        args = {'server': node, 'keys': len(items),
                'socket': sum(memoryview(b).nbytes for b in buffers)}
        flows = None
        if header['op'] == P.PUSH:
            if not device:   # (the common case: no item of this worker's can be the ipc's)
                args['shm'] = sum(data.nbytes for data in keep)
            else:
                _split_by_route(args, items, keep)
            first = items[0]
            self._heads[node, first.key, first.part] = first.seq
            flows = [['r', self.rank, first.key, first.part, first.seq]]
        recorder.span(SENT[header['op']], header['op'], start, args, flows)

    def landed(self, start, node, batch, socket, shm, ipc=0):
        """The span of a DATA answer written into the caller's arrays (``batch``: the parts
        asked; ``socket``, ``shm``, ``ipc``: the bytes that came each way, ``ipc`` through
        the device segment), with the arrows of the rounds it brings back."""
        recorder = recording.RECORDER
        if recorder is not None:
            args = {'server': node, 'keys': len(batch), 'socket': socket, 'shm': shm}
            if ipc:
                args['ipc'] = ipc
            recorder.span('land', 'pull', start, args, self._arrows(node, batch))

    def _arrows(self, node, batch):
        """The arrows a pull of ``batch`` from ``node`` ends. A pull's parts for a server are
        cut as the push's were, so its first part is the push message's head: only when it
        is not are the others looked through."""
        heads = self._heads
        key, part = batch[0][0], batch[0][1].part
        seq = heads.pop((node, key, part), None)
        if seq is not None:
            return [['r', self.rank, key, part, seq]]
        if not any(head[0] == node for head in heads):
            return None
        found = []
        for key, part, _, _ in batch:
            seq = heads.pop((node, key, part.part), None)
            if seq is not None:
                found.append(['r', self.rank, key, part.part, seq])
        return found or None


def _split_by_route(args, items, keep):
    """A push's ``keep`` bytes in ``args`` as 'shm' and, those in the device segment, 'ipc'."""
    on_device = [item.at >= DEVICE_BASE for item in items if item.at is not None]
    args['shm'] = sum(data.nbytes for data, ipc in zip(keep, on_device) if not ipc)
    if True in on_device:
        args['ipc'] = sum(data.nbytes for data, ipc in zip(keep, on_device) if ipc)
