"""How a restarted server rejoins its job: RESUMEs awaited, restored counts rebased on them
(an elastic job's joiners' first rounds included)."""

import logging

log = logging.getLogger('kvps.server')


class Recovery:
    """A restarted server waits for every active worker's RESUME before serving anything:
    only then does it know which rounds the job has completed. Requests that arrive
    meanwhile are parked, to be served in order once it does."""

    def __init__(self, name, awaiting, finished):
        self.name = name                 # the server's, for its log
        self.awaiting = set(awaiting)    # worker identities not yet resumed
        self.finished = set(finished)    # workers that left the job
        self.acked = {}                  # worker -> its ResumeItems
        self.parked = []                 # (identity, header, buffers) held until resumed

    @property
    def done(self):
        """Whether every worker has resumed or left."""
        return not self.awaiting

    def awaits(self, identity):
        """Whether a RESUME from ``identity`` is expected."""
        return identity in self.awaiting

    def resume(self, identity, header):
        """Take a RESUME (one of several when ``more``): the worker is in after its last."""
        self.acked.setdefault(identity, []).extend(header['keys'])
        if not header.get('more'):
            self.awaiting.discard(identity)

    def finish(self, worker):
        """``worker`` left the job: it will not resume."""
        self.finished.add(worker)
        self.awaiting.discard(worker)

    def park(self, identity, header, buffers):
        self.parked.append((identity, header, buffers))

    def settle(self, shard, workers):
        """Every worker is in: rebase ``shard`` on what they saw acknowledged (``workers``:
        the job's). Returns the workers that left and the parked requests, in order: the
        caller finishes the one and serves the other."""
        lost = rebase(shard.entries, self.acked, workers)
        if lost:
            log.warning('%s: its checkpoint is %d update(s) behind what the workers saw '
                        'acknowledged (KVPS_CHECKPOINT_EVERY/SECONDS): those are lost; %s',
                        self.name, sum(lost.values()),
                        ', '.join(f'{k!r} part {p}: {n}' for (k, p), n in list(lost.items())[:5]))
        log.warning('%s: every worker resumed; serving %d requests held meanwhile', self.name,
                    len(self.parked))
        return sorted(self.finished), self.parked


def rebase(entries, acked, workers):
    """Line the restored counts of ``entries`` ({(key, part): Entry}) up with what the workers
    saw acknowledged before this server was lost: ``acked`` maps worker -> [ResumeItem, ...].

    A sync round that some worker saw completed is complete here too, even where the
    checkpoint predates it (its update is then lost: the checkpoint interval bounds how
    many); every worker has pushed exactly the completed rounds, so a resent push of one of
    them is acknowledged, not merged again, and the round after them is redone. Async
    entries count each worker's pushes on their own. Returns {(key, part): rounds lost}
    for sync keys whose checkpoint predates rounds the workers saw completed."""
    by_part, lost = {}, {}
    for worker, items in acked.items():
        for item in items:
            by_part.setdefault((item.key, item.part), {})[worker] = item
    for key_part, entry in entries.items():
        items = by_part.get(key_part, {})
        if entry.sync:
            # (a joiner none of whose pushes was acknowledged tells of no completed round)
            seen = max((i.acked for i in items.values() if i.acked > i.first), default=0)
            if seen > entry.version:
                lost[key_part] = seen - entry.version
            entry.version = max(entry.version, seen)
            entry.pushed = {worker: entry.version for worker in workers}
            _joiners_wait(entry, items)
        else:
            for worker, item in items.items():
                entry.pushed[worker] = max(entry.pushed.get(worker, 0), item.acked)
    return lost


def _joiners_wait(entry, items):
    """An elastic job's joiners whose first round of ``entry`` is still ahead count from it,
    as when they joined (kvps.server.members): the checkpoint does not hold that, the
    joiners' RESUMEs do."""
    entry.late = {}
    for worker, item in items.items():
        if item.first > entry.version:
            entry.pushed[worker] = entry.late[worker] = item.first
