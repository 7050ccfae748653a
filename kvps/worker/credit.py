"""A pushpull's credit: how many bytes of its pushes may be on the socket before the results
of its earlier waves are back.

Sent all at once, a big model's pushes fill the links' queues, and a key's results (sent by
its servers as soon as its round completes) wait behind them: at 1 Gbit/s a worker's 48 MiB
of pushes queue for 400 ms. Held to a few waves ahead of the results, the queues stay short,
results come back as they are ready, and the step ends soon after its last push (BytePS
and ByteScheduler bound what is in flight with a credit the same way). The waves pushed on
the same host go through shared memory and take no credit.

A wave's results need every worker's pushes of its keys, so one worker waiting for them
could wait on another that pushes those keys late (another order, or a straggler): a wait
lasts at most PATIENCE, after which the call sends the rest as it would without a credit."""

import collections

PATIENCE = 0.25   # seconds a wave waits for earlier results before the credit is dropped
# KVPS_PUSHPULL_CREDIT=auto while pushes are compressed: at 1 Gbit/s (bench_hosts h4, 64 MiB in
# fp16) 4 and 12 MiB were slower than 6 and 8. Off for uncompressed pushes, whose links are
# often fast: a credit below a link's rate times a wave's round trip leaves the link idle.
AUTO_COMPRESSED = 6 << 20


class Credit:
    """``admit(nbytes)`` before a wave leaves, ``add(done, nbytes)`` after (``done``: an
    Event set once the wave's results are in). ``limit`` 0: no credit."""

    def __init__(self, limit):
        self.limit = limit
        self._open = collections.deque()   # (done, nbytes) of waves sent, oldest first
        self._held = 0

    @classmethod
    def of(cls, setting, runs):
        """The credit of a pushpull of ``runs`` (Backend.pushpull's: a list of copies, or
        encoded runs) under KVPS_PUSHPULL_CREDIT ``setting``."""
        if setting == 'auto':
            return cls(0 if isinstance(runs, list) else AUTO_COMPRESSED)
        return cls(setting)

    def admit(self, nbytes):
        """Return once ``nbytes`` more fit in the credit with what is unanswered (at once
        when nothing is: a wave bigger than the credit still leaves alone)."""
        while self.limit and self._open and self._held + nbytes > self.limit:
            done, held = self._open[0]
            if not done.wait(PATIENCE):
                self.limit = 0   # waiting on others: this call sends the rest at once
                return
            self._open.popleft()
            self._held -= held

    def add(self, done, nbytes):
        if self.limit and nbytes:
            self._open.append((done, nbytes))
            self._held += nbytes
