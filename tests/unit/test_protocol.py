"""Header encode/decode and the validation that protects nodes from malformed messages."""

import msgpack
import numpy as np
import pytest

from kvps.wire import protocol as P
from kvps.wire.pieces import STATE_CHUNK_BYTES, continued, joined, state_pieces
from kvps.wire.items import CheckItem, DataItem, InitItem, PushItem
from kvps.errors import ProtocolError


def push_frames(n=3, dtype='float32', **over):
    header = {'op': P.PUSH, 'id': 7, 'keys': [['w', 0, dtype, n, None, 0]], 'sync': True, **over}
    return P.encode(header, [np.arange(n, dtype=P.DTYPES.get(dtype, np.float32))])


def test_round_trip_keeps_header_and_shares_the_buffer():
    array = np.arange(4, dtype=np.float64)
    frames = P.encode({'op': P.DATA, 'id': 1, 'keys': [[None, None], [None, None]]},
                      [array, np.zeros(2, np.int8)])
    assert frames[1] is array                      # no copy on the way out
    header, buffers = P.decode(frames)
    assert header['keys'][0] == DataItem(at=None, lent=None)
    assert P.as_array(buffers[0], 'float64').tolist() == [0, 1, 2, 3]
    assert P.as_array(buffers[1], 'int8').tolist() == [0, 0]


@pytest.mark.parametrize('frames, reason', [
    ([], 'empty'),
    ([b'\xc1garbage'], 'undecodable'),
    ([msgpack.packb([1, 2])], 'must be a map'),
    ([msgpack.packb({'op': 'explode', 'id': 1})], 'unknown op'),
    ([msgpack.packb({'op': 'pull', 'id': 'x', 'keys': [[1, 0]]})], 'id must be an int'),
    ([msgpack.packb({'op': 'pull', 'id': 1})], "'keys' missing"),
    ([msgpack.packb({'op': 'pull', 'id': 1, 'keys': []})], '1 to 65536 keys'),
    ([msgpack.packb({'op': 'pull', 'id': 1, 'keys': [[1.5, 0, None]]})], 'key must be int or str'),
    ([msgpack.packb({'op': 'pull', 'id': 1, 'keys': [1]})], 'list of 3 fields'),
    ([msgpack.packb({'op': 'pull', 'id': 1, 'keys': [['k' * 2000, 0, None]]})], 'longer than'),
    ([msgpack.packb({'op': 'pull', 'id': 1, 'keys': [[1, -1, None]]})], 'part must be an int >= 0'),
    ([msgpack.packb({'op': 'pull', 'id': 1, 'keys': [[1, 0, None]]}), b'extra'], 'expected 0'),
    ([msgpack.packb({'op': 'push', 'id': 1, 'sync': True, 'keys': [[1, 0, 'float32', -2, None, 0]]})],
     'n must be an int >= 0'),
    ([msgpack.packb({'op': 'push', 'id': 1, 'sync': True, 'keys': [[1, 0, 'float32', 2, 0]]})],
     'list of 6 fields'),
    ([msgpack.packb({'op': 'push', 'id': 1, 'sync': True,
                     'keys': [[1, 0, 'float32', 2, None, -1]]})], 'seq must be an int >= 0'),
    ([msgpack.packb({'op': 'push', 'id': 1, 'sync': True,
                     'keys': [[1, 0, 'float32', 2, -4096, 0]]})], 'at must be an int >= 0'),
    ([msgpack.packb({'op': 'push', 'id': 1, 'sync': True,
                     'keys': [[1, 0, 'float32', 2, '4096', 0]]})], 'at must be an int >= 0'),
    ([msgpack.packb({'op': 'pull', 'id': 1, 'keys': [[1, 0, 1.5]]})], 'at must be an int >= 0'),
    ([msgpack.packb({'op': 'data', 'id': 1, 'keys': [[True, None]]})],
     'at must be an int >= 0'),
    ([msgpack.packb({'op': 'data', 'id': 1, 'keys': [[None, -64]]})],
     'lent must be an int >= 0'),
    ([msgpack.packb({'op': 'data', 'id': 1, 'keys': [[1, 0, 'int8', 2, None, None]]})],
     'list of 2 fields'),
    ([msgpack.packb({'op': 'data', 'id': 1, 'keys': [[None, None], [64, None]]}), b'ab', b'c'],
     'expected 1 data frame'),
    ([msgpack.packb({'op': 'pull', 'id': 1, 'keys': [[1, 0, None]], 'seen': -1})],
     'seen must be an int >= 0'),
    ([msgpack.packb({'op': 'data', 'id': 1, 'keys': [[None, 64]],
                     'lease': 'x'})], 'lease must be an int >= 0'),
    ([msgpack.packb({'op': 'push', 'id': 1, 'sync': True,
                     'keys': [[1, 0, 'float32', 2, 4096, 0]]}), b'\0' * 8], 'expected 0 data'),
    ([msgpack.packb({'op': 'attach', 'id': 1, 'name': 'kvps-1-ab', 'size': 1 << 20})],
     "'nonce' missing"),
    ([msgpack.packb({'op': 'attach', 'id': 1, 'name': 'kvps-1-ab', 'nonce': 'text',
                     'size': 1 << 20}, use_bin_type=True)], "'nonce' missing"),
    ([msgpack.packb({'op': 'attach', 'id': 1, 'name': 'kvps-1-ab', 'nonce': b'x' * 16,
                     'size': -1}, use_bin_type=True)], 'size must be an int >= 0'),
    ([msgpack.packb({'op': 'resume', 'id': 0, 'keys': [[1, 0, 'x', 0]]})], 'acked must be an int'),
    ([msgpack.packb({'op': 'resume', 'id': 0, 'keys': [[1, 0, 3, -1]]})], 'first must be an int'),
    ([msgpack.packb({'op': 'server_back', 'id': 0, 'rank': 1, 'host': 'h'})], "'port' missing"),
    ([msgpack.packb({'op': 'barrier', 'id': 1, 'seq': 1, 'digest': 'text'})],
     'digest must be at most 64 bytes'),
    ([msgpack.packb({'op': 'barrier', 'id': 1, 'seq': 1, 'digest': b'x' * 65})],
     'digest must be at most 64 bytes'),
    ([msgpack.packb({'op': 'barrier', 'id': 1, 'seq': 1, 'sum': b'x' * 12})],
     'sum must be float64 values'),
    ([msgpack.packb({'op': 'barrier', 'id': 1, 'seq': 1, 'sum': b'x' * (P.MAX_SUM_BYTES + 8)})],
     'sum must be float64 values'),
    ([b'\x00' * (P.MAX_HEADER_BYTES + 1)], 'exceeds'),
    ([msgpack.packb({'op': 'pull_rows', 'id': 1, 'part': 0})], "'key' missing"),
    ([msgpack.packb({'op': 'pull_rows', 'id': 1, 'key': 1, 'part': 0, 'ids': True})],
     'expected 1 data'),
    ([msgpack.packb({'op': 'pull_rows', 'id': 1, 'key': 1, 'part': 0}), b'\0' * 8],
     'expected 0 data'),
    ([msgpack.packb({'op': 'pull_rows', 'id': 1, 'key': 1, 'part': 0, 'ids': 1}), b'\0' * 8],
     'ids must be true or false'),
    ([msgpack.packb({'op': 'pull_rows', 'id': 1, 'key': 1, 'part': 0, 'live': 1})],
     'live must be true or false'),
    ([msgpack.packb({'op': 'pull_rows', 'id': 1, 'key': 1, 'part': 0, 'since': [1]})],
     'since must be'),
    ([msgpack.packb({'op': 'pull_rows', 'id': 1, 'key': 1, 'part': 0, 'since': [1, -2]})],
     'since must be'),
    ([msgpack.packb({'op': 'row_data', 'id': 1, 'epoch': 1, 'count': -1}), b''],
     'count must be an int >= 0'),
    ([msgpack.packb({'op': 'row_data', 'id': 1, 'epoch': 1, 'count': 1})], 'expected 1 data'),
    ([msgpack.packb({'op': 'push', 'id': 1, 'sync': True,
                     'keys': [[1, 0, 'rows', 16, None, 0]]}), b'\0' * 8], 'has 8 bytes'),
    ([msgpack.packb({'op': 'set_optimizer', 'id': 1, 'check': 'yes'}), b'\x80'],
     'check must be true or false'),
    ([msgpack.packb({'op': 'ack', 'id': 1, 'whole': 1})], 'whole must be true or false'),
])
def test_malformed_messages_are_rejected_with_a_reason(frames, reason):
    with pytest.raises(ProtocolError, match=reason):
        P.decode(frames)


def test_a_worker_holding_no_key_of_a_restarted_server_resumes_with_an_empty_list():
    header, buffers = P.decode(P.encode({'op': P.RESUME, 'id': 0, 'keys': []}))
    assert header['keys'] == [] and buffers == []


def test_payload_must_match_declared_dtype_and_count():
    frames = push_frames(n=3)
    frames[1] = np.arange(2, dtype=np.float32)
    with pytest.raises(ProtocolError, match='need 12'):
        P.decode(frames)
    with pytest.raises(ProtocolError, match='expected 1 data frame'):
        P.decode(push_frames()[:1])
    with pytest.raises(ProtocolError, match='unsupported dtype'):
        P.decode(push_frames(dtype='complex64'))
    with pytest.raises(ProtocolError, match="'sync' missing"):
        P.decode(push_frames(sync=1))
    two = P.encode({'op': P.PUSH, 'id': 1, 'sync': True,
                    'keys': [[1, 0, 'float32', 2, None, 0], [2, 0, 'float64', 1, None, 0]]},
                   [np.zeros(2, np.float32), np.zeros(3, np.float32)])
    with pytest.raises(ProtocolError, match='key 2 has 12 bytes, but 1 float64'):
        P.decode(two)


def test_only_items_outside_shared_memory_carry_a_frame():
    """``at`` (an offset in the worker's segment) replaces the item's data frame; the frame
    count must match exactly the items without one, in order."""
    mixed = {'op': P.PUSH, 'id': 1, 'sync': True,
             'keys': [[1, 0, 'float32', 2, 8192, 0], [2, 0, 'float64', 1, None, 0]]}
    header, buffers = P.decode(P.encode(mixed, [np.zeros(1, np.float64)]))
    assert header['keys'][0].at == 8192 and len(buffers) == 1
    assert header['keys'] == [PushItem(1, 0, 'float32', 2, 8192, 0),
                              PushItem(2, 0, 'float64', 1, None, 0)]
    with pytest.raises(ProtocolError, match='expected 1 data frame'):
        P.decode(P.encode(mixed, [np.zeros(2, np.float32), np.zeros(1, np.float64)]))
    data = {'op': P.DATA, 'id': 1, 'keys': [[4096, None], [None, 4096]], 'lease': 3}
    assert P.decode(P.encode(data)) == ({**data, 'keys': [DataItem(4096, None),
                                                          DataItem(None, 4096)]}, [])
    attach = {'op': P.ATTACH, 'id': 1, 'name': 'kvps-1-00', 'nonce': b'n' * 16, 'size': 1 << 20}
    assert P.decode(P.encode(attach))[0] == attach


def test_message_size_limit():
    with pytest.raises(ProtocolError, match='exceeds the limit'):
        P.decode(push_frames(n=100), max_message_bytes=100)
    assert P.decode(push_frames(n=25), max_message_bytes=100)[0]['keys'][0].n == 25


def test_error_header_carries_type_message_and_node():
    header = P.error_header(5, ValueError('bad'), 'server 1', 'tb')
    assert P.decode(P.encode(header))[0] == header


@pytest.mark.parametrize('header', [
    {'op': []}, {'op': 'heartbeat', 'dtype': []}, {'op': 'heartbeat', 'part': None},
    {'op': 'heartbeat', 'n': '3'}, {'op': 'register', 'role': 'worker', 'host': 'h', 'port': 1.5},
    {'op': 'push', 'id': 1, 'sync': True, 'keys': [[1, 0, [], 3, None, 0]]},
    {'op': 'push', 'id': 1, 'sync': True, 'keys': [[1, True, 'float32', 3, None, 0]]},
    {'op': 'push', 'id': 1, 'sync': True, 'keys': [[1, 0, 'float32', 3, [], 0]]},
    {'op': 'pull', 'id': 1, 'keys': [[{}, 0, None]]},
    {'op': 'pull', 'id': 1, 'keys': [[1, 0, {}]]},
    {'op': 'attach', 'id': 1, 'name': ['kvps'], 'nonce': b'n' * 16, 'size': 1},
])
def test_type_confused_headers_are_protocol_errors_not_crashes(header):
    with pytest.raises(ProtocolError):
        P.decode([msgpack.packb(header)])


def test_request_id_of_an_unreadable_request():
    assert P.request_id([msgpack.packb({'op': 'push', 'id': 42, 'keys': 'nonsense'})]) == 42
    assert P.request_id([msgpack.packb({'op': 'push', 'id': True})]) is None
    assert P.request_id([b'\xc1']) is None


def test_request_ids_of_an_unreadable_answer_name_the_acks_riding_on_it():
    header = {'op': P.DATA, 'id': 7, 'keys': [], 'acks': [3, True, 'x', 5]}
    assert P.request_ids([msgpack.packb(header)]) == (7, [3, 5])
    assert P.request_ids([msgpack.packb({'op': P.DATA, 'id': 7})]) == (7, [])
    assert P.request_ids([b'\xc1']) == (None, [])


def test_a_states_answer_resent_from_a_restarted_server_starts_afresh():
    """The worker keeps a STATES answer's pieces until the last; a server lost part way is
    asked again by its replacement, whose answer starts at piece 0: only that one counts."""
    from kvps.worker.messages import state_collector
    got = []
    keep = state_collector(got.append)
    old = continued({'op': P.STATES, 'id': 1}, 3)[:2]        # the lost server's first two
    for header, piece in zip(old, [b'ol', b'd-']):
        keep(header, [piece])
    for header, piece in zip(continued({'op': P.STATES, 'id': 1}, 3), [b'ne', b'w-', b'!']):
        keep(header, [piece])
    assert got == [b'new-!']
    keep({'op': P.STATES, 'id': 2}, [b'one'])                  # a one-piece answer as before
    assert got[-1] == b'one'


@pytest.mark.parametrize('field, bad, reason', [
    ('id', 'x', 'id must be an int'), ('id', True, 'id must be an int'),
    ('since', [1], 'since must be'), ('priority', 2 ** 31, 'priority must be an int of 32'),
    ('device', 1, 'device must be true or false'), ('more', None, 'more must be true or'),
    ('key', 1.5, 'key must be int or str'), ('key', None, 'key must be int or str'),
    ('dtype', 'complex64', 'unsupported dtype'), ('n', -1, 'n must be an int >= 0'),
    ('step', True, 'step must be an int >= 0'), ('rank', -1, 'rank must be an int >= 0'),
    ('shared', [], 'shared must map'), ('rank_from', 5, 'rank_from must be a string'),
    ('codec', 'zip', 'codec must be one of'), ('acks', [1], 'acks must be a list'),
    ('digest', 'x', 'digest must be at most'), ('sum', b'1234567', 'sum must be float64'),
    ('fenced', 'gone', 'fenced must be one of lost, replaced')])
def test_every_field_is_checked_wherever_it_appears(field, bad, reason):
    """A node reads these fields from any message that carries them: each is checked by its
    name, whatever the op (here an ACK, which needs none of them)."""
    with pytest.raises(ProtocolError, match=reason):
        P.validate_header({'op': P.ACK, 'id': 1, field: bad})


@pytest.mark.parametrize('field, value', [
    ('since', None), ('priority', None), ('priority', -2 ** 31), ('rank', None), ('rank', 3),
    ('rank_from', None), ('codec', None), ('codec', 'fp16'), ('acks', None), ('digest', None),
    ('digest', b'x' * P.MAX_DIGEST_BYTES), ('sum', None), ('sum', bytes(8)),
    ('fenced', None), ('fenced', 'lost'), ('fenced', 'replaced'),
    ('unknown', object())])
def test_optional_fields_may_be_none_and_unknown_ones_are_not_read(field, value):
    P.validate_header({'op': P.ACK, 'id': 1, field: value})
    assert P.validate_header({'op': P.DATA, 'id': 1, 'keys': [[None, 0]], 'acks': [2, 3]})


def test_init_may_ask_for_the_gpu_with_a_boolean_only():
    header = {'op': P.INIT, 'id': 1, 'keys': [[3, 0, 'float32', 2, [2]]], 'sync': True}
    P.validate_header({**header, 'device': True})
    P.validate_header(header)                     # absent: host memory
    with pytest.raises(ProtocolError, match='device must be true or false'):
        P.validate_header({**header, 'device': 'cuda'})


@pytest.mark.parametrize('shape, match', [
    ([-1], 'shape'), ([2.0], 'shape'), ((2,), 'shape'), ([True], 'shape'),
    ([1] * (P.MAX_DIMS + 1), 'shape'), ('2', 'shape')])
def test_init_and_check_items_carry_a_shape_of_ints(shape, match):
    for op, item in ((P.INIT, [7, 0, 'float32', 1, shape]), (P.CHECK, [7, 0, 'float32', shape])):
        with pytest.raises(ProtocolError, match=match):
            P.validate_header({'op': op, 'id': 1, 'keys': [item], 'sync': True})


def test_init_carries_one_frame_per_item_of_its_size():
    init = {'op': P.INIT, 'id': 1, 'sync': False,
            'keys': [['a', 0, 'float32', 2, [2]], ['b', 0, 'float64', 0, [0, 3]]]}
    header, buffers = P.decode(P.encode(init, [bytes(8), b'']))
    assert header == {**init, 'keys': [InitItem(*item) for item in init['keys']]}
    assert [b.nbytes for b in buffers] == [8, 0]
    with pytest.raises(ProtocolError, match='expected 2 data frame'):
        P.decode(P.encode(init, [bytes(8)]))
    with pytest.raises(ProtocolError, match="key 'a' has 4 bytes"):
        P.decode(P.encode(init, [bytes(4), b'']))
    check = {'op': P.CHECK, 'id': 2, 'keys': [['a', 0, 'float32', [2]]]}
    assert P.decode(P.encode(check)) == ({**check, 'keys': [CheckItem('a', 0, 'float32', [2])]},
                                         [])
    with pytest.raises(ProtocolError, match='4 fields'):
        P.decode(P.encode({**check, 'keys': [['a', 0, 'float32', 2, [2]]]}))


def test_a_state_travels_in_pieces_a_message_may_carry():
    blob = bytes(range(10))
    pieces = state_pieces(blob, 4)
    assert [len(p) for p in pieces] == [4, 4, 2] and b''.join(pieces) == blob
    assert [bytes(p) for p in state_pieces(b'')] == [b'']   # one (empty) piece at least
    assert len(state_pieces(bytes(STATE_CHUNK_BYTES + 1))) == 2
    header, buffers = P.decode(P.encode({'op': P.STATES, 'id': 3, 'more': True}, [pieces[0]]))
    assert header['more'] is True and bytes(buffers[0]) == blob[:4]
    assert continued({'op': P.STATES, 'id': 3}, 3) == [
        {'op': P.STATES, 'id': 3, 'piece': 0, 'more': True},
        {'op': P.STATES, 'id': 3, 'piece': 1, 'more': True}, {'op': P.STATES, 'id': 3, 'piece': 2}]
    assert continued({'op': P.STATES, 'id': 3}, 1) == [{'op': P.STATES, 'id': 3, 'piece': 0}]
    with pytest.raises(ProtocolError, match='piece'):
        P.validate_header({'op': P.STATES, 'id': 3, 'piece': -1})
    assert joined(pieces) == blob and joined([pieces[0]]) is pieces[0]
