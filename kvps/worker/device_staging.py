"""The ipc route on a worker: its device segment (kvps.wire.device_segments), the servers that
mapped it, blocks of it for the GPU values of pushes and pulls, and the setup that shares it.

The route applies once every server of the job has mapped the segment (each on this host, with
GPU shards on a device that reaches the worker's): a push of GPU values is then copied on the
device into blocks of it (or gathered in blocks held for the job: the Trainer's fused keys) and
a pull lands from them, and only headers travel. Until then, and for good where a server
refuses (another host, host shards, no peer access), GPU values take shared memory or the
socket as before; the segment is made only once every server has said it would map it. The
I/O thread changes who has mapped it; API threads only read that (a frozenset replaced whole)
and take blocks.

Each server that maps the segment sends its interprocess event in its answer, and records it
behind its work on the blocks a request names before it answers; the I/O thread waits for that
record (``answer_of``) before it reads a pull's values from the blocks or lets them go to be
reused, so the servers never wait for the GPU before they answer.
"""

import functools
import logging
import threading

from ..errors import KVPSError, ProtocolError
from ..wire import protocol as P
from ..wire.device_segments import DEVICE_BASE, DeviceSegment
from ..wire.device_sharing import sharing_for
from .messages import server_name
from .pending import Attaching, Request

log = logging.getLogger('kvps.worker')

_SETTING_UP = threading.Lock()   # API threads pushing at once set the route up once
ROUTE = ('CUDA IPC: a device buffer the servers on this host map (copies on the GPU only, '
         'none through host memory)')


class DeviceStaging:
    """A worker's device segment and which of the job's ``servers`` (node names) mapped it."""

    def __init__(self, segment, servers):
        self.segment, self.servers = segment, frozenset(servers)
        self.attached = frozenset()
        self.refused = {}             # node name -> why it did not map the segment
        self.used = False             # whether a block was ever taken (requests may name it)
        self.answers = {}             # node name -> its event (opened), which answers follow

    @classmethod
    def create(cls, sharing, nbytes, servers):
        """A DeviceStaging whose segment of ``nbytes`` is made with ``sharing``, or None where
        it cannot be (logged)."""
        try:
            return cls(DeviceSegment(sharing, nbytes), servers)
        except KVPSError as exc:
            log.info('no CUDA IPC for GPU values (%s); they take shared memory', exc)
            return None

    @property
    def ready(self):
        """Whether every server has mapped the segment: the route applies."""
        return self.attached == self.servers

    def attach_header(self):
        """The ATTACH_DEVICE message that asks a server to map the segment."""
        return {'op': P.ATTACH_DEVICE, **self.segment.describe()}

    def attach_request(self, node, what='attach the device buffer'):
        """The Request of an ATTACH_DEVICE to ``node``: its answer carries the server's event
        (opened here) and tells ``answered``."""
        return Request(Attaching(f'{what} to {node}', self.answered, node), node,
                       lambda header, _: self._open_answers(node, header))

    def _open_answers(self, node, header):
        event = self.segment.sharing.open_event(header.get('event'))   # (ProtocolError)
        self._close_answers(node)
        self.answers[node] = event

    def _close_answers(self, node):
        event = self.answers.pop(node, None)
        if event is not None:
            event.close()

    def answered(self, node, error=None):
        """``node`` mapped the segment, or could not (``error``: logged once, at INFO)."""
        if error is None:
            self.attached = self.attached | {node}
            self.refused.pop(node, None)
        else:
            self.refused[node] = error
            log.info('%s does not map this worker\'s device buffer (%s); GPU values take '
                     'shared memory', node, error)

    def detach(self, node):
        """``node`` is lost: its replacement maps the segment anew (a new ATTACH_DEVICE)."""
        self.attached = self.attached - {node}
        self._close_answers(node)   # (its events go with it: never used after)

    def answer_of(self, node, header):
        """What the I/O thread calls with the request of ``header`` to ``node`` when its
        answer comes (Request.after), where the request names blocks of the segment; else
        None."""
        if header['op'] not in (P.PUSH, P.PULL) or not any(
                item.at is not None and item.at >= DEVICE_BASE for item in header['keys']):
            return None
        return functools.partial(self._answered_by, node)

    def _answered_by(self, node, request):
        """Wait (on the host) for ``node``'s work on the blocks ``request`` names, recorded
        behind its event before it answered; ProtocolError where the stand-in finds a block
        that work was not recorded for."""
        event = self.answers.get(node)
        if event is None:
            raise ProtocolError(f'{node} answered a request naming this worker\'s device '
                                'buffer, which it has not mapped')
        event.synchronize()
        for kept in request.keep:
            block = kept[1] if type(kept) is tuple else kept
            if block is not None and not self.segment.answered(block, event):
                raise ProtocolError(f'{node} answered before its work on this worker\'s '
                                    'device buffer was recorded behind its event')

    def why_not(self):
        """Why the route does not apply, in words."""
        if self.refused:
            return '; '.join(f'{node}: {why}' for node, why in sorted(self.refused.items()))
        return 'not every server has mapped this worker\'s device buffer yet'

    def record(self, stream=None):
        """The copies into blocks taken so far were issued on CUDA ``stream``: record the
        segment's event behind them (DeviceSegment.record), for the servers to wait on."""
        self.segment.record(stream)

    def take(self, nbytes):
        """``(wire offset, device block)`` of ``nbytes``, or None (no room, or the route does
        not apply)."""
        if self.attached != self.servers:
            return None
        self.used = True
        return self.segment.take(nbytes)

    def hold(self, nbytes):
        """A block of ``nbytes`` kept for the job (DeviceSegment.hold), or None (no room, or
        the route does not apply)."""
        if self.attached != self.servers:
            return None
        self.used = True
        taken = self.segment.hold(nbytes)
        return None if taken is None else taken[1]

    def readable_by(self, node):
        """Whether ``node`` can read every request of this worker's as it is: it has mapped
        the segment, or no request ever named it."""
        return not self.used or node in self.attached

    def offset_in(self, node, array):
        """Where device ``array`` (part of a block) lies, or None. Also for a ``node`` that
        has not mapped the segment (a restarted server, before it has): a request is made
        readable for it as it is sent (kvps.worker.staging.Staging.readable)."""
        return self.segment.offset_of(array)

    def host_copy(self, at, nbytes):
        """A host copy of the ``nbytes`` at wire offset ``at`` (for a server that has not
        mapped the segment: a request sent again to a restarted server)."""
        return self.segment.host_copy(at, nbytes)

    def close(self):
        for node in list(self.answers):
            self._close_answers(node)
        self.segment.close()


def device_route(io, config, device=None):
    """kvps.kvstore.backend.Backend.device_route of a worker (``io``: its WorkerIO): the ipc
    route where it applies, else its shared memory's route. The first call sets the ipc route
    up (unless KVPS_IPC=off, see ``share``), its answers waited for (within KVPS_TIMEOUT), so
    that the route it names is the one GPU values take from then on."""
    staging = io.staging
    if staging is None:
        return False, ('pinned host buffers <-> the socket (no shared memory with a server: '
                       'none on this host, KVPS_SHM=0 or no room in /dev/shm)')
    direct, how = staging.device_route()
    if config.ipc != 'off' and staging.device is None:
        with _SETTING_UP:
            if not staging.device_tried:
                staging.device_tried = True
                share(io, config, device)
    shared = staging.device
    if shared is not None and shared.ready:
        return True, f'{ROUTE}; {how}'
    return direct, how


def share(io, config, device=None):
    """Ask every server whether it would map a device segment of this worker's; only if all
    would, make it (on CUDA ``device``: KVPS_IPC_BYTES of GPU memory) and ask them to map it;
    keep it if some did (the route applies once all have: a restarted server maps it again),
    else free it."""
    servers = [server_name(rank) for rank in range(io.welcome['num_servers'])]
    io.staging.wait_answered(config.timeout)   # (a first push may come before they answered)
    local = io.staging.attached
    if not all(node in local for node in servers):
        log.info('no CUDA IPC for GPU values: some servers are on other hosts; they take '
                 'shared memory and the socket')
        return
    try:
        sharing = sharing_for('cuda' if config.ipc == 'auto' else config.ipc, device)
    except KVPSError as exc:
        log.info('no CUDA IPC for GPU values (%s); they take shared memory', exc)
        return
    refused = {}   # node -> why it would not map it

    def told(node, error=None):
        if error is not None:
            refused[node] = error
    ask_all(io, config, [(node, {'op': P.ASK_DEVICE, 'kind': sharing.name},
                          Request(Attaching(f'ask_device to {node}', told, node), node))
                         for node in servers])
    if refused:   # (host shards, another kind of memory): no GPU memory is taken for it
        log.info('no CUDA IPC for GPU values (%s); they take shared memory',
                 '; '.join(f'{node}: {why}' for node, why in sorted(refused.items())))
        return
    shared = DeviceStaging.create(sharing, config.ipc_bytes, servers)
    if shared is None:
        return
    io.staging.device = shared
    ask_all(io, config, [(node, shared.attach_header(),
                          shared.attach_request(node, 'attach_device')) for node in servers])
    if not shared.attached:
        io.staging.device = None
        shared.close()


def ask_all(io, config, messages):
    """Send each ``(node, header, request)`` of ``messages`` and wait for their answers
    (within KVPS_TIMEOUT; each request's Attaching tells whom it concerns)."""
    ops = []
    for node, header, request in messages:
        io.submit(node, header, (), request)
        ops.append(request.op)
    for op in ops:
        try:
            op.wait(config.timeout)
        except KVPSError:   # (told to ``answered``: the route then does not apply)
            pass
