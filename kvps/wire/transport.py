"""The only module importing zmq: sockets, zero-copy send/recv, polling, addresses, error mapping."""

import errno
import fcntl
import logging
import random
import socket
import struct
import threading
import time
import weakref

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..config import variable
from ..errors import AuthError, ConfigError, TransportError
from ..env_parsers import port_range_text
from .auth import TO_DEALER, TO_ROUTER, Guard
from .refusals import REFUSALS

log = logging.getLogger('kvps.wire.transport')

_LOOPBACK_NAMES = ('127.0.0.1', 'localhost')


# Plain ints: pyzmq's Flag enum costs an enum construction per `|`, per frame.
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)


def new_context():
    return zmq.Context(io_threads=1)


def guard_from(config):
    """A fresh Guard when the job has a secret (one per socket: sessions are per socket)."""
    secret = config.secret_value()
    return Guard(secret, config.auth_payload) if secret else None


class Socket:
    """One zmq socket used by exactly one thread; frames go out and come in without copies."""

    def __init__(self, ctx, kind, identity=None, guard=None):
        self.guard = guard
        self._sock = ctx.socket(kind)
        self._sock.setsockopt(zmq.LINGER, 2000)
        # kvps bounds memory with its own in-flight window; zmq must never drop silently.
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        if identity is not None:
            self._sock.setsockopt(zmq.IDENTITY, identity)
        # Frames below this are copied: cheaper than tracking a zero-copy frame, whose release
        # wakes pyzmq's garbage-collector thread (and needs the GIL) once per frame.
        self._sock.copy_threshold = 1 << 18

    @property
    def raw(self):
        return self._sock

    def send(self, frames, track=False):
        """Queue a message without ever blocking: a loop thread that blocks in send cannot
        notice that its peer is gone. A full or vanished peer raises TransportError.
        With ``track``, return a tracker whose ``done`` says zmq has let go of every frame it
        did not copy (None: it copied them all)."""
        send, last = self._sock.send, len(frames) - 1
        try:
            if not track:
                for i, frame in enumerate(frames):
                    send(frame, _MORE if i < last else _LAST, copy=False)
                return None
            # Each frame sent in place has a tracker of its own, and zmq may let go of them in
            # any order: pyzmq's send_multipart returns only the last one's, which is already
            # done when the last frame was small enough to copy.
            trackers = [send(frame, _MORE if i < last else _LAST, copy=False, track=True)
                        for i, frame in enumerate(frames)]
        except zmq.ZMQError as exc:
            raise TransportError(f'send failed: {exc}') from None
        pending = [t for t in trackers if not t.done]
        return zmq.MessageTracker(*pending) if pending else None

    def send_taken(self, frames, on_taken):
        """Send as ``send`` does, and call ``on_taken()`` (on pyzmq's garbage collector
        thread) once zmq has taken the whole message off its queue toward the peer: its last
        frame goes uncopied, whatever its size, and zmq takes a message's frames in order."""
        # a view of its own, which only pyzmq holds once sent: it ends when zmq lets go
        view = memoryview(frames[-1])
        weakref.finalize(view, on_taken)
        Socket.send(self, [*frames[:-1], zmq.Frame(view, copy=False)])   # (signed: no subclass's)

    def recv(self):
        """Frames of one message; each supports the buffer protocol (no copy made)."""
        try:
            return [f.buffer for f in self._sock.recv_multipart(copy=False)]
        except zmq.ZMQError as exc:
            raise TransportError(f'receive failed: {exc}') from None

    def close(self, linger_s=2.0):
        self._sock.close(linger=int(linger_s * 1000))


def job_router(ctx, config):
    """A scheduler's or server's Router, signed as guard_from says. It reads frames of up to
    4x KVPS_MAX_MESSAGE_BYTES (a message over that bound is refused, saying why); a peer
    announcing a bigger one, a hostile or broken one, is cut off before its bytes are kept
    (authentication comes only once they all are)."""
    return Router(ctx, guard_from(config), 4 * config.max_message_bytes)


class Router(Socket):
    """A bound ROUTER: receives ``[identity, *frames]`` and answers by identity."""

    def __init__(self, ctx, guard=None, max_frame_bytes=None):
        super().__init__(ctx, zmq.ROUTER, guard=guard)
        # Replying to a peer that is gone raises instead of vanishing silently.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A peer connecting again under its name (after a reset this side may not have seen
        # yet) takes it over. With a secret no stranger can: workers' names carry a tag only
        # the job's members can make (kvps.wire.identities).
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if max_frame_bytes:   # a peer announcing a bigger frame is cut off before it is kept
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)

    def bind(self, host, port=0, port_range=None):
        """Bind host:port and return the port bound. Port 0: one the OS picks, or, with a
        ``port_range`` (KVPS_PORT_RANGE), the first free one of the range from a random start
        (nodes starting together on a host then rarely try the same ports)."""
        try:
            if port:
                self._sock.bind(f'tcp://{host}:{port}')
                return port
            if port_range is not None:
                return self._bind_in_range(host, port_range)
            # zmq's wildcard port binds port 0: the OS picks from its ephemeral range, so a
            # job never takes the fixed port another job on the host was told to use
            self._sock.bind(f'tcp://{host}:*')
            endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            return int(endpoint.rsplit(':', 1)[1])
        except zmq.ZMQError as exc:
            raise TransportError(f'cannot bind {host}:{port}: {exc}') from None

    def _bind_in_range(self, host, ports):
        start = random.randrange(len(ports))
        for i in range(len(ports)):
            port = ports[(start + i) % len(ports)]
            try:
                self._sock.bind(f'tcp://{host}:{port}')
                return port
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
        raise ConfigError(f'KVPS_PORT_RANGE={port_range_text(ports)}: every port of it is in '
                          f'use on {host} ({len(ports)} tried); widen the range (the '
                          'scheduler and every server of a host each need one)')

    def recv_from(self):
        """``(identity, frames)``; frames is None when authentication refused the message."""
        frames = self.recv()
        identity = bytes(frames[0])
        return identity, _verified(self.guard, frames[1:], TO_ROUTER, identity)

    def send_to(self, identity, frames, track=False):
        if self.guard is not None:
            frames = self.guard.sign(frames, TO_DEALER, identity)
        return Socket.send(self, [identity, *frames], track)


class Dealer(Socket):
    """A connecting DEALER with a fixed identity; signs and verifies when it has a guard."""

    def __init__(self, ctx, identity, guard=None):
        super().__init__(ctx, zmq.DEALER, identity, guard)
        self.identity = identity

    def send(self, frames, on_taken=None):
        """Send ``frames``; with ``on_taken``, as Socket.send_taken."""
        if self.guard is not None:
            frames = self.guard.sign(frames, TO_ROUTER, self.identity)
        if on_taken is None:
            super().send(frames)
        else:
            self.send_taken(frames, on_taken)

    def recv(self):
        """The frames of one message, or None when authentication refused it."""
        return _verified(self.guard, super().recv(), TO_DEALER, self.identity)

    def connect(self, host, port):
        self._sock.connect(f'tcp://{_bracket(host)}:{port}')


class Monitor:
    """The connection events of a socket (``raw``: what a Poller waits on): ``event()``
    says 'reset' (its connection went down) or 'up' (connected, handshake done), else None."""

    _EVENTS = {zmq.EVENT_DISCONNECTED: 'reset', zmq.EVENT_HANDSHAKE_SUCCEEDED: 'up'}

    def __init__(self, sock):
        self.raw = sock.raw.get_monitor_socket(zmq.EVENT_DISCONNECTED
                                               | zmq.EVENT_HANDSHAKE_SUCCEEDED)

    def event(self):
        return self._EVENTS.get(recv_monitor_message(self.raw)['event'])

    def close(self):
        self.raw.close(linger=0)


class Poller:
    """Waits on several sockets at once."""

    def __init__(self):
        self._poller = zmq.Poller()
        self._by_raw = {}

    def register(self, sock):
        self._poller.register(sock.raw, zmq.POLLIN)
        self._by_raw[sock.raw] = sock

    def unregister(self, sock):
        self._poller.unregister(sock.raw)
        del self._by_raw[sock.raw]

    def poll(self, timeout_s):
        """The sockets with a message waiting, after at most ``timeout_s`` seconds."""
        events = self._poller.poll(max(0, int(timeout_s * 1000)))
        return [self._by_raw[raw] for raw, _ in events]


class Waker:
    """Lets any thread wake a loop thread blocked in Poller.poll (an inproc pair)."""

    _count = 0

    def __init__(self, ctx):
        Waker._count += 1
        address = f'inproc://kvps-waker-{id(self)}-{Waker._count}'
        self.socket = Socket(ctx, zmq.PULL)
        self.socket.raw.bind(address)
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(address)
        self._lock = threading.Lock()

    def wake(self):
        with self._lock:
            if not self._push.closed:  # waking a loop that has already ended is a no-op
                self._push.send(b'', copy=True)

    def drain(self):
        while True:
            try:
                self.socket.raw.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close(self):
        with self._lock:
            self._push.close(linger=0)
        self.socket.close(0)


def _verified(guard, frames, direction, identity):
    if guard is None:
        return frames
    try:
        return guard.verify(frames, direction, identity)
    except AuthError as exc:
        REFUSALS.refuse(identity, str(exc).split(' (')[0], 'refused a message from %r: %s',
                        identity, exc)
        return None


def _bracket(host):
    return f'[{host}]' if ':' in host else host


def resolve(host, timeout_s):
    """IP address of ``host``, retrying DNS until ``timeout_s`` (services appear late on k8s)."""
    if ':' in host:   # an IPv6 literal: retrying cannot help
        raise ConfigError(f'scheduler host {host!r} ({variable("scheduler_host")}) is an IPv6 '
                          'address; kvps speaks IPv4: give an IPv4 address or a name that has '
                          'one')
    deadline = time.monotonic() + timeout_s
    warned = False
    while True:
        try:
            return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        except socket.gaierror as exc:
            if time.monotonic() >= deadline:
                raise ConfigError(f'cannot resolve scheduler host {host!r} '
                                  f'({variable("scheduler_host")}): {exc}') from None
            if not warned:   # once: a misspelled name must not look like a silent hang
                log.warning('cannot resolve scheduler host %r yet (%s); retrying until '
                            'KVPS_CONNECT_TIMEOUT (%g s) runs out', host, exc, timeout_s)
                warned = True
            time.sleep(0.5)


def interface_address(name):
    """IPv4 address of a network interface (DMLC_INTERFACE), e.g. 'eth0'."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack('256s', name[:15].encode()))
        except OSError as exc:
            raise ConfigError(f'interface {name!r} ({variable("interface")}) has no IPv4 '
                              f'address: {exc}') from None
    return socket.inet_ntoa(packed[20:24])


def advertised_host(config, scheduler_ip):
    """The address this node tells peers to reach it at."""
    if config.node_host:
        return _checked_node_host(config.node_host, config.use_kubernetes)
    if config.interface:
        return interface_address(config.interface)
    if scheduler_ip.startswith('127.') or config.scheduler_host in _LOOPBACK_NAMES:
        return '127.0.0.1'
    # The source address of the route to the scheduler (a UDP connect sends nothing).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((scheduler_ip, config.scheduler_port or 9))
        return s.getsockname()[0]


def _checked_node_host(host, use_kubernetes):
    """``host`` (KVPS_NODE_HOST) once it can be an address: without Kubernetes the node binds
    it, so it must resolve here (under Kubernetes it names a Service, which may not yet)."""
    try:
        if any(c.isspace() for c in host):
            raise ValueError('an address has no spaces')
        if not use_kubernetes:
            socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (ValueError, socket.gaierror) as exc:
        raise ConfigError(f'{variable("node_host")}={host!r}: not an address this node can '
                          f'bind ({exc})') from None
    return host


def bind_host(config, advertised):
    """Where to bind: all interfaces under Kubernetes (the advertised name is a Service)."""
    return '0.0.0.0' if config.use_kubernetes else advertised
