"""MXNet's priority: the order requests leave a worker's I/O thread and a server serves a burst
(highest first, arrival order within one, a key part's requests between one worker and one
server never reordered), and the calls that take it. Orders, never timings."""

import threading

import numpy as np
import pytest

from fake_sockets import Router
from kvps.config import Config
from kvps.errors import ProtocolError
from kvps.kvstore import create
from kvps.kvstore.keys import checked_priority
from kvps.server.loop import Server
from kvps.timeline.counters import ServerCounts
from kvps.wire import protocol as P
from kvps.wire.items import PullItem, PushItem
from kvps.wire.ordering import PriorityOrder, by_priority
from kvps.worker.loop import WorkerIO
from kvps.worker.pending import Operation, Request


def push(*keys, priority=0):
    header = {'op': P.PUSH, 'sync': True,
              'keys': [PushItem(k, 0, 'float32', 1, None, 0) for k in keys]}
    if priority:
        header['priority'] = priority
    return header


def pull(*keys, priority=0):
    header = {'op': P.PULL, 'keys': [PullItem(k, 0, None) for k in keys]}
    if priority:
        header['priority'] = priority
    return header


def ordered(messages):
    """The names of ``messages`` ((name, peer, header)) as a PriorityOrder gives them back."""
    order = PriorityOrder()
    for name, peer, header in messages:
        order.add(peer, header, name)
    names = [order.pop() for _ in range(len(messages))]
    assert order.pop() is None and len(order) == 0
    return names


def test_priority_zero_everywhere_keeps_the_arrival_order():
    messages = [(i, f'server {i % 2}', push(i) if i % 3 else pull(i)) for i in range(9)]
    assert ordered(messages) == list(range(9))


def test_a_higher_priority_goes_first_and_one_priority_keeps_its_order():
    messages = [('a', 's0', push(1)), ('b', 's0', push(2, priority=5)),
                ('c', 's1', pull(3, priority=-1)), ('d', 's0', push(4, priority=5)),
                ('e', 's1', pull(5))]
    assert ordered(messages) == ['b', 'd', 'a', 'e', 'c']


def test_a_pull_takes_the_earlier_push_of_its_key_along_instead_of_overtaking_it():
    # The server would answer that pull after the push anyway: sending the push first is
    # what lets the pull be answered early.
    messages = [('other', 's0', push(9)), ('push 1', 's0', push(1, 2)),
                ('pull 1', 's0', pull(1, priority=3))]
    assert ordered(messages) == ['push 1', 'pull 1', 'other']


def test_the_same_key_on_another_server_is_another_key_part():
    messages = [('push on s0', 's0', push(1)), ('pull on s1', 's1', pull(1, priority=3))]
    assert ordered(messages) == ['pull on s1', 'push on s0']


def test_pushes_of_one_key_keep_their_order_whatever_their_priorities():
    messages = [(f'push {seq}', 's0', push(1, priority=seq)) for seq in range(4)]
    assert ordered(messages) == ['push 0', 'push 1', 'push 2', 'push 3']


def test_what_must_go_first_is_found_through_a_chain_of_key_parts():
    messages = [('a', 's0', push(1)), ('x', 's0', push(7)), ('b', 's0', push(1, 2)),
                ('y', 's0', push(8, priority=2)), ('c', 's0', pull(2, priority=5))]
    assert ordered(messages) == ['a', 'b', 'c', 'y', 'x']


def test_nothing_passes_a_message_that_is_not_a_data_request_nor_does_it_pass_any():
    init = {'op': P.INIT, 'sync': True, 'keys': []}
    messages = [('a', 's0', push(1)), ('init', 's1', init), ('b', 's0', pull(2, priority=9)),
                ('barrier', 'scheduler', {'op': P.BARRIER, 'seq': 1}),
                ('c', 's1', pull(3, priority=9))]
    assert ordered(messages) == ['a', 'init', 'b', 'barrier', 'c']


def test_messages_added_between_pops_wait_behind_those_taken_along():
    order = PriorityOrder()
    order.add('s0', push(1), 'push 1')
    order.add('s0', push(2), 'push 2')
    order.add('s0', pull(1, priority=4), 'pull 1')
    assert order.pop() == 'push 1'
    order.add('s0', pull(3, priority=9), 'pull 3')
    assert [order.pop() for _ in range(3)] == ['pull 1', 'pull 3', 'push 2']


def test_a_burst_of_one_priority_is_served_as_it_came():
    burst = [(b'worker-0', push(1)), (b'worker-1', pull(1))]
    assert by_priority(burst) is burst
    assert by_priority([]) == []


def test_a_burst_is_served_by_priority_each_workers_key_parts_in_order():
    burst = [(b'worker-0', push(1), 'w0 push 1'), (b'worker-1', push(1), 'w1 push 1'),
             (b'worker-1', pull(1, priority=2), 'w1 pull 1'),
             (b'worker-0', pull(2, priority=1), 'w0 pull 2')]
    assert [m[2] for m in by_priority(burst)] == ['w1 push 1', 'w1 pull 1', 'w0 pull 2',
                                                  'w0 push 1']


# -- the worker's I/O thread --------------------------------------------------------------
class _Dealer:
    """A server's socket that records the headers sent on it."""

    def __init__(self, name, sent):
        self.name, self.sent = name, sent

    def send(self, frames, on_taken=None):
        header, _ = P.decode(frames)
        self.sent.append((self.name, header['op'], [item.key for item in header['keys']]))

    def close(self, linger_s):
        pass


def test_the_io_thread_sends_the_highest_priority_first_a_keys_pull_after_its_push():
    io = WorkerIO(Config())
    sent = []
    io._servers = {f'server {r}': _Dealer(r, sent) for r in range(2)}
    try:
        for node, header in [('server 0', push(1)), ('server 1', push(2)),
                             ('server 0', push(3, priority=1)),
                             ('server 1', pull(2, priority=7)),
                             ('server 0', pull(3, priority=1)),
                             ('server 0', pull(4, priority=7))]:
            pushing = header['op'] == P.PUSH   # (a thread's push, over the socket)
            frames = [np.zeros(1, np.float32)] if pushing else []
            io._queue.append((node, header, frames, Request(
                Operation('call', 1), node, pusher=threading.get_ident() if pushing else None)))
        io._send_queued()
    finally:
        io._close()
    assert sent == [(1, P.PUSH, [2]), (1, P.PULL, [2]), (0, P.PULL, [4]), (0, P.PUSH, [3]),
                    (0, P.PULL, [3]), (0, P.PUSH, [1])]


# -- the server's burst ---------------------------------------------------------------------
def test_a_server_serves_a_burst_by_priority():
    server = Server.__new__(Server)   # its sockets and shard are not needed to order
    frames = [np.zeros(1, np.float32)]
    server.router = Router([(b'worker-0', P.encode(push(1), frames)),
                             (b'worker-1', P.encode(push(1), frames)),
                             (b'worker-1', P.encode(pull(1, priority=3))),
                             (b'worker-0', P.encode(pull(5, priority=2)))])
    server.config, server.counts, server.recovery = Config(), ServerCounts(), None
    server.workers, server.name = {b'worker-0', b'worker-1'}, 'server 0'
    served = []
    server._handle = lambda identity, header, _: served.append(
        (identity, header['op'], header['keys'][0].key))
    server._serve_burst()
    assert served == [(b'worker-1', P.PUSH, 1), (b'worker-1', P.PULL, 1),
                      (b'worker-0', P.PULL, 5), (b'worker-0', P.PUSH, 1)]
    assert server.counts.requests == 4


# -- the calls --------------------------------------------------------------------------------
def test_priority_is_an_int_of_32_bits():
    assert checked_priority(np.int64(-3)) == -3
    with pytest.raises(TypeError, match='priority must be an int'):
        checked_priority(1.5)
    with pytest.raises(TypeError):
        checked_priority(True)
    with pytest.raises(ValueError, match='32 bits'):
        checked_priority(2 ** 31)
    with pytest.raises(ProtocolError, match='priority'):
        P.validate_header({**pull(1), 'priority': 2 ** 40})


def test_a_local_store_takes_priority_and_gives_what_priority_zero_gives():
    kv = create('local')
    kv.init([0, 1], [np.ones(3, np.float32)] * 2)
    kv.push([0, 1], [np.full(3, 2, np.float32)] * 2, priority=-4)
    out = [np.empty(3, np.float32) for _ in range(2)]
    kv.pull([0, 1], out=out, priority=9)
    kv.pushpull(0, np.full(3, 5, np.float32), out=out[0], priority=3)
    assert out[0].tolist() == [5] * 3 and out[1].tolist() == [2] * 3
    with pytest.raises(TypeError):
        kv.pull(0, out=out[0], priority='high')
