"""Data for elastic jobs: the samples of an epoch dealt among whichever workers are members."""

import numbers

import numpy as np


def epoch_order(dataset_len, epoch, seed=0):
    """The order of an epoch's samples: a permutation of ``range(dataset_len)`` drawn from
    ``(seed, epoch)``, the same on every worker (numpy's PCG64, independent of the version's
    legacy global state)."""
    if dataset_len < 0 or epoch < 0:
        raise ValueError(f'dataset_len and epoch must be >= 0, got {dataset_len} and {epoch}')
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(dataset_len)


def shard(dataset_len, epoch, ranks, rank, start=0, seed=0):
    """This worker's samples of what remains of ``epoch``: the epoch's order from position
    ``start`` on (the samples the job has trained on so far), dealt round-robin among the
    member ``ranks`` (kv.on_membership_change gives them) by their order. Members that call
    it with the same ``start`` and ``ranks`` get disjoint shares that cover every remaining
    sample once; share sizes differ by at most one."""
    ranks = sorted(ranks)
    if rank not in ranks:
        raise ValueError(f'rank {rank} is not one of the member ranks {ranks}')
    if not 0 <= start <= dataset_len:
        raise ValueError(f'start {start} is outside the epoch of {dataset_len} samples')
    return epoch_order(dataset_len, epoch, seed)[start + ranks.index(rank)::len(ranks)]


class Sampler:
    """This worker's batches of ``epoch``, claimed from a ledger on the server that holds
    ``key`` (a key this worker pushes once per step: ``trainer.round_key``), so that every
    sample of the epoch has its gradient applied once, whatever workers leave and join:

    - each batch is the next positions of the epoch's order (``epoch_order``) not dealt yet,
      those given back first, tied to this worker's next push of ``key``;
    - the batch is kept once that push is in a round that closes; it goes back to be dealt
      again if the worker is lost first, or abstains from that round (a joiner waiting for
      its state), exactly when its push is not applied;
    - iteration ends for every member at the same step, once every sample is kept. Near the
      end a batch may be short or empty: step with it anyway (its gradient is zeros), since
      the round waits for every member's push.

    ``dataset_len`` samples, ``batch_size`` of them per step (at most 65536). Every member
    must iterate a Sampler of the same ``epoch``, ``dataset_len``, ``key`` and ``seed``,
    one batch per step, pushing ``key`` once per batch (a Trainer's step does)."""

    def __init__(self, kv, dataset_len, epoch, batch_size, key, seed=0):
        for name, value, least in (('dataset_len', dataset_len, 0), ('epoch', epoch, 0),
                                   ('batch_size', batch_size, 1)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) \
                    or value < least:
                raise ValueError(f'{name} must be an int >= {least}, got {value!r}')
        self.kv, self.key, self.epoch, self.batch_size = kv, key, int(epoch), int(batch_size)
        self.order = epoch_order(int(dataset_len), self.epoch, seed)

    def __iter__(self):
        notes = self.kv.notes
        while True:
            positions, end = notes.claim(self.key, self.epoch, len(self.order),
                                         self.batch_size)
            if end:
                return
            yield self.order[np.asarray(positions, np.int64)]
