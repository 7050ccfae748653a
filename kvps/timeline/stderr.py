"""kvps's own lines to stderr (`--stats` lines, a node's log records), written by a thread of their own.

A reader that stops reading (a paused terminal, `| less` left unscrolled, a launcher whose own
output is blocked) fills the pipe, and a write to it then blocks. Written from a node's loop,
that would stall the loop, and with it the node's heartbeats, which its peers would take for
its loss: a job killed by its log. Here a write only queues the line; a thread writes them,
and while it is blocked, lines beyond MOST_WAITING are dropped (and said so once it writes
again). At exit the lines still waiting get DRAIN_S to go out.
"""

import atexit
import collections
import os
import sys
import threading

MOST_WAITING = 1000   # lines queued while stderr takes none; more are dropped
DRAIN_S = 2.0         # at exit, how long the lines still waiting may take to be written


class Lines:
    """A file-like object (``write``, ``flush``) whose writes never block: see the module.
    ``stream``: where the thread writes (None: sys.stderr as it is at each write)."""

    def __init__(self, stream=None):
        self._stream = stream
        self._start()
        os.register_at_fork(after_in_child=self._start)   # (the thread is not forked)

    def _start(self):
        self._waiting, self._dropped = collections.deque(), 0
        self._changed = threading.Condition()
        self._idle = True      # nothing waits and the thread is not writing
        self._thread = None

    def write(self, text):
        with self._changed:
            if len(self._waiting) >= MOST_WAITING:
                self._dropped += 1
                return
            self._waiting.append(text)
            self._idle = False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name='kvps-stderr',
                                                daemon=True)
                self._thread.start()
                atexit.register(self.drain)
            self._changed.notify_all()

    def flush(self):
        """Nothing to do: the thread flushes after each batch it writes."""

    def drain(self, timeout=DRAIN_S):
        """Wait up to ``timeout`` s until every waiting line is written; whether they were."""
        with self._changed:
            return self._changed.wait_for(lambda: self._idle, timeout)

    def _run(self):
        while True:
            with self._changed:
                self._idle = not self._waiting
                self._changed.notify_all()
                self._changed.wait_for(lambda: self._waiting)
                text, dropped = ''.join(self._waiting), self._dropped
                self._waiting.clear()
                self._dropped = 0
            if dropped:
                text = (f'kvps: {dropped} line(s) to stderr dropped while it was not read\n'
                        + text)
            stream = self._stream or sys.stderr
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):   # stderr closed: there is nobody to tell
                pass


# The one every node's loop writes through (its Ticker, and a scheduler's or server's log).
STDERR = Lines()
