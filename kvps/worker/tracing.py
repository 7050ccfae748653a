"""A worker's messages in the timeline: each push or pull sent and each answer landed, with bytes by route and the flow keys that follow a round.

A round's arrow is keyed ``['r', worker rank, key, part, seq]`` by the first key part of
each push message: the worker's push span carries it, the server's update that closes that
round carries it (kvps.server.flows), and the span landing this worker's next pull of that
key part carries it last. Only the I/O thread uses this, and only while the timeline
records (``WorkerIO.trace`` is None otherwise).
"""

from ..timeline import recording
from ..wire import protocol as P
from .messages import part_nbytes


class MessageTrace:
    """The I/O thread's record of messages, and the rounds whose arrows await their pull."""

    def __init__(self, rank):
        self.rank = rank
        self._heads = {}    # (server, key, part) -> seq of the push a pull's arrow ends

    def sent(self, start, node, header, buffers):
        """The span of a PUSH or PULL sent to ``node``: encoding and handing it to ZeroMQ."""
        items = header['keys']
        args = {'server': node, 'keys': len(items),
                'socket': sum(memoryview(b).nbytes for b in buffers)}
        flows = None
        if header['op'] == P.PUSH:
            args['shm'] = sum(P.nbytes(item.dtype, item.n) for item in items
                              if item.at is not None)
            first = items[0]
            self._heads[node, first.key, first.part] = first.seq
            flows = [['r', self.rank, first.key, first.part, first.seq]]
        recorder = recording.RECORDER
        if recorder is not None:
            recorder.span(f'send {header["op"]}', header['op'], start, args, flows)

    def landed(self, start, node, batch, answers):
        """The span of a DATA answer written into the caller's arrays (``batch``: the parts
        asked, ``answers``: the DataItems), with the arrows of the rounds it brings back."""
        socket = shm = 0
        flows = []
        for asked, answer in zip(batch, answers):
            nbytes = part_nbytes(asked)
            if answer.at is None and answer.lent is None:
                socket += nbytes
            else:
                shm += nbytes
            seq = self._heads.pop((node, asked[0], asked[1].part), None)
            if seq is not None:
                flows.append(['r', self.rank, asked[0], asked[1].part, seq])
        recorder = recording.RECORDER
        if recorder is not None:
            recorder.span('land', 'pull', start, {'server': node, 'keys': len(batch),
                                                  'socket': socket, 'shm': shm}, flows or None)
