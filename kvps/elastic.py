"""Data for elastic jobs: the samples of an epoch dealt among whichever workers are members."""

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
