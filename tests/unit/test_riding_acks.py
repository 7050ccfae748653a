"""A server's plain acks ride on the pulled values it sends the same worker in the same flush
(one message instead of two), and a worker completes them before the DATA they came with."""

from types import SimpleNamespace

import msgpack
import pytest

from kvps.errors import KVPSError, ProtocolError
from kvps.server.records import PullAnswer, Reply, ReplyKind
from kvps.server.replies import Replies
from kvps.wire import protocol as P
from kvps.wire.bundle import unbundled
from kvps.worker.pending import Operation, PendingTable, Request

ACK, DATA, ERROR = ReplyKind.ACK, ReplyKind.DATA, ReplyKind.ERROR
NOTHING = PullAnswer(None, [], [])


class NoLending:
    def deliver(self, answer):
        return SimpleNamespace(items=[], lease=None, frames=[], framed=[])


def sent_messages(held):
    """What flushing ``held`` sends: per message, its worker and the headers it carries (more
    than one where the DATA of a flush to one worker went as a bundle)."""
    sent = []
    replies = Replies(lambda who, frames, track: sent.append((who, [
        msgpack.unpackb(message[0]) for message in unbundled(frames)])), 'server 0', NoLending())
    replies.hold(held)
    replies.flush()
    return [(who, [(h['op'], h['id'], h.get('acks')) for h in headers]) for who, headers in sent]


def flushed(held):
    return [(who, *each) for who, headers in sent_messages(held) for each in headers]


def test_plain_acks_ride_on_the_first_data_to_their_worker():
    assert flushed([Reply(ACK, (b'w0', 1), None), Reply(ACK, (b'w1', 2), None),
                    Reply(DATA, (b'w0', 3), NOTHING), Reply(ACK, (b'w0', 4), None),
                    Reply(DATA, (b'w0', 5), NOTHING)]) == [
        (b'w1', P.ACK, 2, None), (b'w0', P.DATA, 3, [1, 4]), (b'w0', P.DATA, 5, None)]


def test_acks_with_fields_and_errors_go_as_they_are():
    assert flushed([Reply(ACK, (b'w0', 1), {'counts': [2]}), Reply(ERROR, (b'w0', 2),
                                                                     KVPSError('bad')),
                    Reply(DATA, (b'w0', 3), NOTHING)]) == [
        (b'w0', P.ACK, 1, None), (b'w0', P.ERROR, 2, None), (b'w0', P.DATA, 3, None)]


def test_without_data_an_ack_goes_alone():
    assert flushed([Reply(ACK, (b'w0', 7), None)]) == [(b'w0', P.ACK, 7, None)]


def test_a_worker_completes_the_riding_acks_before_the_data():
    table, order = PendingTable(), []
    pushes = [Operation(f'push {i}', 1) for i in range(2)]
    pull = Operation('pull', 1)
    ids = [table.add(Request(op, 'server 0')) for op in pushes]
    pull_id = table.add(Request(pull, 'server 0', on_data=lambda header, buffers: order.append(
        [op.done.is_set() for op in pushes])))
    table.resolve({'op': P.DATA, 'id': pull_id, 'keys': [], 'acks': ids}, [])
    assert order == [[True, True]]
    assert pull.done.is_set() and len(table) == 0
    table.resolve({'op': P.DATA, 'id': 99, 'acks': [98]}, [])   # late: nothing to complete


def test_an_answer_that_cannot_be_read_fails_its_pull_and_completes_its_riding_acks():
    table = PendingTable()
    push, pull = Operation('push', 1), Operation('pull', 1)
    push_id, pull_id = table.add(Request(push, 'server 0')), table.add(Request(pull, 'server 0'))
    frames = [msgpack.packb({'op': P.DATA, 'id': pull_id, 'keys': [], 'acks': [push_id]})]
    table.refused(frames, ProtocolError('too big'))
    assert push.done.is_set() and push.error is None
    with pytest.raises(ProtocolError, match='too big'):
        pull.wait(1)
    assert len(table) == 0


def test_acks_only_on_data_and_as_request_ids():
    item = [[None, None]]
    P.validate_header({'op': P.DATA, 'id': 1, 'keys': item, 'acks': [3, 4]})
    for bad in ({'op': P.DATA, 'id': 1, 'keys': item, 'acks': [0]},
                {'op': P.DATA, 'id': 1, 'keys': item, 'acks': 'x'},
                {'op': P.DATA, 'id': 1, 'keys': item, 'acks': [True]},
                {'op': P.ACK, 'id': 1, 'acks': [3]}):
        with pytest.raises(ProtocolError, match='acks'):
            P.validate_header(bad)


def test_the_data_of_a_flush_to_one_worker_go_as_one_message_in_their_order():
    assert sent_messages([Reply(DATA, (b'w0', 1), NOTHING), Reply(DATA, (b'w1', 2), NOTHING),
                          Reply(ACK, (b'w0', 3), None), Reply(DATA, (b'w0', 4), NOTHING)]) == [
        (b'w0', [(P.DATA, 1, [3]), (P.DATA, 4, None)]), (b'w1', [(P.DATA, 2, None)])]


def test_a_reply_that_is_not_data_keeps_its_place_among_the_data():
    """A push's error must reach the worker before the values of a pull made after it."""
    assert sent_messages([Reply(DATA, (b'w0', 1), NOTHING), Reply(ERROR, (b'w0', 2),
                                                                   KVPSError('bad')),
                          Reply(DATA, (b'w0', 3), NOTHING), Reply(DATA, (b'w0', 4), NOTHING)]) == [
        (b'w0', [(P.DATA, 1, None)]), (b'w0', [(P.ERROR, 2, None)]),
        (b'w0', [(P.DATA, 3, None), (P.DATA, 4, None)])]
