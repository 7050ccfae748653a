"""The ipc route's answers, on the host stand-in of CUDA IPC: a server records its own
interprocess event behind its work on a worker's device blocks before it answers (it never
waits for the GPU), its ATTACH_DEVICE answer carries that event, and the worker's I/O thread
waits for the record before it reads a pull's values from the blocks or lets them be reused;
an answer no record preceded, or one the worker did not wait for, is found."""

import numpy as np
import pytest
from test_ipc_flow import NODES, W0, N, Server, device_segment, staged

from kvps.errors import ProtocolError
from kvps.server.records import ReplyKind
from kvps.wire import protocol as P
from kvps.wire.items import PullItem, PushItem
from kvps.worker.device_staging import DeviceStaging
from kvps.worker.pending import Operation, PendingTable, Request


@pytest.fixture
def pair(tmp_path):
    """A server with GPU shards (emulated) and a worker's DeviceStaging it mapped, the ACK's
    event opened as the worker's I/O thread opens it."""
    server, segment = Server(tmp_path), device_segment(tmp_path)
    device = DeviceStaging(segment, NODES[:1])
    request = device.attach_request('server 0')
    ack = server.attach(W0, segment)
    assert ack.kind == ReplyKind.ACK and set(ack.payload) == {'event'}
    request.on_data({'op': P.ACK, **ack.payload}, [])
    request.op.part_done()
    assert device.ready and set(device.answers) == {'server 0'}
    yield server, device
    device.close()


def answered(device, header, keep):
    """Run what the worker's I/O thread runs when the answer to ``header`` comes."""
    request = Request(Operation('test', 1), 'server 0', keep=keep)
    request.message = (header, [])
    device.answer_of('server 0', header)(request)


def test_a_push_s_answer_is_ordered_behind_the_server_s_event_not_waited_for(pair):
    server, device = pair
    server.init('a', np.zeros(N, np.float32))
    server.storage.order()
    at, block = staged(device.segment, np.full(N, 2.0, np.float32))
    header = {'op': P.PUSH, 'sync': False, 'keys': [PushItem('a', 0, 'float32', N, at, 0)]}
    (reply,) = server.handle(W0, header)
    assert reply.kind == ReplyKind.ACK
    with pytest.raises(ProtocolError, match='answered before its work on this worker'):
        answered(device, header, [block])      # the server read it; no record followed yet
    records = device.answers['server 0'].recorded()
    server.storage.order()                     # as the loop does before its replies go
    assert device.answers['server 0'].recorded() == records + 1
    answered(device, header, [block])          # waited for: the block may be reused
    assert device.answers['server 0'].seen == records + 1
    assert server.shard.entries[('a', 0)].weight.tolist() == [2.0] * N


def test_a_server_with_nothing_on_the_device_to_order_records_nothing(pair):
    server, device = pair
    records = device.answers['server 0'].recorded()
    server.storage.order()
    assert device.answers['server 0'].recorded() == records


def test_an_answer_the_worker_did_not_wait_for_is_found(pair):
    server, device = pair
    server.init('a', np.arange(N, dtype=np.float32))
    at, block = device.segment.take(N * 4)
    header = {'op': P.PULL, 'keys': [PullItem('a', 0, at)]}
    (reply,) = server.handle(W0, header)
    server.lending.deliver(reply.payload)      # copied into the block, the event recorded
    assert not device.segment.answered(block, device.answers['server 0'])   # not waited for
    answered(device, header, [(at, block)])
    assert block.view(np.float32).tolist() == list(range(N))


def test_only_requests_naming_device_blocks_wait_for_an_answer_s_record(pair):
    _, device = pair
    at, _ = device.segment.take(64)
    assert device.answer_of('server 0', {'op': P.PULL, 'keys': [PullItem('a', 0, None)]}) \
        is None
    assert device.answer_of('server 0', {'op': P.PULL, 'keys': [PullItem('a', 0, 4096)]}) \
        is None                                # a block of the host segment
    assert device.answer_of('server 0', {'op': P.INIT, 'keys': []}) is None
    assert device.answer_of('server 0', {'op': P.PULL, 'keys': [PullItem('a', 0, at)]}) \
        is not None


def test_a_lost_server_s_event_is_closed_and_never_waited_for(pair):
    _, device = pair
    at, block = device.segment.take(64)
    header = {'op': P.PULL, 'keys': [PullItem('a', 0, at)]}
    after = device.answer_of('server 0', header)
    device.detach('server 0')
    assert device.answers == {}
    request = Request(Operation('test', 1), 'server 0', keep=[(at, block)])
    with pytest.raises(ProtocolError, match='which it has not mapped'):
        after(request)


def test_an_attach_answer_without_a_good_event_fails_the_attach(tmp_path):
    device = DeviceStaging(device_segment(tmp_path), NODES[:1])
    request = device.attach_request('server 0')
    table = PendingTable()
    table.resolve({'op': P.ACK, 'id': table.add(request), 'event': b'x' * 64}, [])
    assert not device.ready and 'not a device event handle' in device.why_not()
    device.close()


def test_the_io_thread_orders_an_answer_before_it_reads_it_and_a_bad_one_fails_the_call():
    table, calls = PendingTable(), []
    good = Request(Operation('pull', 1), 'server 0', lambda h, b: calls.append('data'))
    good.after = lambda request: calls.append('after')
    table.resolve({'op': P.DATA, 'id': table.add(good), 'keys': []}, [])
    assert calls == ['after', 'data'] and good.op.done.is_set() and good.op.error is None

    def unordered(request):
        raise ProtocolError('answered before its work was recorded')
    bad = Request(Operation('pull', 1), 'server 0', lambda h, b: calls.append('read'))
    bad.after = unordered
    table.resolve({'op': P.DATA, 'id': table.add(bad), 'keys': []}, [])
    assert calls == ['after', 'data'] and isinstance(bad.op.error, ProtocolError)



def test_an_answer_about_a_block_the_server_did_no_work_on_needs_no_record(pair):
    # (a push sent again and acknowledged again, counted before: nothing read it this time)
    server, device = pair
    server.init('a', np.zeros(N, np.float32))
    at, block = staged(device.segment, np.full(N, 2.0, np.float32))
    header = {'op': P.PUSH, 'sync': False, 'keys': [PushItem('a', 0, 'float32', N, at, 0)]}
    server.handle(W0, header)
    server.storage.order()
    answered(device, header, [block])
    records = device.answers['server 0'].recorded()
    (reply,) = server.handle(W0, header)   # the same push, seq 0 again
    assert reply.kind == ReplyKind.ACK
    server.storage.order()
    assert device.answers['server 0'].recorded() == records   # no work: nothing recorded
    answered(device, header, [block])
    assert server.shard.entries[('a', 0)].weight.tolist() == [2.0] * N   # applied once
