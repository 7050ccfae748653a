"""Several messages sent as one (kvps.wire.bundle): what a bundle gives back, a plain message
passing through, malformed indexes refused, the headers it carries signed as any header, and a
server serving each request of one (a malformed one answered with why, the rest served), a
worker taking each answer of one (the call of a malformed one failed, saying why)."""

from types import SimpleNamespace

import msgpack
import numpy as np
import pytest

from fake_sockets import Router
from kvps.config import Config
from kvps.errors import AuthError, ProtocolError
from kvps.server.loop import Server
from kvps.timeline.counters import ServerCounts
from kvps.wire import protocol as P
from kvps.wire.auth import TO_DEALER, Guard
from kvps.wire.bundle import bundle, unbundled
from kvps.wire.items import DataItem, PullItem
from kvps.worker.loop import WorkerIO
from kvps.worker.pending import Operation, Request

SECRET = b's' * 32


def data(req_id, *values):
    """A DATA answer framing ``values``, as a server sends it."""
    header = {'op': P.DATA, 'id': req_id, 'keys': [DataItem(None, None) for _ in values]}
    return P.encode(header, [np.asarray(v, np.float32) for v in values])


def test_a_bundle_gives_back_each_message_whole_and_in_order():
    messages = [data(1, [1.0, 2.0]), data(2, [6.0]), data(3, [3.0], [4.0, 5.0])]
    got = unbundled(bundle(messages))
    assert len(got) == 3
    for sent, back in zip(messages, got):
        header, buffers = P.decode(back)
        assert header == P.decode(sent)[0]
        assert [bytes(b) for b in buffers] == [bytes(memoryview(f)) for f in sent[1:]]


def test_a_message_that_is_no_bundle_passes_as_it_is():
    message = data(7, [1.0])
    assert unbundled(message) == [message]


@pytest.mark.parametrize('index,frames', [
    (msgpack.packb([]), 0),                              # no message
    (msgpack.packb([[b'h', 1]]), 0),                     # names a frame that did not come
    (msgpack.packb([[b'h', 0]]), 1),                     # a frame no message names
    (msgpack.packb([['h', 0]]), 0),                      # a header that is no bytes
    (msgpack.packb([[b'h', -1]]), 0),
    (msgpack.packb([[b'h']]), 0),
    (b'\x91\xc1', 0),                                    # undecodable
])
def test_a_malformed_index_is_refused(index, frames):
    with pytest.raises(ProtocolError):
        unbundled([index, *[b'x'] * frames])


def test_the_headers_a_bundle_carries_are_signed_as_its_own():
    guard = Guard(SECRET)
    signed = guard.sign(bundle([data(1, [1.0]), data(2, [2.0])]), TO_DEALER, b'worker-0')
    tampered = bytearray(signed[0])
    tampered[-3] ^= 1   # inside the second message's header
    with pytest.raises(AuthError):
        Guard(SECRET).verify([bytes(tampered), *signed[1:]], TO_DEALER, b'worker-0')
    frames = Guard(SECRET).verify(signed, TO_DEALER, b'worker-0')
    assert [P.decode(m)[0]['id'] for m in unbundled(frames)] == [1, 2]


def test_a_server_serves_each_request_of_a_bundle_and_answers_a_malformed_one_with_why():
    server = Server.__new__(Server)   # its sockets and shard are not needed to admit
    pull = {'op': P.PULL, 'keys': [PullItem(7, 0, None)]}
    broken = msgpack.packb({'op': P.PULL, 'id': 3, 'keys': 'not a list'})
    server.router = Router([(b'worker-0', bundle([P.encode({**pull, 'id': 1}), [broken],
                                                   P.encode({**pull, 'id': 2})])),
                             (b'worker-0', [msgpack.packb([[b'h', 5]])])])   # bad index
    server.config, server.counts, server.recovery = Config(), ServerCounts(), None
    server.workers, server.name = {b'worker-0'}, 'server 0'
    answered, served = [], []
    server.replies = SimpleNamespace(send=answered.append)
    server._handle = lambda identity, header, _: served.append(header['id'])
    server._serve_burst()
    assert served == [1, 2]
    assert [(reply.token, type(reply.payload)) for reply in answered] == [
        ((b'worker-0', 3), ProtocolError)]


class _Dealer:
    """A worker's socket to a server holding one received message."""

    def __init__(self, frames):
        self.frames = frames

    def recv(self):
        return self.frames


def test_a_worker_takes_each_answer_of_a_bundle_and_fails_the_call_of_a_malformed_one():
    io = WorkerIO(Config())
    calls = [Operation(f'call {i}', 1) for i in range(2)]
    ids = [io._pending.add(Request(op, 'server 0')) for op in calls]
    broken = msgpack.packb({'op': P.ACK, 'id': ids[1], 'acks': 'not a list'})
    sock = _Dealer(bundle([P.encode({'op': P.ACK, 'id': ids[0]}), [broken]]))
    io._by_socket = {sock: 'server 0'}
    try:
        io._from_server(sock)
    finally:
        io._close()
    assert calls[0].done.is_set() and calls[0].error is None
    assert calls[1].done.is_set() and isinstance(calls[1].error, ProtocolError)
    assert 'the answer of server 0 could not be read' in str(calls[1].error)
