"""The claim ledger of an elastic Sampler (kvps.elastic.Sampler): the positions of an epoch's
order dealt to workers round by round, tied to the rounds of one sync key part; a claim is
kept once its round closes with the claimer in it, and goes back to the pool when the claimer
is lost before that or abstains from that round (exactly when its push is not applied)."""

from ..errors import ConfigError, KeyNotInitializedError
from .records import Reply, ReplyKind

MAX_CLAIM = 1 << 16        # positions one claim may ask for (they travel in a header)
MAX_DATASET = 1 << 48


def claim(shard, token, worker, header):
    """A CLAIM of ``worker`` on ``shard``: its Reply now, or none (it waits)."""
    entry = shard.entries.get((header['key'], header['part']))
    if entry is None or not entry.sync:
        raise (KeyNotInitializedError if entry is None else ConfigError)(
            f'a claim is tied to the sync rounds of a key this server holds; key '
            f'{header["key"]!r} is ' + ('not initialized here' if entry is None else 'async'))
    if entry.claims is None:
        entry.claims = Claims()
    return entry.claims.claim(token, worker, header['round'], header['epoch'], header['size'],
                              header['count'], entry.version)


class Claims:
    """The ledgers of one key part (an Entry's ``claims``), one per epoch; the latest two are
    kept (members claim in one epoch at a time, so two cover a step across an epoch's end)."""

    def __init__(self):
        self.ledgers = {}   # epoch -> Ledger

    def claim(self, token, worker, round_index, epoch, size, count, version):
        """A worker's claim of ``count`` positions for its push of round ``round_index``
        (``version``: the rounds the key part has closed): its Reply now, or none (it waits
        for earlier rounds to close, at the epoch's end)."""
        if not 0 < count <= MAX_CLAIM or not 0 <= size <= MAX_DATASET:
            raise ConfigError(f'a claim asks for 1 to {MAX_CLAIM} positions of a dataset of '
                              f'at most {MAX_DATASET} samples, not {count} of {size}')
        ledger = self.ledgers.get(epoch)
        if ledger is None:
            ledger = self.ledgers[epoch] = Ledger(size)
            for old in sorted(self.ledgers)[:-2]:
                del self.ledgers[old]
        elif ledger.size != size:
            raise ConfigError(f'epoch {epoch} is of {ledger.size} samples; a claim says {size}')
        return ledger.claim(token, worker, round_index, count, version)

    def closed(self, version):
        """Rounds before ``version`` have closed: their claims are kept; claims that waited
        for them are answered."""
        return [r for ledger in self.ledgers.values() for r in ledger.settle(version)]

    def lost(self, worker, version):
        """``worker`` left: its claims of rounds not closed yet (``version`` on) go back,
        and its waiting claims go unanswered; the others' waiting claims are tried again."""
        replies = []
        for ledger in self.ledgers.values():
            ledger.waiting = [w for w in ledger.waiting if w[1] != worker]
            ledger.give_back(worker, version, lambda round_index: True)
            replies += ledger.settle(version)
        return replies

    def abstained(self, worker, round_index, version):
        """``worker`` abstains from round ``round_index``: its claim of that round goes back
        (waiting claims are tried again when the round closes)."""
        for ledger in self.ledgers.values():
            ledger.give_back(worker, version, lambda i: i == round_index)


class Ledger:
    """One epoch's deal: positions ``dealt`` so far in order, a ``pool`` of positions given
    back (dealt first), the claims not yet kept, and claims waiting at the epoch's end."""

    def __init__(self, size):
        self.size, self.dealt, self.pool = size, 0, []
        self.pending = []       # (worker, round, positions) of rounds not closed yet
        self.last = -1          # the last round positions were dealt for
        self.waiting = []       # (token, worker, round, count) of claims not answered yet

    def claim(self, token, worker, round_index, count, version):
        """Positions for round ``round_index``: from the pool, then the order. When none are
        left the answer waits while claims of earlier rounds may still come back; then it is
        an empty batch in a round that others got positions for (the claimer steps with
        them), else the epoch's end (the same round for every member: nothing can come
        back, every dealt position is kept)."""
        self.settle(version, answer=False)
        if self.pool or self.dealt < self.size:
            taken, self.pool = self.pool[:count], self.pool[count:]
            more = min(count - len(taken), self.size - self.dealt)
            taken += range(self.dealt, self.dealt + more)
            self.dealt += more
            self.pending.append((worker, round_index, taken))
            self.last = max(self.last, round_index)
            return [_answer(token, taken)]
        if any(round < round_index for _, round, _ in self.pending):
            self.waiting.append((token, worker, round_index, count))
            return []
        return [_answer(token, [], end=round_index > self.last)]

    def settle(self, version, answer=True):
        """Claims of rounds before ``version`` are kept; waiting claims are tried again."""
        self.pending = [claim for claim in self.pending if claim[1] >= version]
        if not answer or not self.waiting:
            return []
        waiting, self.waiting = self.waiting, []
        return [r for token, worker, round_index, count in waiting
                for r in self.claim(token, worker, round_index, count, version)]

    def give_back(self, worker, version, which):
        """``worker``'s claims not kept yet, of the rounds ``which`` says, back to the pool,
        ahead of the rest of the order."""
        self.settle(version, answer=False)
        back = [claim for claim in self.pending if claim[0] == worker and which(claim[1])]
        self.pending = [claim for claim in self.pending if claim not in back]
        self.pool = [p for claim in back for p in claim[2]] + self.pool


def _answer(token, positions, end=False):
    return Reply(ReplyKind.ACK, token, {'positions': list(positions), 'end': end})
