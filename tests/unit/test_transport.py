"""The transport: a tracked message is done only when zmq has let go of every frame that it did
not copy, whatever the order of big and small frames; ports come from the OS; IPv6 is named."""

import socket

import numpy as np
import pytest

from kvps.errors import ConfigError
from kvps.transport import Dealer, Router, Socket, new_context, resolve

BIG = 1 << 20      # above the copy threshold: sent in place, so tracked
SMALL = 1 << 10    # below it: copied at send time


@pytest.fixture
def stalled_dealer():
    """A DEALER connected to a TCP listener that never answers zmq's greeting: everything it
    sends stays queued inside zmq, frames included, until the socket closes."""
    listener = socket.create_server(('127.0.0.1', 0))
    ctx = new_context()
    dealer = Dealer(ctx, b'worker-0')
    dealer.connect('127.0.0.1', listener.getsockname()[1])
    yield dealer
    dealer.close(linger_s=0)
    ctx.term()
    listener.close()


@pytest.mark.parametrize('order', ['big_last', 'big_first', 'big_in_the_middle'])
def test_a_tracked_message_is_pending_while_any_uncopied_frame_is(stalled_dealer, order):
    big, small = np.ones(BIG, np.uint8), b'x' * SMALL
    frames = {'big_last': [small, small, big], 'big_first': [big, small, small],
              'big_in_the_middle': [small, big, small]}[order]
    tracker = Socket.send(stalled_dealer, frames, track=True)
    assert tracker is not None and not tracker.done


def test_a_message_of_copied_frames_needs_no_tracking(stalled_dealer):
    assert Socket.send(stalled_dealer, [b'a', b'b' * SMALL], track=True) is None


def test_port_zero_is_the_operating_systems_choice():
    """Not a random pick over 1024-65535, which could take the fixed port (9091, say) that
    another job on the host was told to use."""
    low, high = map(int, open('/proc/sys/net/ipv4/ip_local_port_range').read().split())
    ctx = new_context()
    routers = [Router(ctx) for _ in range(5)]
    try:
        ports = [r.bind('127.0.0.1') for r in routers]
        assert all(low <= p <= high for p in ports) and len(set(ports)) == 5
        with socket.create_connection(('127.0.0.1', ports[0]), timeout=5):
            pass                                      # really listening there
    finally:
        for r in routers:
            r.close(linger_s=0)
        ctx.term()


def test_an_ipv6_scheduler_address_is_refused_at_once():
    with pytest.raises(ConfigError, match='IPv6'):
        resolve('::1', timeout_s=60)
