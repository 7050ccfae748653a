"""Requests queued back to back for one server leave in one message (kvps.worker.joined): a
thread's pushes as one request (which ones join, in what order their keys go, how the one answer
completes or fails each call), and pulls and pushes through shared memory as a bundle, each
answered alone. Orders and counts, never timings."""

import threading

import numpy as np

from kvps.config import Config
from kvps.errors import DTypeError
from kvps.wire import protocol as P
from kvps.wire.bundle import unbundled
from kvps.wire.items import PullItem, PushItem
from kvps.wire.ordering import PriorityOrder
from kvps.worker.loop import WorkerIO
from kvps.worker.messages import FUSE_BYTES
from kvps.worker.pending import Operation, PendingTable, Request

ME, OTHER = threading.get_ident(), -1


def push(*keys, priority=0, step=1, nbytes=4, pusher=ME, shm=False):
    """A push of ``keys`` as a client queues it (``shm``: its values in shared memory)."""
    header = {'op': P.PUSH, 'sync': True, 'step': step, 'keys': [
        PushItem(k, 0, 'float32', nbytes // 4, 64 * k if shm else None, 0) for k in keys]}
    if priority:
        header['priority'] = priority
    frames = [] if shm else [np.zeros(nbytes // 4, np.float32) for _ in keys]
    return header, frames, Request(Operation(f'push {keys}', 1), None, pusher=pusher)


def pull(*keys, priority=0):
    header = {'op': P.PULL, 'keys': [PullItem(k, 0, None) for k in keys]}
    if priority:
        header['priority'] = priority
    return header, [], Request(Operation(f'pull {keys}', 1), None)


class _Dealer:
    """A server's socket that records what is sent on it: each request, and in ``bundles``
    each zmq message, as the list of its requests' first keys (several: kvps.wire.bundle)."""

    def __init__(self, name, sent, bundles=None):
        self.name, self.sent, self.bundles = name, sent, bundles

    def send(self, frames, on_taken=None):
        messages = unbundled(frames)
        for message in messages:
            header, buffers = P.decode(message)
            self.sent.append((self.name, header['op'], [item.key for item in header['keys']],
                              len(buffers)))
        if self.bundles is not None:
            self.bundles.append([P.decode(m)[0]['keys'][0].key for m in messages])

    def close(self, linger_s):
        pass


def sent_by_io_thread(messages, bundles=None):
    """What a worker's I/O thread sends of ``messages`` ((server rank, (header, frames,
    request))), all queued before it looks; and the thread's counts."""
    io = WorkerIO(Config())
    sent = []
    io._servers = {f'server {r}': _Dealer(r, sent, bundles) for r in range(2)}
    try:
        for rank, (header, frames, request) in messages:
            request.node = f'server {rank}'
            io._queue.append((request.node, header, frames, request))
        io._send_queued()
    finally:
        io._close()
    return sent, io.counts


def sent_to_server_0(calls):
    """A worker's I/O thread once it has sent ``calls`` (header, frames, request) to server 0,
    all queued before it looks: its table of requests awaiting answers, its counts."""
    io = WorkerIO(Config())
    io._servers = {'server 0': _Dealer(0, [], [])}
    io._pending = PendingTable()
    for header, frames, request in calls:
        request.node = 'server 0'
        io._queue.append(('server 0', header, frames, request))
    try:
        io._send_queued()
    finally:
        io._close()
    return io


def test_pushes_of_one_thread_to_one_server_share_a_message_in_their_order():
    sent, counts = sent_by_io_thread([(0, push(1)), (0, push(2, 3)), (1, push(4)), (0, push(5)),
                                      (1, push(6))])
    # server 1's pushes between them do not split server 0's: each server's queue is its own
    assert sent == [(0, P.PUSH, [1, 2, 3, 5], 4), (1, P.PUSH, [4, 6], 2)]
    assert counts.joined == 3 and counts.messages == 2


def test_a_pull_between_pushes_keeps_them_apart():
    """The pull must follow the push of its key, and a push after it must not pass it."""
    sent, _ = sent_by_io_thread([(0, push(1)), (0, pull(1)), (0, push(2)), (0, push(3))])
    assert sent == [(0, P.PUSH, [1], 1), (0, P.PULL, [1], 0), (0, P.PUSH, [2, 3], 2)]


def test_pushes_join_only_with_the_same_thread_and_step_and_no_key_in_common():
    sent, counts = sent_by_io_thread([
        (0, push(1)), (0, push(2, pusher=OTHER)),   # another thread's
        (0, push(3, pusher=None)),                  # a pushpull's wave (paced)
        (0, push(4)), (0, push(5, step=2)),         # a later step
        (0, push(6, step=2)), (0, push(6, step=2))])   # the same key again
    assert [keys for _, _, keys, _ in sent] == [[1], [2], [3], [4], [5, 6], [6]]
    assert counts.joined == 1


def test_a_push_of_a_lower_priority_joins_only_when_it_would_go_next_alone():
    # MXNet's Gluon loop: a priority per key, the first keys highest
    sent, _ = sent_by_io_thread([(0, push(k, priority=-k)) for k in range(4)])
    assert [keys for _, _, keys, _ in sent] == [[0, 1, 2, 3]]
    # a pull of a higher priority for another server goes before the lower push
    sent, _ = sent_by_io_thread([(0, push(1, priority=5)), (0, push(2)),
                                 (1, pull(9, priority=3))])
    assert [(rank, keys) for rank, _, keys, _ in sent] == [(0, [1]), (1, [9]), (0, [2])]
    # pushes queued out of priority order go in priority order
    sent, _ = sent_by_io_thread([(0, push(1, priority=5)), (0, push(2, priority=-5)),
                                 (0, push(3, priority=-1))])
    assert [keys for _, _, keys, _ in sent] == [[1], [3, 2]]


def test_a_message_of_joined_pushes_stays_within_the_fused_message_size():
    big = FUSE_BYTES // 2
    sent, _ = sent_by_io_thread([(0, push(k, nbytes=big)) for k in range(5)])
    assert [keys for _, _, keys, _ in sent] == [[0, 1], [2, 3], [4]]


def test_a_run_passes_over_other_servers_messages_and_ends_where_one_may_not_be_passed():
    order = PriorityOrder()
    for name, peer, header in [('a', 0, push(1)[0]), ('b', 1, push(2)[0]), ('c', 0, push(3)[0]),
                               ('d', 0, {'op': P.INIT, 'keys': []}), ('e', 0, push(4)[0])]:
        order.add(f'server {peer}', header, name)
    assert order.pop() == 'a'
    assert order.take_run('server 0', lambda item: item != 'c') == []   # refused: the run ends
    # b (another server's) is passed over; nothing passes d (not a data request)
    assert order.take_run('server 0', lambda item: True) == ['c']
    assert [order.pop() for _ in range(4)] == ['b', 'd', 'e', None]


def test_no_run_is_taken_while_messages_taken_along_wait_to_go_first():
    order = PriorityOrder()
    for name, header in [('a', push(1)[0]), ('b', push(1, priority=5)[0]), ('c', push(2)[0])]:
        order.add('server 0', header, name)
    assert order.pop() == 'a'   # b must follow it: a went first, b waits ahead of the rest
    assert order.take_run('server 0', lambda item: True) == []
    assert [order.pop() for _ in range(3)] == ['b', 'c', None]


def test_the_one_answer_completes_or_fails_every_joined_call():
    for answer, raised in [({'op': P.ACK}, None),
                           ({'op': P.ERROR, 'type': 'DTypeError', 'message': 'bad',
                             'node': 'server 0'}, DTypeError)]:
        errors = []
        calls = [push(k) for k in range(3)]
        for _, _, request in calls:
            request.op.on_error = errors.append
        io = sent_to_server_0(calls)
        assert len(io._pending) == 1   # one message, one request waiting
        req_id = next(iter(io._pending._by_id))
        io._pending.resolve({**answer, 'id': req_id}, ())
        ops = [request.op for _, _, request in calls]
        assert all(op.done.is_set() for op in ops)
        assert all(op.waiting_on == {'server 0'} for op in ops)
        if raised is None:
            assert errors == [] and all(op.error is None for op in ops)
        else:
            assert len(errors) == 3 and all(isinstance(op.error, raised) for op in ops)


def test_pulls_and_pushes_through_shared_memory_share_a_message_each_with_its_answer():
    bundles = []
    sent, counts = sent_by_io_thread([
        (0, pull(1)), (0, pull(2)), (1, pull(3)), (0, push(4, shm=True, pusher=OTHER)),
        (0, pull(5)),
        (0, push(6)),   # over the socket: a message of its own (holdback tracks it)
        (0, pull(7)), (0, pull(8))], bundles)
    assert bundles == [[1, 2, 4, 5], [3], [6], [7, 8]]
    assert [keys for _, _, keys, _ in sent] == [[1], [2], [4], [5], [3], [6], [7], [8]]
    assert counts.messages == 8   # (requests)


def test_requests_sharing_a_message_are_each_answered_by_their_own_reply():
    calls = [pull(k) for k in range(3)]
    io = sent_to_server_0(calls)
    assert io._servers['server 0'].bundles == [[0, 1, 2]]   # one zmq message
    assert io.counts.messages == len(io._pending) == 3
    first, second, third = sorted(io._pending._by_id)
    io._pending.resolve({'op': P.ACK, 'id': second}, ())
    assert [request.op.done.is_set() for _, _, request in calls] == [False, True, False]
