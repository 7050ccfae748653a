"""Raw ZeroMQ peers for the hostile-input tests: signed dealers, a fake worker that keeps its
place in the job, a reader of a child's output, and a one-server job to aim requests at."""

import collections
import os
import re
import threading
import time
import uuid

import zmq

from kvps.wire import protocol as P
from kvps.wire.auth import TO_DEALER, TO_ROUTER, Guard
from kvps.wire.identities import identity_salt, worker_identity

SECRET = 'hostile-input-test-secret'

# Longer liveness bound than conftest.FAST: this test keeps both cores busy on purpose.
# Every refusal logged: the test counts one line per refused message (kvps.wire.refusals).
CLUSTER_ENV = {'KVPS_HEARTBEAT_TIMEOUT': '20', 'KVPS_TIMEOUT': '60', 'KVPS_SECRET': SECRET,
               'KVPS_LOG_REFUSALS': 'all'}


class Output:
    """Reads a child's combined output on a thread (a full pipe would stall the child)."""

    def __init__(self, proc):
        self.proc, self.lines = proc, []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        try:
            for line in self.proc.stdout:
                self.lines.append(line)
        except (ValueError, OSError):  # the fixture closed the pipe at teardown
            pass

    @property
    def text(self):
        return ''.join(self.lines)

    def wait_for(self, pattern, timeout, while_waiting=lambda: None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.text)
            if match:
                return match
            assert self.proc.poll() is None, f'exited {self.proc.returncode}:\n{self.text}'
            while_waiting()
            time.sleep(0.05)
        raise AssertionError(f'no {pattern!r} within {timeout} s:\n{self.text}')

    def exit_code(self, timeout, while_waiting=lambda: None):
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            while_waiting()
            time.sleep(0.05)
        code = self.proc.wait(max(0.1, deadline - time.monotonic()))
        self._thread.join(10)
        return code


def dealer(ctx, address, identity=None):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)   # a node that stops reading fails the test
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return sock


class Signed:
    """A DEALER that signs what it sends and verifies what it gets, as kvps nodes do."""

    def __init__(self, ctx, address, identity, secret):
        self.identity, self.sock = identity, dealer(ctx, address, identity)
        self.guard = Guard(secret) if secret else None
        self.last_sent = None

    def send(self, frames):
        if self.guard is not None:
            frames = self.guard.sign(frames, TO_ROUTER, self.identity)
        self.last_sent = frames
        self.sock.send_multipart(frames)

    def recv(self):
        frames = self.sock.recv_multipart()
        if self.guard is not None:
            frames = self.guard.verify(frames, TO_DEALER, self.identity)
        return P.decode(frames)[0]


class FakeWorker:
    """The test as a worker of the job: registered, heartbeating, waiting at every barrier."""

    def __init__(self, ctx, scheduler_addr, secret, rank, calls=lambda seq: 'barrier'):
        """``calls(seq)``: the store call the job's real worker meets barrier ``seq`` from."""
        self.secret, self.calls = secret, calls
        self.link = Signed(ctx, scheduler_addr, f'worker-{uuid.uuid4().hex[:12]}'.encode(),
                           secret)
        self.link.send(P.encode({'op': P.REGISTER, 'id': 0, 'role': 'worker',
                                 'host': '127.0.0.1', 'port': 0, 'rank': rank,
                                 'pid': os.getpid(), 'version': P.VERSION}))
        self.welcome, self.heard, self._beat = None, collections.Counter(), 0.0

    def tick(self):
        """Heartbeat when due and read what the scheduler said."""
        if time.monotonic() - self._beat > 0.3:
            self.link.send(P.encode({'op': P.HEARTBEAT, 'id': 0}))
            self._beat = time.monotonic()
        while self.link.sock.poll(0):
            header = self.link.recv()
            self.heard[header['op']] += 1
            assert header['op'] not in (P.SHUTDOWN, P.PEER_LOST), header
            if header['op'] == P.WELCOME:
                self.welcome = header
                self._barrier(1)
            elif header['op'] == P.BARRIER_DONE:
                # Wait at the next barrier the real worker will reach, as a worker would
                # (the scheduler accepts only the barrier the job is at).
                self._barrier(header['id'] + 1)

    def _barrier(self, seq):
        self.link.send(P.encode({'op': P.BARRIER, 'id': seq, 'seq': seq,
                                 'call': self.calls(seq)}))

    def member(self, rank):
        """The identity worker ``rank`` of this job has towards the servers (once welcomed)."""
        while self.welcome is None:
            self.tick()
            time.sleep(0.01)
        return worker_identity(rank, salt=identity_salt(self.secret, self.welcome['job']))

    def finish(self):
        self.link.send(P.encode({'op': P.FINISH, 'id': -1}))


def answers(signed, proc, probe, timeout=10.0):
    """Whether the node still answers ``probe`` (False as soon as its process is gone)."""
    signed.send(P.encode(probe))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if signed.sock.poll(100):
            header = signed.recv()
            if header.get('id') == probe['id']:
                return True
    return False


def lone_server(by_hand, ctx, extra=None):
    """A job of one server (INFO log; ``extra``: more of its settings) whose worker 0 is the
    test: (server, fake, signed)."""
    sched, env = by_hand.scheduler(1, 1, extra=CLUSTER_ENV)
    server = Output(by_hand('server', {**env, 'KVPS_LOG_LEVEL': 'INFO', **(extra or {})},
                            rank=0))
    fake = FakeWorker(ctx, f'tcp://127.0.0.1:{env["DMLC_PS_ROOT_PORT"]}', SECRET, rank=0)
    host, port = server.wait_for(r'serving on (\S+):(\d+)', 60, fake.tick).groups()
    return server, fake, Signed(ctx, f'tcp://{host}:{port}', fake.member(0), SECRET)


def reply(signed, header, timeout=10.0, buffers=()):
    """Send ``header`` (with ``buffers``) and return the server's answer to its id."""
    signed.send(P.encode(header, buffers))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if signed.sock.poll(100):
            answer = signed.recv()
            if answer.get('id') == header['id']:
                return answer
    raise AssertionError(f'no answer to {header}')
