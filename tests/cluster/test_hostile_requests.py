"""Requests that once killed a node, and hostile shared-memory requests, against a live server
or scheduler started by hand: each is refused (per key where it names keys), and the node
serves on."""

import os

import numpy as np
import pytest
import zmq

from hostile_peers import CLUSTER_ENV, SECRET, Output, Signed, answers, lone_server, reply
from kvps.wire import protocol as P
from kvps.wire.pieces import continued

pytestmark = [pytest.mark.cluster]


# -- headers that once killed a node ------------------------------------------------------------
# validate_header once compared and hashed fields before checking their types, so a signed (or,
# in a cluster without a secret, any) message with an unhashable op or dtype or a non-number
# n/part raised TypeError, which decode_or_log did not catch: the node's loop died with it.
CRASHERS = [{'op': [], 'id': 1},
            {'op': {}, 'id': 1},
            {'op': P.HEARTBEAT, 'id': 1, 'n': 'x'},
            {'op': P.HEARTBEAT, 'id': 1, 'part': None},
            {'op': P.HEARTBEAT, 'id': 1, 'dtype': []}]

@pytest.mark.timeout(60)
def test_type_confused_headers_do_not_kill_the_server(by_hand):
    ctx = zmq.Context()
    try:
        server, fake, signed = lone_server(by_hand, ctx)
        for i, header in enumerate(CRASHERS):
            signed.send(P.encode(header))
            fake.tick()
            probe = {'op': P.CHECK, 'id': 1000 + i, 'keys': [['absent', 0, 'float32', [1]]]}
            assert answers(signed, server.proc, probe), f'{header} killed it:\n{server.text}'
    finally:
        ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_type_confused_headers_do_not_kill_the_scheduler(by_hand):
    ctx = zmq.Context()
    try:
        sched, env = by_hand.scheduler(1, 1, extra=CLUSTER_ENV)
        sched_out = Output(sched)
        signed = Signed(ctx, f'tcp://127.0.0.1:{env["DMLC_PS_ROOT_PORT"]}', b'member', SECRET)
        # A REGISTER whose rank is not an int once crashed rank assignment.
        register = {'op': P.REGISTER, 'id': 0, 'role': 'worker', 'host': '127.0.0.1',
                    'port': 0, 'rank': 'x', 'version': P.VERSION}
        for i, header in enumerate(CRASHERS + [register]):
            signed.send(P.encode(header))
            probe = {'op': P.BARRIER, 'id': 1000 + i, 'seq': 1}   # refused: not a worker
            assert answers(signed, sched, probe), f'{header} killed it:\n{sched_out.text}'
    finally:
        ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_hostile_shared_memory_requests_are_refused_per_key(by_hand, tmp_path):
    """A member naming segments that are not there or not theirs, files to reach them through
    that are not segments, or offsets outside its own segment, gets an error for that key;
    the server serves on."""
    from kvps.wire.shm import Segment
    ctx = zmq.Context()
    segment = Segment.create(1 << 20)
    read, write = os.pipe()
    try:
        server, fake, signed = lone_server(by_hand, ctx)
        real = {'name': segment.name, 'nonce': segment.nonce, 'size': segment.size}
        gone = 'kvps-1-0123456789abcdef'
        init = {'op': P.INIT, 'id': 1, 'keys': [['k', 0, 'float32', 4, [4]]], 'sync': False}
        signed.send(P.encode(init, [np.ones(4, np.float32)]))
        push = {'op': P.PUSH, 'id': 2, 'sync': False, 'keys': [['k', 0, 'float32', 4, 8192, 0]]}
        assert 'not attached' in reply(signed, push)['message']
        for i, bad in enumerate([{'name': 'kvps-1-0123456789abcdef'},
                                 {'name': '../../etc/passwd'},
                                 {'nonce': b'\0' * 16},
                                 {'size': segment.size + 4096},
                                 # A name that is gone, and a way in that is a pipe, a device
                                 # (/proc/1/fd/0) or not there: never opened.
                                 {'name': gone, 'pid': os.getpid(), 'fd': read},
                                 {'name': gone, 'pid': 1, 'fd': 0},
                                 {'name': gone, 'pid': os.getpid(), 'fd': 10 ** 6}]):
            answer = reply(signed, {'op': P.ATTACH, 'id': 10 + i, **real, **bad})
            assert answer['op'] == P.ERROR and answer['type'] == 'ProtocolError', answer
        # The way in a restarted server takes: the name is gone, the holder has it open.
        through_proc = {**real, 'name': gone, 'pid': os.getpid(), 'fd': segment.fd}
        assert reply(signed, {'op': P.ATTACH, 'id': 19, **through_proc})['op'] == P.ACK
        assert reply(signed, {'op': P.ATTACH, 'id': 20, **real})['op'] == P.ACK
        for i, at in enumerate([0, 100, segment.size - 8, 1 << 40]):
            push['id'], push['keys'][0][4], push['keys'][0][5] = 30 + i, at, i
            assert 'outside the segment' in reply(signed, push)['message']
            pull = {'op': P.PULL, 'id': 40 + i, 'keys': [['k', 0, at]]}
            assert 'outside the segment' in reply(signed, pull)['message']
        offset, block = segment.take(16)
        block.view(np.float32)[:] = 5
        push['id'], push['keys'][0][4], push['keys'][0][5] = 50, offset, 9
        assert reply(signed, push)['op'] == P.ACK
        pull = {'op': P.PULL, 'id': 51, 'keys': [['k', 0, offset + 16]]}
        answer = reply(signed, pull)
        assert answer['op'] == P.DATA and answer['keys'] == [P.DataItem(offset + 16, None)]
        assert segment.view(offset + 16, 16).cast('f').tolist() == [5.0] * 4
        assert server.proc.poll() is None and 'Traceback' not in server.text
    finally:
        segment.close()
        os.close(read), os.close(write)
        ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_pieces_of_a_state_load_that_a_restarted_server_never_began_are_refused(by_hand):
    """A server restarted during a load in pieces meets the later pieces first (the worker
    resends what its predecessor left unanswered): refused, saying why, instead of joining
    part of a state. A load from piece 0 starts afresh."""
    import msgpack
    ctx = zmq.Context()
    try:
        server, fake, signed = lone_server(by_hand, ctx)
        blob = msgpack.packb(list(range(100)))   # a whole load, but not a state map
        halves = [blob[:50], blob[50:]]
        first, last = continued({'op': P.SET_STATES, 'stage': True}, 2)
        answer = reply(signed, {**last, 'id': 1}, buffers=[halves[1]])
        assert answer['type'] == 'ConfigError', answer
        assert 'piece 1 of the optimizer state came after 0' in answer['message']
        assert 'restarted during the load' in answer['message']
        # A load begun again from piece 0 (the one before abandoned part way) starts afresh:
        # its pieces join to the whole blob, which is then refused for what it holds.
        for req_id in (2, 3):
            assert reply(signed, {**first, 'id': req_id}, buffers=[halves[0]])['op'] == P.ACK
        answer = reply(signed, {**last, 'id': 4}, buffers=[halves[1]])
        assert answer['message'] == 'set_states: the state must be a map', answer
        assert server.proc.poll() is None and 'Traceback' not in server.text
    finally:
        ctx.destroy(linger=0)


def mapped_by(pid, name):
    """Whether process ``pid`` maps the shared-memory file ``name`` (its name gone or not)."""
    with open(f'/proc/{pid}/maps') as maps:
        return name in maps.read()


@pytest.mark.timeout(60)
def test_device_handles_are_opened_only_from_the_job_s_workers_and_checked(by_hand):
    """CUDA IPC's handles are capabilities: a server (its GPU shards emulated, KVPS_IPC=host)
    opens none from a peer without the secret or from a stranger, refuses malformed ones
    saying why, and serves a worker's device segment once it maps it, every offset checked."""
    from kvps.wire.device_segments import DeviceSegment
    from kvps.wire.device_sharing import HostSharing
    ctx = zmq.Context()
    segment = DeviceSegment(HostSharing(), 1 << 16)
    name = segment.buffer.handle[:40].rstrip(b'\0').decode()
    try:
        server, fake, signed = lone_server(by_hand, ctx, {'KVPS_IPC': 'host'})
        address = signed.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        attach = {'op': P.ATTACH_DEVICE, 'id': 1, **segment.describe()}
        for peer in (Signed(ctx, address, b'worker-0x', 'not the secret'),
                     Signed(ctx, address, b'stranger', SECRET)):
            peer.send(P.encode(attach))
            assert not peer.sock.poll(1000), 'a refused peer got an answer'
        assert not mapped_by(server.proc.pid, name)
        for i, bad in enumerate([{'kind': 'cuda'}, {'handle': b'\0' * 64},
                                 {'size': (1 << 16) + 4096}, {'event': b'x' * 64}]):
            answer = reply(signed, {**attach, 'id': 10 + i, **bad})
            assert answer['op'] == P.ERROR and answer['type'] == 'ProtocolError', answer
        assert not mapped_by(server.proc.pid, name)
        assert reply(signed, {**attach, 'id': 20})['op'] == P.ACK
        assert mapped_by(server.proc.pid, name)
        init = {'op': P.INIT, 'id': 21, 'keys': [['k', 0, 'float32', 4, [4]]], 'sync': False,
                'device': True}
        assert reply(signed, init, buffers=[np.ones(4, np.float32)])['op'] == P.ACK
        at, block = segment.take(16)
        block.view(np.float32)[:] = 5
        segment.record()   # (as a worker does before the header goes)
        push = {'op': P.PUSH, 'id': 22, 'sync': False, 'keys': [['k', 0, 'float32', 4, at, 0]]}
        assert reply(signed, push)['op'] == P.ACK
        out_at, out = segment.take(16)
        answer = reply(signed, {'op': P.PULL, 'id': 23, 'keys': [['k', 0, out_at]]})
        assert answer['keys'] == [P.DataItem(out_at, None)]
        assert out.view(np.float32).tolist() == [5.0] * 4
        for i, bad_at in enumerate([at + (1 << 16), at + (1 << 16) - 8, 1 << 62]):
            push['id'], push['keys'][0][4], push['keys'][0][5] = 30 + i, bad_at, 1 + i
            assert 'outside the worker\'s device segment' in reply(signed, push)['message']
        assert server.proc.poll() is None and 'Traceback' not in server.text
    finally:
        segment.close()
        ctx.destroy(linger=0)
