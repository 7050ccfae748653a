"""The transport's send: a tracked message is done only when zmq has let go of every frame that
it did not copy, whatever the order of big and small frames."""

import socket

import numpy as np
import pytest

from kvps.transport import Dealer, Socket, new_context

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
