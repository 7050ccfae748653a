"""Counts a node keeps from its start: `kv.stats()` returns a worker's, and `--stats` prints every node's rates.

Counting is always on and costs an addition where the counted thing happens (per call or
per message, a few per key at most); nothing is printed unless KVPS_STATS (`python -m
kvps.launch --stats SEC`) asks for a line every so many seconds.
"""

import dataclasses

from .stderr import STDERR


@dataclasses.dataclass
class WorkerCounts:
    """A worker's counts since it joined the job (kv.stats())."""
    push_calls: int = 0            # push and pushpull calls
    pull_calls: int = 0            # pull, pushpull and row pulls
    pushed_shm: int = 0            # bytes pushed through shared memory
    pushed_socket: int = 0         # bytes pushed over the socket
    pulled_shm: int = 0            # bytes pulled through shared memory (the worker's or the
    pulled_socket: int = 0         # server's) and over the socket
    pushed_ipc: int = 0            # bytes pushed and pulled through the worker's device
    pulled_ipc: int = 0            # segment (the ipc route: CUDA IPC)
    messages: int = 0              # requests sent to servers (several may share a message)
    answers: int = 0               # requests servers answered (acks riding on a DATA too)
    waits: int = 0                 # times a call blocked for answers
    wait_seconds: float = 0.0      # and for how long in all
    backpressure_waits: int = 0    # pushes that waited for room (KVPS_MAX_INFLIGHT_BYTES)
    backpressure_seconds: float = 0.0
    retries: int = 0               # requests sent again to a server that rejoined
    held: int = 0                  # requests held behind socket pushes (KVPS_SOCKET_QUEUE)
    joined: int = 0                # pushes sent in the message of the one queued before

    def count_wait(self, kind, nanoseconds):
        """A call blocked ``nanoseconds`` for answers (``kind`` 'wait') or for room to push
        ('backpressure'). (Threads may count at once: a lost increment is possible, rare.)"""
        if kind == 'backpressure':
            self.backpressure_waits += 1
            self.backpressure_seconds += nanoseconds / 1e9
        else:
            self.waits += 1
            self.wait_seconds += nanoseconds / 1e9

    def rates(self):
        """The counts a --stats line gives per second."""
        return {'pushed_shm_bytes': self.pushed_shm, 'pushed_socket_bytes': self.pushed_socket,
                'pulled_shm_bytes': self.pulled_shm, 'pulled_socket_bytes': self.pulled_socket,
                'messages': self.messages, 'answers': self.answers}

    def as_dict(self, rounds, in_flight, in_flight_bytes):
        """What kv.stats() returns: the counts by route, and the gauges of now."""
        counts = dataclasses.asdict(self)
        return {
            'pushed_bytes': {'shm': counts.pop('pushed_shm'),
                             'socket': counts.pop('pushed_socket'),
                             'ipc': counts.pop('pushed_ipc')},
            'pulled_bytes': {'shm': counts.pop('pulled_shm'),
                             'socket': counts.pop('pulled_socket'),
                             'ipc': counts.pop('pulled_ipc')},
            **counts, 'rounds': rounds, 'in_flight_requests': in_flight,
            'in_flight_push_bytes': in_flight_bytes}


@dataclasses.dataclass
class SchedulerCounts:
    """The scheduler's counts since it started."""
    heartbeats: int = 0
    barriers: int = 0              # barriers released


@dataclasses.dataclass
class ServerCounts:
    """A server's counts since it started."""
    requests: int = 0              # messages from workers (a bundle: one, kvps.wire.bundle)
    request_bytes: int = 0         # bytes of their frames (shared-memory payloads not counted)
    replies: int = 0               # messages to workers (a bundle: one)
    reply_bytes: int = 0           # bytes of the replies' frames


class Ticker:
    """Writes a node's line every ``seconds`` (0: never) from its loop's tick: the rate of
    each count since the last line (``read()`` gives the counts now, and the gauges). To
    ``out``, by default stderr through kvps.timeline.stderr (a blocked stderr never stalls
    the loop)."""

    def __init__(self, seconds, name, read, out=STDERR):
        self.seconds, self.name, self.read = seconds, name, read
        self.out = out
        self._last = self._next = None

    def tick(self, now):
        if not self.seconds:
            return
        if self._next is None:
            self._next, self._last = now + self.seconds, (now, self.read()[0])
            return
        if now < self._next:
            return
        counts, gauges = self.read()
        then, before = self._last
        elapsed = max(now - then, 1e-9)
        rates = {k: (counts[k] - before.get(k, 0)) / elapsed for k in counts}
        self._last, self._next = (now, counts), now + self.seconds
        self.out.write(f'kvps stats {self.name}: {line(rates, gauges)}\n')
        self.out.flush()


def line(rates, gauges):
    """``name rate/s`` for each rate (bytes as MB/s), then ``name value`` for each gauge."""
    cells = [f'{k[:-6]} {v / 1e6:.1f} MB/s' if k.endswith('_bytes') else f'{k} {v:.1f}/s'
             for k, v in rates.items()]
    cells += [f'{k} {v}' for k, v in gauges.items()]
    return ', '.join(cells)
