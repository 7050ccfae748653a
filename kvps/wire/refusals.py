"""Refused messages counted per sender and reason, with a bounded number of log lines.

A node that can be reached by strangers (across machines, anyone who finds its port) must not
let them write its log: a flood of forged or garbage messages would fill the disk, bury what
matters, and, where the log is a pipe nobody drains, block the node in its next write (a
scheduler silent that way loses its job). So a sender's first refusals are logged in full,
only a few new senders an interval are, and the rest is one summary line per interval; every
refusal is counted (``total``: the nodes' stats lines show it as ``refused``).
"""

import collections
import logging
import time

log = logging.getLogger('kvps.wire.refusals')

FULL_PER_SENDER = 3     # a sender's first refusals, each logged in full (KVPS_LOG_REFUSALS)
NEW_SENDERS = 10        # senders that get full lines in one interval; later ones are summed
INTERVAL = 10.0         # seconds between summary lines
SHOWN_SENDERS = 3       # senders a summary names, the busiest first


class Refusals:
    """Counts and logs refused messages; ``tick(now)`` writes a due summary (the loops of
    nodes that strangers can reach call it, so a flood that stops is still reported)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self.reset()

    def reset(self):
        """Forget every count and sender (a process that runs several nodes in turn: tests)."""
        self.total = 0
        self.full_per_sender = FULL_PER_SENDER
        self._logged = collections.Counter()   # sender -> full lines written
        self._held = collections.Counter()     # (sender, reason) -> refusals since the summary
        self._new_senders = 0
        self._since = self._clock()

    def configure(self, full_per_sender):
        """KVPS_LOG_REFUSALS: full lines per sender, or 'all' (every refusal logged)."""
        self.full_per_sender = full_per_sender

    def refuse(self, sender, reason, line, *args):
        """Count a message from ``sender`` refused for ``reason`` (a short, fixed text) and
        log ``line % args`` if this sender and interval still have room for full lines."""
        self.total += 1
        now = self._clock()
        self.tick(now)
        if self.full_per_sender == 'all':
            log.warning(line, *args)
            return
        logged = self._logged.get(sender)
        if logged is None and self._new_senders < NEW_SENDERS:
            self._new_senders += 1
            logged = 0
        if logged is not None and logged < self.full_per_sender:
            self._logged[sender] = logged + 1
            log.warning(line, *args)
            if logged + 1 == self.full_per_sender:
                log.warning('further refusals of messages from %r are summed up every %g s',
                            sender, INTERVAL)
            return
        self._held[(sender, reason)] += 1

    def tick(self, now):
        """Write the summary of what was held back once an interval has passed."""
        if now - self._since >= INTERVAL:
            self.flush(now)

    def flush(self, now=None):
        """Write the summary of what was held back now (a node's end: nothing goes unsaid)."""
        now = self._clock() if now is None else now
        if self._held:
            log.warning('refused %s', summary(self._held, now - self._since))
            self._held.clear()
        self._new_senders = 0
        self._since = now


def summary(held, seconds):
    """``N more messages in the last S s: n1 from A (reason), ...`` for a held Counter."""
    busiest = held.most_common()
    cells = [f'{count} from {sender!r} ({reason})'
             for (sender, reason), count in busiest[:SHOWN_SENDERS]]
    rest = busiest[SHOWN_SENDERS:]
    if rest:
        senders = len({sender for (sender, _), _ in rest})
        cells.append(f'{sum(count for _, count in rest)} from {senders} other sender(s)')
    return (f'{sum(held.values())} more messages in the last {seconds:.0f} s: '
            + ', '.join(cells))


# One per process: a process is one node, and its sockets share one budget of log lines.
REFUSALS = Refusals()
