"""The transport: a tracked message is done only when zmq has let go of every frame that it did
not copy, whatever the order of big and small frames; ports come from the OS; IPv6 is named;
a scheduler host not (yet) in DNS is said once, then retried quietly."""

import logging
import socket
import threading

import numpy as np
import pytest

from kvps.config import Config
from kvps.errors import ConfigError
from kvps.wire import transport
from kvps.wire.transport import (Dealer, Router, Socket, advertised_host, interface_address,
                                 new_context, resolve)

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


def test_a_sender_hears_once_zmq_has_taken_the_whole_message(stalled_dealer):
    queued = threading.Event()
    stalled_dealer.send([b'header', b'x' * SMALL], on_taken=queued.set)   # (small: tracked too)
    assert not queued.wait(0.2)   # the peer never reads: zmq still holds it
    ctx = new_context()
    router, dealer = Router(ctx), Dealer(ctx, b'worker-0')
    dealer.connect('127.0.0.1', router.bind('127.0.0.1'))
    taken = threading.Event()
    dealer.send([b'header', np.ones(BIG, np.uint8)], on_taken=taken.set)
    assert taken.wait(30)
    identity, frames = router.recv_from()
    assert identity == b'worker-0' and bytes(frames[0]) == b'header'
    assert memoryview(frames[1]).nbytes == BIG
    dealer.close(0)
    router.close(0)
    ctx.term()


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


class FakeClock:
    """time for resolve(): sleep advances the clock, so retries take no real time."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def failing_dns(monkeypatch, failures):
    """getaddrinfo fails ``failures`` times (as for a name not yet in DNS), then answers."""
    calls = []

    def getaddrinfo(host, *args):
        calls.append(host)
        if len(calls) <= failures:
            raise socket.gaierror(socket.EAI_NONAME, 'Name or service not known')
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, '', ('10.0.0.7', 0))]
    monkeypatch.setattr(transport.socket, 'getaddrinfo', getaddrinfo)
    monkeypatch.setattr(transport, 'time', FakeClock())
    return calls


def test_an_unresolvable_scheduler_host_is_reported_once_while_retrying(monkeypatch, caplog):
    calls = failing_dns(monkeypatch, failures=5)
    with caplog.at_level(logging.WARNING, logger='kvps.wire.transport'):
        assert resolve('sched.example', timeout_s=120) == '10.0.0.7'
    assert len(calls) == 6
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "'sched.example'" in record.getMessage()
    assert 'Name or service not known' in record.getMessage()
    assert 'KVPS_CONNECT_TIMEOUT (120 s)' in record.getMessage()


def test_giving_up_on_dns_raises_after_the_one_warning(monkeypatch, caplog):
    calls = failing_dns(monkeypatch, failures=10 ** 6)
    with caplog.at_level(logging.WARNING, logger='kvps.wire.transport'):
        with pytest.raises(ConfigError, match="cannot resolve scheduler host 'sched.example'"):
            resolve('sched.example', timeout_s=3)
    assert len(calls) > 2 and len(caplog.records) == 1


def test_a_resolvable_host_logs_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger='kvps.wire.transport'):
        assert resolve('127.0.0.1', timeout_s=1) == '127.0.0.1'
    assert not caplog.records


@pytest.mark.parametrize('host, why', [('a b', 'no spaces'),
                                       ('no-such-host.invalid', 'not known|resolution')])
def test_a_bad_node_host_is_refused_naming_its_variable(host, why):
    config = Config(node_host=host, scheduler_host='127.0.0.1', scheduler_port=9)
    with pytest.raises(ConfigError, match=rf"^KVPS_NODE_HOST or DMLC_NODE_HOST='{host}': "
                                          rf'not an address this node can bind \(.*({why})'):
        advertised_host(config, '127.0.0.1')
    service = Config(node_host='no-such-host.invalid', use_kubernetes=True)
    assert advertised_host(service, '10.0.0.1') == 'no-such-host.invalid'   # a Service name


def test_resolve_and_interface_errors_name_their_variables(monkeypatch):
    failing_dns(monkeypatch, failures=10 ** 6)
    with pytest.raises(ConfigError, match=r'DMLC_PS_ROOT_URI'):
        resolve('sched.example', timeout_s=0.01)
    with pytest.raises(ConfigError, match=r"interface 'nosuch0' \(KVPS_INTERFACE or "
                                          r'DMLC_INTERFACE\) has no IPv4 address'):
        interface_address('nosuch0')


def _free_ports(count):
    """``count`` consecutive ports free on 127.0.0.1 now (the first of a run the OS gave)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(('127.0.0.1', 0))
            first = probe.getsockname()[1]
        if first + count > 65535:
            continue
        try:
            held = [socket.create_server(('127.0.0.1', first + i)) for i in range(count)]
        except OSError:
            continue
        for s in held:
            s.close()
        return first
    pytest.skip('no run of free ports found')


def test_a_port_range_restricts_the_ports_bound_until_every_one_is_taken():
    first = _free_ports(3)
    ports = range(first, first + 3)
    ctx = new_context()
    routers = [Router(ctx) for _ in range(4)]
    try:
        bound = [r.bind('127.0.0.1', 0, ports) for r in routers[:3]]
        assert sorted(bound) == [first, first + 1, first + 2]
        with pytest.raises(ConfigError, match=rf'KVPS_PORT_RANGE={first}-{first + 2}: every '
                                              r'port of it is in use on 127.0.0.1 \(3 tried\); '
                                              'widen the range'):
            routers[3].bind('127.0.0.1', 0, ports)
        # an explicit port (a scheduler's fixed one) is bound as given, range or not
        with socket.socket() as probe:
            probe.bind(('127.0.0.1', 0))
            fixed = probe.getsockname()[1]
        assert routers[3].bind('127.0.0.1', fixed, ports) == fixed
    finally:
        for r in routers:
            r.close(linger_s=0)
        ctx.term()


def test_a_router_cuts_off_a_peer_announcing_a_frame_over_its_bound():
    """Without the secret a peer could make a node keep gigabytes of one frame (checked only
    once whole): one announcing more than the bound is dropped, and others are served."""
    import zmq
    ctx = new_context()
    router = Router(ctx, max_frame_bytes=1024)
    hostile, honest = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        port = router.bind('127.0.0.1')
        for sock in (hostile, honest):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f'tcp://127.0.0.1:{port}')
        hostile.send(b'x' * 4096)
        honest.send(b'y' * 1024)
        assert router.raw.poll(5000)
        identity, frame = router.raw.recv_multipart()
        assert frame == b'y' * 1024
        assert not router.raw.poll(300)              # the big frame never arrives
    finally:
        hostile.close()
        honest.close()
        router.close(linger_s=0)
        ctx.term()
