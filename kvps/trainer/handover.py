"""A joiner's Trainer that updates on the workers takes the weights and optimizer state of a
member, with no collective: the member puts them in a blob of the job at a step end, and the
joiner, abstaining from its rounds meanwhile, replays the rounds' sums it kept from them."""

import logging

import msgpack

from ..errors import ConfigError, PeerLostError

BLOB = 'kvps.handover'        # the last handover any member put (each put replaces it)
WANT, HAVE = b'want', b'have'  # a joiner's record: it waits for a handover / it took one

log = logging.getLogger('kvps.trainer')


def record_name(identity):
    """The blob where joiner ``identity`` ((rank, incarnation)) says whether it waits."""
    return f'kvps.joiner/{identity[0]}.{identity[1]}'


class Handover:
    """One Trainer's part in handovers (docs/elastic.md, "Joiners and updates on the
    workers"). ``notes``: its store's Backend.notes; ``params``, ``local`` (LocalUpdates),
    ``exchange`` and ``layout``: the Trainer's. ``waiting``: this worker joined a running
    job and holds no state yet."""

    def __init__(self, notes, params, local, exchange, layout, waiting):
        if not local.hands_over:
            raise ConfigError('an elastic job whose workers update hands a member\'s optimizer '
                              'state to each joiner, and a torch.optim optimizer\'s travels '
                              'only as a pickle, which kvps never sends: give the Trainer a '
                              'kvps optimizer (by name) in such a job')
        self.notes, self._params, self._local = notes, params, local
        self._exchange, self._layout = exchange, layout
        self.waiting = exchange.abstaining = waiting
        self._epoch, self._known = notes.epoch, set(notes.members())
        # members that may not hold the state yet: those that joined a running job, until
        # their record says they took it
        self.pending = {m for m in self._known if m[1] > 0 and m != notes.me}
        self._kept = []    # waiting: (rounds pushed into, the round's Sums), oldest first
        self.replayed = None   # a joiner, once it took a handover: the rounds it replayed

    # -- a waiting joiner -------------------------------------------------------------------
    def keep(self, trainable, reduced, rescale, row_sums):
        """This step's sums, pulled after an abstention, kept for ``replay``."""
        self._kept.append((self.notes.rounds(), Sums.of(
            self._exchange, self._layout, trainable, reduced, rescale, row_sums)))

    def step_ended(self):
        """At each step end: a waiting joiner takes a handover that fits its kept rounds
        (returns True once it did); a member that is the donor serves waiting joiners."""
        if self.waiting:
            return self._take()
        notes = self.notes
        if notes.epoch != self._epoch:   # (what a step costs when nothing changed)
            self._epoch, members = notes.epoch, set(notes.members())
            self.pending = (self.pending | (members - self._known)) & members
            self._known = members
        if self.pending and self._donor() == notes.me:
            self._serve()
        return False

    def _take(self):
        notes = self.notes
        notes.put(record_name(notes.me), WANT)   # each step: a restarted server 0 learns it
        blob = notes.get(BLOB)
        if not blob:
            self._check_someone_holds_the_state()
        if not blob or not self._kept:
            return False
        handed = msgpack.unpackb(blob, raw=False, strict_map_key=False)
        tag = handed['tag']
        # its state must be of a round this joiner kept the sums after (the donor's rounds
        # close only with this joiner's abstentions, so it is never ahead of them)
        if not self._kept[0][0] - 1 <= tag <= self._kept[-1][0]:
            return False
        self._took(handed, tag)
        return True

    def _check_someone_holds_the_state(self):
        """PeerLostError once no other member holds the weights and state: none of the job's
        first workers is left, and no joiner has taken a handover (this joiner would
        otherwise wait, keeping every round's sums, for a handover nobody can make)."""
        notes = self.notes
        others = [m for m in notes.members() if m != notes.me]
        if any(m[1] == 0 for m in others):   # (the job's first workers hold it)
            return
        if any(notes.get(record_name(m)) == HAVE for m in others):
            return
        raise PeerLostError(
            'no member holds the weights and optimizer state any more: the workers that had '
            'them have left the job, and with update_on_kvstore=False they live only on the '
            f'workers (members now: {sorted(notes.members())}, as (rank, incarnation))',
            'worker', None, None)

    def _took(self, handed, tag):
        """Install the handover of round ``tag``, replay the kept rounds after it, say so in
        this joiner's record, and count as waiting the joiners the donor did."""
        notes = self.notes
        self._install(handed['weights'], handed['state'])
        later = [sums for rounds, sums in self._kept if rounds > tag]
        for sums in later:
            sums.replay(self._exchange, self._local, self._params)
        log.info('took the state of round %d from a member; replayed %d round(s) after it',
                 tag, len(later))
        self._kept, self.waiting, self.replayed = [], False, len(later)
        self._exchange.abstaining = False
        notes.put(record_name(notes.me), HAVE)
        members, listed = set(notes.members()), {tuple(m) for m in handed['members']}
        # still waiting: those the donor knew waiting, and those it did not know of
        pending = {tuple(m) for m in handed['pending']} | (members - listed)
        self.pending = pending & members - {notes.me}
        self._epoch, self._known = notes.epoch, members

    def _install(self, weights, state):
        import torch  # (lazily, as everywhere in kvps: a Trainer's parameters brought it)
        if len(weights) != len(self._params):
            raise ConfigError(f'the handover holds {len(weights)} parameters, this Trainer '
                              f'has {len(self._params)}: every worker must build the same model')
        for p, data in zip(self._params, weights):
            tensor = p.tensor.detach()
            if len(data) != tensor.numel() * tensor.element_size():
                raise ConfigError(f'parameter {p.name}: the handover holds {len(data)} bytes, '
                                  f'this worker\'s {tuple(tensor.shape)} {tensor.dtype} has '
                                  f'{tensor.numel() * tensor.element_size()}')
            tensor.copy_(torch.frombuffer(bytearray(data), dtype=tensor.dtype)
                         .reshape(tensor.shape))
        self._local.install(state, 'the handover')

    # -- a member ----------------------------------------------------------------------------
    def _donor(self):
        """The member that serves joiners: the lowest rank not known to be waiting."""
        return min((m for m in self._known if m not in self.pending), default=None)

    def _serve(self):
        """Read the pending joiners' records (dropping those that took a handover); if one
        waits and this member is still the donor, put a handover of its state now. Once none
        is pending, the handover's blob is emptied (server 0 need not keep a model)."""
        notes, wanting = self.notes, False
        for joiner in sorted(self.pending):
            record = notes.get(record_name(joiner))
            if record == HAVE:
                self.pending.discard(joiner)
            wanting |= record == WANT
        if not self.pending:
            notes.put(BLOB, b'')
        elif wanting and self._donor() == notes.me:
            notes.put(BLOB, msgpack.packb({
                'tag': notes.rounds(), 'members': sorted(self._known),
                'pending': sorted(self.pending), 'weights': [_bytes(p) for p in self._params],
                'state': self._local.states()}, use_bin_type=True))


def _bytes(p):
    """A parameter's weights as bytes (any dtype, any device)."""
    import torch
    tensor = p.tensor.detach().reshape(-1).cpu().contiguous()
    return tensor.view(torch.uint8).numpy().tobytes()


class Sums:
    """One round's summed gradients as the local update reads them, copied: what a joiner
    replays once it holds the state of the round before."""

    def __init__(self, keys, reduced, rescale, tensors, row_sums):
        self.keys, self.reduced, self.rescale = keys, reduced, rescale
        self.tensors, self.row_sums = tensors, row_sums

    @classmethod
    def of(cls, exchange, layout, trainable, reduced, rescale, row_sums):
        """``reduced`` 'buffers': the exchange's pull targets of the keys of ``trainable``;
        'grads': their ``.grad`` (allreduce_grads left the sums there)."""
        if reduced == 'grads':
            tensors = {p.key: p.tensor.grad.detach().clone() for p in trainable
                       if p.tensor.grad is not None}
        else:   # store key -> (its parameter or FusedKey, the copy)
            tensors = {key: (entry, exchange.sum_target(entry).detach().clone())
                       for _, key, entry in layout.store_keys(trainable)}
        rows = {key: (ids.copy(), values.copy()) for key, (ids, values) in row_sums.items()}
        return cls([p.key for p in trainable], reduced, rescale, tensors, rows)

    def replay(self, exchange, local, params):
        """The local update of this round, on the state of the round before."""
        trainable = [p for p in params if p.key in set(self.keys)]
        if self.reduced == 'grads':
            for p in trainable:
                p.tensor.grad = self.tensors.get(p.key)
        else:
            for entry, kept in self.tensors.values():
                exchange.sum_target(entry).detach().copy_(kept)
        local.optimizer.rescale_grad = self.rescale
        local.run(trainable, lambda p: True, self.reduced, exchange.summed, self.row_sums)

