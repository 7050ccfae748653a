"""Header encode/decode and the validation that protects nodes from malformed messages."""

import msgpack
import numpy as np
import pytest

from kvps import protocol as P
from kvps.errors import ProtocolError


def push_frames(n=3, dtype='float32', **over):
    header = {'op': P.PUSH, 'id': 7, 'key': 'w', 'part': 0, 'dtype': dtype, 'n': n,
              'sync': True, **over}
    return P.encode(header, [np.arange(n, dtype=P.DTYPES.get(dtype, np.float32))])


def test_round_trip_keeps_header_and_shares_the_buffer():
    array = np.arange(4, dtype=np.float64)
    frames = P.encode({'op': P.DATA, 'id': 1, 'key': 3, 'part': 1, 'dtype': 'float64', 'n': 4},
                      [array])
    assert frames[1] is array                      # no copy on the way out
    header, buffers = P.decode(frames)
    assert header['key'] == 3 and header['part'] == 1
    assert P.as_array(buffers[0], 'float64').tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize('frames, reason', [
    ([], 'empty'),
    ([b'\xc1garbage'], 'undecodable'),
    ([msgpack.packb([1, 2])], 'must be a map'),
    ([msgpack.packb({'op': 'explode', 'id': 1})], 'unknown op'),
    ([msgpack.packb({'op': 'pull', 'id': 'x', 'key': 1, 'part': 0})], 'id must be an int'),
    ([msgpack.packb({'op': 'pull', 'id': 1, 'part': 0})], "'key' missing"),
    ([msgpack.packb({'op': 'pull', 'id': 1, 'key': 1.5, 'part': 0})], "'key' missing"),
    ([msgpack.packb({'op': 'pull', 'id': 1, 'key': 'k' * 2000, 'part': 0})], 'longer than'),
    ([msgpack.packb({'op': 'pull', 'id': 1, 'key': 1, 'part': -1})], 'part must be >= 0'),
    ([msgpack.packb({'op': 'pull', 'id': 1, 'key': 1, 'part': 0}), b'extra'], 'expected 0'),
    ([b'\x00' * (P.MAX_HEADER_BYTES + 1)], 'exceeds'),
])
def test_malformed_messages_are_rejected_with_a_reason(frames, reason):
    with pytest.raises(ProtocolError, match=reason):
        P.decode(frames)


def test_payload_must_match_declared_dtype_and_count():
    frames = push_frames(n=3)
    frames[1] = np.arange(2, dtype=np.float32)
    with pytest.raises(ProtocolError, match='2 float32 elements need|need 12'):
        P.decode(frames)
    with pytest.raises(ProtocolError, match='expected 1 data frame'):
        P.decode(push_frames()[:1])
    with pytest.raises(ProtocolError, match='unsupported dtype'):
        P.decode(push_frames(dtype='complex64'))
    with pytest.raises(ProtocolError, match="'sync' missing"):
        P.decode(push_frames(sync=1))


def test_message_size_limit():
    with pytest.raises(ProtocolError, match='exceeds the limit'):
        P.decode(push_frames(n=100), max_message_bytes=100)
    assert P.decode(push_frames(n=25), max_message_bytes=100)[0]['n'] == 25


def test_error_header_carries_type_message_and_node():
    header = P.error_header(5, ValueError('bad'), 'server 1', 'tb')
    assert P.decode(P.encode(header))[0] == header
