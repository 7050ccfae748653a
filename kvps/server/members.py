"""Workers leaving and joining one server's Shard: a fixed job's finished worker fails the
rounds it can never join; an elastic job's gone worker has its pushes to open rounds taken
out (all or nothing), and a joiner counts from the next round of each key."""

from ..errors import KVPSError
from ..wire.identities import identity_label, worker_identity
from .records import Reply, ReplyKind


def worker_finished(shard, worker):
    """A fixed job's worker is done: fail every sync round of ``shard`` that lacks its push."""
    shard.finished[worker] = {k: e.pushed.get(worker, 0) for k, e in shard.entries.items()}
    replies = []
    for entry in shard.entries.values():
        if entry.sync:   # rounds from index ``made`` on lack its push: answer their waiters
            made = entry.pushed.get(worker, 0)
            exc = KVPSError(f'a sync round of key {entry.key!r} can never complete: '
                            f'{identity_label(worker)} finished after {made} pushes of it')
            replies += [Reply(ReplyKind.ERROR, t, exc) for t in entry.drop_rounds_from(made)]
    return replies


def identities(pairs):
    """Worker socket identities of ``[[rank, incarnation]]`` (a MEMBERS message's lists)."""
    return [worker_identity(rank, incarnation) for rank, incarnation in pairs]


def change(shard, gone, joined):
    """Apply a MEMBERS change (worker identities ``gone`` and ``joined``) to ``shard``;
    returns the replies of the rounds it completes, and {gone worker: the open rounds its
    push was taken out of}."""
    replies, discarded = [], {}
    for worker in joined:
        shard.num_workers += 1
        for entry in shard.entries.values():
            _join(entry, worker)
    for worker in gone:
        shard.num_workers -= 1
        shard.finished.pop(worker, None)
        for entry in shard.entries.values():
            if entry.sync and worker in entry.merged:
                discarded[worker] = discarded.get(worker, 0) + 1
            replies += _leave(shard, entry, worker)
    return replies, discarded


def _join(entry, worker):
    """The joiner's first round of ``entry``: the open one if nobody has pushed into it yet,
    else the next (never one that others have begun without it). Its push count starts
    there (the worker numbers its pushes from it, as CHECK answers), so a pull before its
    first push waits for the round before."""
    if not entry.sync:
        return
    first = entry.version + (1 if entry.merged or entry.rows else 0)
    entry.pushed[worker] = first
    if first > entry.version:
        entry.late[worker] = first


def _leave(shard, entry, worker):
    """Take ``worker`` out of ``entry``: its push to the open round is removed by making the
    round's sum again from the others' pushes (in the order they came); its pushes queued
    for later rounds go; then the round closes if every remaining member has pushed."""
    entry.pushed.pop(worker, None)
    entry.late.pop(worker, None)
    if not entry.sync:
        return []
    entry.queued = [q for q in entry.queued if q.worker != worker]
    if worker in entry.merged:
        kept = [(w, data) for w, data in entry.pushes if w != worker]
        entry.pushes, entry.merged, entry.summed, entry.rows = [], set(), None, []
        for other, data in kept:
            shard.add_push(entry, other, data)
    return shard.close_rounds(entry) if entry.merged else []
