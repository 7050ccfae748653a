"""A node's own timeline: spans kept in a bounded buffer and streamed to its part file.

`KVPS_TIMELINE=PATH` makes each node of a job record into a part file of its own,
``PATH.d/<role>-<host>-<pid>-<tag>.kvtl`` (a stream of msgpack items), which
`kvps.timeline.merge` joins into one Chrome trace at ``PATH``. Off (the default),
``RECORDER`` is None and a recording site costs the one check ``if RECORDER is not None``;
nothing else runs, no thread, no file.

On, a site appends one tuple to a deque (no formatting, no I/O): a writer thread drains it
every FLUSH_SECONDS into the part file, so a node killed by SIGKILL leaves what it recorded
up to the last flush, and a node that exits, or fails, leaves everything (atexit, close).
The deque is bounded: a writer that falls behind loses the oldest events, counted in the
file, never the node's memory. ``pause()`` makes RECORDER None again (the sites cost their
check, as when off) until ``resume()``; SIGUSR2 does one or the other.

Items of a part file, each a msgpack list whose first field says what it is:
- ``['node', {role, rank, name, pid, host}]``: who wrote it (again once the rank is known);
- ``['thread', tid, name]``: a thread's name, before its first event;
- ``['X', name, cat, tid, start_ns, dur_ns, args, flows]``: a span; ``args`` a small map or
  None; ``flows`` None or a list of flow keys (lists) that `merge` links across nodes (one
  key's spans become one arrow, in time order);
- ``['i', name, cat, tid, at_ns, 0, args, None]``: an instant;
- ``['clock', offset_ns, error_ns, at_ns]``: this node's monotonic clock plus ``offset_ns``
  is the scheduler's, to within ``error_ns`` (measured at ``at_ns``);
- ``['dropped', count]``: events the bounded buffer lost.
Times are ``time.monotonic_ns()`` of the node that recorded them.
"""

import atexit
import collections
import contextlib
import functools
import os
import secrets
import signal
import socket
import threading
import time

import msgpack

from ..errors import ConfigError

RECORDER = None            # this process's Recorder while KVPS_TIMELINE is set, else None
_PAUSED = None             # the Recorder while it is paused (RECORDER is None then)
FLUSH_SECONDS = 0.2        # how often the writer thread drains the buffer into the file
CAPACITY = 1 << 18         # events held before the oldest unwritten ones are dropped
SUFFIX = '.kvtl'
now = time.monotonic_ns    # the one clock of every span
get_ident = threading.get_ident


def parts_dir(path):
    """Where the nodes of a job writing ``path`` put their part files."""
    return f'{os.fspath(path)}.d'


def part_name(role):
    """A node's part file: its role, host and pid, and a random tag, since pids repeat
    across hosts that share the directory (containers: every pod's first process is pid 1)
    and 'xb' opening must never meet another node's file."""
    host = ''.join(c if c.isalnum() or c in '.-_' else '_' for c in socket.gethostname())
    return f'{role}-{host}-{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}'


class Recorder:
    """One node's events, appended from any thread, written by one writer thread."""

    def __init__(self, path, role, capacity=CAPACITY):
        directory = parts_dir(path)
        try:   # a path that cannot be written is refused now, not at the end of the job
            os.makedirs(directory, exist_ok=True)
            self._file = open(os.path.join(directory, part_name(role)), 'xb')
        except OSError as exc:
            raise ConfigError(f'KVPS_TIMELINE={path}: cannot write the timeline there '
                              f'({exc.strerror or exc})') from None
        self.role, self._pid = role, os.getpid()
        self._events = collections.deque(maxlen=capacity)
        self._capacity = capacity
        self._dropped = self._reported = 0   # events the full buffer lost; those written down
        self._threads = {}                 # thread ident -> small id
        self._lock = threading.Lock()      # the file and the thread table
        self._stop = threading.Event()
        self.node({'role': role, 'rank': None, 'name': role, 'pid': os.getpid(),
                   'host': socket.gethostname()})
        self._writer = threading.Thread(target=self._write_until_stopped,
                                        name='kvps-timeline', daemon=True)
        self._writer.start()

    # -- recording (any thread) ----------------------------------------------------------
    def span(self, name, cat, start_ns, args=None, flows=None):
        """A span that started at ``start_ns`` (``now()``) and ends now."""
        end = now()
        # (written out, not through _tid and _put: this runs for every message)
        tid = self._threads.get(get_ident())
        if tid is None:
            tid = self._new_thread()
        events = self._events
        if len(events) == self._capacity:   # the oldest goes (racy: a count, not a lock)
            self._dropped += 1
        events.append(('X', name, cat, tid, start_ns, end - start_ns, args, flows))

    @contextlib.contextmanager
    def timed(self, name, cat, args=None, flows=None):
        """The span of a ``with`` block."""
        start = now()
        try:
            yield
        finally:
            self.span(name, cat, start, args, flows)

    def instant(self, name, cat, args=None):
        self._put(['i', name, cat, self._tid(), now(), 0, args, None])

    def clock(self, offset_ns, error_ns, at_ns=None):
        """This node's clock plus ``offset_ns`` reads the scheduler's (within ``error_ns``)."""
        self._put(['clock', int(offset_ns), int(error_ns), now() if at_ns is None else at_ns])

    def node(self, info):
        """Who this node is (its rank and name once registration gave them)."""
        self._put(['node', dict(info)])

    def name_node(self, rank, name):
        self.node({'role': self.role, 'rank': rank, 'name': name, 'pid': os.getpid(),
                   'host': socket.gethostname()})

    def _tid(self):
        tid = self._threads.get(get_ident())
        return self._new_thread() if tid is None else tid

    def _new_thread(self):
        """The calling thread's small id, given (and its name recorded) at its first event."""
        with self._lock:
            tid = self._threads.setdefault(get_ident(), len(self._threads))
        self._events.append(['thread', tid, threading.current_thread().name])
        return tid

    def _put(self, event):
        if len(self._events) == self._capacity:   # the oldest goes (racy: a count, not a lock)
            self._dropped += 1
        self._events.append(event)

    # -- writing (the writer thread; close) ----------------------------------------------
    def _write_until_stopped(self):
        while not self._stop.wait(FLUSH_SECONDS):
            self.flush()

    def flush(self):
        """Write what the buffer holds now (and how many events it lost) to the file."""
        with self._lock:
            if self._file is None:
                return
            pack, take = msgpack.Packer(use_bin_type=True).pack, self._events.popleft
            # (as many as are there now: other threads append while this packs)
            chunk = list(map(pack, [take() for _ in range(len(self._events))]))
            dropped = self._dropped
            if dropped > self._reported:
                chunk.append(pack(['dropped', dropped - self._reported]))
                self._reported = dropped
            if chunk:
                self._file.write(b''.join(chunk))
                self._file.flush()

    def close(self):
        """Write everything and close the file (at exit, or when the node fails). In a
        process forked from the node nothing is written: the file and what it buffered are
        the node's, which writes them itself."""
        if os.getpid() != self._pid:
            return
        self._stop.set()
        if self._writer is not threading.current_thread():
            self._writer.join(5.0)
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def start(path, role):
    """Record this process's timeline into ``path``'s part directory (None: off); returns
    the Recorder. A process records once: a second call returns the first Recorder. In the
    main thread, SIGUSR2 then pauses and resumes the recording (``toggle``), unless the
    program handles that signal itself."""
    global RECORDER
    if not path:
        return None
    if RECORDER is None and _PAUSED is None:
        RECORDER = Recorder(path, role)
        atexit.register(RECORDER.close)
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL):
            signal.signal(signal.SIGUSR2, toggle)
    return recorder_kept()


def stop():
    """Write and close this process's timeline (a failing node calls it before it exits)."""
    global RECORDER, _PAUSED
    recorder, RECORDER, _PAUSED = recorder_kept(), None, None
    if recorder is not None:
        recorder.close()


def pause():
    """Stop recording until ``resume()``: every site costs its one check again, as when the
    timeline is off; what was recorded stays, and is written. Only this process pauses."""
    global RECORDER, _PAUSED
    recorder = RECORDER
    if recorder is not None:
        recorder.instant('pause', 'timeline')
        RECORDER, _PAUSED = None, recorder


def resume():
    """Record again after ``pause()``."""
    global RECORDER, _PAUSED
    recorder = _PAUSED
    if recorder is not None:
        RECORDER, _PAUSED = recorder, None
        recorder.instant('resume', 'timeline')


def toggle(signum=None, frame=None):
    """Pause a recording process, or resume a paused one (SIGUSR2's handler)."""
    if RECORDER is not None:
        pause()
    else:
        resume()


def recorder_kept():
    """This process's Recorder, recording or paused (None when the timeline is off): for
    what a trace needs whatever it records, the node's name and its clock readings."""
    return RECORDER or _PAUSED


def name_node(rank, name):
    """Name this process's node in its timeline (its rank once registration gave it)."""
    recorder = recorder_kept()
    if recorder is not None:
        recorder.name_node(rank, name)


def traced(name, cat):
    """Decorator: each call is a span of this process's timeline, when it records one (off:
    the check of RECORDER and one call more). For API calls, not per-key work."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            recorder = RECORDER
            if recorder is None:
                return fn(*args, **kwargs)
            start = now()
            try:
                return fn(*args, **kwargs)
            finally:
                recorder.span(name, cat, start)
        return call
    return wrap


def note(name, cat, args=None):
    """An instant in this process's timeline, when it records one (for rare events)."""
    if RECORDER is not None:
        RECORDER.instant(name, cat, args)


def clock_sample(sent_ns, remote_ns, received_ns):
    """``(offset, error)`` of a remote clock read ``remote_ns`` between our ``sent_ns`` and
    ``received_ns``: the remote read it in the middle of the round trip, give or take half
    of it (NTP's estimate)."""
    return remote_ns - (sent_ns + received_ns) // 2, (received_ns - sent_ns + 1) // 2
