"""The ipc route's messages without sockets, on the host stand-in of CUDA IPC: a worker's device
segment mapped by the servers of its host that keep GPU shards (ATTACH_DEVICE), pushes read
and pulls written in it by copies on the device, every offset checked, handles opened only
from workers on the server's host, the segment unmapped when its worker leaves or the server
ends, and requests to a server that has not mapped it sent as frames."""

import logging
from types import SimpleNamespace

import numpy as np
import pytest
from test_device_arrays import HostTransfers

from kvps.errors import ConfigError, KVPSError, ProtocolError
from kvps.optimizer.kernels import numpy_kernels
from kvps.server import members
from kvps.server.device_arrays import DeviceArrays
from kvps.server.lending import Lending
from kvps.server.records import ReplyKind
from kvps.server.regions import Regions
from kvps.server.requests import Requests
from kvps.server.shard import Shard
from kvps.server.storage import HostArrays, Storage
from kvps.wire import protocol as P
from kvps.wire.device_segments import DEVICE_BASE, DeviceSegment
from kvps.wire.device_sharing import HostSharing
from kvps.wire.identities import worker_identity
from kvps.wire.items import PullItem, PushItem
from kvps.wire.shm import Segment
from kvps.worker import device_staging
from kvps.worker.device_staging import DeviceStaging
from kvps.worker.staging import Staging

W0, W1 = worker_identity(0), worker_identity(1)
N = 1024   # float32 elements: 4 KB, over MIN_BYTES
NODES = ['server 0', 'server 1']


class Server:
    """One server's shard, lending and request handling, with GPU shards on the host (copies
    written into ``log``); its workers 0 and 1 live on hosts ``hosts``."""

    def __init__(self, tmp_path, gpu=True, hosts=('a', 'a'), elastic=False):
        self.log = []
        self.sharing = HostSharing(str(tmp_path))
        device = DeviceArrays(np, numpy_kernels, HostTransfers(self.log), self.sharing) \
            if gpu else None
        self.storage = Storage(HostArrays(), device)
        self.lending = Lending(Regions(directory=tmp_path), self.storage,
                               ('a', dict(enumerate(hosts))))
        self.shard = Shard(len(hosts), storage=self.storage, elastic=elastic)
        self.requests = Requests(self.shard, self.lending, 'server 0')

    def handle(self, worker, header, frames=()):
        return self.requests.handle(worker, header, list(frames))

    def attach(self, worker, segment):
        (reply,) = self.handle(worker, {'op': P.ATTACH_DEVICE, **segment.describe()})
        return reply

    def init(self, key, value, sync=False):
        self.shard.init('i', key, 0, 'float32', [value.size], sync,
                        memoryview(value).cast('B'), device=True)

    def mapping(self, worker):
        return self.lending.regions._devices[worker]


def device_segment(tmp_path, nbytes=1 << 20):
    return DeviceSegment(HostSharing(str(tmp_path)), nbytes)


def staged(segment, value, record=True):
    """A block of ``segment`` holding ``value`` (float32): ``(wire offset, block)``; the
    worker's event recorded behind the write, as a push does before its header goes."""
    at, block = segment.take(value.nbytes)
    block.view(np.float32)[...] = value
    if record:
        segment.record()
    return at, block


def test_a_push_in_the_device_segment_is_copied_on_the_device_behind_the_worker_s_event(
        tmp_path):
    server, segment = Server(tmp_path), device_segment(tmp_path)
    assert server.attach(W0, segment).kind == ReplyKind.ACK
    server.init('a', np.zeros(N, np.float32))
    server.init('b', np.zeros(N, np.float32))
    server.log.clear()
    (at_a, block_a), (at_b, block_b) = (staged(segment, np.full(N, v, np.float32))
                                        for v in (2.0, 3.0))
    items = [PushItem('a', 0, 'float32', N, at_a, 0), PushItem('b', 0, 'float32', N, at_b, 0)]
    replies = server.handle(W0, {'op': P.PUSH, 'sync': False, 'keys': items})
    assert [r.kind for r in replies] == [ReplyKind.ACK] * 2
    assert server.shard.entries[('a', 0)].weight.tolist() == [2.0] * N
    assert server.shard.entries[('b', 0)].weight.tolist() == [3.0] * N
    assert server.log == [('hold',), ('hold',)]         # copies on the device, no host copy
    assert server.mapping(W0).event.waits == 1           # once per message, before its reads


def push(server, worker, segment, value, sync=True):
    """``worker`` pushes ``value`` of key 'a' through a block of its ``segment``; the block
    and the replies."""
    at, block = staged(segment, value)
    item = PushItem('a', 0, 'float32', N, at, None)
    return block, server.handle(worker, {'op': P.PUSH, 'sync': sync, 'keys': [item]})


def test_a_sync_round_sums_the_workers_mapped_blocks_in_place(tmp_path):
    server = Server(tmp_path)
    segments = [device_segment(tmp_path) for _ in range(2)]
    for worker, segment in zip((W0, W1), segments):
        server.attach(worker, segment)
    server.init('a', np.zeros(N, np.float32), sync=True)
    server.shard.set_optimizer({'name': 'sgd', 'params': {'learning_rate': 0.5}})
    server.log.clear()
    entry = server.shard.entries[('a', 0)]
    first, replies = push(server, W0, segments[0], np.full(N, 1.25, np.float32))
    # kept by reference, read-only: the round's sum so far is the worker's block itself
    assert replies == [] and np.shares_memory(entry.summed, server.mapping(W0).buffer.array)
    assert not entry.summed.flags.writeable
    second, replies = push(server, W1, segments[1], np.full(N, 2.5, np.float32))
    assert [r.kind for r in replies] == [ReplyKind.ACK] * 2   # both answered at the round's end
    assert entry.weight.tolist() == [-0.5 * 3.75] * N
    assert first.view(np.float32).tolist() == [1.25] * N      # the workers' blocks unchanged
    assert second.view(np.float32).tolist() == [2.5] * N
    assert entry.merge is None   # the update read both blocks and added them: no sum made
    # nothing copied to the device, every read (the blocks received, the round's two blocks
    # read by the update) ordered before the answers
    assert server.log == [('hold',)] * 4


def test_a_worker_lost_mid_round_leaves_the_others_kept_blocks_to_sum(tmp_path):
    server = Server(tmp_path, hosts=('a', 'a', 'a'), elastic=True)
    W2 = worker_identity(2)
    segments = [device_segment(tmp_path) for _ in range(3)]
    for worker, segment in zip((W0, W1, W2), segments):
        server.attach(worker, segment)
    server.init('a', np.zeros(N, np.float32), sync=True)
    push(server, W0, segments[0], np.full(N, 1.0, np.float32))
    push(server, W1, segments[1], np.full(N, 4.0, np.float32))
    server.lending.forget(W1)   # (as the loop does first: its segment is unmapped)
    assert members.change(server.shard, [W1], []) == ([], {W1: 1})
    _, replies = push(server, W2, segments[2], np.full(N, 0.5, np.float32))
    assert {r.kind for r in replies} == {ReplyKind.ACK}
    assert server.shard.entries[('a', 0)].weight.tolist() == [1.5] * N   # W0's and W2's


def test_a_push_whose_blocks_no_record_followed_fails_its_key_alone(tmp_path):
    # (on a GPU the server would read the blocks before the worker's copies land)
    server, segment = Server(tmp_path), device_segment(tmp_path)
    server.attach(W0, segment)
    server.init('a', np.zeros(N, np.float32))
    server.init('b', np.zeros(N, np.float32))
    at_a, _ = staged(segment, np.full(N, 2.0, np.float32))
    at_b, _ = staged(segment, np.full(N, 3.0, np.float32), record=False)
    items = [PushItem('a', 0, 'float32', N, at_a, 0), PushItem('b', 0, 'float32', N, at_b, 0)]
    replies = server.handle(W0, {'op': P.PUSH, 'sync': False, 'keys': items})
    assert replies[0].kind == ReplyKind.ACK and type(replies[1].payload) is ProtocolError
    assert 'not recorded by the worker\'s event after it was written' in str(replies[1].payload)
    assert server.shard.entries[('b', 0)].weight.tolist() == [0.0] * N


def test_a_pull_into_the_device_segment_is_copied_on_the_device_and_ordered(tmp_path):
    server, segment = Server(tmp_path), device_segment(tmp_path)
    ack = server.attach(W0, segment)
    events = DeviceStaging(segment, NODES)
    events._open_answers('server 0', ack.payload)   # the server's event, as the worker opens it
    server.init('a', np.arange(N, dtype=np.float32))
    server.storage.order()   # (the init's upload waited for, as the loop does before its ACK)
    server.log.clear()
    at, block = segment.take(N * 4)
    (reply,) = server.handle(W0, {'op': P.PULL, 'keys': [PullItem('a', 0, at)]})
    delivery = server.lending.deliver(reply.payload)
    assert delivery.items[0].at == at and delivery.frames == []
    # ordered behind the server's event before the answer goes, not waited for
    assert server.log == [('hold',), ('record',)]
    assert not segment.answered(block, events.answers['server 0'])   # the worker has not waited
    events.answers['server 0'].synchronize()
    assert segment.answered(block, events.answers['server 0'])
    assert block.view(np.float32).tolist() == list(range(N))


def test_device_handles_are_opened_only_from_workers_on_the_server_s_host(tmp_path):
    server, segment = Server(tmp_path, hosts=('a', 'b')), device_segment(tmp_path)
    reply = server.attach(W1, segment)
    assert reply.kind == ReplyKind.ERROR and type(reply.payload) is ConfigError
    assert str(reply.payload) == ('worker-1 is on b, not on this server\'s host a: device '
                                  'handles are opened only from workers on it')
    assert server.sharing.open_buffers == 0


def test_a_server_without_gpu_shards_does_not_map_a_device_segment(tmp_path):
    server, segment = Server(tmp_path, gpu=False), device_segment(tmp_path)
    reply = server.attach(W0, segment)
    assert reply.kind == ReplyKind.ERROR
    assert 'keeps no GPU shards' in str(reply.payload)


@pytest.mark.parametrize('gpu, hosts, kind, why', [
    (True, ('a', 'a'), 'host', None),
    (True, ('a', 'b'), 'host', 'worker-1 is on b, not on this server\'s host a'),
    (False, ('a', 'a'), 'host', 'keeps no GPU shards that could map a device segment'),
    (True, ('a', 'a'), 'cuda', 'GPU shards share \'host\' memory, not \'cuda\''),
])
def test_a_server_says_whether_it_would_map_a_device_segment_before_one_is_made(
        tmp_path, gpu, hosts, kind, why):
    server = Server(tmp_path, gpu=gpu, hosts=hosts)
    (reply,) = server.handle(W1, {'op': P.ASK_DEVICE, 'kind': kind})
    if why is None:
        assert reply.kind == ReplyKind.ACK
    else:
        assert reply.kind == ReplyKind.ERROR and type(reply.payload) is ConfigError
        assert why in str(reply.payload)
    assert server.sharing.open_buffers == 0   # nothing mapped, nothing made


def test_device_offsets_outside_the_segment_fail_their_key_alone(tmp_path):
    server, segment = Server(tmp_path), device_segment(tmp_path, 1 << 16)
    server.init('a', np.zeros(N, np.float32))
    server.init('b', np.zeros(N, np.float32))
    at, _ = staged(segment, np.ones(N, np.float32))
    items = [PushItem('a', 0, 'float32', N, at, 0),
             PushItem('b', 0, 'float32', N, DEVICE_BASE + (1 << 16) - 64, 0)]
    replies = server.handle(W0, {'op': P.PUSH, 'sync': False, 'keys': items})
    assert [type(r.payload) for r in replies] == [ProtocolError] * 2   # not mapped yet
    assert 'has not attached' in str(replies[0].payload)
    server.attach(W0, segment)
    replies = server.handle(W0, {'op': P.PUSH, 'sync': False, 'keys': items})
    assert replies[0].kind == ReplyKind.ACK
    assert 'outside the worker\'s device segment' in str(replies[1].payload)
    assert server.shard.entries[('a', 0)].weight.tolist() == [1.0] * N   # once: the first
    assert server.shard.entries[('b', 0)].weight.tolist() == [0.0] * N   # was refused


def test_the_device_segment_is_unmapped_when_its_worker_leaves_and_when_the_server_ends(
        tmp_path):
    server = Server(tmp_path)
    first, second = device_segment(tmp_path), device_segment(tmp_path)
    server.attach(W0, first)
    server.attach(W0, second)   # attached anew: the first is unmapped
    server.attach(W1, first)
    assert server.sharing.open_buffers == 2
    server.lending.forget(W0)
    assert server.sharing.open_buffers == 1 and W0 not in server.lending.regions._devices
    server.lending.close()
    assert server.sharing.open_buffers == 0


# -- the worker's side ---------------------------------------------------------------------
@pytest.fixture
def staging(tmp_path):
    staging = Staging(Segment.create(1 << 22, directory=tmp_path, grows=True))
    for node in NODES:
        staging.attach_header(node)
        staging.answered(node)
    staging.device = DeviceStaging(device_segment(tmp_path), NODES)
    yield staging
    staging.close()


def test_device_blocks_are_handed_out_once_every_server_mapped_the_segment(staging):
    assert staging.stage([4096], device=True) == [None]   # the route does not apply yet
    staging.device.answered('server 0')
    staging.device.answered('server 1', ConfigError('no GPU shards'))
    assert staging.stage([4096], device=True) == [None] and not staging.device.ready
    assert 'server 1: no GPU shards' in staging.device.why_not()
    staging.device.answered('server 1')
    (block,) = staging.stage([4096], device=True)
    assert staging.offset_in('server 1', block[1024:]) == DEVICE_BASE + 1024
    (host,) = staging.stage([4096])
    assert staging.offset_in('server 1', host) < DEVICE_BASE   # host blocks: as before
    assert staging.stage([100], device=True) == [None]         # small: the socket


def test_pulls_landing_on_gpus_take_device_blocks(staging):
    for node in NODES:
        staging.device.answered(node)
    parts = [(4096, ('a', 0)), (4096, ('b', 0))]
    device, host = staging.blocks_for('server 0', parts, [True, False])
    assert device[0] >= DEVICE_BASE and host[0] < DEVICE_BASE
    assert all(at < DEVICE_BASE for at, _ in staging.blocks_for('server 0', parts))


def test_requests_to_a_server_that_lost_the_device_segment_carry_frames(staging):
    for node in NODES:
        staging.device.answered(node)
    at, block = staging.device.take(4096)
    block.view(np.float32)[...] = 5.0
    push = {'op': P.PUSH, 'keys': [PushItem('a', 0, 'float32', 1024, at, 0)]}
    pull = {'op': P.PULL, 'keys': [PullItem('a', 0, at)]}
    assert staging.readable('server 1', push, []) == (push, [])   # mapped: as it is
    staging.detach('server 1')   # lost; its replacement has not mapped it
    header, frames = staging.readable('server 1', push, [])
    assert header['keys'][0].at is None and np.frombuffer(frames[0], np.float32).tolist() == \
        [5.0] * 1024
    assert staging.readable('server 1', pull, [])[0]['keys'][0].at is None
    assert not staging.device.ready and staging.stage([4096], device=True) == [None]


class FakeIO:
    """A WorkerIO whose servers answer ATTACH_DEVICE at once: ``refuse`` names those that
    refuse."""

    def __init__(self, staging, refuse=()):
        self.staging, self.refuse, self.sent, self.events = staging, refuse, [], {}
        self.welcome = {'num_servers': 2}

    def submit(self, node, header, buffers, request):
        self.sent.append((node, header['op']))
        if node in self.refuse:
            request.op.fail(KVPSError('no GPU shards here'))
            return
        if header['op'] == P.ATTACH_DEVICE:   # its answer carries the server's event
            event = self.events[node] = HostSharing().event()
            request.on_data({'op': P.ACK, 'event': event.handle}, [])
        request.op.part_done()


@pytest.mark.parametrize('refuse', [(), ('server 1',), tuple(NODES)])
def test_the_first_gpu_values_set_the_route_up_once(tmp_path, refuse, monkeypatch, caplog):
    staging = Staging(Segment.create(1 << 22, directory=tmp_path, grows=True))
    for node in NODES:
        staging.attach_header(node)
        staging.answered(node)
    io = FakeIO(staging, refuse)
    exports, export = [], HostSharing.export
    monkeypatch.setattr(HostSharing, 'export', lambda self, n: exports.append(n) or
                        export(self, n))
    config = SimpleNamespace(ipc='host', ipc_bytes=1 << 16, timeout=5.0)
    with caplog.at_level(logging.INFO, logger='kvps.worker'):
        _, how = device_staging.device_route(io, config)
    asked = [('server 0', P.ASK_DEVICE), ('server 1', P.ASK_DEVICE)]
    attached = [('server 0', P.ATTACH_DEVICE), ('server 1', P.ATTACH_DEVICE)]
    # asked first: the segment (its device memory) is made only when every server would map it
    assert io.sent == asked + (attached if not refuse else [])
    assert exports == ([1 << 16] if not refuse else [])
    assert how.startswith('CUDA IPC') == (not refuse)
    assert (staging.device is not None) == (not refuse)
    if not refuse:   # each server's event opened, to wait for before its answers are read
        assert sorted(staging.device.answers) == NODES
    if refuse:
        assert f'no CUDA IPC for GPU values ({refuse[0]}: no GPU shards here' in caplog.text
    device_staging.device_route(io, config)
    assert len(io.sent) == len(asked + (attached if not refuse else []))   # asked once
    staging.close()


def test_a_segment_no_server_maps_after_all_is_freed(tmp_path):
    # (every server said it would, and then could not open it: no peer access, say)
    staging = Staging(Segment.create(1 << 22, directory=tmp_path, grows=True))
    for node in NODES:
        staging.attach_header(node)
        staging.answered(node)
    io = FakeIO(staging)
    submit = io.submit

    def failing_attach(node, header, buffers, request):
        if header['op'] == P.ATTACH_DEVICE:
            io.refuse = NODES
        submit(node, header, buffers, request)
    io.submit = failing_attach
    _, how = device_staging.device_route(io, SimpleNamespace(ipc='host', ipc_bytes=1 << 16,
                                                             timeout=5.0))
    assert not how.startswith('CUDA IPC') and staging.device is None
    staging.close()


def test_ask_device_is_checked_on_the_wire():
    header = {'op': P.ASK_DEVICE, 'id': 1, 'kind': 'cuda'}
    assert P.decode(P.encode(header))[0] == header
    with pytest.raises(ProtocolError, match="field 'kind' missing"):
        P.decode(P.encode({'op': P.ASK_DEVICE, 'id': 1}))


def test_attach_device_is_checked_on_the_wire():
    header = {'op': P.ATTACH_DEVICE, 'id': 1, 'kind': 'host', 'handle': b'h' * 64, 'size': 10,
              'event': b'e' * 64}
    assert P.decode(P.encode(header))[0] == header
    for field in ('kind', 'handle', 'size', 'event'):
        with pytest.raises(ProtocolError, match=f'field {field!r} missing'):
            P.decode(P.encode({k: v for k, v in header.items() if k != field}))


class SpanRecorder:
    """A recording.Recorder's span() only: the spans made, by name, with their args."""

    def __init__(self):
        self.spans = []

    def span(self, name, cat, start, args=None, flows=None):
        self.spans.append((name, args))


def test_the_timeline_counts_the_device_segment_s_bytes_as_the_ipc_route(monkeypatch):
    from kvps.timeline import recording
    from kvps.worker.tracing import MessageTrace
    recorder = SpanRecorder()
    monkeypatch.setattr(recording, 'RECORDER', recorder)
    trace = MessageTrace(0)
    items = [PushItem('a', 0, 'float32', 1024, DEVICE_BASE, 0),
             PushItem('b', 0, 'float32', 1024, 4096, 0), PushItem('c', 0, 'float32', 2, None, 0)]
    keep = [np.zeros(1024, np.float32), np.zeros(1024, np.float32)]
    trace.sent(0, 'server 0', {'op': P.PUSH, 'keys': items}, [np.zeros(2, np.float32)], keep,
               device=True)   # (a worker with a device segment)
    trace.landed(0, 'server 0', [('a', SimpleNamespace(part=0), None, 'float32')], 0, 0, 4096)
    (_, pushed), (_, landed) = recorder.spans
    assert (pushed['ipc'], pushed['shm'], pushed['socket']) == (4096, 4096, 8)
    assert (landed['ipc'], landed['shm'], landed['socket']) == (4096, 0, 0)


def test_requests_go_as_they_are_while_no_block_of_the_device_segment_was_taken(staging):
    staging.device.answered('server 0')   # server 1 refused: the route never applied
    (block,) = staging.stage([4096])
    push = {'op': P.PUSH, 'keys': [PushItem('a', 0, 'float32', 1024,
                                            staging.offset_in('server 1', block), 0)]}
    assert staging.readable('server 1', push, []) == (push, [])   # no copy made
