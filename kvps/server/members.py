"""Workers leaving and joining one server's Shard: a fixed job's finished worker fails the
rounds it can never join; an elastic job's gone worker has its pushes to open rounds taken
out (all or nothing), a joiner counts from the next round of each key (and may take part in
rounds without a gradient while it waits for its state), and rounds of another size than
the job's are scaled to it where a key asks (the Trainer's)."""

from ..errors import ConfigError, KVPSError
from ..wire.identities import identity_label, worker_identity
from .records import Reply, ReplyKind
from .row_store import RowGrad


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


def check_round_possible(finished, entry, round_index):
    """KVPSError unless round ``round_index`` of ``entry`` can complete: no worker of
    ``finished`` (worker -> its pushes per key, frozen at its finish) left it open."""
    for worker, counts in finished.items():
        made = counts.get((entry.key, entry.part), 0)
        if round_index >= made:
            raise KVPSError(f'round {round_index + 1} of key {entry.key!r} can never complete:'
                            f' {identity_label(worker)} finished after {made} pushes of it')


def abstain(entry, sync, worker):
    """What a push of NOTHING merges into ``entry``'s round: None, an abstention. The
    worker counts in the round (it closes with it, and the worker's pull after it waits for
    it) but adds nothing to its sum, nor to the workers its scale divides by: an elastic
    joiner whose Trainer waits for the weights and optimizer state of a member
    (docs/elastic.md). Sync rounds only: an async push is applied alone, and nothing is
    nothing to apply (ConfigError)."""
    if not (sync and entry.sync):
        raise ConfigError(f'key {entry.key!r}: a push of nothing takes part in a sync round; '
                          'dist_async applies each push alone')
    if entry.claims is not None:   # its samples of the round are not applied: they go back
        entry.claims.abstained(worker, entry.pushed.get(worker, 0), entry.version)
    return None


def zeros(entry):
    """The sum of a round whose every member abstained: zeros in the merge buffer."""
    merge = entry.writable_merge()
    merge[...] = 0
    return merge


def identities(pairs, salt=None):
    """Worker socket identities of ``[[rank, incarnation]]`` (a MEMBERS message's lists) in the
    job of identity ``salt``."""
    return [worker_identity(rank, incarnation, salt) for rank, incarnation in pairs]


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
    # its claims of rounds not closed go back (its push to the open round is taken out)
    replies = [] if entry.claims is None else entry.claims.lost(worker, entry.version)
    entry.queued = [q for q in entry.queued if q.worker != worker]
    if worker in entry.merged:
        kept = [(w, data) for w, data in entry.pushes if w != worker]
        entry.pushes, entry.merged, entry.summed, entry.rows = [], set(), None, []
        entry.abstained = 0
        for other, data in kept:
            shard.add_push(entry, other, data)
    return replies + (shard.close_rounds(entry) if entry.merged else [])


# -- rounds scaled to the job's size (the Trainer's keys in an elastic dist_sync job) --------
FLOATS = ('float16', 'bfloat16', 'float32', 'float64')


def check_scale(key, dtype, scale_to):
    """Only a floating point key's rounds can be scaled (ConfigError)."""
    if scale_to and dtype not in FLOATS:
        raise ConfigError(f'key {key!r}: rounds scaled to {scale_to} workers need a floating '
                          f'point key, not {dtype}')


def scaled(entry, n):
    """The closing round's sum of ``n`` members' gradients, times ``entry.scale_to / n``: the
    round weighs as a round of the job's ``scale_to`` workers (docs/elastic.md, "The
    Trainer"). Only rounds of another size than ``scale_to`` come here. The product is made
    in the merge buffer (the float32 one of a bfloat16 key), never in a received push."""
    factor = entry.scale_to / n
    summed, arrays = entry.summed, entry.arrays
    entry.summed = None
    if type(summed) is tuple:   # (sum so far, last push): the update would have added them
        summed = arrays.add(*summed, out=entry.writable_merge())
    elif summed is not entry.merge:   # one push as received (read-only; bfloat16 bits):
        summed = arrays.add(summed, summed, out=entry.writable_merge())   # 2x, widened
        factor /= 2                   # (exact: a power of two)
    arrays.xp.multiply(summed, factor, out=summed)
    return summed


def scaled_rows(entry, grad, n):
    """A round's RowGrad ``grad`` of ``n`` members, scaled as ``scaled`` does (a copy)."""
    if not entry.scale_to or n == entry.scale_to:
        return grad
    arrays, rows, factor = entry.arrays, grad.rows, entry.scale_to / n
    if entry.dtype != 'bfloat16':
        return RowGrad(grad.ids, (rows * factor).astype(rows.dtype))
    wide = arrays.xp.empty(rows.shape, 'float32')
    arrays.add(rows, rows, out=wide)      # bfloat16 bits widened (doubled: exact)
    arrays.xp.multiply(wide, factor / 2, out=wide)
    out = arrays.xp.empty(rows.shape, rows.dtype)
    arrays.assign(out, wide)              # rounded back to bfloat16
    return RowGrad(grad.ids, out)
