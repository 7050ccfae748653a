"""A shard whose arrays live apart from the wire buffers (on a GPU) follows the same rules: the
same rounds give the same values, pulls get host copies, checkpoints round-trip."""

import numpy as np
import pytest

from kvps.optimizer import create
from kvps.server.checkpoint import restore, snapshot
from kvps.server.placement import HostArrays, for_device
from kvps.server.shard import Shard

W0, W1 = b'worker-0', b'worker-1'


class CopyingArrays(HostArrays):
    """A device stand-in on the host: every buffer in or out is a copy, nothing is lent."""

    name = 'copying'
    lends = False

    def received(self, data, dtype):
        return super().received(data, dtype).copy()

    owned = received

    def to_host(self, array):
        return array.copy()


def wire(values, dtype=np.float32):
    return memoryview(np.asarray(values, dtype=dtype)).cast('B')


def train(arrays, sync, optimizer):
    """Two workers, two keys (one float16 with a float32 master), five rounds; the pulled values
    after each round and a checkpoint taken at the end."""
    shard = Shard(2, arrays=arrays)
    shard.init('i', 'a', 0, 'float32', [6], sync, wire(np.linspace(-1, 1, 6)))
    shard.init('i', 'b', 0, 'float16', [4], sync, wire([0.5, -0.25, 1, 2], np.float16))
    if optimizer:
        shard.set_optimizer(create(optimizer, learning_rate=0.1, multi_precision=True).to_spec())
    pulled = []
    for step in range(5):
        for worker, scale in ((W0, 1.0), (W1, -0.5)):
            grads = {'a': np.arange(6) * scale + step, 'b': np.array([1, 2, 3, 4]) * scale}
            shard.push('p', worker, 'a', 0, 'float32', sync, wire(grads['a']), seq=step)
            shard.push('p', worker, 'b', 0, 'float16', sync, wire(grads['b'], np.float16),
                       seq=step)
        for key in ('a', 'b'):
            (_, _, (_, value, lease)), = shard.pull('q', W0, key, 0)
            pulled.append(np.array(value))
            lease.released = True
    return pulled, snapshot(shard)


def assert_like_host(arrays, sync, optimizer, rtol=0.0):
    """``arrays`` trains as host arrays do: pulls are host arrays of the same dtype and values
    (within ``rtol``, 1e-3 at least for float16; exactly, checkpoint included, when 0 or
    when there is no optimizer)."""
    host, host_blob = train(HostArrays(), sync, optimizer)
    other, other_blob = train(arrays, sync, optimizer)
    for want, got in zip(host, other):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype
        tolerance = max(rtol, 1e-3) if rtol and want.dtype == np.float16 else rtol
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=tolerance)
    if not rtol or optimizer is None:   # sums and copies only: exact on any device
        assert host_blob == other_blob


@pytest.mark.parametrize('sync', [True, False])
@pytest.mark.parametrize('optimizer', [None, 'sgd', 'adam'])
def test_a_copying_placement_gives_the_host_values_bit_for_bit(sync, optimizer):
    assert_like_host(CopyingArrays(), sync, optimizer)


def test_a_pull_from_a_device_placement_is_a_host_copy_nothing_is_lent():
    shard = Shard(1, arrays=CopyingArrays())
    shard.init('i', 'k', 0, 'float32', [3], True, wire([1, 2, 3]))
    (_, _, (entry, value, lease)), = shard.pull('q', W0, 'k', 0)
    assert lease.done and value is not entry.weight
    value[:] = 0                                   # the caller's copy, not the shard's weight
    assert entry.weight.tolist() == [1, 2, 3]


def test_checkpoints_restore_into_the_shards_placement():
    _, blob = train(HostArrays(), True, 'sgd')
    shard = Shard(2, arrays=CopyingArrays())
    restore(shard, blob, rounds=True)
    assert snapshot(shard) == blob


def test_the_cpu_device_is_the_host_placement():
    assert isinstance(for_device('cpu'), HostArrays) and for_device('cpu').lends
