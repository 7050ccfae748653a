"""A node's link to the scheduler: registration, heartbeats and the scheduler's liveness."""

import logging
import os
import time
import uuid

from ..errors import (ConfigError, KVPSError, PeerLostError, ProtocolError, RequestTimeout,
                      from_remote)
from ..timeline import recording
from . import protocol as P
from .bundle import unbundled
from .refusals import REFUSALS
from .transport import Dealer, advertised_host, guard_from, resolve

log = logging.getLogger('kvps')
# Heartbeats sent 50 ms apart at the start when the timeline records: the clock offset it
# aligns nodes with is read at each, and the quietest round trip is kept.
CLOCK_READINGS = 6


class SchedulerLink:
    """Owned by one loop thread: the DEALER to the scheduler and what it has told us."""

    def __init__(self, ctx, config, role):
        self.config, self.role = config, role
        if not config.scheduler_port:   # else it would wait out the connect bound in vain
            raise ConfigError(
                f'DMLC_PS_ROOT_PORT=0 (or KVPS_SCHEDULER_PORT) on a {role}: port 0 (the OS '
                'picks) means something only on the scheduler; give every other node the '
                'port the scheduler bound (it writes it to KVPS_PORT_FILE)')
        self.scheduler_ip = resolve(config.scheduler_host, config.connect_timeout)
        self.host = advertised_host(config, self.scheduler_ip)
        self.socket = Dealer(ctx, f'{role}-{uuid.uuid4().hex[:12]}'.encode(),
                             guard_from(config))
        self.socket.connect(self.scheduler_ip, config.scheduler_port)
        self._last_heard = self._last_sent = self._last_tick = time.monotonic()
        self._beats = {}     # heartbeat id -> when it left (ns), to read the scheduler's clock
        self._beat = 0

    def register(self, port=0):
        """Send REGISTER and wait for WELCOME (every node has arrived); return WELCOME."""
        self._beats[0] = recording.now()
        self.send({'op': P.REGISTER, 'id': 0, 'role': self.role, 'host': self.host,
                   'port': port, 'rank': self.config.rank, 'pid': os.getpid(),
                   'rank_from': self.config.rank_from, 'version': P.VERSION,
                   'beat': self.config.heartbeat_interval,
                   'shared': self.config.shared_settings(self.role)})
        # Wait a little past the scheduler's own bound: its verdict names the missing nodes.
        deadline = time.monotonic() + self.config.connect_timeout + max(
            2.0, 2 * self.config.heartbeat_interval)
        poll, interval = self.socket.raw.poll, self.config.heartbeat_interval
        while True:
            now = time.monotonic()
            left = deadline - now
            if now - self._last_sent >= interval:   # alive while it waits: one that dies
                self.heartbeat()                    # here frees its rank for a restarted one
            if left <= 0:
                raise RequestTimeout(
                    f'{self.role} waited {self.config.connect_timeout:.0f} s for the scheduler at '
                    f'{self.config.scheduler_host}:{self.config.scheduler_port} and the other '
                    f'nodes to register (KVPS_CONNECT_TIMEOUT); {self._secret_hint()}')
            if not poll(int(min(left, interval) * 1000)):
                continue
            header = self.next_message()
            if header is None:
                continue
            if header['op'] == P.WELCOME:
                self._last_tick = time.monotonic()   # (this wait beat on its own)
                # a first reading of the scheduler's clock, from a quiet moment (not the
                # welcome's)
                if recording.recorder_kept() is not None:
                    self.heartbeat()
                return header
            self.raise_if_fatal(header)

    def _secret_hint(self):
        """The scheduler never answers a message it cannot authenticate (an answer would help
        an attacker), so a node with the wrong secret only ever times out."""
        if self.config.secret_value():
            return ('if the scheduler is up, check that this node has the job\'s KVPS_SECRET '
                    '(or KVPS_SECRET_FILE): the scheduler ignores messages signed with another')
        return ('if the scheduler is up and the job has a secret (kvps.launch makes one), this '
                'node needs it too (KVPS_SECRET or KVPS_SECRET_FILE): the scheduler ignores '
                'unsigned messages')

    def next_message(self):
        """The scheduler's next header, or None if it was malformed (logged, not fatal)."""
        frames = self.socket.recv()
        if frames is None:
            return None
        self._last_heard = time.monotonic()
        decoded = decode_or_log(frames, self.config, 'the scheduler')
        if decoded is None:
            return None
        header = decoded[0]
        if 'clock' in header:
            recorder = recording.recorder_kept()   # (paused too: spans recorded later need it)
            if recorder is not None:
                self._read_clock(header, recorder)
        return header

    def _read_clock(self, header, recorder):
        """The scheduler's clock, as a WELCOME or HEARTBEAT_ACK read it: the timeline's
        offset onto the scheduler's time (nodes' spans are aligned with it)."""
        sent = self._beats.pop(header['id'] if header['op'] == P.HEARTBEAT_ACK else 0, None)
        if sent is not None:
            received = recording.now()
            recorder.clock(*recording.clock_sample(sent, header['clock'], received))

    def raise_if_fatal(self, header):
        """Turn the scheduler's ERROR / SHUTDOWN / PEER_LOST into the matching exception."""
        op = header['op']
        if op == P.ERROR:
            raise from_remote(header['type'], header['message'], header.get('traceback', ''),
                              'scheduler')
        if op == P.PEER_LOST:
            raise PeerLostError(f'{header["reason"]}', header['role'], header.get('rank'),
                                header.get('host'))
        if op == P.SHUTDOWN:
            raise ConfigError(f'the scheduler shut the job down: {header.get("reason", "")}')

    def abort(self, reason):
        """Tell the scheduler this node is failing (it then ends the job at once, naming
        us, instead of a heartbeat timeout later); closing the socket delivers it."""
        try:
            self.send({'op': P.ABORT, 'id': 0, 'reason': reason[:2000]})
        except KVPSError:   # the scheduler is gone too: nobody to tell
            pass

    def send(self, header):
        self.socket.send(P.encode(header))
        self._last_sent = time.monotonic()

    def tick(self, now):
        """Heartbeat when due; raise PeerLostError if the scheduler has gone silent."""
        interval = self.config.heartbeat_interval
        if recording.recorder_kept() is not None and self._beat < CLOCK_READINGS:
            interval = min(interval, 0.05)   # read the scheduler's clock a few times at first
        if now - self._last_tick > self.config.heartbeat_timeout:
            # This node did not run (stopped, suspended, its loop held up): the silence was its
            # own, not the scheduler's, which gets a whole timeout to answer a beat sent now
            # (one that took us for lost says so).
            log.warning('this %s did not run for %.1f s, longer than KVPS_HEARTBEAT_TIMEOUT: '
                        'the job may have taken it for lost', self.role, now - self._last_tick)
            self._last_heard, self._last_sent = now, 0.0
        self._last_tick = now
        if now - self._last_sent >= interval:
            self.heartbeat()
        silent = now - self._last_heard
        if silent > self.config.heartbeat_timeout:
            raise PeerLostError(
                f'lost the scheduler at {self.config.scheduler_host}:'
                f'{self.config.scheduler_port}: silent for {silent:.1f} s '
                f'(KVPS_HEARTBEAT_TIMEOUT={self.config.heartbeat_timeout:g})',
                'scheduler', 0, self.config.scheduler_host)

    def heartbeat(self, **fields):
        """Send a heartbeat now (``fields``: news for the scheduler, as ``checkpointed``)."""
        self._beat += 1
        if len(self._beats) > 8:   # acks that never came (the scheduler was busy)
            self._beats.clear()
        self._beats[self._beat] = recording.now()
        self.send({'op': P.HEARTBEAT, 'id': self._beat, **fields})

    def close(self):
        self.socket.close()


def decode_or_log(frames, config, source):
    """Decode a message; on ProtocolError log the reason and return None (keep serving).
    ``frames`` is None when authentication already refused the message (and logged why)."""
    decoded = decode_or_refusal(frames, config, source)
    return None if isinstance(decoded, ProtocolError) else decoded


def decode_or_refusal(frames, config, source):
    """As decode_or_log, but a message refused as malformed gives its ProtocolError (logged)
    instead of None: whoever waits for an answer to it can be told why."""
    if frames is None:
        return None
    try:
        return P.decode(frames, config.max_message_bytes)
    except ProtocolError as exc:
        return _refused_as_malformed(source, exc)


def decoded_or_refusals(frames, config, source):
    """``(frames, decode_or_refusal of them)`` for each message ``frames`` carries (one, or a
    bundle's: kvps.wire.bundle); none where authentication refused it."""
    if frames is None:
        return []
    try:
        messages = unbundled(frames)
    except ProtocolError as exc:
        return [(frames, _refused_as_malformed(source, exc))]
    return [(message, decode_or_refusal(message, config, source)) for message in messages]


def _refused_as_malformed(source, exc):
    """``exc``, a message's ProtocolError, logged (rate-limited) as a refusal of ``source``."""
    REFUSALS.refuse(source, 'malformed', 'rejected a message from %s: %s', source, exc)
    return exc
