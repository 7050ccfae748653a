"""A shard whose arrays live apart from the wire buffers (on a GPU) follows the same rules: the
same rounds give the same values, pulls get host copies, checkpoints round-trip; keys of
device-side stores go to the GPU placement when the server has one, the rest stay on the host."""

import msgpack
import numpy as np
import pytest

from kvps.optimizer.kernels.common import bf16_to_f32, f32_to_bf16
from kvps.optimizer import create
from kvps.server.checkpoint import restore, snapshot
from kvps.errors import ConfigError
from kvps.server import storage as placement
from kvps.server.storage import HostArrays, Storage, for_device
from kvps.server.shard import Shard
from kvps.optimizer.kernels.numpy_packing import PACK_UP_TO

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


def bf16_wire(values):
    return memoryview(f32_to_bf16(np.asarray(values, np.float32))).cast('B')


def train(arrays, sync, optimizer):
    """Two workers, three keys (float16 and bfloat16 with float32 masters), five rounds; the
    pulled values after each round and a checkpoint taken at the end."""
    shard = Shard(2, storage=Storage(arrays, arrays))
    shard.init('i', 'a', 0, 'float32', [6], sync, wire(np.linspace(-1, 1, 6)))
    shard.init('i', 'b', 0, 'float16', [4], sync, wire([0.5, -0.25, 1, 2], np.float16))
    shard.init('i', 'c', 0, 'bfloat16', [4], sync, bf16_wire([0.5, -0.25, 1, 3]))
    if optimizer:
        shard.set_optimizer(create(optimizer, learning_rate=0.1, multi_precision=True).to_spec())
    pulled = []
    for step in range(5):
        for worker, scale in ((W0, 1.0), (W1, -0.5)):
            grads = {'a': np.arange(6) * scale + step, 'b': np.array([1, 2, 3, 4]) * scale}
            shard.push('p', worker, 'a', 0, 'float32', sync, wire(grads['a']), seq=step)
            shard.push('p', worker, 'b', 0, 'float16', sync, wire(grads['b'], np.float16),
                       seq=step)
            shard.push('p', worker, 'c', 0, 'bfloat16', sync, bf16_wire(grads['b'] / 3),
                       seq=step)
        for key in ('a', 'b', 'c'):
            (_, _, (_, value, lease)), = shard.pull('q', W0, key, 0)
            pulled.append(np.array(arrays.to_host(value)))   # a device value too (a copy)
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
        low = {np.dtype(np.float16): 1e-3, np.dtype(np.uint16): 1e-2}.get(want.dtype, 0.0)
        if want.dtype == np.uint16:   # bfloat16 bits
            want, got = bf16_to_f32(want), bf16_to_f32(got)
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=max(rtol, low) if rtol else 0.0)
    if not rtol or optimizer is None:   # sums and copies only: exact on any device
        assert host_blob == other_blob


@pytest.mark.parametrize('sync', [True, False])
@pytest.mark.parametrize('optimizer', [None, 'sgd', 'adam'])
def test_a_copying_placement_gives_the_host_values_bit_for_bit(sync, optimizer):
    assert_like_host(CopyingArrays(), sync, optimizer)


def test_a_pull_from_a_device_placement_is_a_host_copy_nothing_is_lent():
    shard = Shard(1, storage=everywhere(CopyingArrays()))
    shard.init('i', 'k', 0, 'float32', [3], True, wire([1, 2, 3]))
    (_, _, (entry, value, lease)), = shard.pull('q', W0, 'k', 0)
    assert lease.done and value is not entry.weight
    value[:] = 0                                   # the caller's copy, not the shard's weight
    assert entry.weight.tolist() == [1, 2, 3]


def test_checkpoints_restore_into_the_shards_placement():
    _, blob = train(HostArrays(), True, 'sgd')
    shard = Shard(2, storage=everywhere(CopyingArrays()))
    restore(shard, blob, rounds=True)
    assert snapshot(shard) == blob


def everywhere(arrays):
    return Storage(arrays, arrays)


def test_the_cpu_device_puts_every_key_in_host_memory():
    cpu = for_device('cpu')
    for wants_device in (False, True):
        assert isinstance(cpu.for_key(wants_device), HostArrays) and cpu.for_key(wants_device).lends


class Probe:
    """Stands in for looking for a GPU: counts the looks, finds ``found``."""

    def __init__(self, found):
        self.found, self.calls = found, 0

    def __call__(self):
        self.calls += 1
        return self.found


def test_keys_of_device_side_stores_go_to_the_gpu_and_the_rest_stay_on_the_host():
    gpu, probe = CopyingArrays(), Probe(None)
    probe.found = gpu
    shard = Shard(2, storage=Storage(HostArrays(), probe=probe))
    shard.init('i', 'host', 0, 'float32', [3], True, wire([1, 2, 3]))
    assert probe.calls == 0                          # nothing looks for a GPU until asked
    shard.init('i', 'dev', 0, 'float32', [3], True, wire([4, 5, 6]), device=True)
    shard.init('i', 'dev2', 0, 'float32', [3], True, wire([7, 8, 9]), device=True)
    assert probe.calls == 1
    assert type(shard.entries[('host', 0)].arrays) is HostArrays
    assert shard.entries[('dev', 0)].arrays is gpu and shard.entries[('dev2', 0)].arrays is gpu
    for worker in (W0, W1):
        shard.push('p', worker, 'dev', 0, 'float32', True, wire([1, 1, 1]))
    (_, _, (_, value, _)), = shard.pull('q', W0, 'dev', 0)
    assert value.tolist() == [2, 2, 2]


def test_a_server_without_a_gpu_keeps_device_side_keys_in_host_memory():
    probe = Probe(None)
    shard = Shard(1, storage=Storage(HostArrays(), probe=probe))
    for key in ('a', 'b'):
        shard.init('i', key, 0, 'float32', [2], True, wire([1, 2]), device=True)
    assert probe.calls == 1                          # looked once, not per key
    assert all(type(e.arrays) is HostArrays for e in shard.entries.values())


def test_auto_looks_for_a_gpu_only_when_a_device_side_key_arrives(monkeypatch):
    made = []

    def no_gpu(ipc='auto'):
        made.append(1)
        raise ConfigError('this server sees no CUDA GPU')
    monkeypatch.setattr(placement, 'CudaArrays', no_gpu)
    auto = for_device('auto')
    assert not made and type(auto.for_key(False)) is HostArrays
    assert type(auto.for_key(True)) is HostArrays and made == [1]
    with pytest.raises(ConfigError, match='KVPS_SERVER_DEVICE=cuda: this server sees no CUDA'):
        for_device('cuda')


def test_checkpoints_remember_which_keys_wanted_the_gpu():
    gpu = CopyingArrays()
    shard = Shard(1, storage=Storage(HostArrays(), gpu))
    shard.init('i', 'dev', 0, 'float32', [2], True, wire([1, 2]), device=True)
    shard.init('i', 'host', 0, 'float32', [2], True, wire([3, 4]))
    blob = snapshot(shard)
    again = Shard(1, storage=Storage(HostArrays(), gpu))
    restore(again, blob)
    assert again.entries[('dev', 0)].arrays is gpu
    assert type(again.entries[('host', 0)].arrays) is HostArrays
    assert snapshot(again) == blob


def test_a_restored_key_moves_where_its_new_init_asks():
    gpu = CopyingArrays()
    shard = Shard(1)
    shard.init('i', 'k', 0, 'float32', [2], True, wire([1, 2]))
    resumed = Shard(1, storage=Storage(HostArrays(), gpu))
    restore(resumed, snapshot(shard))
    resumed.init('i', 'k', 0, 'float32', [2], True, wire([0, 0]), device=True)
    entry = resumed.entries[('k', 0)]
    assert entry.arrays is gpu and entry.device and entry.weight.tolist() == [1, 2]


def test_a_checkpoint_of_the_previous_format_still_loads():
    state = {'format': 'kvps.server_checkpoint/2', 'updater': None,
             'entries': [['k', 0, 'float32', [2], True, bytes(wire([5, 6])), 3, {}]]}
    shard = Shard(1)
    restore(shard, msgpack.packb(state, use_bin_type=True))
    entry = shard.entries[('k', 0)]
    assert entry.weight.tolist() == [5, 6] and not entry.device and entry.restored


def test_small_keys_weights_lie_end_to_end_and_big_ones_apart():
    """A shard's small keys (packed by the optimizer) share chunks, key after key, each at
    its dtype's alignment; a big key gets an array of its own."""
    host = HostArrays()
    small = [host.owned(np.arange(n, dtype=np.float32).tobytes(), 'float32') for n in (3, 4)]
    wide = host.owned(np.arange(2, dtype=np.float64).tobytes(), 'float64')
    big = host.owned(np.zeros(PACK_UP_TO + 1, np.float32).tobytes(), 'float32')
    starts = [a.__array_interface__['data'][0] for a in (*small, wide)]
    assert starts[1] == starts[0] + 12 and starts[2] == starts[0] + 32   # 28, rounded up to 8
    assert small[1].tolist() == [0, 1, 2, 3] and wide.tolist() == [0, 1]
    assert small[0].flags.writeable and wide.flags.aligned
    assert big.base is None or big.base is not small[0].base
