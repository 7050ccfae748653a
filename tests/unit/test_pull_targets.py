"""A pull into several targets with one bad target raises before any target is written."""

import numpy as np
import pytest
import torch

from kvps.errors import DTypeError
from kvps.kvstore import KVStore
from kvps.kvstore.local import LocalBackend

# Targets that pass the shape and dtype checks (float64, shape (3,)) but cannot be written.
BAD_TARGETS = {
    'read-only': lambda: np.frombuffer(bytes(24), np.float64),
    'share memory': lambda: torch.zeros(1, dtype=torch.float64).expand(3),
    'meta': lambda: torch.empty(3, dtype=torch.float64, device='meta'),
}
ERRORS = {'read-only': ValueError, 'share memory': ValueError, 'meta': DTypeError}
STORE_TYPES = ('local', 'device', 'dist_sync_device')


def store(name):
    kv = KVStore(name, LocalBackend())
    kv.init([0, 1], [np.zeros(3), np.zeros(3)])
    kv.push([0, 1], [np.full(3, 4.0), np.full(3, 5.0)])
    return kv


def calls(bad):
    """(what is called, the good targets it was given, the bad target's key) for each way of
    pulling into ``bad``."""
    first, second, third = (np.full(3, -1.0) for _ in range(3))
    return [
        (lambda kv: kv.pull(0, out=[first, bad]), [first], 0),
        (lambda kv: kv.pull([0, 1], out=[second, bad]), [second], 1),
        (lambda kv: kv.pull([0, 1], out=[[second, third], [first, bad]]),
         [first, second, third], 1),
        (lambda kv: kv.pushpull([0, 1], [np.ones(3), np.ones(3)], out=[first, [second, bad]]),
         [first, second], 1),
    ]


@pytest.mark.parametrize('name', STORE_TYPES)
@pytest.mark.parametrize('kind', sorted(BAD_TARGETS))
def test_one_bad_target_leaves_every_target_and_the_store_unchanged(name, kind):
    kv = store(name)
    for call, good, key in calls(BAD_TARGETS[kind]()):
        with pytest.raises(ERRORS[kind], match=f'key {key}: .*{kind}'):
            call(kv)
        assert [g.tolist() for g in good] == [[-1.0] * 3] * len(good)
    stored = [np.zeros(3), np.zeros(3)]
    kv.pull([0, 1], out=stored)
    assert [s.tolist() for s in stored] == [[4.0] * 3, [5.0] * 3]   # pushpull pushed nothing
