"""Several messages sent as one (kvps.wire.bundle): what a bundle gives back, a plain message
passing through, malformed indexes refused, and the headers it carries signed as any header."""

import msgpack
import numpy as np
import pytest

from kvps.errors import AuthError, ProtocolError
from kvps.wire import protocol as P
from kvps.wire.auth import TO_DEALER, Guard
from kvps.wire.bundle import bundle, unbundled
from kvps.wire.items import DataItem

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
