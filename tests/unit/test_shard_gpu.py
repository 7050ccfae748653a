"""GPU shards (KVPS_SERVER_DEVICE=cuda) against host shards: same rounds, same values."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip('cupy')
try:
    HAS_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # no driver
    HAS_GPU = False
if not HAS_GPU:
    pytest.skip('no CUDA device', allow_module_level=True)

from test_shard_storage import assert_like_host  # noqa: E402

from kvps.server.storage import CudaArrays  # noqa: E402


@pytest.mark.parametrize('sync', [True, False])
@pytest.mark.parametrize('optimizer', [None, 'sgd', 'adam'])
def test_gpu_shard_matches_the_host_shard(sync, optimizer):
    assert_like_host(CudaArrays(), sync, optimizer, rtol=1e-6)


def test_gpu_shard_keeps_its_weights_on_the_device():
    from kvps.server.shard import Shard
    from kvps.server.storage import Storage
    gpu = CudaArrays()
    shard = Shard(1, storage=Storage(gpu, gpu))
    shard.init('i', 'k', 0, 'float32', [3], True,
               memoryview(np.array([1, 2, 3], np.float32)).cast('B'))
    assert isinstance(shard.entries[('k', 0)].weight, cupy.ndarray)


def test_auto_puts_device_side_keys_on_this_gpu():
    from kvps.server.shard import Shard
    from kvps.server.storage import for_device
    shard = Shard(1, storage=for_device('auto'))
    one = memoryview(np.array([1, 2, 3], np.float32)).cast('B')
    shard.init('i', 'dev', 0, 'float32', [3], True, one, device=True)
    shard.init('i', 'host', 0, 'float32', [3], True, one)
    assert isinstance(shard.entries[('dev', 0)].weight, cupy.ndarray)
    assert isinstance(shard.entries[('host', 0)].weight, np.ndarray)


def test_an_abstention_on_a_gpu_shard_adds_to_neither_the_sum_nor_the_scale():
    """As on the host (test_elastic_handover): 2 pushes and an abstention in a job of 4 are
    the sum times 4/2; a round of abstentions alone is zeros."""
    from kvps.server.shard import Shard
    from kvps.server.storage import Storage
    from kvps.wire import protocol as P
    gpu = CudaArrays()
    shard = Shard(3, storage=Storage(gpu, gpu), elastic=True)
    shard.init('i', 'k', 0, 'float32', [2], True,
               memoryview(np.zeros(2, np.float32)).cast('B'), scale_to=4)
    nothing = memoryview(b'')
    shard.push('j', b'worker-2.1', 'k', 0, P.NOTHING, True, nothing)
    for token, worker, values in (('a', b'worker-0', [1, 2]), ('b', b'worker-1', [3, 5])):
        shard.push(token, worker, 'k', 0, 'float32', True,
                   memoryview(np.array(values, np.float32)).cast('B'))
    assert cupy.asnumpy(shard.entries['k', 0].weight).tolist() == [8.0, 14.0]
    for token, worker in (('c', b'worker-0'), ('d', b'worker-1'), ('e', b'worker-2.1')):
        shard.push(token, worker, 'k', 0, P.NOTHING, True, nothing)
    assert cupy.asnumpy(shard.entries['k', 0].weight).tolist() == [0.0, 0.0]


@pytest.mark.parametrize('dtype', ['float32', 'float64'])
@pytest.mark.parametrize('optimizer', ['sgd', 'adam'])
@pytest.mark.parametrize('workers', [2, 3])
def test_a_rounds_last_push_is_added_by_the_update_kernel(workers, optimizer, dtype):
    """Pushes read in place from device blocks, as on the CUDA IPC route: the round's last
    is not added into the merge buffer (a round of two makes no add) but by the update's
    kernel, and the weights are the host shard's, bit for bit; the blocks are unchanged."""
    from test_device_rounds import train

    from kvps.server.storage import HostArrays
    gpu, adds = CudaArrays(), []
    real = gpu.add
    gpu.add = lambda *args, **kwargs: adds.append(1) or real(*args, **kwargs)
    device = train(gpu, workers, optimizer, dtype, block=cupy.asarray)
    host = train(HostArrays(), workers, optimizer, dtype)
    assert np.array_equal(device.weight(), host.weight())
    assert device.kinds == [2] * 3 and len(adds) == 3 * (workers - 2)
    assert device.blocks_unchanged()
